"""16-bit weights without float32 masters: optax wrappers that round the update into them."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jmp_policy._src import optax_wrapper_checks as checks
from jmp_policy._src import rounding


class StochasticRoundingState(NamedTuple):
    """The state of :func:`stochastic_rounding`.

    Attributes:
        inner_state: the wrapped transformation's state, its moments of 16-bit parameters
            in ``moment_dtype``.
        rng_key: the raw data (``uint32``, ``jax.random.key_data``) of the key the next
            step's rounding draws from; advanced every step, so that a checkpoint (any
            checkpointer: it is a plain integer array) resumes bit-identically.

    Examples:
        >>> import jax.numpy as jnp
        >>> import optax
        >>> import jmp_policy as jp
        >>> opt = jp.stochastic_rounding(optax.sgd(0.1), key=0)
        >>> state = opt.init({"w": jnp.ones(2, jnp.bfloat16)})
        >>> state.rng_key.dtype, state.rng_key.shape
        (dtype('uint32'), (2,))
    """

    inner_state: Any
    rng_key: jax.Array


class KahanSummationState(NamedTuple):
    """The state of :func:`kahan_summation`.

    Attributes:
        inner_state: the wrapped transformation's state, its moments of 16-bit parameters
            in ``moment_dtype``.
        compensation: a tree shaped like the parameters: for each 16-bit parameter, in its
            dtype, what rounding its sums to nearest has lost so far (added to the next
            update); ``None`` for the other leaves, which get no buffer.

    Examples:
        >>> import jax.numpy as jnp
        >>> import optax
        >>> import jmp_policy as jp
        >>> opt = jp.kahan_summation(optax.sgd(0.1))
        >>> state = opt.init({"w": jnp.ones(2, jnp.bfloat16), "b": jnp.ones(2)})
        >>> state.compensation
        {'b': None, 'w': Array([0, 0], dtype=bfloat16)}
    """

    inner_state: Any
    compensation: Any


def _is_none(x: Any) -> bool:
    return x is None


def _cast_sixteen_bit(tree: Any, params: Any, dtype: Any) -> Any:
    """``tree``'s leaves whose parameter is 16-bit, cast to ``dtype``; the others as given."""

    def cast(x: Any, p: Any) -> Any:
        return x.astype(dtype) if x is not None and rounding.is_sixteen_bit(p) else x

    return jax.tree.map(cast, tree, params, is_leaf=_is_none)


def _keep_dtypes(new: Any, old: Any) -> Any:
    """``new`` (an inner state) with every floating leaf back in its dtype in ``old``.

    Optax computes a moment in the dtype of its float32 gradient; cast back, the moments stay
    in the dtype they were created in (``moment_dtype``), so the state's dtypes never change
    (``scan`` carries and ``jit`` caches need that).
    """

    def keep(n: Any, o: Any) -> Any:
        dtype = getattr(o, "dtype", None)
        if dtype is None or not jnp.issubdtype(dtype, jnp.floating) or n.dtype == dtype:
            return n
        return n.astype(dtype)

    return jax.tree.map(keep, new, old)


def _wrap(
    inner: Any, moment_dtype: Any, name: str
) -> tuple[optax.GradientTransformationExtraArgs, Any]:
    """The inner transformation (extra arguments accepted) and the checked moment dtype."""
    checks.check_inner(inner)
    dtype = checks.check_moment_dtype(moment_dtype, name)
    if isinstance(inner, optax.MultiSteps):
        inner = inner.gradient_transformation()
    return optax.with_extra_args_support(inner), dtype


def _inner_init(inner: Any, params: Any, dtype: Any) -> Any:
    return inner.init(_cast_sixteen_bit(params, params, dtype))


def _inner_update(
    inner: Any, grads: Any, state: Any, params: Any, extra_args: dict[str, Any], name: str
) -> tuple[Any, Any]:
    """The inner update in float32 from 16-bit parameters, its state's dtypes kept."""
    if params is None:
        raise ValueError(
            f"`{name}`'s `update` needs `params` (the 16-bit parameters to round the update "
            f"into): call `update(grads, opt_state, params)`. Received: params=None"
        )
    grads32 = _cast_sixteen_bit(grads, params, jnp.float32)
    params32 = _cast_sixteen_bit(params, params, jnp.float32)
    updates, new_state = inner.update(grads32, state, params32, **extra_args)
    return updates, _keep_dtypes(new_state, state)


