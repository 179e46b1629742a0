"""gs:// paths against a real GCS emulator (gcp-storage-emulator): model loading and the weight store."""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")  # must be set before gcsfs is imported

BUCKET = "rlpipe-test"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def gcs(tmp_path_factory):
    """A gcsfs filesystem talking to an in-memory emulator on loopback."""
    port = _free_port()
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gcp_storage_emulator",
            "start",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--in-memory",
            "--default-bucket",
            BUCKET,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 30
    while time.time() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                break
        time.sleep(0.1)
    os.environ["STORAGE_EMULATOR_HOST"] = f"http://127.0.0.1:{port}"
    import fsspec

    fsspec.config.conf["gcs"] = {"token": "anon"}  # the emulator takes no credentials
    yield fsspec.filesystem("gs")
    fsspec.config.conf.pop("gcs", None)
    os.environ.pop("STORAGE_EMULATOR_HOST", None)
    server.terminate()
    server.wait(10)


def test_model_loads_from_gs(gcs, tmp_path: Path):
    from rlpipe.models.files import resolve_model_source
    from rlpipe.models.loading import build_char_tokenizer, build_tiny_model, load_policy
    from rlpipe.spec import TinyModelSpec

    tokenizer = build_char_tokenizer()
    build_tiny_model(TinyModelSpec(), tokenizer, seed=0).save_pretrained(tmp_path / "m")
    tokenizer.save_pretrained(tmp_path / "m")
    gcs.put(str(tmp_path / "m") + "/", f"{BUCKET}/models/tiny", recursive=True)
    local = resolve_model_source(f"gs://{BUCKET}/models/tiny", tmp_path / "cache")
    model, loaded_tokenizer = load_policy(local)
    assert model.config.model_type == "qwen2"
    assert loaded_tokenizer("1+2=")["input_ids"] == tokenizer("1+2=")["input_ids"]


def test_weight_store_publishes_on_gs(gcs, tmp_path: Path):
    from rlpipe.store import weights as ws

    run_root = f"gs://{BUCKET}/runs/demo"
    staged = ws.staging_uri(run_root, 1)
    (tmp_path / "v").mkdir()
    (tmp_path / "v" / "model.safetensors").write_bytes(os.urandom(1 << 16))
    gcs.put(str(tmp_path / "v") + "/", staged.removeprefix("gs://"), recursive=True)
    ref = ws.publish(run_root, ws.seal(staged, 1, 1, 0)).ref
    assert ws.latest_version(run_root) == 1
    assert ws.read_weight_ref(run_root, 1) == ref
    local = ws.local_path(ref, tmp_path / "cache")
    assert Path(local, "model.safetensors").read_bytes() == (tmp_path / "v" / "model.safetensors").read_bytes()


def test_data_files_load_from_gs(gcs, tmp_path: Path):
    """data.path as a gs:// glob of JSONL shards, eval_path as one Parquet file."""
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    from rlpipe.data import task_rows
    from rlpipe.spec import parse_spec

    from .conftest import tiny_spec_dict

    rows = [{"question": f"{a}-{b}", "answer": str(a - b)} for a in range(6) for b in range(5)]
    for shard in range(3):
        with gcs.open(f"{BUCKET}/tasks/sub/train-{shard}.jsonl", "w") as f:
            f.write("".join(json.dumps(r) + "\n" for r in rows[shard * 8 : shard * 8 + 8]))
    pq.write_table(pa.Table.from_pylist(rows[24:]), tmp_path / "eval.parquet")
    gcs.put(str(tmp_path / "eval.parquet"), f"{BUCKET}/tasks/sub/eval.parquet")
    data = {"path": f"gs://{BUCKET}/tasks/sub/train-*.jsonl", "eval_path": f"gs://{BUCKET}/tasks/sub/eval.parquet"}
    train, held_out = task_rows(
        parse_spec(tiny_spec_dict(tmp_path, data=data | {"train_size": None, "eval_size": None}))
    )
    assert train == rows[:24] and held_out == rows[24:]
