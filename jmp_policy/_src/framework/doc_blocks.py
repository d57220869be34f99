"""The text of the docstring blocks the three adapters' entry points share.

:data:`BLOCKS` holds each block by placeholder name, :data:`WORDS` the words its
``{word}`` fields take per framework; :func:`jmp_policy._src.framework.shared_docs.fill`
puts them in the adapters' docstrings.
"""

from __future__ import annotations

#: Per adapter package (``jmp_policy.<name>``), the words a block's ``{word}`` fields take.
WORDS: dict[str, dict[str, str]] = {
    "linen": {
        "fw": "linen",
        "model": "module",
        "a_model": "a ``flax.linen`` Module instance",
        "layers": "``Dense``, ``DenseGeneral`` and ``Einsum``",
        "stack": "an ``nn.scan`` or ``nn.vmap`` layer stack",
        "transforms": "``jax.jit``, ``jax.grad``, ``jax.lax.scan`` and Flax's lifted transforms",
        "call_args": "variables, *args",
        "method_error": ", ``method`` names no method",
        "method_arg": "method: as for :func:`jmp_policy.linen.apply`.",
        "apply_returns": "A function with ``module.apply``'s signature.",
        "calibrate_returns": 'The variables, their ``"params"`` quantized (and the report if '
        "asked).",
        "kv_caches": 'the ``"cache"`` collection\'s ``cached_key``/``cached_value`` '
        "(Flax's attention with ``decode=True``)",
    },
    "nnx": {
        "fw": "nnx",
        "model": "model",
        "a_model": "an ``nnx.Module``",
        "layers": "``nnx.Linear``, ``nnx.LinearGeneral`` and ``nnx.Einsum``",
        "stack": "a layer stack (``nnx.vmap``-made, run under ``nnx.scan`` or ``nnx.vmap``)",
        "transforms": "``nnx.jit``/``jax.jit``, ``nnx.grad``/``jax.grad``, ``nnx.vmap`` and "
        "``nnx.scan``",
        "call_args": "*args",
        "method_error": ", ``method`` names no method",
        "method_arg": "method: as for :func:`jmp_policy.nnx.apply`.",
        "apply_returns": "A function ``(*args, **kwargs)`` returning the method's outputs.",
        "calibrate_returns": "The calibrated copy (and the report if asked).",
        "kv_caches": "``nnx.MultiHeadAttention``'s ``cached_key``/``cached_value`` (after "
        "``init_cache``)",
    },
    "equinox": {
        "fw": "equinox",
        "model": "model",
        "a_model": "an ``eqx.Module``",
        "layers": "``eqx.nn.Linear``",
        "stack": "an ``eqx.filter_vmap``-made stack run with ``jax.lax.scan``",
        "transforms": "``eqx.filter_jit``/``jax.jit`` and ``eqx.filter_grad``/``jax.grad``",
        "call_args": "*args",
        "method_error": "",
        "method_arg": "",
        "apply_returns": "A function ``(*args, **kwargs)`` returning ``model(*args, **kwargs)``.",
        "calibrate_returns": "The calibrated model (and the report if asked).",
        "kv_caches": "the caches a model keeps in ``eqx.nn.State`` (see "
        ":func:`jmp_policy.equinox.quantize_caches`)",
    },
}

