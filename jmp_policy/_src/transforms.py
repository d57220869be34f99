"""Every place the library reaches into JAX or a framework: one table, one check.

**Patches.** :data:`PATCHES` declares each global patch once: the module or class whose
attributes it replaces, the attributes, and what for. A :class:`ThreadPatch` made from a
key of the table replaces them while any thread is inside its ``active()`` block and
restores them when the last one leaves; its replacements (the wrappers, which stay with
the concept they serve) act only in the threads inside one and pass through elsewhere.

**Reads.** :data:`READS` declares each internal of JAX the library reads: JAX's current
trace (:func:`current_trace`, calibration's and the search's guard against a foreign trace).

**An unknown JAX.** Every attribute of either table is looked up by :func:`lookup`, at first
use (a patch's first activation, each read): one that is not where it is expected raises
:class:`UnknownJaxError` naming the JAX version (and the framework's), the attribute and
what it is for, never a silent fallback. A framework's classes (Flax's ``Scope``) are found
among the modules already imported (its adapter imported them); this module imports none.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple


class UnknownJaxError(RuntimeError):
    """JAX (or a framework) does not have an attribute where jmp_policy expects it."""


class Patch(NamedTuple):
    """A global patch: ``owner`` (a module or class, by its dotted import path) and the
    ``attributes`` of it replaced while the patch is active, for ``purpose``."""

    owner: str
    attributes: tuple[str, ...]
    purpose: str


#: Every global patch the library installs (each made once, by :class:`ThreadPatch`).
PATCHES: dict[str, Patch] = {
    "loops": Patch(
        "jax.lax",
        ("scan", "while_loop", "fori_loop"),
        "keeps loop carries' dtypes under a wrapper (interception.loop_carries)",
    ),
    "remats": Patch(
        "jax",
        ("checkpoint", "remat"),
        "threads records out of checkpointed calls (traced_records.REMATS)",
    ),
    "vmaps": Patch(
        "jax",
        ("vmap",),
        "threads records out of vmapped calls (traced_records.VMAPS)",
    ),
    "einsum": Patch(
        "jax.numpy",
        ("einsum",),
        "routes a quantized Linen Einsum's matmul (jmp_policy.linen)",
    ),
    "param_reads": Patch(
        "flax.core.scope.Scope",
        ("get_variable",),
        "casts parameters as a Linen model reads them (jmp_policy.linen)",
    ),
    "module_reads": Patch(
        "flax.linen.Module",
        ("variables",),
        "casts parameters read through Module.variables (jmp_policy.linen)",
    ),
}

#: Every internal of JAX the library reads: name -> (owner, attribute path, purpose).
READS: dict[str, Patch] = {
    "current_trace": Patch(
        "jax._src.core",
        ("trace_ctx", "trace"),
        "reads JAX's current trace (calibration's and the search's guard)",
    ),
}


def _versions(owner: str) -> str:
    jax = sys.modules.get("jax")
    text = f"jax {getattr(jax, '__version__', '(not imported)')}"
    package = owner.split(".", 1)[0]
    if package != "jax":
        version = getattr(sys.modules.get(package), "__version__", "(not imported)")
        text = f"{package} {version} (with {text})"
    return text


def _unknown(owner: str, attribute: str, purpose: str, cause: str) -> UnknownJaxError:
    return UnknownJaxError(
        f"jmp_policy {purpose} through `{owner}.{attribute}`, which {_versions(owner)} does "
        f"not have ({cause}): this version is newer than jmp_policy knows. Install a "
        "version that jmp_policy supports (pyproject.toml says which), or a jmp_policy "
        "release that knows this one."
    )


def _owner(entry: Patch) -> Any:
    """The module or class ``entry.owner`` names, among the modules already imported."""
    parts = entry.owner.split(".")
    for n in range(len(parts), 0, -1):
        module = sys.modules.get(".".join(parts[:n]))
        if module is None:
            continue
        found = module
        for i, part in enumerate(parts[n:], n):
            try:
                found = getattr(found, part)
            except AttributeError as e:
                raise _unknown(".".join(parts[:i]), part, entry.purpose, str(e)) from e
        return found
    raise _unknown(entry.owner, "", entry.purpose, f"`{parts[0]}` is not imported")


def lookup(entry: Patch, path: tuple[str, ...]) -> Any:
    """``entry``'s owner's attribute ``path`` (``("trace_ctx", "trace")``): the one check
    of an unknown JAX, raising :class:`UnknownJaxError` where an attribute is missing."""
    found = _owner(entry)
    for part in path:
        try:
            found = getattr(found, part)
        except AttributeError as e:
            raise _unknown(entry.owner, ".".join(path), entry.purpose, str(e)) from e
    return found


def current_trace() -> Any:
    """JAX's current trace, to tell a call made inside a transform of its own (calibration's
    and the search's guard against a foreign trace).

    Read from JAX's internals (``jax._src.core.trace_ctx.trace``, where jax 0.4.36 to 0.12
    keep it; Flax reads the same): on a JAX that moved it this raises
    :class:`UnknownJaxError` naming the JAX version at first use, rather than turning the
    guard off.
    """
    entry = READS["current_trace"]
    return lookup(entry, entry.attributes)


Wrapper = Callable[[Any], Any]  # original -> replacement


class ThreadPatch:
    """Replaces the attributes :data:`PATCHES` ``[key]`` declares (``jax.lax.scan``,
    ``jnp.einsum``) while any thread is inside :meth:`active`, and restores them when the
    last one leaves. A replacement made by ``wrappers[name](original)`` must act only when
    :meth:`inside` is true and pass through otherwise, so threads outside the block see
    the original behaviour. The owner and its attributes are looked up at each first
    activation (:func:`lookup`): an unknown JAX is an error there, before anything is set.
    """

    def __init__(self, key: str, wrappers: dict[str, Wrapper]):
        entry = PATCHES.get(key)
        if entry is None or tuple(wrappers) != entry.attributes:
            raise ValueError(
                f"A patch must be declared in `transforms.PATCHES` and wrap each of its "
                f"attributes. Received: key={key!r}, wrappers for {list(wrappers)} "
                f"(declared: {None if entry is None else list(entry.attributes)})"
            )
        self._entry = entry
        self._wrappers = wrappers
        self._lock = threading.Lock()
        self._active = 0
        self._target: Any = None
        self._originals: dict[str, Any] = {}
        self._depth = threading.local()

    def inside(self) -> bool:
        """Whether this thread is inside :meth:`active`."""
        return getattr(self._depth, "value", 0) > 0

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        with self._lock:
            if self._active == 0:
                # Every attribute found before any is replaced: a missing one sets nothing.
                originals = {name: lookup(self._entry, (name,)) for name in self._wrappers}
                self._target = _owner(self._entry)
                for name, wrap in self._wrappers.items():
                    setattr(self._target, name, wrap(originals[name]))
                self._originals = originals
            self._active += 1
        self._depth.value = getattr(self._depth, "value", 0) + 1
        try:
            yield
        finally:
            self._depth.value -= 1
            with self._lock:
                self._active -= 1
                if self._active == 0:
                    for name, original in self._originals.items():
                        setattr(self._target, name, original)
                    self._originals = {}
