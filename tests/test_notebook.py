"""The quickstart notebook runs end to end, offline, as a user runs it (nbclient, a real kernel)."""

import time
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from .conftest import REPO

NOTEBOOK = REPO / "notebooks" / "quickstart.ipynb"


@pytest.mark.slow  # about 4 minutes: CI's slow step
def test_quickstart_notebook_runs_end_to_end(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("RLPIPE_QUICKSTART_STORAGE", str(tmp_path / "runs"))  # not the checkout's runs/
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    started = time.time()
    NotebookClient(
        notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(REPO / "notebooks")}}
    ).execute()
    elapsed = time.time() - started
    outputs = "\n".join(
        str(output.get("text", "")) + str(output.get("data", {}).get("text/plain", ""))
        for cell in notebook.cells
        if cell.cell_type == "code"
        for output in cell.get("outputs", [])
    )
    assert "iteration   4 of 4 committed" in outputs  # resumed from 2 to 4
    assert "rlpipe fork:" in outputs and "MLflow reward/mean: [(1," in outputs
    images = sum("image/png" in o.get("data", {}) for c in notebook.cells for o in c.get("outputs", []))
    assert images == 2  # the curves, and the fork's beside its parent's
    assert (tmp_path / "runs" / "quickstart-kl" / "weights" / "v000004").exists()
    assert elapsed < 360, f"the notebook took {elapsed:.0f} s; CI allows it 6 minutes"
