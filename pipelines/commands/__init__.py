"""The `rlpipe` commands by what they act on; pipelines/cli.py puts them in one parser.

arguments    what the commands' arguments become: a spec with its --set overrides, a run root
local_runs   run, rehearse: the loop on this machine, on KFP's local runner
checks       check, estimate-memory: a spec before it runs
run_roots    export, status, harness, fork: a run root a run wrote (their logic: rlpipe/commands/)
cluster      compile, submit, schedule: the pipeline on a cluster
"""
