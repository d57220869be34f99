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


def dot_kinds(jaxpr):
    """(operand dtypes, preferred_element_type or None) of every dot_general in a jaxpr
    (a ``jax.extend.core.Jaxpr``), sub-jaxprs included: int8 matmuls read
    ``(("int8", "int8"), "int32")``."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            pref = eqn.params.get("preferred_element_type")
            found.append(
                (tuple(str(v.aval.dtype) for v in eqn.invars), None if pref is None else str(pref))
            )
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    found += dot_kinds(sub.jaxpr)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    found += dot_kinds(sub)
    return found
