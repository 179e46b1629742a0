"""Metric keys that other modules read back (markers, the iteration's wall clock); every other
metric key is named once, where it is computed."""

EVAL_ACCURACY = "eval/accuracy_greedy"  # held-out greedy accuracy (reward.verifier): metrics/eval_N.json
EVAL_STRICT = "eval/accuracy_strict"  # its strict companion: the final answer is the reference, character for character
REWARD_MEAN = "reward/mean"  # every committed iteration has it: metrics/iter_N.json
STARTED_AT = "started_at"  # wall clock the iteration began; sync_weights turns it into the two below
ITERATION_WALL = "time/iteration_wall_s"
ITERATION_OVERHEAD = "overhead/iteration_s"  # iteration wall - the steps' compute
