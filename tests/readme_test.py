"""The README's Python examples run as written."""

import pathlib
import re
import subprocess
import sys

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_blocks_run():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert len(blocks) >= 2
    result = subprocess.run(
        [sys.executable, "-c", "\n".join(blocks)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=README.parent,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "bfloat16" in result.stdout


def _section(title):
    text = README.read_text()
    start = text.index(f"## {title}")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else None]


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
        "`set_dtype_policy(None)` resets to float32",
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
    missing = [link for link in links if not (README.parent / link).is_file()]
    assert not missing, missing
    colabs = {p.name for p in (README.parent / "colabs").glob("*.ipynb")}
    assert colabs == {pathlib.PurePath(link).name for link in links if link.startswith("colabs/")}


def test_peer_table_has_a_column_per_peer():
    header = _section("Against the peers").splitlines()[2]
    for peer in ["Keras 3", "tf.keras", "jmp", "Haiku", "Flax `dtype=`", "optax", "PyTorch AMP"]:
        assert f"| {peer} |" in header, peer
