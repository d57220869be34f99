"""Executes every notebook in colabs/ (each must run on a CPU in about a minute)."""

import pathlib

import nbclient
import nbformat
import pytest

NOTEBOOKS = sorted((pathlib.Path(__file__).parent.parent / "colabs").glob("*.ipynb"))


def test_there_are_notebooks():
    assert NOTEBOOKS, "colabs/ has no notebooks"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_executes_without_errors(path):
    notebook = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        notebook,
        timeout=300,
        kernel_name="python3",
        resources={"metadata": {"path": str(path.parent)}},
    )
    client.execute()
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "loss" in text


def _cells_with_outputs(notebook):
    return [
        i
        for i, cell in enumerate(notebook.cells)
        if cell.cell_type == "code" and (cell.outputs or cell.execution_count is not None)
    ]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_is_stored_without_outputs(path):
    dirty = _cells_with_outputs(nbformat.read(path, as_version=4))
    assert not dirty, f"{path.name}: cells {dirty} have outputs or execution counts; strip them"


def test_output_check_finds_outputs_and_execution_counts():
    notebook = nbformat.v4.new_notebook()
    counted = nbformat.v4.new_code_cell("x = 1", execution_count=1)
    printed = nbformat.v4.new_code_cell("print('loss')")
    printed.outputs = [nbformat.v4.new_output("stream", text="loss\n")]
    notebook.cells = [nbformat.v4.new_markdown_cell("# t"), counted, printed]
    notebook.cells.append(nbformat.v4.new_code_cell("y = 2"))
    assert _cells_with_outputs(notebook) == [1, 2]
