"""Metric keys that more than one module names (one writes them, others read them back, or several
steps write them); every other metric key is named once, where it is computed
(tests/test_code_shape.py::test_metric_keys_named_by_several_modules_are_constants)."""

EVAL_ACCURACY = "eval/accuracy_greedy"  # held-out greedy accuracy (reward.verifier): metrics/eval_N.json
EVAL_STRICT = "eval/accuracy_strict"  # its strict companion: the final answer is the reference, character for character
EVAL_WEIGHTS_VERSION = "eval/weights_version"  # the version an eval scored
REWARD_MEAN = "reward/mean"  # every committed iteration has it: metrics/iter_N.json
REWARD_STD = "reward/std"
REWARD_MAX = "reward/max"  # <= 0 with std 0: no sample earned any reward (rlpipe.evaluation.diagnosis)
REWARD_COUNT = "reward/count"  # the samples scored: how many rollouts a no-reward stretch spans
ZERO_VARIANCE_GROUPS = "groups/zero_variance_fraction"  # groups whose rewards are all equal (no gradient)
ITERATION_WALL = "time/iteration_wall_s"  # from the generate step's start (loop.sync_weights' started_at)
ITERATION_OVERHEAD = "overhead/iteration_s"  # iteration wall - the steps' compute

# the steps' compute, and the loads before it (a resident trainer's are ~0)
GENERATE_TIME = "time/generate_s"
GENERATE_LOAD = "overhead/generate_load_s"
GENERATE_TOKENS_PER_S = "throughput/generate_tokens_per_s"
VALUES_TIME = "time/values_s"
VALUES_LOAD = "overhead/values_load_s"
UPDATE_TIME = "time/update_s"
UPDATE_LOAD = "overhead/update_load_s"
EVALUATE_LOAD = "overhead/evaluate_load_s"

# the update's (rlpipe.training.tally), shown by the progress display
POLICY_LOSS = "policy/loss"
CLIP_FRACTION = "policy/clip_fraction"
ENTROPY = "policy/entropy"
KL_MEAN = "kl/mean"
OPTIMIZER_STEPS = "policy/optimizer_steps"

# asynchronous runs: how many versions behind the rollouts were (rlpipe.services.producer.buffer)
STALENESS_MAX = "async/staleness_max"
STALENESS_MEAN = "async/staleness_mean"

# sharing.enabled: the handovers of one device between the resident trainer and the samplers (rlpipe.sharing.handover)
SHARING_SLEEP = "sharing/sleep_s"  # the samplers put to sleep (POST /sleep), all of them
SHARING_WAKE = "sharing/wake_s"  # the samplers woken (POST /wake_up; the reload between is time/sampler_*)
SHARING_ONLOAD = "sharing/onload_s"  # the trainer's state back on its device
SHARING_OFFLOAD = "sharing/offload_s"  # the trainer's state to host memory
SHARING_OFFLOAD_BYTES = "sharing/offload_bytes"  # what the trainer's device gave back (rank 0's share)
