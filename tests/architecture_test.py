"""The package's import graph: no cycle among jmp_policy's modules, flax only in the glue.

Reads every module under ``jmp_policy/`` with ``ast`` (imports inside functions too), so it
keeps working as modules are added, moved or split into packages.
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = "jmp_policy"
# The integration modules (or packages) that may import flax.
FLAX_GLUE = ("linen", "nnx")
# Modules that must import nothing of jmp_policy (they sit under everything).
BOTTOM = (
    "jmp_policy._src.context",
    "jmp_policy._src.int_arguments",
    "jmp_policy._src.transforms",
)


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, pathlib.Path]:
    return {_module_name(p): p for p in sorted((ROOT / PACKAGE).rglob("*.py"))}


def _imports(name: str, path: pathlib.Path) -> list[tuple[str, int]]:
    """Every module ``name`` imports (absolute names), with the line, at any depth."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = name.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            found.append((module, node.lineno))
            # `from pkg import sub` imports the submodule `pkg.sub` when there is one.
            found += [(f"{module}.{alias.name}", node.lineno) for alias in node.names]
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", None))
            in ("import_module", "__import__")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.append((node.args[0].value, node.lineno))
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for imported, _ in _imports(name, path):
            if imported in modules and imported != name:
                graph[name].add(imported)
    return graph


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    white, grey, black = 0, 1, 2
    color = dict.fromkeys(graph, white)
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        color[node] = grey
        stack.append(node)
        for succ in sorted(graph[node]):
            if color[succ] == grey:
                return [*stack[stack.index(succ) :], succ]
            if color[succ] == white:
                cycle = visit(succ)
                if cycle:
                    return cycle
        stack.pop()
        color[node] = black
        return None

    for node in sorted(graph):
        if color[node] == white:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_finds_the_package_modules():
    modules = _modules()
    assert "jmp_policy" in modules
    assert "jmp_policy._src.policy" in modules
    assert "jmp_policy._src.context" in modules


def test_graph_sees_imports_inside_functions():
    graph = _graph()
    # `from jmp_policy._src import dtypes as dt` at the top of policy.py is an edge.
    assert "jmp_policy._src.dtypes" in graph["jmp_policy._src.policy"]
    # The facade imports every public module.
    assert "jmp_policy._src.policy" in graph["jmp_policy"]


def test_cycle_finder_finds_a_cycle():
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle_among_jmp_policy_modules():
    cycle = _find_cycle(_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


@pytest.mark.parametrize("bottom", BOTTOM)
def test_bottom_modules_import_nothing_of_ours(bottom):
    path = _modules()[bottom]
    ours = [(m, line) for m, line in _imports(bottom, path) if m.split(".")[0] == PACKAGE]
    assert ours == [], f"{bottom} must import nothing of {PACKAGE}: {ours}"


def _is_glue(name: str) -> bool:
    parts = name.split(".")
    return len(parts) > 1 and parts[1] in FLAX_GLUE


def test_flax_is_imported_only_by_the_glue():
    offenders = [
        f"{path.relative_to(ROOT)}:{line}: {imported}"
        for name, path in _modules().items()
        if not _is_glue(name)
        for imported, line in _imports(name, path)
        if imported.split(".")[0] == "flax"
    ]
    assert offenders == [], "flax imported outside jmp_policy/linen* and jmp_policy/nnx*:\n" + (
        "\n".join(offenders)
    )


def test_glue_is_recognised_as_module_or_package():
    assert _is_glue("jmp_policy.linen")
    assert _is_glue("jmp_policy.nnx._interception")
    assert not _is_glue("jmp_policy._src.linen_helpers")
    assert not _is_glue("jmp_policy")


# Sizes (#24): a module holds one concept, a function one step.
MAX_MODULE_LINES = 350
MAX_FUNCTION_LINES = 60
# A function may pass its bound with a comment saying why, on its `def` line or the line
# after: "# long: <reason>". A module may not (#45): a longer one holds two concepts.
LONG = "# long:"


def _code_lines(lines: list[str], node: ast.AST) -> int:
    """Lines of code in ``node``: its docstring, blank lines and comments not counted."""
    skip: set[int] = set()
    body = getattr(node, "body", [])
    if (
        body
        and isinstance(body[0], ast.Expr)
        and isinstance(body[0].value, ast.Constant)
        and isinstance(body[0].value.value, str)
    ):
        skip = set(range(body[0].lineno, body[0].end_lineno + 1))
    return sum(
        1
        for i in range(node.lineno, node.end_lineno + 1)
        if i not in skip and lines[i - 1].strip() and not lines[i - 1].strip().startswith("#")
    )


def oversized(source: str) -> list[str]:
    """What in ``source`` passes the size bounds without a ``# long:`` reason."""
    lines = source.splitlines()
    found = []
    if len(lines) > MAX_MODULE_LINES:
        found.append(f"module: {len(lines)} lines")
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            n = _code_lines(lines, node)
            reason = any(LONG in line for line in lines[node.lineno - 1 : node.lineno + 1])
            if n > MAX_FUNCTION_LINES and not reason:
                found.append(f"{node.name} (line {node.lineno}): {n} lines of code")
    return found


def test_size_check_finds_a_long_function_and_module_and_takes_a_reason():
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES + 1))
    long_function = f'def f():\n    """Doc."""\n{body}\n'
    # the `def` line and the body
    assert oversized(long_function) == [f"f (line 1): {MAX_FUNCTION_LINES + 2} lines of code"]
    assert oversized(long_function.replace("def f():", "def f():  # long: a table")) == []
    short = "def g():\n    return 1\n" + "\n" * MAX_MODULE_LINES
    assert oversized(short) == [f"module: {MAX_MODULE_LINES + 2} lines"]
    # A module has no exemption: a reason on its first lines changes nothing.
    assert oversized("# long: one table\n" + short) == [f"module: {MAX_MODULE_LINES + 3} lines"]


