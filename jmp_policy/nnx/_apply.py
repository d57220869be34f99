"""Running an NNX model per submodule: the core's ``apply`` with the NNX adapter."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from flax import nnx

from jmp_policy._src import interception
from jmp_policy._src.framework import entry_points
from jmp_policy.nnx._adapter import adapter_for, applying
from jmp_policy.nnx._modules import is_nnx_object, methods_for, prepare


def apply(
    model: nnx.Module,
    policy_or_map: Any,
    method: str | Callable[..., Any] = "__call__",
    **options: Any,
) -> Callable[..., Any]:
    """Makes a function that runs an NNX ``model`` per submodule under a policy or a map.

    The returned function takes ``method``'s arguments. Each submodule (the root: path
    ``""``; a module's path is its ``'/'``-joined attribute path, ``"layers/0"``) runs
    under :func:`jmp_policy.current_policy` set to its policy, the floating leaves of its
    arguments and its ``nnx.Param`` values cast to its compute dtype; its outputs are cast
    only when its policy's output dtype differs from its compute dtype, and loop carries
    keep their dtype. A parameter's policy is resolved from its own path
    (``"embed/embedding"``), otherwise its module's. The rules are those of
    :func:`jmp_policy.linen.apply`, warnings included. Each call runs a copy of the model
    (``nnx.split``, cast, ``nnx.merge``): ``model`` keeps its stored parameters,
    ``nnx.grad`` gives gradients in their stored dtype, and the copy's non-``Param`` state
    (batch statistics, caches, RNG counts) is written back in its stored dtype. Int8 and
    float8 policies run ``nnx.Linear``, ``nnx.LinearGeneral`` and ``nnx.Einsum`` matmuls
    quantized (float8 state: :func:`jmp_policy.nnx.init_float8`). Works under
    ``nnx.jit``, ``nnx.grad``, ``nnx.vmap`` and ``nnx.scan`` over a model: call
    ``apply`` inside the transformed function. The README's "How the Flax wrappers work"
    gives the details and what is not covered.

    Args:
        model: an ``nnx.Module``; never modified except for its non-``Param`` state.
        policy_or_map: as for :func:`jmp_policy.linen.apply`.
        method: the name of the model's method to run (``"__call__"``), or a function
            ``fn(model, *args, **kwargs)`` that runs under the root policy.
        **options: as for :func:`jmp_policy.linen.apply`.

    Returns:
        A function ``(*args, **kwargs)`` returning the method's outputs.

    Raises:
        TypeError: ``model`` is not an ``nnx.Module``, ``method`` is neither a string nor
            callable, or an option has the wrong type.
        ValueError: ``policy_or_map`` or a policy of ``type_policies`` is not a valid
            floating policy, or the model has no method ``method``.

    Examples:
        >>> import jax
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> import jmp_policy as jp
        >>> class Model(nnx.Module):
        ...     def __init__(self, rngs):
        ...         self.encoder = nnx.Linear(3, 4, rngs=rngs)
        ...         self.head = nnx.Linear(4, 2, rngs=rngs)
        ...     def __call__(self, x):
        ...         return self.head(self.encoder(x))
        >>> model = Model(nnx.Rngs(0))
        >>> policy_map = jp.DTypePolicyMap("mixed_bfloat16", {"head": "float32"})
        >>> run = jp.nnx.apply(model, policy_map)
        >>> run(jnp.ones((1, 3))).dtype   # the float32 head's logits
        dtype('float32')
        >>> model.encoder.kernel.dtype  # the stored parameters are unchanged
        dtype('float32')
        >>> loss = lambda m, x: jp.nnx.apply(m, "mixed_bfloat16")(x).astype("float32").sum()
        >>> grads = nnx.grad(loss)(model, jnp.ones((1, 3)))
        >>> {x.dtype for x in jax.tree.leaves(grads)}
        {dtype('float32')}
    """
    policies, opts = prepare(model, policy_or_map, options)
    return apply_with(model, policies, opts, method)


def apply_with(
    model: nnx.Module, policies: Any, opts: Any, method: Any, taps: tuple[Any, ...] = ()
) -> Callable[..., Any]:
    """:func:`apply` with checked arguments and built options, ``taps`` outermost (the
    extensions ``diagnose`` and ``search_map`` add)."""
    adapter = adapter_for(methods_for(model, method))
    invoke = None if method == "__call__" else functools.partial(_invoke, method)
    extensions = (*taps, *opts.extensions)
    run = entry_points.apply(adapter, model, policies, opts, extensions, invoke)
    warned: set[str] = set()  # what this wrapper has warned about

    def apply_run(*args: Any, **kwargs: Any) -> Any:
        with applying(warned):
            return run(*args, **kwargs)

    return apply_run


def _invoke(method: Any, copy: Any, resolver: Any, extensions: Any, args: Any, kwargs: Any) -> Any:
    """The copy's ``method`` (a name), or ``method(copy, ...)`` under the root's policy."""
    if isinstance(method, str):
        return getattr(copy, method)(*args, **kwargs)
    call = interception.Call("", copy, resolver.module(""))
    fn = functools.partial(method, copy)
    return interception.run(call, fn, args, kwargs, extensions=extensions, opaque=is_nnx_object)
