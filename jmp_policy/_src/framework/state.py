"""The per-layer state slot, written once against the adapter protocol: ``init`` of the
state a stateful scheme keeps per layer (float8 delayed scaling's scales and amax
histories), named by the scheme's ``state_kind``.

A scheme says what its state is (``state_kind``, ``init_state()``); an adapter with a
state slot (:class:`~jmp_policy._src.framework.protocol.Routing`: ``with_states`` to put
it in a model, ``layer_state`` to hand it to the layer's matmul at a call) says where the
model holds it. The core's routed matmuls read it through ``layer_state``
(:mod:`jmp_policy._src.framework.routing`); :func:`per_batch` runs a stateful layer once
on the batch under a per-example ``jax.vmap``, so its amax is the batch's.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.custom_batching import custom_vmap

from jmp_policy._src import transforms
from jmp_policy._src.framework.entry_points import resolver_for
from jmp_policy._src.framework.protocol import Adapter
from jmp_policy._src.options import Options, floating_policy_or_map


class Slot(NamedTuple):
    """A layer's state: its scheme's ``state_kind``, its value and the name of the policy
    whose scheme keeps it (for messages)."""

    kind: str
    value: Any
    policy: str


def init_states(
    adapter: Adapter, model: Any, policy_or_map: Any, options: Options
) -> tuple[Any, int]:
    """``(new model, n)``: ``model`` whose routable layers under a stateful scheme (their
    policy resolved as ``apply`` resolves it) hold a fresh state of their scheme's
    ``state_kind`` (a stacked layer's stacked over its stacked axes, so each layer of the
    stack has its own); ``n`` counts the routable layers whose scheme has a state kind
    (those whose scheme keeps no state this time, float8 current scaling, included)."""
    adapter.check(model)
    policies = floating_policy_or_map(policy_or_map)
    resolver = resolver_for(adapter, model, policies, options)
    states: dict[str, Slot] = {}
    found = 0
    for layer in adapter.layers(model):
        policy = resolver.module(layer.path).policy
        scheme = policy.scheme
        if layer.kernel_name is None or scheme is None or scheme.state_kind is None:
            continue
        found += 1
        state = scheme.init_state()
        if state is None:
            continue  # this form of the scheme keeps none (float8 current scaling)
        stacked = jax.tree.map(functools.partial(_stack, tuple(layer.stacked)), state)
        states[layer.path] = Slot(scheme.state_kind, stacked, policy.name)
    return getattr(adapter, "with_states")(model, states), found  # noqa: B009


def shapes(tree: Any) -> Any:
    """``tree`` with each leaf's shape (``None`` for a leaf without one)."""
    return jax.tree.map(lambda x: getattr(x, "shape", None), tree)


def fits(value: Any, scheme: Any) -> bool:
    """Whether a layer's state ``value`` has the shapes of ``scheme.init_state()``'s."""
    return shapes(value) == shapes(jax.eval_shape(scheme.init_state))


def _stack(lead: tuple[int, ...], x: Any) -> Any:
    return jnp.broadcast_to(x, lead + x.shape)


def _batched(x: Any) -> bool:
    """Whether ``x`` is batched by the ``jax.vmap`` the call runs in (its innermost
    transform), read from JAX's current trace (:func:`transforms.current_trace`)."""
    trace = transforms.current_trace()
    return type(trace).__name__ == "BatchTrace" and getattr(x, "_trace", None) is trace


def per_batch(run: Callable[[Any], Any], x: Any) -> Any:
    """``run(x)``, and under a ``jax.vmap`` of ``x`` (per-example layers: Equinox's) one
    call on the whole batch: a float8 layer's amax is the batch's, and its new state one
    value (a ``vmap`` would sum the per-example new states into its gradient). The layer's
    kernel and state must not be batched by that ``vmap`` (a stack runs under ``scan``).
    An adapter whose layers run under a per-example ``vmap`` calls its stateful layers
    through it."""
    if not _batched(x):
        return run(x)

    @custom_vmap
    def call(x: Any) -> Any:
        return run(x)

    @call.def_vmap
    def rule(axis_size: int, in_batched: Any, x: Any) -> Any:
        return run(x), in_batched[0]  # the batch axis leads; Linear's matmul reads the last

    return call(x)
