"""Flax Linen integration: run a Linen model under a policy or a map, per submodule.

A user keeps the model as it is and writes one policy or one
:class:`~jmp_policy.DTypePolicyMap`; :func:`apply` and :func:`init` wrap ``module.apply``
and ``module.init`` so that every submodule computes in its own dtype, with float32 master
weights and float32 gradients; :func:`explain` says which policy each submodule got and
why.

How it works (the glue only finds calls; the rules live in ``jmp_policy._src``):

* **Parameters** are cast before ``module.apply`` runs, leaf by leaf, to the compute dtype
  of the policy of each variable's path (``"encoder/mlp/kernel"`` resolves like its module
  ``"encoder/mlp"`` unless a key names the variable itself; a variable of the root module
  belongs to the path ``""``). Only the ``"params"`` collection is cast; other collections
  (BatchNorm's ``"batch_stats"``, caches) are passed and returned in their stored dtype.
  The casts are ordinary ``astype`` ops, so gradients flow back to the stored dtype and
  XLA compiles the same code as a hand-written ``jax.tree.map(astype)``.
* **Every submodule's call** (``__call__``, and the root's ``method``) is found by a
  ``flax.linen.intercept_methods`` interceptor and handed to the one per-submodule hook:
  its floating inputs cast to its compute dtype (unless ``autocast_exclude`` names it),
  :func:`jmp_policy.current_policy` set, and the **output rule**: outputs are cast only
  when the policy's output dtype differs from its compute dtype (``"p=f32,c=bf16,o=f32"``);
  Keras names leave them as computed, so a float32 head returns float32 logits at any
  depth. ``NORM_FLOAT32`` computes norms in float32 and returns the caller's dtype.
* **Loops**: the carry of every loop in the model (``nn.scan`` as a class or a decorator,
  ``nn.RNN`` with any cell, ``nn.Bidirectional``, ``nn.while_loop``, ``nn.fori_loop``)
  keeps the dtype it entered with: while the model runs, the loops of ``jax.lax`` cast
  their body's carry back to the carry's dtypes (JAX rejects any other carry, so no
  working program changes).
* **Module classes** (for ``type_policies``) and modules' own ``dtype=`` attributes are
  learnt as the model runs; as soon as a module met changes the dtype a parameter was cast
  to, the run is cut short, the model is learnt shape-only (nothing computed) and run
  again, so a float32 island's weights are never rounded through bfloat16 and an eager
  first call never runs the model twice. What a wrapper learnt is kept for its next
  calls: a model whose policies depend on paths only is traced once.
* **A module's own ``dtype``** (``nn.Dense(..., dtype=jnp.float32)``) wins over the
  policy (Keras's rule); when that turns the policy off for most of the modules that
  carry the matmuls and convolutions (stock configs set ``dtype=jnp.float32`` on every
  layer), the wrappers warn once, saying how many, and
  ``module_dtype="override"`` lets the policy win everywhere. A key of the map that
  chooses nothing (a typo) is warned about once too.

What it does not cover: only ``__call__`` (and the root's method) is intercepted, so a
submodule's other methods called from outside (``embed.attend(x)``) see their parameters
in the compute dtype but receive their arguments as they are and run under the caller's
:func:`~jmp_policy.current_policy`; arrays a module closes over or creates itself are its
own business (``current_policy()`` is there to create them in the right dtype); loops
written with ``from jax.lax import scan`` (a name bound before the run) are not covered by
the loop rule. During :func:`init` parameters are created in their ``param_dtype`` and
read as created (Flax creates and reads them in one step). Caches (``"cache"``) keep the
dtype they were created in: create them in the compute dtype (Flax's attention does, from
its ``dtype``) and the keys written to them arrive in it.

Examples:
    >>> import jax
    >>> import jax.numpy as jnp
    >>> import flax.linen as nn
    >>> import jmp_policy as jp
    >>> class Model(nn.Module):
    ...     @nn.compact
    ...     def __call__(self, x):
    ...         x = nn.Dense(8)(x)
    ...         x = nn.LayerNorm()(x)
    ...         return nn.Dense(2, name="head")(x)
    >>> model = Model()
    >>> x = jnp.ones((4, 3))
    >>> variables = jp.linen.init(model, "mixed_bfloat16")(jax.random.key(0), x)
    >>> variables["params"]["Dense_0"]["kernel"].dtype
    dtype('float32')
    >>> policy_map = jp.DTypePolicyMap("mixed_bfloat16", {"head": "float32"})
    >>> fn = jp.linen.apply(model, policy_map, type_policies=jp.linen.NORM_FLOAT32)
    >>> fn(variables, x).dtype   # the float32 head's logits
    dtype('float32')
"""

from __future__ import annotations

from jmp_policy.linen._apply import apply as apply
from jmp_policy.linen._diagnose import diagnose as diagnose
from jmp_policy.linen._explain import explain as explain
from jmp_policy.linen._init import init as init
from jmp_policy.linen._modules import NORM_FLOAT32 as NORM_FLOAT32
from jmp_policy.linen._quantization import split_gradients as split_gradients
from jmp_policy.linen._quantize import quantize as quantize

__all__ = [
    "NORM_FLOAT32",
    "apply",
    "diagnose",
    "explain",
    "init",
    "quantize",
    "split_gradients",
]


def __dir__() -> list[str]:
    return list(__all__)
