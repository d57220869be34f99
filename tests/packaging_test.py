"""What a user who installs the package, or opens a notebook in Colab, finds: a license,
metadata that says where the project lives, install cells that work where they run, and no
link that leads outside the repository."""

from __future__ import annotations

import ast
import importlib.metadata
import json
import pathlib
import re
import subprocess
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
NOTEBOOKS = sorted((ROOT / "colabs").glob("*.ipynb"))


def test_license_file_is_apache_2_and_named_in_the_metadata():
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" in text
    assert PYPROJECT["license"] == "Apache-2.0"
    assert PYPROJECT["license-files"] == ["LICENSE"]


def test_pyproject_names_authors_urls_and_classifiers():
    assert PYPROJECT["authors"] and all(a.get("name") for a in PYPROJECT["authors"])
    urls = PYPROJECT["urls"]
    assert set(urls) == {"Repository", "Documentation", "Changelog"}
    assert all(u.startswith(urls["Repository"]) for u in urls.values())
    assert urls["Changelog"].endswith("/CHANGELOG.md")
    classifiers = PYPROJECT["classifiers"]
    assert "Typing :: Typed" in classifiers  # jmp_policy/py.typed ships
    assert (ROOT / "jmp_policy" / "py.typed").is_file()
    minimum = re.fullmatch(r">=3\.(\d+)", PYPROJECT["requires-python"])
    assert minimum, PYPROJECT["requires-python"]
    assert f"Programming Language :: Python :: 3.{minimum.group(1)}" in classifiers


def test_installed_metadata_carries_the_license_and_urls():
    # What `pip show jmp_policy` prints, from the installed (here: editable) distribution.
    meta = importlib.metadata.metadata("jmp_policy")
    assert meta["License-Expression"] == "Apache-2.0"
    assert "LICENSE" in (meta.get_all("License-File") or [])
    urls = dict(u.split(", ", 1) for u in meta.get_all("Project-URL") or [])
    assert urls == PYPROJECT["urls"]
    assert meta["Author"] or meta["Author-email"]


def _install_cell(path: pathlib.Path) -> str:
    notebook = json.loads(path.read_text())
    code = [c for c in notebook["cells"] if c["cell_type"] == "code"]
    return "".join(code[0]["source"])


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_install_cell_installs_the_clone_or_the_repository(path, tmp_path, monkeypatch):
    source = _install_cell(path)
    assert "%pip install -q jmp_policy" not in source  # not on PyPI
    # The cell's line magics as calls we can watch (IPython turns `%pip ...` into a call).
    python = re.sub(r"%pip (.*)", lambda m: f"_pip(f{m.group(1)!r})", source)
    ast.parse(python)

    def run(cwd: pathlib.Path, installed: bool) -> list[str]:
        calls: list[str] = []
        monkeypatch.chdir(cwd)
        monkeypatch.setattr(
            "importlib.util.find_spec", lambda name: object() if installed else None
        )
        exec(compile(python, str(path), "exec"), {"_pip": calls.append})
        monkeypatch.undo()
        return calls

    # Installed already (CI, a set-up environment): nothing to do.
    assert run(ROOT / "colabs", installed=True) == []
    # In a clone: the clone, editable.
    assert run(ROOT / "colabs", installed=False) == [f"install -q -e {ROOT}"]
    # Elsewhere (Colab's /content): the repository the metadata names.
    repository = PYPROJECT["urls"]["Repository"]
    assert run(tmp_path, installed=False) == [f"install -q git+{repository}"]


def _tracked_text_files() -> list[pathlib.Path]:
    out = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=False
    ).stdout.split()
    if not out:  # not a git checkout (an unpacked sdist): every file
        return [p for p in ROOT.rglob("*") if p.is_file() and ".venv" not in p.parts]
    suffixes = {".md", ".py", ".toml", ".ipynb", ".txt", ".cfg", ".sh", ".yaml", ".yml"}
    return [ROOT / name for name in out if pathlib.Path(name).suffix in suffixes]


def test_no_tracked_file_links_outside_the_repository():
    outside = []
    for path in _tracked_text_files():
        if not path.is_file():
            continue
        for match in re.finditer(r"(?:\.\./)+[\w.\-/]*", path.read_text(errors="replace")):
            target = (path.parent / match.group()).resolve()
            if not target.is_relative_to(ROOT):
                outside.append(f"{path.relative_to(ROOT)}: {match.group()}")
    assert not outside, outside


def test_readme_and_docs_link_to_files_that_exist():
    missing, count = [], 0
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        links = re.findall(r"\]\(((?!https?:|#)[^)\s]+)\)", page.read_text())
        count += len(links)
        missing += [
            f"{page.name}: {link}"
            for link in links
            if not (page.parent / link.split("#")[0]).exists()
        ]
    assert count >= 10
    assert not missing, missing
