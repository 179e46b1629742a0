"""vLLM's OpenAI-compatible server with rlpipe's import guard (rlpipe.models.optional_imports): the
sampler servers run `python -m rlpipe.services.samplers.server <vLLM server flags>`, so an environment
where pip put CUDA builds of torchvision/torchaudio beside torch+cpu still serves."""

import runpy

from rlpipe.models.optional_imports import hide_vision_and_audio

if __name__ == "__main__":
    hide_vision_and_audio()  # vLLM's engine core is forked from this process and inherits it
    runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__", alter_sys=True)
