from kfp import dsl

from rlpipe.components import TRAINER_IMAGE


@dsl.component(base_image=TRAINER_IMAGE, install_kfp_package=False)
def evaluate(
    spec: str,
    run_root: str,
    weights: dict,
    iteration: int,
    metrics: dsl.Output[dsl.Metrics],
    eval_samples: dsl.Output[dsl.Markdown],
):
    """Greedy accuracy of `weights` on the held-out set, when due (iteration 0, every
    loop.eval_every, the last) and not already recorded (rlpipe.loop.evaluate); eval_samples: the
    accuracy and the held-out rows' greedy completions (rlpipe.reports.step_reports)."""
    import time

    entered = time.time()
    from rlpipe.components import finish, start

    run_spec, overhead = start("evaluate", spec, entered)
    from rlpipe import loop

    values = loop.evaluate(run_spec, run_root, weights, iteration, run_spec.cache_root)
    from rlpipe.reports import step_reports

    with open(eval_samples.path, "w", encoding="utf-8") as f:
        f.write(step_reports("evaluate", iteration=iteration, run_root=run_root)["eval_samples"])
    finish(metrics, (values | overhead) if values else {})
