"""The one per-submodule hook: run one module call under its resolved policy.

Every per-submodule behaviour happens here, once, for ``cast_apply``, Linen and NNX:

1. the floating leaves of the call's arguments are cast to the module's compute dtype;
   a module that ``autocast_exclude`` names receives them uncast instead (as they were
   before any wrapper cast them on their way down, so a timestep passed through a
   bfloat16 root keeps its float32 value);
2. the call runs in a context holding its policy and module path (what
   :func:`jmp_policy.current_policy` reads);
3. the call goes through the extensions of the run's options (each
   ``ext(call, next_fn, args, kwargs) -> outputs``, outermost first): the place where a
   quantized ``dot_general`` provider or a statistics tap plugs in;
4. the **output rule**: outputs are cast to the output dtype only when it differs from the
   compute dtype (jmp's ``"p=f32,c=bf16,o=f32"``); otherwise they are left as computed, as
   in Keras. An :class:`~jmp_policy._src.options.Island` (``NORM_FLOAT32``) returns its
   outputs in the compute dtype of the module that called it.

The **loop-carry rule** (:func:`loop_carries`): while a wrapper runs a model, the carry of
every ``jax.lax.scan``, ``jax.lax.while_loop`` and ``jax.lax.fori_loop`` called through
``jax.lax`` (which is how ``nn.scan``, ``nn.RNN``, ``nn.while_loop``, ``nn.fori_loop``,
``nnx.scan`` and ``nnx.RNN`` all run) is cast back to the dtypes it entered the loop with.
JAX rejects any loop whose carry changes dtype, so this changes no program that runs
without it; it makes loops whose body computes under another policy than their carry's
run at all. One mechanism for every construct, rather than one recogniser per construct.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import jax
import numpy as np

from jmp_policy._src import casting, global_state, transforms
from jmp_policy._src import dtypes as dt
from jmp_policy._src.kv_cache import arguments as cache_arguments
from jmp_policy._src.options import Options
from jmp_policy._src.quantization import serving_kernels
from jmp_policy._src.resolution import Resolution

# ext(call, next_fn, args, kwargs) -> outputs
Extension = Callable[["Call", Callable[..., Any], tuple[Any, ...], dict[str, Any]], Any]


class Call(NamedTuple):
    """One submodule call, as the hook and its extensions see it."""

    path: str  # the module path ("" for the root)
    module: Any  # the Linen or NNX module, or None for a plain function
    resolution: Resolution

    @property
    def policy(self) -> Any:
        return self.resolution.policy


# id(cast array) -> (cast array, the array it was cast from), for the run in progress.
_ORIGINS: contextvars.ContextVar[dict[int, tuple[Any, Any]] | None] = contextvars.ContextVar(
    "jmp_policy_origins", default=None
)


def cast_inputs(tree: Any, dtype: np.dtype, opaque: Callable[[Any], bool] | None = None) -> Any:
    """Casts every floating leaf of ``tree``; ``opaque`` nodes are passed as they are.

    Inside :func:`model_run`, remembers what each cast array was cast from, so a module
    that ``autocast_exclude`` names receives its inputs uncast (:func:`uncast_inputs`).
    """
    origins = _ORIGINS.get()

    def cast(x: Any) -> Any:
        if opaque is not None and opaque(x):
            return x
        new = casting.cast_leaf(x, dtype)
        if origins is not None and new is not x:
            origins[id(new)] = (new, x)
        return new

    return jax.tree.map(cast, tree, is_leaf=opaque)


def uncast_inputs(tree: Any, opaque: Callable[[Any], bool] | None = None) -> Any:
    """Every leaf that the wrappers cast on its way here, as it was before any cast.

    A timestep the root received as float32 and passed on unchanged reaches an excluded
    module in float32, although the root itself computes in bfloat16; a value the model
    computed reaches it as computed.
    """
    origins = _ORIGINS.get()
    if not origins:
        return tree

    def uncast(x: Any) -> Any:
        entry = origins.get(id(x))
        while entry is not None and entry[0] is x:
            x = entry[1]
            entry = origins.get(id(x))
        return x

    return jax.tree.map(uncast, tree, is_leaf=opaque)


def run(
    call: Call,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    extensions: tuple[Extension, ...] = (),
    opaque: Callable[[Any], bool] | None = None,
) -> Any:
    """Runs ``fn(*args, **kwargs)`` as the submodule call ``call`` (the hook).

    Args:
        call: the call's path, module and resolved policy.
        fn: the call itself (the module's method, bound).
        args: its positional arguments.
        kwargs: its keyword arguments.
        extensions: ``ext(call, next_fn, args, kwargs)`` wrappers, outermost first.
        opaque: a predicate for argument nodes never cast or traversed (NNX objects).

    Returns:
        The call's outputs, after the output rule.
    """
    resolution = call.resolution
    policy = resolution.policy
    caller = global_state.current_policy()
    caches, opaque = cache_arguments.run_for(opaque)
    if resolution.autocast:
        args, kwargs = cast_inputs((args, kwargs), policy.compute_dtype, opaque)
    else:
        args, kwargs = uncast_inputs((args, kwargs), opaque)
    handed = (
        None if caches is None else cache_arguments.hand_out(caches, call.path, fn, args, kwargs)
    )
    if handed is not None:
        args, kwargs = handed
    inner = fn
    for ext in reversed(extensions):
        inner = _link(ext, call, inner)
    with global_state.current_policy_scope(policy, call.path):
        out = inner(*args, **kwargs)
    if caches is not None and handed is not None:
        out = cache_arguments.take_back(caches, out)
    if resolution.island:
        return _cast_outputs(out, caller.compute_dtype, opaque)
    if policy.output_dtype != policy.compute_dtype:
        return _cast_outputs(out, policy.output_dtype, opaque)
    return out


def _cast_outputs(tree: Any, dtype: np.dtype, opaque: Callable[[Any], bool] | None) -> Any:
    if opaque is None:
        return casting.cast_tree(tree, dtype)
    return jax.tree.map(
        lambda x: x if opaque(x) else casting.cast_leaf(x, dtype), tree, is_leaf=opaque
    )


def _link(ext: Extension, call: Call, next_fn: Callable[..., Any]) -> Callable[..., Any]:
    def linked(*args: Any, **kwargs: Any) -> Any:
        return ext(call, next_fn, args, kwargs)

    return linked


# -- the loop-carry rule ------------------------------------------------------------------


@contextlib.contextmanager
def attribute_set(obj: Any, name: str, value: Any) -> Iterator[None]:
    """``obj.name`` is ``value`` inside the block (frozen Flax modules included)."""
    old = getattr(obj, name)
    object.__setattr__(obj, name, value)
    try:
        yield
    finally:
        object.__setattr__(obj, name, old)


def _in_scope() -> bool:
    return _LOOPS.inside()


def _like(new: Any, old: Any) -> Any:
    """``new`` with each floating array leaf cast to the dtype of ``old``'s leaf.

    Leaves are paired by their key path (NNX's scan carries grow containers that are
    empty on the way in), else by position when both have as many leaves; leaves of
    ``new`` that pair with none are left for JAX to judge, as it would without us.
    """
    try:
        old_flat = jax.tree_util.tree_flatten_with_path(old)[0]
        new_flat, treedef = jax.tree_util.tree_flatten_with_path(new)
    except (AttributeError, TypeError, ValueError):
        new_leaves, treedef = jax.tree.flatten(new)
        old_leaves = jax.tree.leaves(old)
        if len(new_leaves) != len(old_leaves):
            return new
        pairs = zip(new_leaves, old_leaves, strict=True)
        return jax.tree.unflatten(treedef, [_leaf_like(n, o) for n, o in pairs])
    by_path = {jax.tree_util.keystr(kp): leaf for kp, leaf in old_flat}
    leaves = []
    for kp, leaf in new_flat:
        key = jax.tree_util.keystr(kp)
        leaves.append(_leaf_like(leaf, by_path[key]) if key in by_path else leaf)
    return jax.tree.unflatten(treedef, leaves)


def _leaf_like(new: Any, old: Any) -> Any:
    old_dtype = getattr(old, "dtype", None)
    if old_dtype is None or not dt.is_floating(old_dtype):
        return new
    return casting.cast_leaf(new, old_dtype)


# ``around(scan, f, init, args, kwargs) -> result``: runs each wrapped ``jax.lax.scan`` in
# this context instead of ``scan(f, init, *args, **kwargs)`` (how the map search threads
# its per-iteration values through a layer stack's loop); ``None``: the scan as called.
SCAN_AROUND: contextvars.ContextVar[Callable[..., Any] | None] = contextvars.ContextVar(
    "jmp_policy_scan_around", default=None
)


def _scan(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def scan(f: Callable[..., Any], init: Any, *args: Any, **kwargs: Any) -> Any:
        if not _in_scope():
            return original(f, init, *args, **kwargs)

        def carried(f: Callable[..., Any], init: Any, *args: Any, **kwargs: Any) -> Any:
            def body(carry: Any, x: Any) -> Any:
                new, y = f(carry, x)
                return _like(new, carry), y

            return original(body, init, *args, **kwargs)

        around = SCAN_AROUND.get()
        if around is None:
            return carried(f, init, *args, **kwargs)
        return around(carried, f, init, args, kwargs)

    return scan


def _while_loop(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def while_loop(cond_fun: Callable[..., Any], body_fun: Callable[..., Any], init: Any) -> Any:
        if not _in_scope():
            return original(cond_fun, body_fun, init)
        return original(cond_fun, lambda c: _like(body_fun(c), c), init)

    return while_loop


def _fori_loop(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def fori_loop(
        lower: Any, upper: Any, body_fun: Callable[..., Any], init: Any, **kw: Any
    ) -> Any:
        if not _in_scope():
            return original(lower, upper, body_fun, init, **kw)
        return original(lower, upper, lambda i, c: _like(body_fun(i, c), c), init, **kw)

    return fori_loop


_LOOPS = transforms.ThreadPatch(
    "loops", {"scan": _scan, "while_loop": _while_loop, "fori_loop": _fori_loop}
)


@contextlib.contextmanager
def model_run(options: Options | None = None) -> Iterator[None]:
    """The context of one wrapped model run: the loop-carry rule, the ``serving_kernel``
    option and, when ``options`` exclude modules from autocasting, the origins of cast
    inputs (kept only then: eagerly, they hold every cast input alive until the run ends)."""
    track = options is not None and bool(options.exclude_types or options.exclude_patterns)
    token = _ORIGINS.set({} if track else None)
    kernel = "auto" if options is None else options.serving_kernel
    try:
        with loop_carries(), serving_kernels.using(kernel):
            yield
    finally:
        _ORIGINS.reset(token)


@contextlib.contextmanager
def loop_carries() -> Iterator[None]:
    """Inside the block, loops keep their carry's dtypes (see the module docstring).

    ``jax.lax.scan``, ``while_loop`` and ``fori_loop`` are wrapped while any thread is
    inside such a block and restored when the last one leaves; the wrappers act only in
    the threads that are inside one, and pass through elsewhere.
    """
    with _LOOPS.active():
        yield
