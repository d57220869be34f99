"""Searching a policy map for a Linen model: its runs handed to the core's search."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax

from jmp_policy._src import map_search
from jmp_policy._src.tree_paths import leaf_path
from jmp_policy.linen._apply import apply_with
from jmp_policy.linen._modules import check_module, check_params, prepare
from jmp_policy.linen._quantize import quantize, stacks


def kernels_of(params: Any) -> dict[str, Any]:
    """``{layer path: kernel}`` of every floating ``kernel`` of rank >= 2, in tree order."""
    out = {}
    for kp, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        path = leaf_path(kp)
        layer, _, name = path.rpartition("/")
        if name == "kernel" and getattr(leaf, "ndim", 0) >= 2:
            out[layer] = leaf
    return out


def search_map(
    module: nn.Module,
    variables: Mapping[str, Any],
    batches: Sequence[Any],
    loss_fn: Callable[[Any, Any], Any],
    *,
    budget: Mapping[str, float],
    candidates: Sequence[str] = map_search.DEFAULT_CANDIDATES,
    base: str = "mixed_bfloat16",
    inputs: Callable[[Any], tuple[Any, ...]] | None = None,
    jit: bool = True,
    progress: Callable[[str], None] | None = None,
    **options: Any,
) -> map_search.SearchResult:
    """Chooses a policy per layer under ``budget``, by each format's measured effect.

    ModelOpt's ``auto_quantize`` for Linen. A few backward passes on ``batches`` cache each
    layer's output gradient ``g``; one forward pass per candidate, every layer given its
    baseline input, gives each layer's output error ``dy = Q(y) - y`` under it; a layer's
    score is ``0.5 * mean over examples (n * g . dy)^2``, an estimate of the loss increase
    it causes. A multiple-choice knapsack then picks one candidate per layer (``base``, no
    quantization, always allowed). Layers are the modules holding a ``kernel``
    (``Dense``, ``DenseGeneral``, ``Conv``, ``Einsum``); embeddings and norms keep
    ``base``. A layer stack under ``nn.scan`` or ``nn.vmap`` (kernels ``[depth, ...]``)
    is one module path, so one entry of the map: it is scored and chosen per stack (its
    score the sum over its layers, each on its own iteration's or lane's inputs, its bytes
    all of theirs; the table says ``per stack (scanned: N layers)`` or ``(vmapped: N
    layers)``); a map cannot give the layers of one stack different policies. Layers
    under ``nn.remat`` (also ``nn.scan`` of ``nn.remat``) are scored as without it;
    layers inside another transform (``shard_map``) are not scored, keep ``base``, and
    the table says so. Deterministic. The jit-compiled passes are kept for the module,
    ``loss_fn``, ``inputs`` and options given (by identity): searching the same model
    again (new weights, another budget) compiles nothing new for batches of the same shapes.

    Args:
        module: a ``flax.linen`` Module instance.
        variables: its float variables (``{"params": ...}``).
        batches: calibration batches; each is passed to the model (see ``inputs``).
        loss_fn: ``loss_fn(outputs, batch) -> scalar``, the mean over the batch's
            examples (the leading axis of each layer's output).
        budget: one of ``{"effective_bits": b}`` (kernel bits per parameter, scales
            included), ``{"weight_bytes": n}`` or ``{"loss_increase": x}`` (the sum
            of the chosen scores; the search then minimizes bytes).
        candidates: quantized policy names (any format that quantizes a kernel).
        base: the float policy of unquantized layers, and the map's default.
        inputs: ``inputs(batch) -> args`` of ``module.apply`` (default ``(batch,)``).
        jit: compile the passes (``False`` runs them eagerly).
        progress: ``progress(message)`` called before each pass (``print``, or a tqdm
            bar's ``set_description``).
        **options: as for :func:`apply`.

    Returns:
        A :class:`SearchResult` ``(policy_map, table, weight_bytes, effective_bits,
        loss_increase, method)``; ``print(result)`` shows the table;
        ``result.at(budget)`` chooses again under another budget from the same scores.

    Raises:
        TypeError, ValueError: a candidate name is not a quantized policy name (quoted),
            ``budget`` is not one of the forms above, or no choice meets it (the message
            names the cheapest possible); a batch holds NaN, or the model fails on one
            (naming ``batches[i]``, the model's error chained).

    Examples:
        >>> import jax
        >>> import jax.numpy as jnp
        >>> import flax.linen as nn
        >>> import jmp_policy as jp
        >>> class MLP(nn.Module):
        ...     @nn.compact
        ...     def __call__(self, x):
        ...         x = nn.relu(nn.Dense(256, name="up")(x))
        ...         return nn.Dense(4, name="head")(x)
        >>> model, x = MLP(), jax.random.normal(jax.random.key(0), (16, 128))
        >>> variables = model.init(jax.random.key(1), x)
        >>> loss = lambda out, batch: (out.astype(jnp.float32) ** 2).mean()
        >>> result = jp.linen.search_map(model, variables, [x], loss,
        ...                              budget={"effective_bits": 8})
        >>> result.effective_bits <= 8
        True
        >>> sorted(row.path for row in result.table)
        ['head', 'up']
    """
    check_module(module)
    check_params(variables, "search")
    args_of = inputs or (lambda batch: (batch,))
    kernels = kernels_of(variables["params"])

    def make_loss(policy_map: Any) -> tuple[Callable[[Any, Any], Any], Any]:
        policies, opts = prepare(module, policy_map, None, dict(options))
        opts = dataclasses.replace(opts, extensions=(map_search.ScoreTaps(), *opts.extensions))
        run = apply_with(module, policies, opts, None)
        stored = variables
        if map_search.stores_weights(policy_map):
            stored = quantize(module, policy_map, variables, *args_of(batches[0]))

        def loss(stored: Any, batch: Any) -> Any:
            return loss_fn(run(stored, *args_of(batch)), batch)

        return loss, stored

    return map_search.search(
        kernels,
        make_loss,
        batches,
        candidates=candidates,
        budget=budget,
        base=base,
        jit=jit,
        progress=progress,
        stacked_at=lambda: {  # once `batches` is checked
            path[: -len("/kernel")]: at
            for path, (_, at) in stacks(module, variables, args_of(batches[0]), {}, None).items()
            if path.endswith("/kernel")
        },
        # Linen modules are immutable: the same module, loss and options make the same
        # passes (their jitted forms kept across calls); options by their text.
        reuse=(module, loss_fn, inputs, repr(sorted(options.items()))),
    )
