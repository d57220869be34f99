"""Dynamic loss scaling as an optax wrapper, and the value-and-grad that feeds it."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jmp_policy._src import numerics, state_collections
from jmp_policy._src import optax_wrapper_checks as checks
from jmp_policy._src.dtypes import bounded_repr
from jmp_policy._src.loss_scale import LossScale, NoOpLossScale
from jmp_policy._src.state_pytree import register_with_flax_serialization


class LossScalingState(NamedTuple):
    """The state of :func:`loss_scaling`.

    Attributes:
        inner_state: the wrapped transformation's state (unchanged by skipped steps).
        loss_scale: the current loss scale object (``NoOpLossScale``, ``StaticLossScale`` or
            ``DynamicLossScale``); pass it to :func:`scaled_value_and_grad`.
        total_skipped: int32, how many steps were skipped because their gradients were not
            finite, since ``init`` (it stays at ``2**31 - 1`` rather than wrap).
        consecutive_skipped: int32, how many of the latest steps in a row were skipped (0
            after a finite step; it stays at ``2**31 - 1`` rather than wrap).

    Examples:
        >>> import jax.numpy as jnp
        >>> import optax
        >>> import jmp_policy as jp
        >>> state = jp.loss_scaling(optax.sgd(0.1)).init({"w": jnp.ones(2)})
        >>> int(state.total_skipped), float(state.loss_scale.loss_scale)
        (0, 32768.0)
    """

    inner_state: Any
    loss_scale: LossScale
    total_skipped: jax.Array
    consecutive_skipped: jax.Array


def _all_devices_finite(finite: jax.Array, axis_name: str | tuple[str, ...]) -> jax.Array:
    """Whether every device along ``axis_name`` saw finite gradients."""
    try:
        num_bad = lax.psum(jnp.logical_not(finite).astype(jnp.int32), axis_name)
    except NameError as e:  # JAX's "unbound axis name"
        raise ValueError(
            f"`axis_name`={axis_name!r} of `loss_scaling` names no axis where `update` runs: "
            "call `update` inside `jax.shard_map`/`jax.pmap` with that axis name, or pass "
            "axis_name=None under plain `jit` (sharded gradients are reduced globally there). "
            f"Received: axis_name={axis_name!r}"
        ) from e
    return num_bad == 0


def _saturating_add(count: jax.Array, step: Any) -> jax.Array:
    """``count + step`` (``step`` 0 or 1) in int32, staying at 2**31-1 instead of wrapping."""
    count = jnp.asarray(count, jnp.int32)
    return count + jnp.where(count < jnp.iinfo(jnp.int32).max, step, 0).astype(jnp.int32)


def loss_scaling(
    inner: optax.GradientTransformation | optax.MultiSteps,
    loss_scale: str | float | LossScale = "dynamic",
    *,
    axis_name: str | Sequence[str] | None = None,
) -> optax.GradientTransformationExtraArgs:
    """Wraps an optax transformation with loss scaling and skipping of non-finite steps.

    ``update`` takes the gradients of the **scaled** loss (from :func:`scaled_value_and_grad`)
    and, in one jittable step with no host synchronisation: unscales them in float32,
    decides once for all devices whether they are all finite, runs ``inner`` on finite steps
    only (a non-finite step returns zero updates and keeps the inner state, however many
    come in a row) and adjusts the loss scale. Put clipping and ``MultiSteps`` inside, where
    the gradients are unscaled (the README's loss-scaling section says why and how).

    Args:
        inner: the transformation run on finite, unscaled gradients (``MultiSteps`` too).
        loss_scale: ``"dynamic"`` (a default :class:`DynamicLossScale`), ``"auto"`` (dynamic
            when the global policy computes in float16 when ``loss_scaling`` is called, else no
            scaling), ``"none"`` (no scaling; non-finite steps are still skipped), a positive
            number (a static scale) or a loss-scale object.
        axis_name: the ``shard_map``/``pmap`` axis (or axes) over which devices hold different
            gradients; ``None`` under plain ``jit`` (sharded arrays are reduced globally there).

    Returns:
        An ``optax.GradientTransformationExtraArgs`` whose state is a :class:`LossScalingState`.

    Raises:
        ValueError: an unknown ``loss_scale`` string or a non-positive number; (from
            ``update``) an ``axis_name`` that names no axis where it runs.
        TypeError: ``loss_scale`` of another type, ``inner`` not a transformation (``optax.adam``
            uncalled, ``"adam"``), or ``axis_name`` neither a string nor a tuple of strings.

    Examples:
        >>> import jax
        >>> import jax.numpy as jnp
        >>> import optax
        >>> import jmp_policy as jp
        >>> params = {"w": jnp.array([1.0, 2.0])}
        >>> opt = jp.loss_scaling(optax.sgd(0.5))
        >>> state = opt.init(params)
        >>> loss_fn = lambda p: jnp.sum(p["w"] ** 2)
        >>> loss, grads = jp.scaled_value_and_grad(loss_fn)(jp.get_loss_scale(state), params)
        >>> updates, state = jax.jit(opt.update)(grads, state, params)
        >>> optax.apply_updates(params, updates)["w"]
        Array([0., 0.], dtype=float32)
        >>> bad = {"w": jnp.array([jnp.inf, 1.0])}
        >>> updates, state = jax.jit(opt.update)(bad, state, params)
        >>> updates["w"], int(state.total_skipped), float(state.loss_scale.loss_scale)
        (Array([0., 0.], dtype=float32), 1, 16384.0)
    """
    checks.check_inner(inner)
    axis_name = checks.check_axis_name(axis_name)
    initial_scale = checks.resolve_loss_scale(loss_scale)
    warned = False
    if isinstance(inner, optax.MultiSteps):
        inner = inner.gradient_transformation()
    inner_tx = optax.with_extra_args_support(inner)

    def init_fn(params: Any) -> LossScalingState:
        register_with_flax_serialization()  # in case flax came after `loss_scaling`
        return LossScalingState(
            inner_state=inner_tx.init(params),
            loss_scale=initial_scale,
            total_skipped=jnp.zeros((), jnp.int32),
            consecutive_skipped=jnp.zeros((), jnp.int32),
        )

    def update_fn(
        updates: Any, state: LossScalingState, params: Any = None, **extra_args: Any
    ) -> tuple[Any, LossScalingState]:
        nonlocal warned
        state_collections.check_not_in(updates, "loss_scaling's update")
        scale = state.loss_scale
        if not warned and not isinstance(scale, NoOpLossScale):
            paths = checks.float16_paths(updates)
            if paths:  # at trace time, once per wrapper
                warned = True
                checks.warn_float16(paths)
        # Unscale with the scale these gradients were computed with, before adjusting it, and
        # check the unscaled values: one fused reduction that reads each gradient once, and
        # covers scales below 1 (where unscaling may overflow a 16-bit gradient) with no
        # second code path.
        grads = scale.unscale(updates)
        finite = numerics.all_finite(grads)
        if axis_name is not None:
            finite = _all_devices_finite(finite, axis_name)
        # Selects, not `lax.cond`: XLA fuses them (and the unscaling) into the inner update,
        # while a conditional makes XLA copy the inner state on every step (3x slower for adam
        # on CPU, see benchmarks/loss_scaling_bench.py) and on GPU reads its predicate on the
        # host. `where`, not a multiply: a NaN in the rejected values never leaks.
        inner_updates, inner_state = inner_tx.update(grads, state.inner_state, params, **extra_args)
        new_updates = jax.tree.map(
            lambda u: jnp.where(finite, u, jnp.zeros((), u.dtype)), inner_updates
        )
        new_inner_state = numerics.select_tree(finite, inner_state, state.inner_state)
        skipped = jnp.logical_not(finite).astype(jnp.int32)
        return new_updates, LossScalingState(
            inner_state=new_inner_state,
            loss_scale=scale.adjust(finite),
            total_skipped=_saturating_add(state.total_skipped, skipped),
            consecutive_skipped=_saturating_add(state.consecutive_skipped, 1) * skipped,
        )

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)  # type: ignore[arg-type]


def get_loss_scale(opt_state: Any) -> LossScale:
    """Finds the loss scale in an optimizer state.

    Looks through any optax state (chains, nested tuples and dicts, ``MultiSteps``,
    ``inject_hyperparams``) for the one :class:`LossScalingState`.

    Args:
        opt_state: an optimizer state that contains exactly one :class:`LossScalingState`.

    Returns:
        Its loss scale object (an array-valued pytree: fine to call under ``jit``).

    Raises:
        ValueError: there is no :class:`LossScalingState` in ``opt_state``, or more than one.

    Examples:
        >>> import jax.numpy as jnp
        >>> import optax
        >>> import jmp_policy as jp
        >>> # Clip inside the wrapper, where the gradients are unscaled.
        >>> inner = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3))
        >>> opt = jp.loss_scaling(optax.MultiSteps(inner, every_k_schedule=4))
        >>> train_state = {"step": 0, "opt_state": opt.init({"w": jnp.ones(2)})}
        >>> float(jp.get_loss_scale(train_state).loss_scale)
        32768.0
    """

    def is_state(x: Any) -> bool:
        return isinstance(x, LossScalingState)

    found = [s for s in jax.tree.leaves(opt_state, is_leaf=is_state) if is_state(s)]
    if len(found) != 1:
        raise ValueError(
            f"`opt_state` must contain exactly one LossScalingState (the state of "
            f"`jmp_policy.loss_scaling`); found {len(found)} in an object of type "
            f"{type(opt_state).__name__}. Wrap your optimizer once with "
            f"`jmp_policy.loss_scaling(...)`. Received: opt_state={bounded_repr(opt_state)}"
        )
    return found[0].loss_scale


def scaled_value_and_grad(
    fun: Callable[..., Any],
    *,
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
) -> Callable[..., tuple[Any, Any]]:
    """Like ``jax.value_and_grad``, but differentiates the scaled loss.

    Returns ``g(loss_scale, *args, **kwargs) -> (value, grads)`` where ``value`` is what
    ``fun`` returns (``(loss, aux)`` with ``has_aux``), unscaled, and ``grads`` are the
    gradients of ``loss_scale.scale(loss)`` (computed in float32), ready for the ``update`` of
    :func:`loss_scaling`. Works under ``jit`` and ``shard_map``/``pmap`` like
    ``jax.value_and_grad``; the loss scale is an argument, so a new scale does not retrace.

    Args:
        fun: returns a scalar loss (or ``(loss, aux)`` with ``has_aux=True``).
        argnums: which positional arguments of ``fun`` to differentiate.
        has_aux: whether ``fun`` returns ``(loss, aux)``.

    Returns:
        The function ``g`` described above.

    Raises:
        TypeError: (when ``g`` is called) ``loss_scale`` is not a loss-scale object.

    Examples:
        >>> import jax.numpy as jnp
        >>> import jmp_policy as jp
        >>> g = jp.scaled_value_and_grad(lambda w: jnp.sum(w**2))
        >>> loss, grads = g(jp.StaticLossScale(4.0), jnp.array([1.0, 2.0]))
        >>> loss, grads
        (Array(5., dtype=float32), Array([ 8., 16.], dtype=float32))
    """

    def scaled_fun(loss_scale: LossScale, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        out = fun(*args, **kwargs)
        loss, aux = out if has_aux else (out, None)
        return loss_scale.scale(loss), (loss, aux)

    def g(loss_scale: LossScale, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        if not isinstance(loss_scale, checks.LOSS_SCALE_TYPES):
            number = isinstance(loss_scale, (int, float)) and not isinstance(loss_scale, bool)
            hint = f" (a number: `StaticLossScale({loss_scale!r})`)" if number else ""
            raise TypeError(
                "`loss_scale`, the first argument of the function returned by "
                "`scaled_value_and_grad`, must be a loss scale (NoOpLossScale, "
                f"StaticLossScale, DynamicLossScale){hint}. With an optimizer state, pass "
                "`jmp_policy.get_loss_scale(opt_state)`. Received: "
                f"loss_scale={bounded_repr(loss_scale)} (of type {type(loss_scale).__name__})"
            )
        bound = functools.partial(scaled_fun, loss_scale)
        (_, (loss, aux)), grads = jax.value_and_grad(bound, argnums=argnums, has_aux=True)(
            *args, **kwargs
        )
        return ((loss, aux) if has_aux else loss), grads

    return g
