"""The notebooks under notebooks/, each run end to end in a Jupyter kernel (nbclient), as a reader would.

Each notebook starts its own local grid (``LabNode.local``) and asserts its own results; any cell error
fails the test.  CI copies notebooks/ next to tests/ (``.ci/run``); a notebook's data files
(``notebooks/data/``) are copied next to it in the scratch directory it runs in.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
NAMES = ["01_matrix_products", "02_xarray", "03_capture_pytorch", "04_training"]


def test_every_notebook_is_run_here():
    assert sorted(p.stem for p in NOTEBOOKS.glob("*.ipynb")) == NAMES


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_notebook_runs_end_to_end(name, tmp_path, monkeypatch):
    if name in ("03_capture_pytorch", "04_training"):
        pytest.importorskip("torch")
    if (NOTEBOOKS / "data").is_dir():  # the files a notebook reads (04: data/sonnets.txt), as next to it
        shutil.copytree(NOTEBOOKS / "data", tmp_path / "data")
    monkeypatch.delenv("MPLBACKEND", raising=False)  # the kernel's inline backend: figures as PNG outputs
    book = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    # no per-cell time limit (the suite's own timeout applies); run in a scratch directory
    client = nbclient.NotebookClient(book, timeout=None, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()  # raises CellExecutionError naming the cell on any error
    errors = [o for c in book.cells if c.cell_type == "code" for o in c.get("outputs", ())
              if o.get("output_type") == "error"]
    assert not errors, errors
    images = [o for c in book.cells if c.cell_type == "code" for o in c.get("outputs", ())
              if "image/png" in o.get("data", {})]
    assert images, f"{name}: no plot rendered"
