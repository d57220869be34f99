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

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

import flax.linen as nn

from jmp_policy._src import interception, state_collections, transforms
from jmp_policy._src.framework.shared_docs import fill
from jmp_policy._src.quantization import matmuls, stack_layers
from jmp_policy.linen._modules import path_of
from jmp_policy.linen._reads import unfixed_reads

COLLECTION = state_collections.OVERWRITE_WITH_GRADIENT

# This thread's `jnp.einsum` calls go to `_EINSUM_AS.get()` while `_EINSUM.inside()`.
_EINSUM_AS: contextvars.ContextVar[Callable[..., Any] | None] = contextvars.ContextVar(
    "jmp_policy_linen_einsum", default=None
)


def _einsum(original: Callable[..., Any]) -> Callable[..., Any]:
    def einsum(*args: Any, **kwargs: Any) -> Any:
        replacement = _EINSUM_AS.get() if _EINSUM.inside() else None
        if replacement is None:
            return original(*args, **kwargs)
        return replacement(*args, **kwargs)

    return einsum


_EINSUM = transforms.ThreadPatch("einsum", {"einsum": _einsum})


@contextlib.contextmanager
def _einsum_as(replacement: Callable[..., Any]) -> Iterator[None]:
    token = _EINSUM_AS.set(replacement)
    try:
        with _EINSUM.active():
            yield
    finally:
        _EINSUM_AS.reset(token)


def routable(module: Any) -> bool:
    """A Dense/DenseGeneral with Flax's own matmul, or an Einsum."""
    if isinstance(module, (nn.Dense, nn.DenseGeneral)):
        return module.dot_general is None and module.dot_general_cls is None
    return isinstance(module, nn.Einsum)


def installed(call: Any, matmul: Callable[..., Any]) -> Any:
    """A context manager during which the routable layer of ``call`` runs ``matmul`` (a
    ``jnp.einsum`` for an ``nn.Einsum``, else a ``dot_general``) as its matmul (a stacked
    layer's reading its own slice, recorded as such)."""
    run = _KERNEL_RUN.get()
    if run is not None and call.path in run.sliced:
        matmul = matmuls.in_stack(matmul, call.path)
    if isinstance(call.module, nn.Einsum):
        return _einsum_as(matmul)
    return interception.attribute_set(call.module, "dot_general", matmul)


# -- quantized kernels reaching their layers ----------------------------------------------


class KernelRun(NamedTuple):
    """What one model run knows of the quantized kernels of its parameters (module path ->
    kernel): ``kernels`` passed whole as integer values; ``sliced``, stacked ones a layer
    reads a slice of in the stack's loop; ``ahead``, dequantized before the model runs.
    ``routes``, when not None, records for the paths in ``learn`` the kernel shape each
    routed module sees (None when its matmul is not routed).
    """

    kernels: Mapping[str, Any]
    learn: Mapping[str, Any] = {}
    routes: dict[str, tuple[int, ...] | None] | None = None
    ahead: Mapping[str, Any] = {}
    sliced: Mapping[str, Any] = {}


_KERNEL_RUN: contextvars.ContextVar[KernelRun | None] = contextvars.ContextVar(
    "jmp_policy_linen_kernel_run", default=None
)


@contextlib.contextmanager
def kernel_run(run: KernelRun) -> Iterator[None]:
    token = _KERNEL_RUN.set(run)
    try:
        yield
    finally:
        _KERNEL_RUN.reset(token)


def _learn_route(module: Any, path: str, run: KernelRun) -> None:
    if run.routes is None or path not in run.learn:
        return
    seen = (
        module.get_variable("params", "kernel") if module.has_variable("params", "kernel") else None
    )
    shape = getattr(seen, "shape", None)
    run.routes[path] = tuple(shape) if routable(module) and shape is not None else None


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
    whole, its own slice of a stacked one, else :data:`FLOAT_KERNEL`; ``None`` for a
    module whose matmul is not routed. A learning run records the kernel shape it sees."""
    if not routable(module):
        return None
    run = _KERNEL_RUN.get()
    if run is None:
        return FLOAT_KERNEL
    path = path_of(module)
    _learn_route(module, path, run)
    if (whole := run.kernels.get(path)) is not None:
        return whole
    if path in run.sliced:
        return _layer_kernel(module, run.sliced[path])
    return FLOAT_KERNEL


def kernel_ahead(path: str) -> Any:
    """The ``QuantizedArray`` kernel dequantized ahead of the layer at ``path``."""
    run = _KERNEL_RUN.get()
    return None if run is None else run.ahead.get(path)


# id(module) -> (module, its calls so far) in the run in progress. Flax gives each call a
# fresh scope, but the same instance; a lifted transform (nn.scan) traces clones, so a body
# is one call.
_CALLS: contextvars.ContextVar[dict[int, tuple[Any, int]] | None] = contextvars.ContextVar(
    "jmp_policy_linen_calls", default=None
)


@contextlib.contextmanager
def counting(calls: dict[int, tuple[Any, int]]) -> Iterator[None]:
    """Module calls in the block count their float8 states in ``calls`` (one per run)."""
    token = _CALLS.set(calls)
    try:
        yield
    finally:
        _CALLS.reset(token)


def layer_state(call: Any, scheme: Any) -> Any:
    """The float8 state of this call of the layer (its ``index``-th in the run)."""
    calls = _CALLS.get()
    if calls is None:
        calls = {}
    module = call.module
    index = calls.get(id(module), (module, 0))[1]
    calls[id(module)] = (module, index + 1)
    return float8_state(module, call.resolution.policy, index)


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
