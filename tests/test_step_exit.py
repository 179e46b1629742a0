"""A step process on KFP's local runner skips interpreter teardown once its outputs are written,
and still fails when its step fails."""

from pathlib import Path

import pytest
from kfp import dsl, local


@dsl.component(base_image="python:3.11", install_kfp_package=False)
def _step(fail: bool, out: dsl.Output[dsl.Dataset]) -> int:
    import atexit
    from pathlib import Path

    from rlpipe.components import exit_without_teardown

    atexit.register(lambda: print("teardown ran"))  # registered first, so it runs after the fast exit: never
    exit_without_teardown()
    if fail:
        raise RuntimeError("the step failed")
    Path(out.path).write_text("written")
    return 7


def test_fast_exit_keeps_outputs_and_failures(tmp_path: Path, capfd):
    from kfp.local import config

    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(tmp_path))
    try:
        ok = _step(fail=False)
        assert ok.outputs["Output"] == 7
        assert Path(ok.outputs["out"].path).read_text() == "written"
        assert "teardown ran" not in capfd.readouterr().out
        with pytest.raises(RuntimeError, match="FAILURE"):
            _step(fail=True)
        assert "teardown ran" in capfd.readouterr().out  # the failure exits the normal way
    finally:
        config.LocalExecutionConfig.instance = None
