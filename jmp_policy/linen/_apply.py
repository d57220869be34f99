"""Running a Linen model per submodule: ``apply``, the core's with the Linen adapter."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import flax.linen as nn

from jmp_policy._src.framework import entry_points
from jmp_policy._src.options import Options
from jmp_policy._src.resolution import Resolver
from jmp_policy._src.run_report import compute_modules, warn_once
from jmp_policy.linen._adapter import ADAPTER, Bound
from jmp_policy.linen._modules import MATMUL_CLASSES, check_method, check_variables, prepare


def apply(
    module: nn.Module,
    policy_or_map: Any,
    method: Any = None,
    **options: Any,
) -> Callable[..., Any]:
    """Makes ``module.apply`` run every submodule under its own policy.

    The returned function has ``module.apply``'s signature,
    ``fn(variables, *args, rngs=None, method=None, mutable=False,
    capture_intermediates=False, **kwargs)``, and returns what ``module.apply`` returns.
    Each submodule (the root: path ``""``) runs under :func:`jmp_policy.current_policy`
    set to its policy, its parameters and floating arguments cast to its compute dtype;
    its outputs are cast only when its policy's output dtype differs from its compute
    dtype (Keras names leave them as computed). Only ``"params"`` is cast, and comes back
    as stored under ``mutable``. Int8 and float8 policies run ``Dense``, ``DenseGeneral``
    and ``Einsum`` matmuls quantized (float8 state: :func:`init`, :func:`split_gradients`).
    Works under ``jax.jit``, ``jax.grad`` (gradients in the stored dtype), Flax's lifted
    transforms and loops. Warns once when modules' own ``dtype`` turns the policy off for
    most matmul modules, or a key of the map chooses nothing. See the README's "How the
    Flax wrappers work".

    Args:
        module: a ``flax.linen`` Module instance.
        policy_or_map: a policy, a policy name, a :class:`~jmp_policy.DTypePolicyMap`, a
            ``dict`` of keys to policies (a map whose default is the global policy) or
            ``None`` (the global policy). Only floating compute dtypes.
        method: the method to run (a name or ``fn(module, *args)``); ``None`` is
            ``__call__``. The returned function's ``method=`` overrides it.
        **options: the same for every wrapper. ``type_policies``: ``{ModuleClass: policy
            or name}`` for every instance of a class or subclass, unless a key of the map
            matches its path (see ``NORM_FLOAT32``). ``module_dtype``: ``"respect"`` (the
            default: a module's own ``dtype=`` wins) or ``"override"`` (the policy wins
            everywhere). ``autocast_exclude``: module classes and/or path regular
            expressions whose modules receive their inputs uncast. ``serving_kernel``:
            ``"auto"`` (the default; XLA's matmul until a GPU measures the Pallas kernel
            faster), ``"pallas"`` (int8/int4 weights at up to 64 rows on a GPU run the
            library's Pallas kernel) or ``"xla"``. ``kv_cache``: ``"int8"``,
            ``"float8_e4m3fn"`` (vLLM's ``"fp8"``) or ``{module path: format}``: the
            ``"cache"`` collection's ``cached_key``/``cached_value`` (Flax's attention with
            ``decode=True``) stored as :class:`~jmp_policy.QuantizedKVCache`.

    Returns:
        A function with ``module.apply``'s signature.

    Raises:
        TypeError: ``module`` is not a Linen module, ``method``, ``type_policies``,
            ``autocast_exclude`` or ``variables`` has the wrong type.
        ValueError: ``policy_or_map`` names no policy or a non-floating one, ``method``
            names no method, ``module_dtype`` is neither "respect" nor "override", or
            ``serving_kernel`` is none of "auto", "pallas" and "xla".

    Examples:
        >>> import jax
        >>> import jax.numpy as jnp
        >>> import flax.linen as nn
        >>> import jmp_policy as jp
        >>> class Model(nn.Module):
        ...     @nn.compact
        ...     def __call__(self, x):
        ...         h = nn.Dense(8, name="body")(x)
        ...         return nn.Dense(2, name="head")(h)
        >>> model, x = Model(), jnp.ones((4, 3))
        >>> variables = model.init(jax.random.key(0), x)
        >>> fn = jp.linen.apply(model, jp.DTypePolicyMap(
        ...     "mixed_bfloat16", {"head": "float32"}))
        >>> fn(variables, x).dtype   # the float32 head's output, as computed
        dtype('float32')
        >>> loss = lambda p: fn({"params": p}, x).sum()
        >>> grads = jax.jit(jax.grad(loss))(variables["params"])
        >>> grads["body"]["kernel"].dtype
        dtype('float32')
    """
    policies, opts = prepare(module, policy_or_map, method, options)
    return apply_with(module, policies, opts, method)


def apply_with(
    module: nn.Module,
    policies: Any,
    opts: Options,
    method: Any,
    extensions: tuple[Any, ...] = (),
) -> Callable[..., Any]:
    """:func:`apply` with checked arguments and built options: the core's ``apply`` on
    each call's variables (``extensions``: ``diagnose``'s taps). ``fn.bind(variables,
    **apply_kwargs)`` is the core's model of one call."""
    default_method = method
    known: dict[str, Any] = {}  # the modules met, kept across calls
    warned: set[str] = set()  # what this wrapper has warned about

    def apply_fn(
        variables: Mapping[str, Any],
        *args: Any,
        rngs: Any = None,
        method: Any = None,
        mutable: Any = False,
        capture_intermediates: Any = False,
        **kwargs: Any,
    ) -> Any:
        model = bind(
            variables,
            rngs=rngs,
            method=method,
            mutable=mutable,
            capture_intermediates=capture_intermediates,
            **kwargs,
        )
        return entry_points.apply(ADAPTER, model, policies, opts, extensions)(*args)

    def bind(variables: Mapping[str, Any], method: Any = None, **apply_kwargs: Any) -> Bound:
        """The core's model for one call (``apply_kwargs``: ``module.apply``'s keywords
        and the model's); checks ``variables`` and ``method``."""
        check_variables(variables)
        method = default_method if method is None else method
        check_method(module, method)
        params = variables.get("params")

        def report(resolver: Resolver) -> None:
            compute = compute_modules(resolver, params, MATMUL_CLASSES)
            warn_once(resolver, type(module).__name__, warned, compute)

        return Bound(module, variables, known, method, apply_kwargs, report)

    apply_fn.bind = bind  # type: ignore[attr-defined]
    return apply_fn
