"""The README's and the docs pages' Python examples run as written, without a warning."""

import pathlib
import re
import subprocess
import sys

import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
DOCS = sorted((README.parent / "docs").glob("*.md"))
PAGES = [README, *DOCS]

BLOCKS = [
    (f"{page.relative_to(README.parent)}#{i}", block)
    for page in PAGES
    for i, block in enumerate(re.findall(r"```python\n(.*?)```", page.read_text(), re.S))
]
# A Python warning as the interpreter prints it: "file.py:12: UserWarning: ...".
WARNING_LINE = re.compile(r"^.*:\d+: \w*Warning: ", re.M)


def test_readme_and_docs_have_python_blocks():
    assert len(BLOCKS) >= 9
    assert sum(name.startswith("README.md#") for name, _ in BLOCKS) == 2  # the quick start


def test_readme_stays_short_and_links_every_docs_page():
    text = README.read_text()
    assert len(text.splitlines()) <= 150
    for page in DOCS:
        assert f"(docs/{page.name})" in text, page.name


@pytest.mark.heavy(5)
@pytest.mark.parametrize("name, block", BLOCKS, ids=[name for name, _ in BLOCKS])
def test_each_python_block_runs_on_its_own_without_a_warning(name, block):
    """A reader copies one block into a fresh interpreter: its imports come with it."""
    result = subprocess.run(
        [sys.executable, "-W", "default", "-c", block],
        capture_output=True,
        text=True,
        cwd=README.parent,  # imports this checkout's jmp_policy
    )
    assert result.returncode == 0, block[:200] + "\n" + result.stderr[-3000:]
    assert result.stdout.strip()  # every block shows what it did
    assert not WARNING_LINE.search(result.stderr), result.stderr[-3000:]
    if name == "README.md#0":
        assert "bfloat16" in result.stdout


def test_the_warning_check_sees_a_warning():
    code = "import warnings; warnings.warn('x'); print(1)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert WARNING_LINE.search(result.stderr)


def _section(title):
    """The section `## title` of the README or of the docs page that has it."""
    for page in PAGES:
        text = page.read_text()
        start = text.find(f"## {title}")
        if start != -1:
            end = text.find("\n## ", start + 1)
            return text[start : end if end != -1 else None]
    raise AssertionError(f"no page has a section {title!r}")


def test_names_table_has_a_row_per_peer_and_the_kept_differences():
    section = _section("Names that work here")
    for peer in ["Keras 3", "tf.keras", "jmp", "Haiku", "PyTorch AMP", "optax", "Flax"]:
        assert re.search(rf"^\| {re.escape(peer)} \|", section, re.M), peer
    for name in ["Int4DTypePolicy", '"_infer"', 'format="keras"', "custom_objects"]:
        assert name in section, name
    differences = section[section.index("Differences kept on purpose") :]
    for fact in [
        "2**-14",
        "zero scale or floor",
        "integer scales",
        "`select_tree` raises `TypeError`",
        "always bfloat16",
        "`f32` where jmp writes `full`",
        "one leaf",
        "`set_global_policy(None)` resets to float32",
        "`default_policy=None` map keeps its entries' names",
        "single-dtype policies serialize to dicts",
        '`"string"` dtype',
    ]:
        assert fact in differences, fact


def test_good_to_know_says_the_global_policy_is_read_at_trace_time():
    assert "a jitted function keeps the policy it was traced under" in _section("Good to know")


def test_newcomer_section_runs_train_and_links_existing_colabs_and_benchmarks():
    section = _section("Two commands for a newcomer")
    assert 'pip install -e ".[examples]" && python examples/train.py' in section
    links = re.findall(r"\]\(([^)]+)\)", section)
    assert any(link.startswith("colabs/") for link in links)
    assert "benchmarks/run_all.py" in links
    local = [link for link in links if not link.startswith("https://")]
    missing = [link for link in local if not (README.parent / link.split("#")[0]).is_file()]
    assert not missing, missing
    colabs = {p.name for p in (README.parent / "colabs").glob("*.ipynb")}
    assert colabs == {pathlib.PurePath(link).name for link in links if link.startswith("colabs/")}
    # An "Open in Colab" badge per notebook, opening that notebook from GitHub.
    badge = "[![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)]"
    for name in colabs:
        assert re.search(
            rf"\({re.escape(f'colabs/{name}')}\)\s+{re.escape(badge)}"
            rf"\(https://colab\.research\.google\.com/github/[\w.-]+/[\w.-]+/blob/main/"
            rf"colabs/{re.escape(name)}\)",
            section,
        ), name


