"""Long-lived services, each beside the client that steps, engines and rewards import (the clients
speak HTTP only, so importing one does not import what its service computes with).

    trainer/            the resident trainer: server (holds the policy, optimizer and reference), client
    samplers/           the vLLM samplers: fleet (command line, local fleet), server, worker extension,
                        client (fan prompts out, reload in place), vllm_settings (shared with the vLLM engine)
    producer/           the rollout producer: server (keeps the rollout buffer full), buffer (the steps' side)
    local_servers       the servers `rlpipe run` owns on this machine (the local runner, with its step forks
                        and containers, is pipelines/local_runner/)
"""
