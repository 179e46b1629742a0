"""What the CLI's run-root commands do to a run root (the CLI's side: pipelines/commands/run_roots.py).

status      `rlpipe status`: where a run stands, from its run root alone
fork        `rlpipe fork`: a new run from version N of another
"""
