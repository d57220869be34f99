"""Running an NNX model per submodule: the core's ``apply`` with the NNX adapter."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from flax import nnx

from jmp_policy._src import interception
from jmp_policy._src.framework import entry_points
from jmp_policy._src.framework.shared_docs import fill
from jmp_policy.nnx._adapter import adapter_for, applying
from jmp_policy.nnx._modules import is_nnx_object, methods_for, prepare


@fill
def apply(
    model: nnx.Module,
    policy_or_map: Any,
    method: str | Callable[..., Any] = "__call__",
    **options: Any,
) -> Callable[..., Any]:
    """Makes a function that runs an NNX ``model`` per submodule under a policy or a map.

    The returned function takes ``method``'s arguments. A module's path is its
    ``'/'``-joined attribute path (``"layers/0"``); a parameter's policy is resolved from
    its own path (``"embed/embedding"``), otherwise its module's. Each call runs a copy of
    the model (``nnx.split``, cast, ``nnx.merge``): ``model`` keeps its stored parameters,
    and the copy's non-``Param`` state (batch statistics, caches, RNG counts) is written
    back in its stored dtype. Float8 state: :func:`init_float8`. Under ``nnx.jit`` and the
    other transforms, call ``apply`` inside the transformed function.
    {apply_rules}

    Args:
        model: an ``nnx.Module``; never modified except for its non-``Param`` state.
        {apply_policy_or_map}
        method: the name of the model's method to run (``"__call__"``), or a function
            ``fn(model, *args, **kwargs)`` that runs under the root policy.
        {apply_options}

    {apply_tail}

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from flax import nnx
        >>> import jmp_policy as jp
        >>> model = nnx.Sequential(nnx.Linear(3, 4, rngs=nnx.Rngs(0)),
        ...                        nnx.Linear(4, 2, rngs=nnx.Rngs(1)))
        >>> policy_map = jp.DTypePolicyMap("mixed_bfloat16", {"layers/1": "float32"})
        >>> run = jp.nnx.apply(model, policy_map)
        >>> run(jnp.ones((1, 3))).dtype   # the float32 head's logits
        dtype('float32')
        >>> model.layers[0].kernel.dtype  # the stored parameters are unchanged
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
