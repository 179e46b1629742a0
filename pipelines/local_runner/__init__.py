"""The local runner: `rlpipe run` and `rlpipe rehearse` on KFP's local runner, on this machine.

driver       `rlpipe run`: the pipeline on KFP's local runner, a pipeline run per chunk of iterations, to the end
progress     what the driver shows while it runs
rehearse     `rlpipe rehearse`: the file `rlpipe compile` wrote, loaded to run here as it is
step_forks   KFP's local tasks as forks of one warm process (each step of `rlpipe run`)
containers   steps and services in their images on this machine (`rlpipe run --containers`)
podman_play  the manifests' services as one file `podman kube play` runs on this machine
"""
