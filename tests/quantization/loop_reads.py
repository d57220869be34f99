"""Where a jaxpr's matmuls read quantized integers: inside a scan body (a stacked layer
reading its own slice) or outside, and the float copies of a stacked kernel made outside
every loop (a stack dequantized ahead)."""

import jax
import jax.extend
import jax.numpy as jnp

# Ops that only move an operand's elements between the conversion and the matmul.
_VIEWS = {"reshape", "transpose", "squeeze", "expand_dims", "broadcast_in_dim", "pad"}


def _subjaxprs(eqn):
    for value in eqn.params.values():
        for sub in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(sub, jax.extend.core.ClosedJaxpr):
                yield sub.jaxpr
            elif isinstance(sub, jax.extend.core.Jaxpr):
                yield sub


def integer_dots(jaxpr, in_loop=False):
    """``(integer dtype, inside a scan body)`` of each dot_general that reads an operand
    converted from integers (through element moves only)."""
    produced, found = {}, []
    for eqn in jaxpr.eqns:
        for v in eqn.outvars:
            produced[v] = eqn
        if eqn.primitive.name == "dot_general":
            for v in eqn.invars:
                src = produced.get(v)
                while src is not None and src.primitive.name in _VIEWS:
                    src = produced.get(src.invars[0])
                if (
                    src is not None
                    and src.primitive.name == "convert_element_type"
                    and jnp.issubdtype(src.invars[0].aval.dtype, jnp.integer)
                ):
                    found.append((str(src.invars[0].aval.dtype), in_loop))
        for sub in _subjaxprs(eqn):
            found += integer_dots(sub, in_loop or eqn.primitive.name == "scan")
    return found


def floats_outside_loops(jaxpr, shape):
    """The float arrays of ``shape`` made outside every scan body (a dequantized copy)."""
    found = []
    for eqn in jaxpr.eqns:
        found += [
            v.aval
            for v in eqn.outvars
            if tuple(v.aval.shape) == tuple(shape) and jnp.issubdtype(v.aval.dtype, jnp.floating)
        ]
        if eqn.primitive.name != "scan":
            for sub in _subjaxprs(eqn):
                found += floats_outside_loops(sub, shape)
    return found


def assert_read_in_loop(jaxpr, kernel, dtype):
    """Every matmul reading integers reads ``dtype`` values inside a scan body, and no
    float array of the stacked ``kernel``'s shape is made outside the loops."""
    dots = integer_dots(jaxpr)
    assert dots and all(d == (dtype, True) for d in dots), dots
    assert floats_outside_loops(jaxpr, kernel.shape) == []
