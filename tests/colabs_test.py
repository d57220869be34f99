"""The notebooks in colabs/: stored with small executed outputs (a reader on GitHub or in
Colab sees results), an install cell first, and CI re-executes each (on a CPU in about a
minute) to check it still runs."""

import pathlib

import nbclient
import nbformat
import pytest

ROOT = pathlib.Path(__file__).parent.parent
NOTEBOOKS = sorted((ROOT / "colabs").glob("*.ipynb"))
MAX_BYTES = 200_000  # a notebook with its outputs; images at a low dpi


def test_there_are_notebooks():
    assert NOTEBOOKS, "colabs/ has no notebooks"


@pytest.mark.heavy(15)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_executes_without_errors(path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(ROOT))  # the kernel imports this checkout
    notebook = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        notebook,
        timeout=None,  # no wall-clock limit: a loaded machine is slow, not wrong
        kernel_name="python3",
        resources={"metadata": {"path": str(path.parent)}},
    )
    client.execute()
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "loss" in text


def _code_cells(notebook):
    return [cell for cell in notebook.cells if cell.cell_type == "code"]


def _unexecuted(notebook):
    return [
        i
        for i, cell in enumerate(notebook.cells)
        if cell.cell_type == "code" and cell.execution_count is None
    ]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_is_stored_executed_with_small_outputs(path):
    notebook = nbformat.read(path, as_version=4)
    assert not _unexecuted(notebook), f"{path.name}: cells {_unexecuted(notebook)} not executed"
    outputs = [o for cell in _code_cells(notebook) for o in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert any(o.output_type == "stream" for o in outputs)
    if "plt.show()" in path.read_text():  # its plots are stored, as images
        assert any("image/png" in o.get("data", {}) for o in outputs), path.name
    assert path.stat().st_size < MAX_BYTES, f"{path.name}: {path.stat().st_size} bytes"
    assert "/work/" not in path.read_text()  # no paths of the machine that ran it


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_starts_with_an_install_cell_that_ci_skips(path):
    first = _code_cells(nbformat.read(path, as_version=4))[0]
    assert "%pip install" in first.source
    # Installed already (CI, a checkout): the cell imports nothing and installs nothing.
    assert 'if importlib.util.find_spec("jmp_policy") is None:' in first.source
    assert first.outputs == []


def test_unexecuted_check_finds_cells_without_execution_counts():
    notebook = nbformat.v4.new_notebook()
    counted = nbformat.v4.new_code_cell("x = 1", execution_count=1)
    notebook.cells = [nbformat.v4.new_markdown_cell("# t"), counted]
    notebook.cells.append(nbformat.v4.new_code_cell("y = 2"))
    assert _unexecuted(notebook) == [2]
