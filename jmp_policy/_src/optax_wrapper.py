"""Dynamic loss scaling as an optax wrapper, and the value-and-grad that feeds it."""

from __future__ import annotations

import functools
import os
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from jmp_policy._src import numerics, state_collections
from jmp_policy._src.loss_scale import (
    DynamicLossScale,
    LossScale,
    NoOpLossScale,
    StaticLossScale,
)
from jmp_policy._src.state_pytree import register_with_flax_serialization

_LOSS_SCALE_TYPES = (NoOpLossScale, StaticLossScale, DynamicLossScale)
_LOSS_SCALE_STRINGS = ("dynamic", "auto", "none")


class LossScalingState(NamedTuple):
    """The state of :func:`loss_scaling`.

    Attributes:
        inner_state: the wrapped transformation's state (unchanged by skipped steps).
        loss_scale: the current loss scale object (``NoOpLossScale``, ``StaticLossScale`` or
            ``DynamicLossScale``); pass it to :func:`scaled_value_and_grad`.
        total_skipped: int32, how many steps were skipped because their gradients were not
            finite, since ``init``.
        consecutive_skipped: int32, how many of the latest steps in a row were skipped (0
            after a finite step).

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


def _resolve_loss_scale(loss_scale: Any) -> LossScale:
    if isinstance(loss_scale, _LOSS_SCALE_TYPES):
        return loss_scale
    if isinstance(loss_scale, str):
        key = loss_scale.lower()
        if key == "dynamic":
            return DynamicLossScale()
        if key == "none":
            return NoOpLossScale()
        if key == "auto":
            from jmp_policy._src.global_state import dtype_policy

            if dtype_policy().compute_dtype == np.float16:
                return DynamicLossScale()
            return NoOpLossScale()
        raise ValueError(
            f"Unknown `loss_scale` {loss_scale!r}; expected one of "
            f"{', '.join(repr(s) for s in _LOSS_SCALE_STRINGS)}, a positive number (a static "
            f"scale) or a loss-scale object (NoOpLossScale, StaticLossScale, DynamicLossScale)."
        )
    if not isinstance(loss_scale, bool) and isinstance(
        loss_scale, (int, float, np.integer, np.floating)
    ):
        return StaticLossScale(loss_scale)  # validated there, quoting the value as given
    if (
        isinstance(loss_scale, (jax.Array, np.ndarray))
        and not isinstance(loss_scale, jax.core.Tracer)
        and loss_scale.shape == ()
        and (
            jnp.issubdtype(loss_scale.dtype, jnp.floating)
            or jnp.issubdtype(loss_scale.dtype, jnp.integer)
        )
    ):  # `jnp.float32(2**15)` is a jax array, not a NumPy scalar
        return StaticLossScale(float(loss_scale))
    raise TypeError(
        f"Invalid `loss_scale` argument. Expected 'dynamic', 'auto', 'none', a positive number "
        f"or a loss-scale object (NoOpLossScale, StaticLossScale, DynamicLossScale). Received: "
        f"loss_scale={loss_scale!r} (of type {type(loss_scale).__name__})"
    )


def _check_axis_name(axis_name: Any) -> str | tuple[str, ...] | None:
    """``axis_name`` as ``psum`` takes it: ``None``, a name, or a tuple of names."""
    if axis_name is None or isinstance(axis_name, str):
        return axis_name
    if (
        isinstance(axis_name, (tuple, list))
        and axis_name
        and all(isinstance(name, str) for name in axis_name)
    ):
        return tuple(axis_name)
    raise TypeError(
        "`axis_name` must be None (plain `jit`), the name of a `shard_map`/`pmap` axis such as "
        "'batch', or a non-empty tuple of such names. Received: "
        f"axis_name={axis_name!r} (of type {type(axis_name).__name__})"
    )


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


def _check_inner(inner: Any) -> None:
    if callable(getattr(inner, "init", None)) and callable(getattr(inner, "update", None)):
        return
    if isinstance(inner, str):
        hint = "; pass the transformation itself (`optax.adam(1e-3)`), not its name"
    elif callable(inner):
        name = getattr(inner, "__name__", "it")
        hint = f"; did you mean to call it, `{name}(learning_rate)`?"
    else:
        hint = ""
    raise TypeError(
        f"`inner` must be an optax GradientTransformation (such as `optax.adam(1e-3)`). "
        f"Received: inner={inner!r} (of type {type(inner).__name__}){hint}"
    )


_LIBRARY_DIRS = tuple(
    os.path.dirname(m.__file__) + os.sep for m in (jax, optax, numerics) if m.__file__
)


def _user_stacklevel() -> int:
    """The ``stacklevel`` of the first frame outside jax, optax and jmp_policy (the user's
    call, however deep in ``jit`` tracing the warning is raised)."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(_LIBRARY_DIRS):
        frame, level = frame.f_back, level + 1  # type: ignore[assignment]
    return level


def _float16_paths(tree: Any) -> list[str]:
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return [
        jax.tree_util.keystr(path, simple=True, separator="/") or "<root>"
        for path, x in leaves
        if getattr(x, "dtype", None) == np.float16
    ]


