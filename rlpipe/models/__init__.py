"""Models: where a policy's files are and how it loads.

files             a model's files and prompt tokenizer, without torch (the light steps use it)
loading           build the tiny offline model, load any policy and its tokenizer (torch)
gguf              a GGUF file as a model source
devices           trainer.device as a torch.device (torch only)
optional_imports  hide the vision and audio packages that transformers and vLLM import but a text policy never uses
"""