def stochastic_rounding(
    inner: optax.GradientTransformation | optax.MultiSteps,
    key: jax.Array | int,
    *,
    moment_dtype: Any = jnp.float32,
) -> optax.GradientTransformationExtraArgs:
    """Trains 16-bit parameters without float32 masters: the update stochastically rounded.

    ``inner`` runs in float32 (16-bit gradients and parameters upcast), its moments of 16-bit
    parameters stored in ``moment_dtype``. Each 16-bit parameter ``p`` then becomes
    ``p + update`` rounded to one of its two neighbouring 16-bit values at random, the
    farther with probability proportional to the distance: unbiased, so updates below half
    a unit in the last place, which round-to-nearest loses, are applied on average. The
    returned updates are float32, ``f32(new) - f32(p)``, and ``optax.apply_updates`` lands
    exactly on the rounded value (``docs/bf16_training.md`` says when and why). Other
    parameters (float32 norms) get ``inner``'s update unchanged.

    Put this wrapper outermost (``jp.loss_scaling`` inside it; a transformation chained
    after it would change the float32 update). It works under ``jit``; the random bits do
    not depend on how parameters are sharded, and data-parallel replicas, sharing the key,
    round alike.

    Args:
        inner: the optax transformation (``optax.adam(1e-3)``, a chain, ``MultiSteps``).
        key: a PRNG key (``jax.random.key(0)``, or a raw ``jax.random.PRNGKey(0)``) or an
            int seed.
        moment_dtype: the dtype of ``inner``'s state for 16-bit parameters: float32 (the
            default), bfloat16, float16 or float64.

    Returns:
        An ``optax.GradientTransformationExtraArgs`` whose state is a
        :class:`StochasticRoundingState`.

    Raises:
        TypeError: ``inner`` is not a transformation, ``key`` neither a key nor an int, or
            ``moment_dtype`` not a dtype.
        ValueError: ``moment_dtype`` is not a float of 16 bits or more, ``key`` holds
            several keys; (from ``update``) ``params`` is missing.

    Examples:
        >>> import jax.numpy as jnp
        >>> import optax
        >>> import jmp_policy as jp
        >>> params = {"w": jnp.ones(4, jnp.bfloat16)}   # 1.0: bfloat16's next is 1.0078
        >>> opt = jp.stochastic_rounding(optax.sgd(1e-3), key=0)
        >>> state = opt.init(params)
        >>> grads = {"w": jnp.ones(4, jnp.bfloat16)}
        >>> for _ in range(100):   # 100 updates of -0.001: -0.1 in all
        ...     updates, state = opt.update(grads, state, params)
        ...     params = optax.apply_updates(params, updates)
        >>> params["w"].dtype, bool(abs(params["w"].astype(float).mean() - 0.9) < 0.02)
        (dtype(bfloat16), True)
    """
    inner_tx, dtype = _wrap(inner, moment_dtype, "stochastic_rounding")
    key_data, impl = checks.resolve_key(key)

    def init_fn(params: Any) -> StochasticRoundingState:
        return StochasticRoundingState(_inner_init(inner_tx, params, dtype), key_data)

    def update_fn(
        grads: Any, state: StochasticRoundingState, params: Any = None, **extra_args: Any
    ) -> tuple[Any, StochasticRoundingState]:
        updates, inner_state = _inner_update(
            inner_tx, grads, state.inner_state, params, extra_args, "stochastic_rounding"
        )
        next_key, step_key = jax.random.split(jax.random.wrap_key_data(state.rng_key, impl=impl))
        leaves, treedef = jax.tree.flatten(params)
        keys = jax.random.split(step_key, max(len(leaves), 1))
        key_tree = jax.tree.unflatten(treedef, list(keys[: len(leaves)]))

        def apply(p: Any, u: Any, k: jax.Array) -> Any:
            return rounding.stochastic_add(p, u, k)[1] if rounding.is_sixteen_bit(p) else u

        new_state = StochasticRoundingState(inner_state, jax.random.key_data(next_key))
        return jax.tree.map(apply, params, updates, key_tree), new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)  # type: ignore[arg-type]


