from kfp import dsl

from rlpipe.components import TRAINER_IMAGE


@dsl.component(base_image=TRAINER_IMAGE, install_kfp_package=False)
def evaluate(spec: dict, run_root: str, weights: dict, iteration: int, metrics: dsl.Output[dsl.Metrics]):
    """Greedy accuracy of `weights` on the held-out set, when due (iteration 0, every
    loop.eval_every, the last) and not already recorded; otherwise returns before importing torch."""
    import time

    entered = time.time()
    from rlpipe.components import exit_without_teardown
    from rlpipe.evaluation import evaluation_pending
    from rlpipe.spec import parse_spec

    exit_without_teardown()
    run_spec = parse_spec(spec)
    if not evaluation_pending(run_spec, run_root, iteration):
        return
    from rlpipe.components import import_overhead
    from rlpipe.evaluation import evaluate_policy
    from rlpipe.store.run_root import cache_root_for

    overhead = import_overhead("evaluate", entered)
    cache = cache_root_for(run_spec.storage.root, run_spec.storage.cache)
    values = evaluate_policy(run_spec, run_root, weights, iteration, cache)
    for key, value in (values | overhead).items():
        metrics.log_metric(key, value)
