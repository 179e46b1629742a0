"""What the CLI does to a run root around the loop.

preflight   `rlpipe check`: the spec against the world before the first step
status      `rlpipe status`: where a run stands, from its run root alone
fork        `rlpipe fork`: a new run from version N of another
tracking    MLflow: one MLflow run per RL run, the evaluated versions in the Model Registry
"""
