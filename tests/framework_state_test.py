"""The protocol's per-layer state slot (issue #45), on a toy adapter written here with no
framework: ``init_states`` puts a stateful scheme's state in the layers its adapter holds
it for, and the core's routed matmuls hand it to the scheme's matmul (its new value comes
back as its gradient), where an adapter without the slot is refused by name."""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmp_policy as jp
from jmp_policy._src import interception
from jmp_policy._src.framework import entry_points, state
from jmp_policy._src.framework.protocol import Layer
from jmp_policy._src.options import Options
from jmp_policy._src.quantization import matmuls

F8 = jp.QuantizedFloat8DTypePolicy("float8", "float32", amax_history_length=8)


class Dense(NamedTuple):
    kernel: Any  # [in, out], or [n, in, out] for a stack of n layers
    states: Any = None  # state kind -> state


class Model(NamedTuple):
    body: Dense
    head: Dense

    def __call__(self, x):
        return self.head(self.body(x))


def _dense_call(layer, x):
    return x @ layer.kernel


Dense.__call__ = _dense_call


class _Running(NamedTuple):
    """A layer of a run: its calls go through the hook."""

    layer: Dense
    path: str
    resolver: Any
    extensions: Any

    def __call__(self, x):
        call = interception.Call(self.path, self.layer, self.resolver.module(self.path))
        return interception.run(call, self.layer, (x,), {}, extensions=self.extensions)


class ToyAdapter:
    model_name = "toy Model"

    def check(self, model):
        if not isinstance(model, Model):
            raise TypeError(f"`model` must be a toy Model. Received: model={model!r}")

    def layers(self, model):
        yield Layer("", Model, None)
        for name in ("body", "head"):
            kernel = getattr(model, name).kernel
            yield Layer(name, Dense, None, "kernel", kernel, tuple(kernel.shape[:-2]))

    def params(self, model):
        return {f"{name}/kernel": getattr(model, name).kernel for name in ("body", "head")}

    def kernel_of(self, module):
        return module.kernel if isinstance(module, Dense) else None

    def call_with_matmul(self, module, matmul, kernel, args, kwargs):
        (x,) = args
        return matmul(x, kernel, (((x.ndim - 1,), (0,)), ((), ())))

    def run(self, model, resolver, options, extensions, call):
        body, head = (_Running(getattr(model, n), n, resolver, extensions) for n in Model._fields)
        return call(lambda x: head(body(x)))

    def split(self, model):
        return model, lambda m: m

    def with_kernels(self, model, kernels):
        raise NotImplementedError


class SlotAdapter(ToyAdapter):
    """The toy adapter with the state slot: a layer holds its states by kind."""

    def layer_state(self, call, scheme):
        return call.module.states[scheme.state_kind]

    def with_states(self, model, states):
        layers = {
            name: Dense(getattr(model, name).kernel, {states[name].kind: states[name].value})
            if name in states
            else getattr(model, name)
            for name in Model._fields
        }
        return Model(**layers)


def _model(stack=()):
    k1, k2 = jax.random.split(jax.random.key(0))
    return Model(
        Dense(jax.random.normal(k1, (*stack, 4, 8))), Dense(jax.random.normal(k2, (*stack, 8, 2)))
    )


def test_init_states_fills_the_slot_of_the_stateful_layers_only():
    policies = jp.DTypePolicyMap(F8, {"head": "float32"})
    model, found = state.init_states(SlotAdapter(), _model(), policies, Options())
    assert found == 1
    assert model.head.states is None
    kind = F8.scheme.state_kind
    assert kind == "float8"
    history = model.body.states[kind]["input_amax_history"]
    assert history.shape == (8,) and not history.any()
    assert float(model.body.states[kind]["input_scale"]) == 1.0


def test_init_states_stacks_a_stacked_layers_state_and_counts_stateless_forms():
    model, found = state.init_states(SlotAdapter(), _model((3,)), F8, Options())
    assert found == 2
    assert model.body.states["float8"]["kernel_amax_history"].shape == (3, 8)
    assert model.body.states["float8"]["kernel_scale"].shape == (3,)
    current = jp.get("float8_current_from_float32")
    model, found = state.init_states(SlotAdapter(), _model(), current, Options())
    assert found == 2 and model.body.states is None  # current scaling keeps no state


@pytest.mark.parametrize("use_jit", [False, True])
def test_routed_matmul_reads_the_slot_and_returns_the_new_state_as_gradient(use_jit):
    adapter = SlotAdapter()
    policies = jp.DTypePolicyMap(F8, {"head": "float32"})
    model, _ = state.init_states(adapter, _model(), policies, Options())
    x = jnp.full((4, 4), 0.5)

    def loss(states):
        live = model._replace(body=model.body._replace(states=states))
        run = entry_points.apply(adapter, live, policies, Options(), ())
        return run(x).sum()

    with matmuls.recording() as forms:
        grad = (jax.jit(jax.grad(loss)) if use_jit else jax.grad(loss))(model.body.states)
    assert forms["body"].startswith("float8 (delayed)"), forms
    assert "head" not in forms
    new = grad["float8"]
    np.testing.assert_allclose(np.asarray(new["input_amax_history"][:2]), [0.5, 0.0])
    assert float(new["input_scale"]) == 448.0 / 0.5


@pytest.mark.parametrize("use_jit", [False, True])
def test_an_adapter_without_the_slot_refuses_a_stateful_scheme_by_name(use_jit):
    run = entry_points.apply(ToyAdapter(), _model(), F8, Options(), ())
    x = jnp.ones((2, 4))
    with pytest.raises(ValueError, match=r"Dense at 'body' runs under .*toy Model models do not"):
        (jax.jit(run) if use_jit else run)(x)
