"""The vLLM samplers: fleet.py starts them, server.py is each one's entrypoint, worker.py the worker
extension loaded into each, client.py the steps' side, vllm_settings.py how rlpipe runs vLLM."""