#: The shared blocks by placeholder name (one source for the three adapters' docs).
BLOCKS: dict[str, str] = {
    # -- apply and the arguments every entry point takes ----------------------------------
    "apply_rules": """\
Each submodule (the root: path ``""``) runs under :func:`jmp_policy.current_policy` set
to its policy, its parameters and the floating leaves of its arguments cast to its
compute dtype; its outputs are cast only when its policy's output dtype differs from its
compute dtype (Keras names leave them as computed), and loop carries keep their dtype.
Int8 and float8 policies run the matmuls of {layers} quantized, and a ``QuantizedArray``
kernel (:func:`jmp_policy.{fw}.quantize`) reaches its matmul as integers, in {stack}
as each layer's own slice. Gradients come in the stored dtype. Works under
{transforms}. Warns once when modules' own ``dtype`` turns the policy off for most
matmul modules, or a key of the map chooses nothing. The README's "How the Flax wrappers
work" gives the details and what is not covered.""",
    "policy_or_map": """\
policy_or_map: a policy (or name), a :class:`~jmp_policy.DTypePolicyMap` or a dict.""",
    "apply_policy_or_map": """\
policy_or_map: a policy, a policy name, a :class:`~jmp_policy.DTypePolicyMap`, a ``dict``
    of keys to policies (a map whose default is the global policy) or ``None`` (the
    global policy). Only floating compute dtypes.""",
    "apply_options": """\
**options: the same for every entry point. ``type_policies``: ``{ModuleClass: policy or
    name}`` for every instance of a class or subclass, unless a key of the map matches
    its path (see ``NORM_FLOAT32``). ``module_dtype``: ``"respect"`` (the default: a
    module's own ``dtype=`` wins) or ``"override"`` (the policy wins everywhere).
    ``autocast_exclude``: module classes and/or path regular expressions whose modules
    receive their inputs uncast. ``serving_kernel``: ``"auto"`` (the default; XLA's
    matmul until a GPU measures the Pallas kernel faster), ``"pallas"`` (int8/int4
    weights at up to 64 rows on a GPU run the library's Pallas kernel) or ``"xla"``.
    ``kv_cache``: ``"int8"``, ``"float8_e4m3fn"`` (vLLM's ``"fp8"``) or ``{module path:
    format}``: {kv_caches} stored as :class:`~jmp_policy.QuantizedKVCache`.""",
    "options": """\
**options: the options of :func:`jmp_policy.{fw}.apply`.""",
    "apply_raises": """\
TypeError: ``{model}`` is not {a_model}, or an argument or option has the wrong type.
ValueError: ``policy_or_map`` names no policy or a non-floating one{method_error}, or
    an option has a value it does not take (``module_dtype``: "respect" or "override";
    ``serving_kernel``: "auto", "pallas" or "xla").""",
    # -- diagnose -------------------------------------------------------------------------
    "diagnose_description": """\
The returned function also takes keywords ``probe`` and ``step`` and returns ``(result,
report)``, ``result`` what :func:`jmp_policy.{fw}.apply`'s function returns. The report (a
:class:`~jmp_policy._src.diagnostics.Report` pytree) holds, per submodule path, for the
floating leaves of its inputs and outputs, the largest finite absolute value, the count
of non-finite values, and the fractions that underflow its compute dtype or come within
a factor 2 of its largest value; and, through the gradient with respect to ``probe``, the
same of the cotangents reaching its outputs (``report.with_gradients(probe_gradient)``).
:func:`jmp_policy.format_report` renders it, naming the first submodule where a
non-finite value appeared. Works under {transforms} (return the report as ``has_aux``),
with no host synchronisation; submodules called inside a transform of their own are
listed as ``skipped``. :func:`jmp_policy.{fw}.apply` pays nothing: the taps exist only
here; the README's "Diagnostics" gives the cost and how to tap less.""",
    "diagnose_args": """\
policy_or_map: as for :func:`jmp_policy.{fw}.apply`.
{method_arg}
every: compute the statistics on the steps where ``step % every == 0`` (an int >= 1;
    with ``every > 1`` the function requires ``step=``); the other steps report zeros,
    with ``report.sampled`` false, and skip the reductions where the compiler keeps the
    conds (a CPU does; XLA's GPU compiler turns them into selects, so there the
    statistics are computed on every step).
paths: ``None`` (tap every submodule), or a module path or regular expression, or a
    list of them (``DTypePolicyMap`` key syntax): the submodules to tap; the report
    lists the others as ``untapped``.
**options: as for :func:`jmp_policy.{fw}.apply`.""",
    "diagnose_returns": """\
A function ``fn({call_args}, probe=None, step=None, **kwargs)`` returning ``(result,
report)``; ``fn.probe({call_args}, **kwargs)`` returns a zero-valued probe for that call
(traced with ``jax.eval_shape``: nothing runs, nothing changes).""",
    "diagnose_raises": """\
TypeError, ValueError: as :func:`jmp_policy.{fw}.apply`; ``every`` or ``paths`` is not
    valid; ``probe`` is not a probe of this model; ``step`` is missing with ``every > 1``.""",
    # -- explain --------------------------------------------------------------------------
    "explain_rows": """\
One row per module path (and one per variable that a key of the map names itself): the
module's class, the policy resolved for it, its source (``key '<key>'``, ``type
<Class>`` or ``default``), the module's own ``dtype`` when set (it wins over the
policy's compute dtype unless ``module_dtype="override"``), the stored and compute
dtypes of its parameters and their bytes stored and in compute. Given the call's
arguments (arrays or ``jax.ShapeDtypeStruct``), the model is traced shape-only (nothing
is computed) and the table is followed by the matmul each quantized or float8 layer runs
(its form and shape), and by the KV caches (format and bytes, as ``kv_cache`` stores
them).""",
    "explain_calibration": """\
``calibration=``: the report of :func:`jmp_policy.{fw}.calibrate` (``return_report=True``),
listed under the table (per calibrated kernel: its method, round-to-nearest's and its
output error on the calibration inputs, seconds).""",
    # -- quantize -------------------------------------------------------------------------
    "quantize_description": """\
Every floating kernel of rank >= 2 under an int8 or int4 policy becomes a
:class:`~jmp_policy.QuantizedArray` (see :meth:`DTypePolicyMap.quantize
<jmp_policy.DTypePolicyMap.quantize>`); the rest stay float. A layer of {stack} is
quantized per layer: each layer its own scales, int4 blocks along its own input axis,
its stacked bias left float. :func:`jmp_policy.{fw}.apply` runs the result, a stacked
layer reading its own slice of the quantized values and scales inside the stack's
loop. Policies are resolved by path, as ``DTypePolicyMap.quantize`` does (no
``type_policies``).""",
    "quantize_policy_or_map": """\
policy_or_map: an int8 or int4 policy (or its name), or a
    :class:`~jmp_policy.DTypePolicyMap` or ``dict`` holding some.""",
    "quantize_error": """\
ValueError: ``policy_or_map`` is invalid or quantizes nothing (a float policy, a map
    without int8 or int4 policies).""",
    # -- float8 training ------------------------------------------------------------------
    "float8_state": """\
A float8 layer's state holds float32 scales (shape ``()``, of 1 when created) and amax
histories (shape ``(amax_history_length,)``, zeros when created; newest at index 0) of
its input, kernel and output gradient: ``input_scale``, ``input_amax_history``,
``kernel_scale``, ``kernel_amax_history``, ``output_grad_scale`` and
``output_grad_amax_history``. :func:`jmp_policy.{fw}.apply` runs the layer's matmul in
float8 with delayed scaling (inputs and kernels ``float8_e4m3fn``, output gradients
``float8_e5m2``), reading it.""",
    "float8_gradient": """\
The float8 state's "gradient" is its new value (Flax's convention): it must replace the
state, never go through an optimizer (which would add it, decay it, or unscale it under
loss scaling).""",
    # -- search_map -----------------------------------------------------------------------
    "search_description": """\
ModelOpt's ``auto_quantize``. A few backward passes on ``batches`` cache each layer's
output gradient ``g``; one forward pass per candidate, every layer given its baseline
input, gives each layer's output error ``dy = Q(y) - y`` under it; a layer's score is
``0.5 * mean over examples (n * g . dy)^2``, an estimate of the loss increase it causes.
A multiple-choice knapsack then picks one candidate per layer (``base``, no
quantization, always allowed). Embeddings and norms keep ``base``; ``{model}`` is not
modified. {stack_capitalized} is one module path, so one entry of the map: it is scored
and chosen per stack (its score the sum over its layers, each on its own iteration's or
lane's inputs, its bytes all of theirs; the table says ``per stack (scanned: N
layers)`` or ``(vmapped: N layers)``). Layers inside a transform not seen into keep
``base``, and the table says so. Deterministic.""",
    "search_args": """\
batches: calibration batches; each is passed to the model (see ``inputs``).
loss_fn: ``loss_fn(outputs, batch) -> scalar``, the mean over the batch's examples (the
    leading axis of each layer's output).
budget: one of ``{"effective_bits": b}`` (kernel bits per parameter, scales included),
    ``{"weight_bytes": n}`` or ``{"loss_increase": x}`` (the sum of the chosen scores;
    the search then minimizes bytes).
candidates: quantized policy names (any format that quantizes a kernel).
base: the float policy of unquantized layers, and the map's default.
inputs: ``inputs(batch) -> args`` of the model's call (default ``(batch,)``).
progress: ``progress(message)`` called before each pass (``print``, or a tqdm bar's
    ``set_description``).
**options: as for :func:`jmp_policy.{fw}.apply`.""",
    "search_returns": """\
A :class:`~jmp_policy.SearchResult` ``(policy_map, table, weight_bytes, effective_bits,
loss_increase, method)``; ``print(result)`` shows the table; ``result.at(budget)``
chooses again under another budget from the same scores.""",
    "search_raises": """\
TypeError, ValueError: a candidate name is not a quantized policy name (quoted),
    ``budget`` is not one of the forms above, or no choice meets it (the message names
    the cheapest possible); a batch holds NaN, or the model fails on one (naming
    ``batches[i]``, the model's error chained).""",
    # -- calibrate ------------------------------------------------------------------------
    "calibrate_description": """\
Gathers, for each of {layers} whose kernel is under a
:class:`~jmp_policy.GPTQDTypePolicy` or :class:`~jmp_policy.AWQDTypePolicy`, the Gram
matrix ``XᵀX`` (float32) and ``mean |x|`` of the inputs of its matmul; then solves each
kernel (GPTQ, or AWQ's scale search, each jit-compiled) in the int4/int8 storage the
serving matmuls read. Kernels under int8/int4 policies are rounded to nearest, as
:func:`jmp_policy.{fw}.quantize` does; the rest stay float. Each layer sees the float
model's inputs (not those of already-quantized earlier layers). The layers of {stack}
are each solved from the inputs they see in their own iteration or lane (the same inputs
for all when broadcast, ``in_axes=None``) and stored stacked as ``quantize`` stores
them. A layer under a GPTQ/AWQ policy whose matmul is not seen is rounded to nearest
with a warning naming it. Batches of different shapes each compile the run once.""",
    "calibrate_options": """\
hessian_damping: GPTQ's damping, a fraction of the mean Hessian diagonal.
num_grid_points: AWQ's exponent grid ``0, 1/n, ..., 1``.
clip_search: choose each int4/int8 group's scale by a clipping search (GPTQ's
    reference ``mse=True`` grid on the weights; AWQ's ``auto_clip`` by the group's
    output error on the calibration inputs) instead of abs-max; ``False`` for
    abs-max scales, as Keras 3.15.
return_report: also return the per-layer report (a list of ``LayerReport``: per
    calibrated kernel, the relative output error of round-to-nearest and of the
    method on the calibration inputs, and seconds).
progress: ``True`` shows a progress bar over the calibrated layers (``tqdm`` when
    installed, else a line per layer on stderr); a callable is given each
    ``LayerReport`` as its layer is solved; ``False`` (default) is quiet.
max_statistics_bytes: bounds the device memory the gathered statistics take
    (each layer's ``XᵀX`` and ``mean |x|``, float32): the layers are gathered in
    groups that fit, one pass over the batches per group, each group's moved to
    host memory before the next (a layer larger than the bound alone). ``None``
    (default): every layer in one pass. The result is the same.
**kwargs: keyword arguments of each call.""",
    "batches": """\
batches: an iterable of calls' arguments (a tuple per call, or one array).""",
    "calibrate_raises": """\
TypeError: ``{model}`` is not {a_model}, ``batches`` not iterable (or a string),
    ``progress`` neither a bool nor a callable, or ``return_report`` not a bool.
ValueError: no batch, a batch holding NaN, or a batch the model fails on (naming
    ``batches[i]``, the model's error chained).""",
    "calibrate_warns": """\
UserWarning: a GPTQ/AWQ key of the map chooses the policy of no layer.""",
}


def _sections(*sections: tuple[str, str]) -> str:
    """Docstring sections (``Returns:``, ``Raises:``) from ``(header, body)`` pairs."""
    return "\n\n".join(
        f"{header}:\n" + "\n".join("    " + line for line in body.splitlines())
        for header, body in sections
    )


# The sections after ``Args`` that an entry point's three adapters share, as one block.
BLOCKS.update(
    apply_tail=_sections(("Returns", "{apply_returns}"), ("Raises", BLOCKS["apply_raises"])),
    diagnose_tail=_sections(
        ("Returns", BLOCKS["diagnose_returns"]), ("Raises", BLOCKS["diagnose_raises"])
    ),
    search_tail=_sections(
        ("Returns", BLOCKS["search_returns"]), ("Raises", BLOCKS["search_raises"])
    ),
    calibrate_tail=_sections(
        ("Returns", "{calibrate_returns}"),
        ("Raises", BLOCKS["calibrate_raises"]),
        ("Warns", BLOCKS["calibrate_warns"]),
    ),
)