def kahan_summation(
    inner: optax.GradientTransformation | optax.MultiSteps,
    *,
    moment_dtype: Any = jnp.float32,
) -> optax.GradientTransformationExtraArgs:
    """Trains 16-bit parameters without float32 masters: Kahan-compensated updates.

    ``inner`` runs in float32 (16-bit gradients and parameters upcast), its moments of 16-bit
    parameters stored in ``moment_dtype``. Each 16-bit parameter ``p`` has a compensation
    buffer ``c`` of its dtype in the state: ``p + (update + c)`` is rounded to nearest and
    what that rounding lost becomes the new ``c``, so small updates accumulate in ``c`` until
    they move ``p``. Deterministic; the pair carries about 16 significant bits for bfloat16
    (a float32 master 24), so updates below about ``2**-16`` of a parameter are still lost.
    The returned updates are float32, ``f32(new) - f32(p)``, which ``optax.apply_updates``
    turns exactly into the new value; other parameters (float32 norms) get ``inner``'s
    update unchanged, and no buffer. Put this wrapper outermost (``jp.loss_scaling`` inside
    it). Works under ``jit`` and on sharded parameters (the buffers follow their sharding).

    Args:
        inner: the optax transformation (``optax.adam(1e-3)``, a chain, ``MultiSteps``).
        moment_dtype: the dtype of ``inner``'s state for 16-bit parameters: float32 (the
            default), bfloat16, float16 or float64.

    Returns:
        An ``optax.GradientTransformationExtraArgs`` whose state is a
        :class:`KahanSummationState`.

    Raises:
        TypeError: ``inner`` is not a transformation or ``moment_dtype`` not a dtype.
        ValueError: ``moment_dtype`` is not a float of 16 bits or more; (from ``update``)
            ``params`` is missing.

    Examples:
        >>> import jax.numpy as jnp
        >>> import optax
        >>> import jmp_policy as jp
        >>> params = {"w": jnp.ones(4, jnp.bfloat16)}   # 1.0: bfloat16's next is 1.0078
        >>> opt = jp.kahan_summation(optax.sgd(1e-3))
        >>> state = opt.init(params)
        >>> grads = {"w": jnp.ones(4, jnp.bfloat16)}
        >>> for _ in range(100):   # 100 updates of -0.001: -0.1 in all
        ...     updates, state = opt.update(grads, state, params)
        ...     params = optax.apply_updates(params, updates)
        >>> params["w"]
        Array([0.898438, 0.898438, 0.898438, 0.898438], dtype=bfloat16)
    """
    inner_tx, dtype = _wrap(inner, moment_dtype, "kahan_summation")

    def init_fn(params: Any) -> KahanSummationState:
        def buffer(p: Any) -> Any:
            return jnp.zeros_like(p) if rounding.is_sixteen_bit(p) else None

        return KahanSummationState(
            _inner_init(inner_tx, params, dtype), jax.tree.map(buffer, params)
        )

    def update_fn(
        grads: Any, state: KahanSummationState, params: Any = None, **extra_args: Any
    ) -> tuple[Any, KahanSummationState]:
        updates, inner_state = _inner_update(
            inner_tx, grads, state.inner_state, params, extra_args, "kahan_summation"
        )
        # `None` as a leaf: the buffers hold `None` for the parameters without one.
        leaves, treedef = jax.tree.flatten(params, is_leaf=_is_none)
        out, buffers = [], []
        for p, u, c in zip(
            leaves,
            jax.tree.leaves(updates, is_leaf=_is_none),
            jax.tree.leaves(state.compensation, is_leaf=_is_none),
            strict=True,
        ):
            if rounding.is_sixteen_bit(p):
                _, u, c = rounding.kahan_add(p, u, c)
            out.append(u)
            buffers.append(c)
        out, buffers = jax.tree.unflatten(treedef, out), jax.tree.unflatten(treedef, buffers)
        return out, KahanSummationState(inner_state, buffers)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)  # type: ignore[arg-type]
