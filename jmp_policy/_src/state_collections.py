"""Variable collections that hold state, not parameters: an optimizer must never update them.

Flax's convention (``flax.linen.fp8_ops.OVERWRITE_WITH_GRADIENT``): ``jax.grad`` returns the
*new value* of a variable in the collection ``"_overwrite_with_gradient"`` as its gradient,
and the training step replaces the variable with it. Linen's float8 scales and amax
histories live there, both Flax's own fp8 layers' and ``jmp_policy.linen``'s. Loss scaling
would unscale, skip or add them, so :func:`check_not_in` refuses gradients that carry it.

The name is Flax's convention, not the Linen glue's, and it is known here (as a string:
nothing here imports flax) so that the check holds from ``import jmp_policy`` on, whether
or not ``jmp_policy.linen`` was imported: a model of Flax's own fp8 layers never imports it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: Where Flax keeps state whose gradient is its new value (and where Linen's float8 goes).
OVERWRITE_WITH_GRADIENT = "_overwrite_with_gradient"


def check_not_in(grads: Any, where: str) -> None:
    """Raises when ``grads`` (a dict of collections) carries float8 state, which an
    optimizer must replace rather than update (loss scaling would also unscale it).

    Examples:
        >>> from jmp_policy._src import state_collections
        >>> state_collections.check_not_in({"params": {}}, "loss_scaling")  # no error
    """
    if isinstance(grads, Mapping) and OVERWRITE_WITH_GRADIENT in grads:
        raise ValueError(
            f"{where} received gradients with the {OVERWRITE_WITH_GRADIENT!r} collection: "
            "that is float8 state, whose gradient is its new value and must replace it, never "
            "be unscaled, skipped or added. Split it off first with "
            "`grads, float8_state = jmp_policy.linen.split_gradients(grads)` and update "
            "only grads['params'] (flax's TrainState.apply_gradients does this itself)."
        )
