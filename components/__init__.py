"""One subpackage per step: `step.py` holds the plain function, `component.py` the thin KFP component.

Component bodies import rlpipe inside the function: KFP ships only the function's source
to the container, which has rlpipe installed (images/).
"""

TRAINER_IMAGE = "ghcr.io/rlpipe/trainer:0.1.0"  # torch + transformers + rlpipe (generate, update, ...)
STEP_IMAGE = "ghcr.io/rlpipe/step:0.1.0"  # rlpipe without torch (score, advantages, sync, ...)
