"""Reading jaxprs in tests: the operand dtypes of every matmul a function traces to."""

import jax


def dot_operand_dtypes(closed_jaxpr):
    """The operand dtypes of every dot_general in a jaxpr, sub-jaxprs (scan, while) included."""
    found = []

    def walk(j):
        for eqn in j.eqns:
            if eqn.primitive.name == "dot_general":
                found.append(tuple(str(v.aval.dtype) for v in eqn.invars))
            for value in eqn.params.values():
                for sub in value if isinstance(value, (tuple, list)) else (value,):
                    if isinstance(sub, jax.extend.core.ClosedJaxpr):
                        walk(sub.jaxpr)
                    elif isinstance(sub, jax.extend.core.Jaxpr):
                        walk(sub)

    walk(closed_jaxpr.jaxpr)
    return found


def dot_dtypes(fn, *args, **kwargs):
    """:func:`dot_operand_dtypes` of ``fn(*args, **kwargs)``, traced (nothing runs)."""
    return dot_operand_dtypes(jax.make_jaxpr(lambda *a: fn(*a, **kwargs))(*args))
