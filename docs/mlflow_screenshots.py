"""Screenshots of a run in the real MLflow UI, headless (Debian's chromium driven by Playwright): the
run's reward and held-out accuracy charts, and its registered model. They are the images in docs/.

    apt-get install chromium && pip install playwright   # a docs tool: not a project dependency
    python docs/mlflow_screenshots.py runs/addition-demo [--out docs]
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

CHROMIUM_FLAGS = [  # no background connections: this machine's network is closed
    "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
    "--disable-component-update", "--disable-sync",
]  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def screenshot(url: str, path: Path, charts: str | None = None) -> None:
    """`url` once it rendered; `charts`: a filter typed into the run's chart search."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=CHROMIUM_FLAGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1300})
        page.goto(url, wait_until="load")
        page.wait_for_timeout(3000)
        assistant = page.get_by_role("button", name="Close")  # the MLflow Assistant side panel
        if assistant.count():
            assistant.first.click()
        if charts:
            page.get_by_placeholder("Search metric charts").fill(charts)
        page.wait_for_timeout(6000)  # the charts draw after their data arrives
        page.screenshot(path=str(path))
        browser.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_root")
    parser.add_argument("--out", default=str(Path(__file__).parent))
    args = parser.parse_args()
    run_root = Path(args.run_root).resolve()
    state = json.loads((run_root / "state.json").read_text())
    spec = json.loads((run_root / "spec.json").read_text())
    store = f"sqlite:///{run_root / 'mlflow.db'}"
    from mlflow.tracking import MlflowClient

    run = MlflowClient(store).get_run(state["mlflow_run_id"])
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", store, "--port", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        base = f"http://127.0.0.1:{port}"
        for _ in range(120):
            try:
                urllib.request.urlopen(f"{base}/health", timeout=1)
                break
            except OSError:
                time.sleep(0.5)
        experiment, run_id = run.info.experiment_id, run.info.run_id
        name = (spec.get("tracking") or {}).get("registered_model") or spec["name"]
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        charts = f"#/experiments/{experiment}/runs/{run_id}/model-metrics?workflowType=machine_learning"
        pages = {
            "mlflow-run-charts.png": (charts, "accuracy_greedy|reward/mean"),
            "mlflow-registered-model.png": (f"#/models/{name}", None),
        }
        for file, (page, shown) in pages.items():
            screenshot(f"{base}/{page}", out / file, shown)
            print(f"wrote {out / file}: {base}/{page}")
    finally:
        server.terminate()
        server.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
