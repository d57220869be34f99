"""The public Equinox functions: the core's entry points with the Equinox adapter."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import equinox as eqx

from jmp_policy._src.framework import entry_points, state
from jmp_policy._src.framework.diagnose import diagnose as diagnose_once
from jmp_policy._src.framework.shared_docs import fill
from jmp_policy._src.options import Options, float32_islands, make_options
from jmp_policy.equinox._adapter import EquinoxAdapter
from jmp_policy.equinox._kv_cache import as_shapes, cache_table, with_kv_caches

M = TypeVar("M")

ADAPTER = EquinoxAdapter()

NORM_FLOAT32: Mapping[type, Any] = float32_islands(
    eqx.nn.LayerNorm, eqx.nn.RMSNorm, eqx.nn.GroupNorm, eqx.nn.BatchNorm
)
"""``type_policies`` that compute Equinox's ``LayerNorm``, ``RMSNorm``, ``GroupNorm`` and
``BatchNorm`` in float32 and return their outputs in the caller's compute dtype (read-only)."""


def options_of(option_kwargs: dict[str, Any]) -> Options:
    return make_options(eqx.Module, "eqx.Module", "eqx.nn.LayerNorm", **option_kwargs)


@fill
def apply(model: eqx.Module, policy_or_map: Any, **options: Any) -> Callable[..., Any]:
    """Makes a function with ``model``'s call signature that runs it per submodule.

    A submodule's path is its attribute path as the plain-tree functions write it
    (``"mlp/layers/0"``, ``"attn/query_proj"``). ``model`` is never modified: each call runs
    a cast copy. Under ``eqx.filter_jit`` and the other transforms, call ``apply`` inside
    the transformed function.
    {apply_rules}

    Args:
        model: an ``eqx.Module``.
        {apply_policy_or_map}
        {apply_options}

    {apply_tail}

    Examples:
        >>> import jax
        >>> import jax.numpy as jnp
        >>> import equinox as eqx
        >>> import jmp_policy as jp
        >>> class Model(eqx.Module):
        ...     encoder: eqx.nn.Linear
        ...     head: eqx.nn.Linear
        ...     def __init__(self, key):
        ...         k1, k2 = jax.random.split(key)
        ...         self.encoder = eqx.nn.Linear(3, 4, key=k1)
        ...         self.head = eqx.nn.Linear(4, 2, key=k2)
        ...     def __call__(self, x):
        ...         return self.head(jax.nn.relu(self.encoder(x)))
        >>> model = Model(jax.random.key(0))
        >>> policy_map = jp.DTypePolicyMap("mixed_bfloat16", {"head": "float32"})
        >>> jp.equinox.apply(model, policy_map)(jnp.ones(3)).dtype   # the float32 head
        dtype('float32')
        >>> loss = lambda m, x: jp.equinox.apply(m, "mixed_bfloat16")(x).astype("float32").sum()
        >>> grads = eqx.filter_grad(loss)(model, jnp.ones(3))
        >>> grads.encoder.weight.dtype
        dtype('float32')
    """
    opts = options_of(options)
    run = entry_points.apply(ADAPTER, model, policy_or_map, opts, ())
    return run if opts.kv_cache is None else with_kv_caches(model, opts.kv_cache, run)


@fill
def quantize(model: M, policy_or_map: Any) -> M:
    """A new model whose ``eqx.nn.Linear`` weights under int8 or int4 policies are quantized.

    {quantize_description}
    A weight is stored as ``[in, out]`` (Equinox keeps ``[out, in]``; the library's storage
    and matmuls read ``[in, out]``), scaled per output channel (int4: per block of inputs).
    Biases, norms, embeddings and convolutions stay float. ``model`` is not modified.

    Args:
        model: an ``eqx.Module``.
        {quantize_policy_or_map}

    Returns:
        The quantized model (run it with :func:`apply`).

    Raises:
        TypeError: ``model`` is not an ``eqx.Module``.
        {quantize_error}

    Examples:
        >>> import jax
        >>> import jax.numpy as jnp
        >>> import equinox as eqx
        >>> import jmp_policy as jp
        >>> mlp = eqx.nn.MLP(8, 2, 16, depth=2, key=jax.random.key(0))
        >>> policy_map = jp.DTypePolicyMap("int8_from_float32", {"layers/2": "float32"})
        >>> q = jp.equinox.quantize(mlp, policy_map)
        >>> q.layers[0].weight
        QuantizedArray(int8, shape=(8, 16), original_dtype=float32)
        >>> q.layers[2].weight.dtype, mlp.layers[0].weight.dtype   # the head, the original
        (dtype('float32'), dtype('float32'))
        >>> jp.equinox.apply(q, policy_map)(jnp.ones(8)).shape
        (2,)
    """
    return entry_points.quantize(ADAPTER, model, policy_or_map)  # type: ignore[no-any-return]


