"""Quick start: policies and a policy map casting a real Flax parameter pytree.

Run: python examples/quickstart.py
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

import jmp_policy as jp


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Embed(100, 32, name="embed")(x)
        x = nn.Dense(64, name="hidden")(x)
        x = nn.LayerNorm(name="norm")(nn.relu(x))
        return nn.Dense(10, name="head")(x)


def main() -> None:
    model = MLP()
    tokens = jnp.arange(8).reshape(2, 4)
    params = model.init(jax.random.key(0), tokens)["params"]

    # One policy for everything: Keras, jmp and dtype names all work.
    policy = jp.get_policy("p=f32,c=bf16,o=f32")
    # Equal by value, whatever the names: mixed_bfloat16 is p=f32,c=bf16,o=bf16.
    print(
        repr(jp.DTypePolicy("mixed_bfloat16")),
        "==",
        repr(jp.get_policy("p=f32,c=bf16,o=bf16")),
        jp.DTypePolicy("mixed_bfloat16") == jp.get_policy("p=f32,c=bf16,o=bf16"),
    )
    bf16_params = policy.cast_to_compute(params)
    print(
        "hidden kernel:",
        params["hidden"]["kernel"].dtype,
        "->",
        bf16_params["hidden"]["kernel"].dtype,
    )

    # A policy per submodule: norm and head stay float32, embeddings too.
    policy_map = jp.DTypePolicyMap(
        "mixed_bfloat16", {"norm": "float32", "head": "float32", ".*/embedding": "float32"}
    )
    print(policy_map.explain(params))

    # Run the model's apply under the map: gradients reach the float32 parameters.
    apply = jp.cast_apply(policy_map)(lambda p, x: model.apply({"params": p}, x))

    @jax.jit
    def loss_and_grads(params, tokens):
        return jax.value_and_grad(lambda p: jnp.mean(apply(p, tokens) ** 2))(params)

    loss, grads = loss_and_grads(params, tokens)
    print(
        f"loss {float(loss):.4f}; grad dtypes:",
        sorted({str(g.dtype) for g in jax.tree.leaves(grads)}),
    )
    print("unused keys (typos):", policy_map.unused_keys(params))


if __name__ == "__main__":
    main()