def test_no_module_or_function_passes_its_size_without_a_reason():
    found = {
        name: problems
        for name, path in _modules().items()
        if (problems := oversized(path.read_text()))
    }
    assert found == {}


# Formats as values (#29): what differs between quantization formats is asked of the policy's
# scheme; no module outside the scheme modules tests a mode's text or reaches for a format's
# setting by name.
_MODE_TEST = re.compile(
    r"quantization_mode\s*(==|!=|\bin\b|\bnot\s+in\b)"
    r"|getattr\([^)]*[\"'](quantization_mode|scaling|block_size)[\"']"
)


def _is_scheme_module(name: str) -> bool:
    return "scheme" in name.rsplit(".", 1)[-1]


def mode_tests(source: str) -> list[str]:
    """The lines of ``source`` that test a quantization mode's text."""
    return [
        f"{i}: {line.strip()}"
        for i, line in enumerate(source.splitlines(), 1)
        if _MODE_TEST.search(line)
    ]


def test_mode_test_finder_finds_string_tests_of_a_mode():
    assert mode_tests('if policy.quantization_mode == "int8":\n    pass\n') == [
        '1: if policy.quantization_mode == "int8":'
    ]
    assert mode_tests('x = getattr(policy, "scaling", "delayed")') != []
    assert mode_tests('b = getattr(p, "block_size", None)') != []
    assert mode_tests("if p.quantization_mode not in MODES:") != []
    assert mode_tests("mode = policy.quantization_mode") == []
    assert _is_scheme_module("jmp_policy._src.quantization.int_schemes")
    assert not _is_scheme_module("jmp_policy._src.quantization.matmuls")


def test_no_quantization_mode_string_test_outside_the_scheme_modules():
    found = {
        name: lines
        for name, path in _modules().items()
        if not _is_scheme_module(name) and (lines := mode_tests(path.read_text()))
    }
    assert found == {}


def test_equinox_is_imported_only_by_its_adapter():
    offenders = [
        f"{path.relative_to(ROOT)}:{line}: {imported}"
        for name, path in _modules().items()
        if name.split(".")[:2] != [PACKAGE, "equinox"]
        for imported, line in _imports(name, path)
        if imported.split(".")[0] == "equinox"
    ]
    assert offenders == [], "equinox imported outside jmp_policy/equinox:\n" + "\n".join(offenders)


# The layout (#45): docs/layout.md names every module of `_src/` with what it holds.
def test_docs_layout_names_every_src_module():
    layout = (ROOT / "docs" / "layout.md").read_text()
    paths = re.findall(r"\w+(?:/\w+)*", layout)  # "policy_map/_index", "diagnostics"
    words = {*paths, *(part for path in paths for part in path.split("/"))}
    missing = [
        name
        for name in _modules()
        if name.startswith(f"{PACKAGE}._src.")
        and name.rsplit(".", 1)[-1] not in words
        and "/".join(name.split(".")[-2:]) not in words
    ]
    assert missing == [], f"docs/layout.md does not name: {missing}"
