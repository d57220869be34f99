"""Quantized compute for Linen: the hook's extension that routes layers' matmuls.

A ``Dense``/``DenseGeneral`` whose user set neither ``dot_general`` nor ``dot_general_cls``
gets the routed matmul (:func:`jmp_policy._src.quantization.matmuls.pick`) in that attribute
for the call; an ``nn.Einsum`` calls ``jnp.einsum`` itself, so while one runs,
``jax.numpy.einsum`` is replaced by a router that sends that thread's calls to the routed
matmul (other threads' to the original). **float8 state**: each call of a float8 layer reads
its own ``float8_<i>`` (its ``i``-th call in this run) of :data:`COLLECTION`, which
:func:`jmp_policy.linen.init` creates; a missing one is a ``ValueError`` naming ``init``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import flax.linen as nn

from jmp_policy._src import interception, state_collections
from jmp_policy._src.framework import run_kernels
from jmp_policy._src.framework.einsum_route import einsum_as
from jmp_policy._src.framework.param_reads import unfixed_reads
from jmp_policy._src.framework.shared_docs import fill
from jmp_policy._src.quantization import matmuls, stack_layers
from jmp_policy.linen._modules import path_of

COLLECTION = state_collections.OVERWRITE_WITH_GRADIENT


def routable(module: Any) -> bool:
    """A Dense/DenseGeneral with Flax's own matmul, or an Einsum."""
    if isinstance(module, (nn.Dense, nn.DenseGeneral)):
        return module.dot_general is None and module.dot_general_cls is None
    return isinstance(module, nn.Einsum)


def installed(call: Any, matmul: Callable[..., Any]) -> Any:
    """A context manager during which the routable layer of ``call`` runs ``matmul`` (a
    ``jnp.einsum`` for an ``nn.Einsum``, else a ``dot_general``) as its matmul (a stacked
    layer's reading its own slice, recorded as such)."""
    if call.path in run_kernels.kernels().sliced:
        matmul = matmuls.in_stack(matmul, call.path)
    if isinstance(call.module, nn.Einsum):
        return einsum_as(matmul)
    return interception.attribute_set(call.module, "dot_general", matmul)


def _layer_kernel(module: Any, stored: Any) -> Any:
    """The layer's own ``QuantizedArray`` kernel, rebuilt from the slices of the stacked
    kernel ``stored`` that the loop body sees (read as stored, not cast)."""
    with unfixed_reads():
        values = module.get_variable("params", "kernel")
        leaves = {
            field: module.get_variable("params", stack_layers.leaf_name("kernel", field))
            for field in stack_layers.extra_leaves(stored)
        }
    return stack_layers.layer_of(stored, values, leaves)


#: What :func:`kernel` answers for a routable layer reading its own float kernel.
FLOAT_KERNEL = "the layer's own float kernel"


def kernel(module: Any) -> Any:
    """A routable layer's kernel as its matmul receives it: the ``QuantizedArray`` it reads
    whole, its own slice of a stacked one (the run's kernels,
    :mod:`jmp_policy._src.framework.run_kernels`), else :data:`FLOAT_KERNEL`; ``None``
    for a module whose matmul is not routed."""
    if not routable(module):
        return None
    path = path_of(module)
    run = run_kernels.kernels()
    if (whole := run.whole.get(path)) is not None:
        return whole
    if path in run.sliced:
        return _layer_kernel(module, run.sliced[path])
    return FLOAT_KERNEL


def layer_state(call: Any, scheme: Any) -> Any:
    """The float8 state of this call of the layer (its how-manieth in the run: Flax gives
    each call a fresh scope, but the same instance; a lifted transform such as ``nn.scan``
    traces clones, so a body is one call)."""
    index = run_kernels.call_index(call.module)
    return float8_state(call.module, call.resolution.policy, index)


def float8_state(module: nn.Module, policy: Any, index: int) -> Any:
    """The state of ``module``'s ``index``-th call in this run, created when mutable."""
    name = f"float8_{index}"
    if module.has_variable(COLLECTION, name):
        return module.get_variable(COLLECTION, name)
    if not module.is_mutable_collection(COLLECTION):
        where = "/".join(module.path) or "the root module"
        twice = (
            f" It is call {index + 1} of this module in one step: a module called several "
            "times needs a state per call, which `init` creates when it calls it as often."
            if index
            else ""
        )
        raise ValueError(
            f"{type(module).__name__} at {where!r} runs under the float8 policy "
            f"{policy.name!r} but its float8 state {COLLECTION!r}/{name!r} is not in the "
            "variables. Create the variables with `jmp_policy.linen.init(module, "
            "policy_or_map)` and pass them whole (the float8 state comes back as its "
            "gradient: see `jmp_policy.linen.split_gradients`). Under `nn.scan`, list "
            f"{COLLECTION!r} in `variable_axes` (like 'params').{twice}"
        )
    return module.variable(COLLECTION, name, policy.scheme.init_state).value


@fill
def split_gradients(grads: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Splits gradients into what the optimizer updates and the new float8 state.

    {float8_gradient}
    ``flax.training.train_state.TrainState.apply_gradients`` does this split itself; a plain
    optax loop uses this function.

    Args:
        grads: the gradients with respect to the whole variables (``{"params": ...,
            "_overwrite_with_gradient": ...}``), e.g. ``jax.grad(loss)(variables)``.

    Returns:
        ``(optimizer_grads, float8_state)``: ``grads`` without the
        ``"_overwrite_with_gradient"`` collection, and ``{"_overwrite_with_gradient":
        new_state}`` (empty when there is none), ready to merge into the new variables
        (``{"params": new_params, **float8_state}``).

    Raises:
        TypeError: ``grads`` is not a mapping of collections.

    Examples:
        >>> import jax, jax.numpy as jnp, flax.linen as nn, optax
        >>> import jmp_policy as jp
        >>> model, x = nn.Dense(4), jnp.ones((2, 3))
        >>> variables = jp.linen.init(model, "float8_from_mixed_bfloat16")(
        ...     jax.random.key(0), x)
        >>> sorted(variables)
        ['_overwrite_with_gradient', 'params']
        >>> fn = jp.linen.apply(model, "float8_from_mixed_bfloat16")
        >>> loss = lambda v: fn(v, x).astype(jnp.float32).sum()
        >>> tx = optax.sgd(0.1)
        >>> opt_state = tx.init(variables["params"])
        >>> grads, state = jp.linen.split_gradients(jax.grad(loss)(variables))
        >>> updates, opt_state = tx.update(grads["params"], opt_state)
        >>> variables = {"params": optax.apply_updates(variables["params"], updates),
        ...              **state}
        >>> float(variables["_overwrite_with_gradient"]["float8_0"]["input_scale"])
        448.0
    """
    if not isinstance(grads, Mapping):
        raise TypeError(
            "`grads` must be a mapping of variable collections (the gradients with respect "
            "to the whole variables, e.g. {'params': ..., '_overwrite_with_gradient': ...}). "
            f"Received: grads of type {type(grads).__name__}"
        )
    rest = {name: value for name, value in grads.items() if name != COLLECTION}
    state = {COLLECTION: grads[COLLECTION]} if COLLECTION in grads else {}
    return rest, state
