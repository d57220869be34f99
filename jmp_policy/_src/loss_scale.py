"""Loss scales: no-op, static and dynamic, with the rule that adapts a dynamic scale.

A loss scale multiplies the loss before differentiation so that small gradients survive a
16-bit backward pass, and divides the gradients afterwards. The classes are state pytrees
(see ``state_pytree``): the arrays (scale, counters) are leaves, the settings (period, factor,
bounds) are static metadata, so nothing is lost when a loss scale crosses ``jit``, ``scan``,
``tree.map`` or a checkpoint, and a new scale value never forces a recompile. Settings are
validated when their values are known, whatever their type (Python, NumPy or JAX scalars).
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeAlias, TypeVar

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jmp_policy._src import loss_scale_checks as checks
from jmp_policy._src import numerics
from jmp_policy._src.state_pytree import register_state, replace_leaves, tree_equal
from jmp_policy._src.state_pytree import register_with_flax_serialization as _register_flax

T = TypeVar("T")

#: The default initial scale (Keras, tf.keras and jmp's documentation).
DEFAULT_LOSS_SCALE = 2.0**15
#: The default floor: float16's smallest normal number. Low enough that training never stalls
#: (a float16 gradient that overflows even at this scale is a real gradient above 1e9), high
#: enough that ``1 / scale`` is exact and a collapsed scale recovers in a bounded time.
DEFAULT_MIN_LOSS_SCALE = 2.0**-14
#: The default ceiling: float16's smallest subnormal is ``2**-24``, so a larger scale lifts no
#: float16-representable gradient further; it keeps ``scale * loss`` far from float32's maximum.
DEFAULT_MAX_LOSS_SCALE = 2.0**24
#: The counter is int32: ``counter >= period - 1`` must be representable.
_MAX_PERIOD = 2**31
_MAX_HYSTERESIS = 2**31 - 1


@register_state
@dataclasses.dataclass(frozen=True, eq=False)
class NoOpLossScale:
    """A loss scale that does nothing: a drop-in for when no scaling is wanted.

    ``scale`` and ``unscale`` return their argument itself; ``adjust`` returns ``self``. It has
    no leaves, so it costs nothing under ``jit``.

    Examples:
        >>> import jax.numpy as jnp
        >>> import jmp_policy as jp
        >>> loss_scale = jp.NoOpLossScale()
        >>> tree = {"g": jnp.ones(2)}
        >>> loss_scale.unscale(tree) is tree
        True
        >>> float(loss_scale.loss_scale)
        1.0
    """

    __eq__ = tree_equal
    __hash__ = None  # type: ignore[assignment]  # array leaves

    def __post_init__(self) -> None:
        _register_flax()

    @property
    def loss_scale(self) -> jax.Array:
        """The scale, always ``1.0`` (float32)."""
        return jnp.ones((), jnp.float32)

    def scale(self, tree: T) -> T:
        """Returns ``tree`` unchanged."""
        return tree

    def unscale(self, tree: T) -> T:
        """Returns ``tree`` unchanged."""
        return tree

    def adjust(self, grads_finite: jax.Array) -> NoOpLossScale:
        """Returns ``self``."""
        del grads_finite
        return self


class _ScaleByLeaf:
    """``scale`` and ``unscale`` by an array leaf ``loss_scale`` (static and dynamic scales)."""

    loss_scale: Any

    def scale(self, tree: T) -> T:
        """Multiplies every floating leaf by the scale, in float32 (16-bit leaves come back
        float32, so a scaled loss cannot overflow); other leaves are returned as they are."""
        return numerics.scale_tree(tree, self.loss_scale)

    def unscale(self, tree: T) -> T:
        """Divides every floating leaf by the scale, computing in float32 and returning each
        leaf in its own dtype; other leaves are returned as they are."""
        return numerics.unscale_tree(tree, self.loss_scale)


@register_state
@dataclasses.dataclass(frozen=True, eq=False)
class StaticLossScale(_ScaleByLeaf):
    """A constant loss scale.

    Args:
        loss_scale: a finite number > 0 (a Python number or a NumPy or JAX scalar, validated
            when concrete); stored as a float32 array leaf.

    Raises:
        ValueError: ``loss_scale`` is not a finite number > 0.

    Examples:
        >>> import jax.numpy as jnp
        >>> import jmp_policy as jp
        >>> loss_scale = jp.StaticLossScale(128.0)
        >>> loss_scale.scale(jnp.float16(2.0))  # computed in float32
        Array(256., dtype=float32)
        >>> loss_scale.unscale({"g": jnp.ones(2, jnp.float16) * 256})["g"]
        Array([2., 2.], dtype=float16)
    """

    loss_scale: ArrayLike

    __eq__ = tree_equal
    __hash__ = None  # type: ignore[assignment]  # array leaves

    def __post_init__(self) -> None:
        _register_flax()
        object.__setattr__(
            self, "loss_scale", checks.as_leaf(self.loss_scale, jnp.float32, "loss_scale")
        )

    def adjust(self, grads_finite: jax.Array) -> StaticLossScale:
        """Returns ``self``: a static scale never changes."""
        del grads_finite
        return self


@register_state
@dataclasses.dataclass(frozen=True, eq=False)
class DynamicLossScale(_ScaleByLeaf):
    """A loss scale that grows while gradients are finite and shrinks when they are not.

    The rule is jmp's and PyTorch ``GradScaler``'s: on the ``period``-th consecutive finite
    step the scale is multiplied by ``factor`` (only if the result is finite and at most
    ``max_loss_scale``) and the counter resets; on a non-finite step the scale is divided by
    ``factor``, never below ``min_loss_scale``, and the counter resets. With ``hysteresis=n``
    (Megatron-LM's rule) the first ``n - 1`` non-finite steps since the last growth keep the
    scale; later ones back off as usual.

    It is a pytree: ``loss_scale`` and ``counter`` (and ``overflows`` with hysteresis) are
    array leaves (so a new value never recompiles a jitted step), the settings are static
    metadata (so ``jit``, ``scan``, ``tree.map`` and checkpoints keep them). ``adjust`` is pure
    ``jnp`` code: it runs under ``jit`` with no host synchronisation. Across devices, pass
    every device the same ``grads_finite`` (as :func:`jmp_policy.loss_scaling` does) and the
    scales stay identical.

    Every setting may be a Python number or a NumPy or JAX scalar, and is validated when its
    value is known: ``jnp.float16(2**16)`` is inf and is rejected like ``float("inf")``. Under
    ``jit`` the scale and counter are traced and are not checked; the static settings must be
    concrete there too.

    Args:
        loss_scale: the initial scale (default ``2**15``), a number or scalar array of any
            float dtype (stored as float32, so ``jnp.float16(2**15)`` works).
        counter: consecutive finite steps so far (int32).
        period: finite steps between growths, an integer in ``[1, 2**31]`` (the counter is
            int32; default 2000).
        factor: growth and backoff factor, a finite number ``> 1`` (default 2).
        min_loss_scale: the floor, a finite positive number (default ``2**-14``; never 1,
            which stalls training whose gradients overflow float16).
        max_loss_scale: the ceiling, a finite positive number (default ``2**24``), so the
            scale never reaches inf.
        hysteresis: non-finite steps tolerated since the last growth before backing off, an
            integer in ``[1, 2**31 - 1]`` (default 1: back off on every non-finite step).
        overflows: non-finite steps since the last growth (an int32 leaf only when
            ``hysteresis > 1``; ``None`` otherwise, so the leaves are jmp's
            ``[loss_scale, counter]``).

    Raises:
        ValueError: ``period`` or ``hysteresis`` out of range, ``factor <= 1``, a non-positive
            or non-finite scale or bound, ``min_loss_scale > max_loss_scale``, or an initial
            scale outside ``[min_loss_scale, max_loss_scale]``; each quoting the value.
        TypeError: a setting of the wrong type (``period=2.5``, ``factor="2"``, a traced
            setting, a non-scalar array).

    Examples:
        >>> import jax
        >>> import jax.numpy as jnp
        >>> import jmp_policy as jp
        >>> loss_scale = jp.DynamicLossScale(2.0**15, period=2)
        >>> loss_scale = loss_scale.adjust(jnp.array(True))
        >>> loss_scale = loss_scale.adjust(jnp.array(True))  # 2nd finite step: grow
        >>> float(loss_scale.loss_scale)
        65536.0
        >>> loss_scale = jax.jit(lambda s: s.adjust(jnp.array(False)))(loss_scale)
        >>> float(loss_scale.loss_scale), int(loss_scale.counter), loss_scale.period
        (32768.0, 0, 2)
    """

    loss_scale: ArrayLike = DEFAULT_LOSS_SCALE
    counter: ArrayLike = 0
    period: int = dataclasses.field(default=2000, metadata={"static": True})
    factor: float = dataclasses.field(default=2.0, metadata={"static": True})
    min_loss_scale: float = dataclasses.field(
        default=DEFAULT_MIN_LOSS_SCALE, metadata={"static": True}
    )
    max_loss_scale: float = dataclasses.field(
        default=DEFAULT_MAX_LOSS_SCALE, metadata={"static": True}
    )
    hysteresis: int = dataclasses.field(default=1, metadata={"static": True})
    overflows: ArrayLike | None = None

    __eq__ = tree_equal
    __hash__ = None  # type: ignore[assignment]  # array leaves

    def __post_init__(self) -> None:
        _register_flax()
        object.__setattr__(self, "period", checks.count(self.period, "period", _MAX_PERIOD))
        hysteresis = checks.count(self.hysteresis, "hysteresis", _MAX_HYSTERESIS)
        object.__setattr__(self, "hysteresis", hysteresis)
        object.__setattr__(self, "factor", checks.factor(self.factor))
        low = checks.bound(self.min_loss_scale, "min_loss_scale")
        high = checks.bound(self.max_loss_scale, "max_loss_scale")
        if low > high:
            raise ValueError(
                f"`min_loss_scale` must be <= `max_loss_scale`. Received: "
                f"min_loss_scale={low!r}, max_loss_scale={high!r}"
            )
        object.__setattr__(self, "min_loss_scale", low)
        object.__setattr__(self, "max_loss_scale", high)
        leaf = checks.as_leaf(self.loss_scale, jnp.float32, "loss_scale")
        checks.within_bounds(leaf, self.loss_scale, low, high)
        object.__setattr__(self, "loss_scale", leaf)
        object.__setattr__(self, "counter", checks.as_leaf(self.counter, jnp.int32, "counter"))
        # Without hysteresis there is nothing to count: no leaf (jmp's leaves are exactly
        # `[loss_scale, counter]`).
        overflows = (
            None if self.hysteresis == 1 else (0 if self.overflows is None else self.overflows)
        )
        if overflows is not None:
            overflows = checks.as_leaf(overflows, jnp.int32, "overflows")
        object.__setattr__(self, "overflows", overflows)

    def adjust(self, grads_finite: jax.Array) -> DynamicLossScale:
        """Returns the loss scale for the next step.

        Args:
            grads_finite: a scalar bool (array): whether this step's gradients were finite.
                Agree on it across devices first (see :func:`all_finite`).

        Returns:
            A new ``DynamicLossScale`` with the same settings.
        """
        finite = numerics.scalar_bool(grads_finite, "grads_finite")
        loss_scale = jnp.asarray(self.loss_scale, jnp.float32)
        counter = jnp.asarray(self.counter, jnp.int32)
        grow = counter >= self.period - 1
        grown = loss_scale * self.factor
        may_grow = jnp.isfinite(grown) & (grown <= self.max_loss_scale)
        finite_scale = jnp.where(grow & may_grow, grown, loss_scale)
        finite_counter = jnp.where(grow, 0, counter + 1)
        backed_off = jnp.maximum(loss_scale / self.factor, self.min_loss_scale)
        new_overflows = None
        if self.overflows is None:  # hysteresis == 1: back off on every non-finite step
            bad_scale = backed_off
        else:
            overflows = jnp.asarray(self.overflows, jnp.int32)
            bad_overflows = jnp.minimum(overflows, self.hysteresis - 1) + 1  # never wraps
            bad_scale = jnp.where(bad_overflows >= self.hysteresis, backed_off, loss_scale)
            finite_overflows = jnp.where(grow, 0, overflows)
            new_overflows = jnp.where(finite, finite_overflows, bad_overflows).astype(jnp.int32)

        return replace_leaves(
            self,
            loss_scale=jnp.where(finite, finite_scale, bad_scale).astype(jnp.float32),
            counter=jnp.where(finite, finite_counter, 0).astype(jnp.int32),
            overflows=new_overflows,
        )


LossScale: TypeAlias = NoOpLossScale | StaticLossScale | DynamicLossScale