@fill
def init_float8(model: M, policy_or_map: Any, **options: Any) -> M:
    """A new model whose ``eqx.nn.Linear`` layers under float8 delayed scaling hold their state.

    Each such layer (its policy resolved as :func:`apply` resolves it) becomes a copy
    holding, in a field ``float8``, a fresh :class:`~jmp_policy.equinox.Float8State`; it
    stays an ``eqx.nn.Linear`` at the same path. A layer of an ``eqx.filter_vmap``-made
    stack gets its state stacked the same way, so a ``jax.lax.scan`` over the stack hands
    each layer its own; one amax is taken over the batch when the layer is called under
    ``jax.vmap``. Call each float8 layer once per differentiated function (two calls would
    sum their new states). ``model`` is not modified.
    {float8_state}

    Args:
        model: an ``eqx.Module``.
        policy_or_map: the policy or map that :func:`apply` will run.
        {options}

    Returns:
        The new model.

    Raises:
        {apply_raises}
        ValueError: no layer runs under a float8 policy.

    Examples:
        >>> import jax
        >>> import jax.numpy as jnp
        >>> import equinox as eqx
        >>> import jmp_policy as jp
        >>> mlp = eqx.nn.MLP(4, 2, 8, depth=1, key=jax.random.key(0))
        >>> policy_map = jp.DTypePolicyMap("float8_from_mixed_bfloat16", {"layers/1": "float32"})
        >>> fp8 = jp.equinox.init_float8(mlp, policy_map)
        >>> fp8.layers[0].float8.value["kernel_amax_history"].shape
        (1024,)
        >>> hasattr(fp8.layers[1], "float8"), isinstance(fp8.layers[0], eqx.nn.Linear)
        (False, True)
        >>> jp.equinox.apply(fp8, policy_map)(jnp.ones(4)).dtype
        dtype('float32')
    """
    opts = options_of(options)
    new, found = state.init_states(ADAPTER, model, policy_or_map, opts)
    if not found:
        raise ValueError(
            "No layer of the model runs under a float8 policy: `init_float8` creates float8 "
            "state for eqx.nn.Linear layers whose policy is float8 (such as "
            f"'float8_from_mixed_bfloat16'). Received: policy_or_map={policy_or_map!r} for "
            f"a {type(model).__name__}"
        )
    return new  # type: ignore[no-any-return]


@fill
def explain(model: eqx.Module, policy_or_map: Any, *args: Any, **options: Any) -> str:
    """A table of the policy every submodule of ``model`` runs under, and why.

    Arguments other than arrays or ``jax.ShapeDtypeStruct`` are held as given; the KV caches
    listed are those of an ``eqx.nn.State`` among the arguments.
    {explain_rows}

    Args:
        model: an ``eqx.Module``.
        policy_or_map: as in :func:`apply`.
        *args: the model's positional arguments, to list the layers' matmuls (optional).
        **options: the options of :func:`apply`, and
            {explain_calibration}

    Returns:
        The table as a string.

    Examples:
        >>> import jax
        >>> import equinox as eqx
        >>> import jmp_policy as jp
        >>> mlp = eqx.nn.MLP(4, 2, 8, depth=1, key=jax.random.key(0))
        >>> print(jp.equinox.explain(mlp, {"layers/1": "float32"}))
        path      class   policy   source          dtype  bytes  c.bytes
        <root>    MLP     float32  default
        layers/0  Linear  float32  default         f32      160      160
        layers/1  Linear  float32  key 'layers/1'  f32       72       72
        total                                               232      232
        bytes: as stored; c.bytes: as the compute reads them (K = 1024, M = 1024 K)
    """
    calibration = options.pop("calibration", None)
    opts = options_of(options)
    traced = as_shapes(args)
    table = entry_points.explain(ADAPTER, model, policy_or_map, opts, (), traced, calibration)
    return table + cache_table(model, args, opts.kv_cache)


@fill
def diagnose(
    model: eqx.Module,
    policy_or_map: Any,
    *,
    every: int = 1,
    paths: Any = None,
    **options: Any,
) -> Callable[..., Any]:
    """Makes a function that runs ``model`` as :func:`apply` does and also returns a report.

    The returned function takes the model's arguments. Submodules called inside a transform
    of their own (a ``jax.vmap`` of a layer, a ``jax.lax.scan`` over a stack) are
    ``skipped``: diagnose a model written per example (Equinox's idiom) on one example to
    tap every layer.
    {diagnose_description}

    Args:
        model: an ``eqx.Module``.
        {diagnose_args}

    {diagnose_tail}

    Examples:
        >>> import jax
        >>> import jax.numpy as jnp
        >>> import equinox as eqx
        >>> import jmp_policy as jp
        >>> class Model(eqx.Module):
        ...     body: eqx.nn.Linear
        ...     head: eqx.nn.Linear
        ...     def __call__(self, x):
        ...         return self.head(self.body(x) * 1e5)   # overflows float16
        >>> k1, k2 = jax.random.split(jax.random.key(0))
        >>> model = Model(eqx.nn.Linear(3, 4, key=k1), eqx.nn.Linear(4, 2, key=k2))
        >>> out, report = jp.equinox.diagnose(model, "float16")(jnp.ones(3))
        >>> print(jp.format_report(report).splitlines()[0])
        first non-finite: head (forward input)
    """
    return diagnose_once(ADAPTER, model, policy_or_map, options_of(options), every, paths)
