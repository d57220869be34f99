"""Running an NNX model per submodule: a policy-running copy of the object graph."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from flax import nnx

from jmp_policy._src import interception
from jmp_policy._src.run_report import compute_modules, warn_once
from jmp_policy.nnx._copy import cast_copy, warn_plain_arrays, write_back
from jmp_policy.nnx._hook import dress, resolver_for
from jmp_policy.nnx._kv_cache import kv_caches
from jmp_policy.nnx._modules import (
    MATMUL_CLASSES,
    is_nnx_object,
    methods_for,
    prepare,
)
from jmp_policy.nnx._quantization import quantized_matmuls, quantized_run


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
    model: nnx.Module, policies: Any, opts: Any, method: str | Callable[..., Any]
) -> Callable[..., Any]:
    """:func:`apply` with checked arguments and built options (``diagnose`` adds its taps)."""
    methods = methods_for(model, method)
    # Quantized layers' matmuls innermost, and only on the layers they can reach: each
    # Python frame a module call adds costs trace time in every op it runs.
    extensions = (*opts.extensions, quantized_matmuls)
    warned: set[str] = set()  # what this wrapper has warned about

    def run(*args: Any, **kwargs: Any) -> Any:
        resolver = resolver_for(model, policies, opts)
        copy, casts = cast_copy(model, resolver)
        dress(copy, resolver, methods, opts.extensions)
        # Before the call: a policy turned off by modules' own dtypes may well make the
        # model fail (a cache of one dtype written with another), so say why first.
        compute = compute_modules(resolver, nnx.state(model), MATMUL_CLASSES)
        warn_once(resolver, type(model).__name__, warned, compute)
        if casts.plain and "plain" not in warned:
            warned.add("plain")
            warn_plain_arrays(type(model).__name__, casts.plain)
        with (
            interception.model_run(opts),
            quantized_run(casts.whole, casts.ahead, casts.sliced),
            kv_caches(opts.kv_cache, copy, casts.stored),
        ):
            if isinstance(method, str):
                out = getattr(copy, method)(*args, **kwargs)
            else:
                call = interception.Call("", copy, resolver.module(""))
                out = interception.run(
                    call,
                    functools.partial(method, copy),
                    args,
                    kwargs,
                    extensions=extensions,
                    opaque=is_nnx_object,
                )
        write_back(model, copy, casts.stored)
        return out

    return run