def test_peer_table_has_a_column_per_peer():
    header = _section("Against the peers").splitlines()[2]
    for peer in ["Keras 3", "tf.keras", "jmp", "Haiku", "Flax `dtype=`", "optax", "PyTorch AMP"]:
        assert f"| {peer} |" in header, peer


def test_ci_runs_the_readmes_test_command_in_parallel():
    root = README.parent
    command = re.search(r'pip install -e "\.\[test\]" && (python -m pytest.*)', README.read_text())
    assert command and command[1] == "python -m pytest -q -n auto"
    # .ci/run runs it in each of its environments (oldest and current), install and suite.
    ci = [line.strip() for line in (root / ".ci" / "run").read_text().splitlines()]
    assert command[1] in ci and 'pip install -e ".[test]"' in ci
    assert 'run_environment oldest "$oldest"' in ci and 'run_environment current "$current"' in ci
    assert '"pytest-xdist>=' in (root / "pyproject.toml").read_text()  # in the `test` extra
    minutes = re.search(
        r"takes (?:about|under) (\d+) minutes on 2 (?:quiet )?cores", README.read_text()
    )
    assert minutes, "the README says how long the suite takes"


def test_the_runs_compilation_cache_is_shared_and_written_atomically(tmp_path):
    """The root conftest.py makes one XLA cache per run, shared by the xdist workers, whose
    entries are written to a temporary file and renamed into place: written in place, a
    worker once read an entry another was still writing. The subprocesses the tests start
    (which write in place) get a folder per worker."""
    import os

    import jax
    from jax._src import lru_cache

    base = os.environ.get("JMP_POLICY_TESTS_XLA_CACHE")
    if base is None:
        pytest.skip("a compilation cache the caller set up is used as it is")
    worker = os.environ.get("PYTEST_XDIST_WORKER") or "controller"
    assert jax.config.jax_compilation_cache_dir == base
    assert os.environ["JAX_COMPILATION_CACHE_DIR"] == os.path.join(base, "subprocesses", worker)

    cache = lru_cache.LRUCache(str(tmp_path), max_size=-1)
    replaced = []
    real_replace = os.replace
    os.replace = lambda source, target: (replaced.append(target), real_replace(source, target))
    try:
        cache.put("key", b"compiled program")
        cache.put("key", b"another value")  # an entry already there is kept, as JAX does
    finally:
        os.replace = real_replace
    assert replaced == [os.path.join(str(tmp_path), "key-cache")]
    assert cache.get("key") == b"compiled program"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["key-cache"]  # no temporary left


def test_tests_compile_fast_in_every_process():
    """The root conftest.py gives XLA its fast-compile settings before jax is imported (the
    fusion flag only where this XLA has it): the suite's time is mostly compiling."""
    import ast
    import os

    # conftest.py's own `_xla_knows`, taken out of its source (running the file again would
    # redo its settings)
    source = (README.parent / "conftest.py").read_text()
    (knows,) = [
        node
        for node in ast.parse(source).body
        if isinstance(node, ast.FunctionDef) and node.name == "_xla_knows"
    ]
    namespace = {"os": os}
    exec(compile(ast.Module([knows], []), "conftest.py", "exec"), namespace)

    flags = os.environ["XLA_FLAGS"]
    assert flags.count("--xla_backend_optimization_level") == 1  # 0, or the caller's
    fusion = "--xla_cpu_use_fusion_emitters"
    if namespace["_xla_knows"](fusion):
        assert flags.count(fusion) == 1
    else:  # an XLA without the flag would abort on it
        assert fusion not in flags


def test_tests_see_8_cpu_devices_in_every_process():
    """The root conftest.py sets XLA_FLAGS before jax is imported, in each xdist worker too."""
    import os

    import jax

    assert os.environ["XLA_FLAGS"].count("--xla_force_host_platform_device_count=8") == 1
    if jax.default_backend() == "cpu":
        assert jax.device_count() == 8
