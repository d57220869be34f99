"""The peers' int4 on the same kernels, as their users quantize: qwix's PTQ and Keras's int4.

``pretrained_int4_bench.py``'s rows ``qwix:int4/128`` and ``keras:int4/128`` (issue #49):
each projection kernel the library's ``int4/128`` row quantizes is quantized by the peer
instead, and the model runs those weights dequantized (float32, cast to bfloat16 by the
blocks' policy like the reference's), so the rows differ from the reference by their
weights only. Bytes are the peer's stored arrays (values at 4 bits, scales and zero points
as the peer stores them).

- qwix 0.1.8: ``qwix.quantize_model(model, qwix.PtqProvider(rules))`` with one
  ``QuantizationRule(module_path=<the projections>, weight_qtype=jnp.int4, tile_size=128)``
  (its README's PTQ recipe; symmetric absmax, tiles of 128 along the input),
  ``qwix.quantize_params`` on the abstract quantized params, then ``qwix.dequantize``.
- Keras (3.15): a ``keras.layers.Dense`` holding the kernel, ``layer.quantize("int4",
  config=Int4QuantizationConfig(block_size=128))`` (Keras's default int4: groups of 128
  along the input with a zero point per group), read back as ``layer(eye)`` (the layer's
  own dequantizing matmul on the identity gives its effective kernel).

Needs ``pip install qwix keras`` (the rows are skipped with a message without them).
"""

from __future__ import annotations

import os
import re

import jax
import jax.numpy as jnp
import numpy as np


def _nbytes(tree):
    return sum(
        int(np.prod(x.shape)) * (0.5 if x.dtype == jnp.int4 else np.dtype(x.dtype).itemsize)
        for x in jax.tree.leaves(tree)
    )


def _replace(params, pattern, fn):
    """``params`` with each ``kernel`` under a module path ``pattern`` full-matches replaced
    by ``fn(path, kernel)``; the new tree, the bytes ``fn`` reports (the peer's storage) and
    the replaced kernels' own bytes, summed."""
    total = replaced = 0

    def walk(node, path):
        nonlocal total, replaced
        out = {}
        for key, value in node.items():
            sub = f"{path}/{key}" if path else key
            if isinstance(value, dict):
                out[key] = walk(value, sub)
            elif key == "kernel" and re.fullmatch(pattern, path):
                out[key], nbytes = fn(path, value)
                total += nbytes
                replaced += value.nbytes
            else:
                out[key] = value
        return out

    return walk(params, ""), total, replaced


def qwix_int4(model, params, sample, pattern, tile=128):
    """``(params, peer bytes, replaced bytes)``: qwix's PTQ int4 with tiles of ``tile``, dequantized."""
    import qwix

    rules = [qwix.QuantizationRule(module_path=pattern, weight_qtype=jnp.int4, tile_size=tile)]
    qmodel = qwix.quantize_model(model, qwix.PtqProvider(rules))
    abstract = jax.eval_shape(qmodel.init, jax.random.key(0), sample)["params"]
    # qwix takes a pure dict of jax.Array (the GGUF reader gives numpy arrays).
    quantized = qwix.quantize_params(jax.tree.map(jnp.asarray, params), abstract)

    def read(path, kernel):
        node = quantized
        for key in path.split("/"):
            node = node[key]
        stored = node["kernel"].array
        return np.asarray(qwix.dequantize(stored), np.float32), _nbytes(stored)

    return _replace(params, pattern, read)


def keras_int4(params, pattern, block=128):
    """``(params, peer bytes, replaced bytes)``: Keras's int4 (``block`` groups, zero points), dequantized."""
    os.environ.setdefault("KERAS_BACKEND", "jax")
    import keras
    from keras.src.quantizers import Int4QuantizationConfig

    def read(path, kernel):
        kernel = np.asarray(kernel, np.float32)
        if kernel.ndim != 2:
            raise ValueError(f"{path}: a Keras Dense kernel is [in, out]; got {kernel.shape}")
        layer = keras.layers.Dense(kernel.shape[1], use_bias=False, dtype="float32")
        layer.build((None, kernel.shape[0]))
        layer.kernel.assign(kernel)
        layer.quantize("int4", config=Int4QuantizationConfig(block_size=block))
        # Keras packs two int4 values per int8 byte: every variable counts at its itemsize.
        nbytes = sum(np.asarray(v.value).nbytes for v in layer.variables)
        effective = np.asarray(layer(np.eye(kernel.shape[0], dtype=np.float32)), np.float32)
        return effective, int(nbytes)

    return _replace(params, pattern, read)