def _warn_float16(paths: list[str]) -> None:
    shown = ", ".join(repr(p) for p in paths[:3]) + (", ..." if len(paths) > 3 else "")
    warnings.warn(
        f"`loss_scaling` got float16 gradients ({len(paths)} "
        f"{'leaf' if len(paths) == 1 else 'leaves'}: {shown}), so the "
        f"parameters are stored in float16 with no float32 master weights. Unscaled back to "
        f"float16, every gradient below float16's smallest subnormal (6e-8) is 0 whatever the "
        f"loss scale. Keep the parameters in float32 and compute in float16: the policy "
        f'"mixed_float16".',
        UserWarning,
        stacklevel=_user_stacklevel(),
    )


def loss_scaling(
    inner: optax.GradientTransformation | optax.MultiSteps,
    loss_scale: str | float | LossScale = "dynamic",
    *,
    axis_name: str | Sequence[str] | None = None,
) -> optax.GradientTransformationExtraArgs:
    """Wraps an optax transformation with loss scaling and skipping of non-finite steps.

    ``update`` takes the gradients of the **scaled** loss (from :func:`scaled_value_and_grad`)
    and, in one jittable step with no host synchronisation:

    1. unscales them in float32 with the scale they were computed with (the one in the state);
    2. decides whether they are all finite, once for all devices: under ``jit`` with sharded
       gradients the reduction is global; under ``shard_map``/``pmap`` pass ``axis_name`` and
       the local answers are combined over that axis, so one device's NaN makes every device
       skip and every device keeps the same scale;
    3. runs ``inner`` on finite steps only: a non-finite step returns zero updates and the
       unchanged inner state, however many come in a row (unlike ``optax.apply_if_finite``,
       which eventually applies them);
    4. adjusts the loss scale (grow after ``period`` finite steps, back off on a non-finite one).

    Steps 2 and 3 compile to selects, not a branch (no conditional, so nothing is read back
    to the host): XLA fuses the unscaling and the selection into the inner update, so the
    wrapper costs one extra read of the gradients (the finiteness reduction of the unscaled
    gradients, which also catches a scale below 1 overflowing a 16-bit gradient), as any
    wrapper that skips non-finite steps must (see ``benchmarks/loss_scaling_bench.py``).
    Float16 gradients (parameters stored in float16, no float32 master weights) underflow
    when unscaled whatever the scale: ``update`` warns once, when traced, and points to
    ``"mixed_float16"`` (float32 parameters, float16 compute).
    Extra arguments of ``update`` (such as ``value=`` for ``optax.contrib.reduce_on_plateau``)
    reach ``inner`` when it accepts them. ``inner`` may be any transformation, a chain, an
    ``inject_hyperparams`` one or an ``optax.MultiSteps``. Put gradient clipping inside
    (``loss_scaling(optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)))``): only there
    does it see unscaled gradients. Put ``MultiSteps`` inside too
    (``loss_scaling(optax.MultiSteps(inner, k))``): each non-finite mini-step is then skipped
    and backs the scale off at once, and the window goes on. The result may go inside
    ``MultiSteps``, but there a non-finite mini-step poisons the whole window, and optax 0.2.x
    keeps that NaN in its accumulator (``0 * NaN``), so every later window is skipped too.

    Args:
        inner: the transformation to run on finite, unscaled gradients.
        loss_scale: ``"dynamic"`` (a default :class:`DynamicLossScale`), ``"auto"`` (dynamic
            when the global policy computes in float16 when ``loss_scaling`` is called, else no
            scaling, as tf.keras's ``compile`` did), ``"none"`` (no scaling; non-finite steps
            are still skipped), a positive number (a static scale) or a loss-scale object.
        axis_name: the ``shard_map``/``pmap`` axis (or axes) over which devices hold different
            gradients; ``None`` under plain ``jit`` (sharded arrays are reduced globally there).

    Returns:
        An ``optax.GradientTransformationExtraArgs`` whose state is a
        :class:`LossScalingState`.

    Raises:
        ValueError: an unknown ``loss_scale`` string, or a non-positive number.
        TypeError: ``loss_scale`` of another type, ``inner`` that is not a transformation
            (``optax.adam`` uncalled, the string ``"adam"``), or ``axis_name`` neither a
            string nor a tuple of strings. (``update`` raises ``ValueError`` when
            ``axis_name`` is not an axis where it runs, such as under plain ``jit``.)

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
    _check_inner(inner)
    axis_name = _check_axis_name(axis_name)
    initial_scale = _resolve_loss_scale(loss_scale)
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
            paths = _float16_paths(updates)
            if paths:  # at trace time, once per wrapper
                warned = True
                _warn_float16(paths)
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
            total_skipped=state.total_skipped + skipped,
            consecutive_skipped=(state.consecutive_skipped + 1) * skipped,
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
            f"`jmp_policy.loss_scaling(...)`."
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
        if not isinstance(loss_scale, _LOSS_SCALE_TYPES):
            raise TypeError(
                f"The first argument of the function returned by `scaled_value_and_grad` must "
                f"be a loss scale (NoOpLossScale, StaticLossScale, DynamicLossScale); received "
                f"{type(loss_scale).__name__}. With an optimizer state, pass "
                f"`jmp_policy.get_loss_scale(opt_state)`."
            )
        bound = functools.partial(scaled_fun, loss_scale)
        (_, (loss, aux)), grads = jax.value_and_grad(bound, argnums=argnums, has_aux=True)(
            *args, **kwargs
        )
        return ((loss, aux) if has_aux else loss), grads

    return g
