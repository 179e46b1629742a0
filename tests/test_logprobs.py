"""Log-probs and entropy from the final hidden states in chunks of tokens (trainer.logit_chunk_tokens)
equal the whole-logits computation: values, and the gradients they send into the model, in fp32; with
LoRA adapters; with the reference's adapters off; and through a whole update."""

import copy
import random

import pytest
import torch

from rlpipe.training.batching import pack
from rlpipe.training.logprobs import chunks_head_on_hidden, completion_logprobs_and_entropy


def _model(vocab: int = 300):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=True,
        pad_token_id=0,
    )
    return Qwen2ForCausalLM(config).float()


def _rows(vocab: int, n: int = 6) -> list[dict]:
    """Prompts and completions of different lengths, so rows are padded and windows start apart."""
    rng = random.Random(0)
    return [
        {
            "prompt_token_ids": [rng.randrange(1, vocab) for _ in range(rng.randrange(2, 7))],
            "completion_token_ids": [rng.randrange(1, vocab) for _ in range(rng.randrange(1, 9))],
            "advantage": rng.uniform(-1, 1),
        }
        for _ in range(n)
    ]


def _loss_and_grads(model, mb, chunk_tokens, entropy_grad: bool):
    model.zero_grad(set_to_none=True)
    logprobs, entropy = completion_logprobs_and_entropy(model, mb, 0.7, chunk_tokens, entropy_grad=entropy_grad)
    mask = mb.completion_mask
    loss = -(logprobs * mb.advantages * mask).sum() - 0.1 * (entropy * mask).sum() * entropy_grad
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return logprobs.detach(), entropy.detach(), grads


@pytest.mark.parametrize("chunk_tokens", [1, 5, 4096])
@pytest.mark.parametrize("entropy_grad", [False, True])
def test_chunked_logprobs_entropy_and_gradients_equal_the_whole_logits(chunk_tokens: int, entropy_grad: bool):
    model = _model()
    mb = pack(_rows(300), pad_id=0)
    assert chunks_head_on_hidden(model)
    whole = _loss_and_grads(model, mb, None, entropy_grad)
    chunked = _loss_and_grads(model, mb, chunk_tokens, entropy_grad)
    mask = mb.completion_mask.bool()
    torch.testing.assert_close(chunked[0][mask], whole[0][mask], rtol=0, atol=1e-5)
    torch.testing.assert_close(chunked[1][mask], whole[1][mask], rtol=0, atol=1e-5)
    assert chunked[2].keys() == whole[2].keys() and len(whole[2]) == len(list(model.parameters()))
    for name, grad in whole[2].items():
        torch.testing.assert_close(chunked[2][name], grad, rtol=1e-4, atol=1e-6, msg=name)
    assert (chunked[0][~mask] == 0).all()  # off the completion: nothing computed, every loss masks it


def test_chunked_logprobs_through_lora_adapters_and_with_them_off():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(_model(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    for name, p in model.named_parameters():  # B != 0: the adapters change the output
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.5)
    mb = pack(_rows(300), pad_id=0)
    mask = mb.completion_mask.bool()
    assert chunks_head_on_hidden(model)
    whole = _loss_and_grads(model, mb, None, False)
    chunked = _loss_and_grads(model, mb, 3, False)
    torch.testing.assert_close(chunked[0][mask], whole[0][mask], rtol=0, atol=1e-5)
    assert whole[2] and all("lora_" in name for name in whole[2])
    for name, grad in whole[2].items():
        torch.testing.assert_close(chunked[2][name], grad, rtol=1e-4, atol=1e-6, msg=name)
    with torch.no_grad(), model.disable_adapter():
        base_whole = completion_logprobs_and_entropy(model, mb, 0.7, None)[0]
        base_chunked = completion_logprobs_and_entropy(model, mb, 0.7, 3)[0]
    torch.testing.assert_close(base_chunked[mask], base_whole[mask], rtol=0, atol=1e-5)
    assert (base_whole[mask] - whole[0][mask]).abs().max() > 1e-3  # the adapters were really off


def test_bf16_autocast_chunked_logprobs_match_the_whole_logits():
    model = _model()
    mb = pack(_rows(300), pad_id=0)
    mask = mb.completion_mask.bool()
    with torch.no_grad():
        whole = completion_logprobs_and_entropy(model, mb, 1.0, None, precision=torch.autocast("cpu", torch.bfloat16))
        chunked = completion_logprobs_and_entropy(model, mb, 1.0, 4, precision=torch.autocast("cpu", torch.bfloat16))
        fp32 = completion_logprobs_and_entropy(model, mb, 1.0, 4)
    torch.testing.assert_close(chunked[0][mask], whole[0][mask], rtol=0, atol=2e-2)
    assert (chunked[0][mask] - fp32[0][mask]).abs().max() > 0  # the head really ran in bf16


def test_heads_that_transform_their_logits_take_the_whole_logits_path():
    model = _model()
    model.config.final_logit_softcapping = 30.0  # Gemma 2: logits = 30 tanh(h W / 30)
    assert not chunks_head_on_hidden(model)


def test_an_update_with_chunked_logprobs_equals_the_whole_logits_update(tmp_path):
    from rlpipe.training.trainer import train_on_batch

    from .test_precision_and_memory import _batch, _params, _trainer

    batch = _batch(tmp_path)
    whole = _trainer(tmp_path, logit_chunk_tokens=None)
    chunked = _trainer(tmp_path, logit_chunk_tokens=7)
    chunked.policy.load_state_dict(copy.deepcopy(whole.policy.state_dict()))
    m_whole = train_on_batch(whole, batch, 1)
    m_chunked = train_on_batch(chunked, batch, 1)
    for name, value in _params(whole).items():
        torch.testing.assert_close(_params(chunked)[name], value, rtol=1e-5, atol=1e-6, msg=name)
    for key in ("policy/loss", "policy/entropy", "policy/grad_norm"):
        assert m_chunked[key] == pytest.approx(m_whole[key], rel=1e-5, abs=1e-6), key
