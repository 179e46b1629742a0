"""The torch engine's fast decode (rlpipe.engines.decode) against Hugging Face's forward: the log-prob it
records for every sampled token is the one a full forward of prompt + completion gives, for each
architecture it runs (LoRA adapters included), with rows leaving the batch (a CPU) and at the fixed shapes
a GPU captures as a CUDA graph (`static`; the graph itself: tests/test_gpu.py); its draws follow
softmax(logits / T) and what top-k / top-p leave."""

from __future__ import annotations

import pytest
import torch

from rlpipe.engines import LoadedModel, Sampling
from rlpipe.engines.decode import decode, decoder_of, next_tokens

SIZES = dict(vocab_size=24, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128)  # fmt: skip
PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11]]


def tiny(family: str) -> torch.nn.Module:
    import transformers

    configs = {
        "qwen2": transformers.Qwen2Config(**SIZES),
        "llama": transformers.LlamaConfig(
            **SIZES,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        ),  # fmt: skip
        "qwen3": transformers.Qwen3Config(**SIZES, head_dim=32),
        "mistral": transformers.MistralConfig(**SIZES),
    }
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(configs[family]).eval()


def recorded_against_forward(
    model: torch.nn.Module, samples: int, temperature: float, static: bool = False, **options
) -> float:
    """The largest |recorded log-prob - a full forward's| over every token of every completion."""
    decoder = decoder_of(model, 32, {0, 1}, 23)
    assert decoder is not None
    generator = torch.Generator().manual_seed(0)
    top_k = options.get("top_k", 0)
    pick = lambda z: next_tokens(z, temperature, False, top_k, 1.0, generator)  # noqa: E731
    done = decode(decoder, PROMPTS, Sampling(samples, 10), pick, static=static)
    assert len(done.token_ids) == len(PROMPTS) * samples
    assert any(reason == "stop" for reason in done.finish_reasons)  # rows ended before the others
    worst = 0.0
    for row, (tokens, logprobs) in enumerate(zip(done.token_ids, done.logprobs)):
        prompt = PROMPTS[row // samples]
        assert len(tokens) == len(logprobs) and (tokens[-1] in (0, 1)) == (done.finish_reasons[row] == "stop")
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()
        full = torch.log_softmax(logits / temperature, -1).gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)
        worst = max(worst, (full - torch.tensor(logprobs)).abs().max().item())
    return worst


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("family", ["qwen2", "llama", "qwen3", "mistral"])
def test_recorded_logprobs_are_the_forward_ones(family: str, static: bool):
    assert recorded_against_forward(tiny(family), samples=4, temperature=0.8, static=static) < 1e-5


@pytest.mark.parametrize("static", [False, True])
def test_a_lora_model_decodes_through_its_adapters(static: bool):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny("qwen2"), LoraConfig(r=4, target_modules=["q_proj", "v_proj", "up_proj"],
                                                     init_lora_weights=False))  # fmt: skip
    assert recorded_against_forward(model.eval(), samples=3, temperature=1.0, static=static, top_k=5) < 1e-5


def test_fixed_shapes_decode_what_rows_leaving_the_batch_decode():
    """The GPU's static steps and the CPU's shrinking batch: the same greedy tokens, ends and log-probs."""
    decoder = decoder_of(tiny("llama"), 32, {0, 1}, 23)
    greedy = lambda z: next_tokens(z, greedy=True)  # noqa: E731
    shrinking, static = (decode(decoder, PROMPTS, Sampling(2, 10), greedy, static=s) for s in (False, True))
    assert static.token_ids == shrinking.token_ids and static.finish_reasons == shrinking.finish_reasons
    assert "stop" in static.finish_reasons and "length" in static.finish_reasons
    for a, b in zip(static.logprobs, shrinking.logprobs):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-5)


def test_greedy_takes_the_argmax():
    model = tiny("llama")
    done = decode(decoder_of(model, 32, {0}, 23), PROMPTS, Sampling(1, 6), lambda z: next_tokens(z, greedy=True))
    for prompt, tokens in zip(PROMPTS, done.token_ids):
        ids = list(prompt)
        for token in tokens:
            with torch.no_grad():
                assert token == int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
            ids.append(token)


def test_draws_follow_the_distribution_top_k_and_top_p_leave():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 3.0]]).repeat(100_000, 1)
    full = torch.softmax(logits[0], -1)
    expected = {
        (0, 1.0): full,
        (2, 1.0): torch.tensor([full[0], 0, 0, 0, full[4]]) / (full[0] + full[4]),
        (0, 0.7): torch.tensor([full[0], 0, 0, 0, full[4]]) / (full[0] + full[4]),  # the token crossing 0.7 stays
    }
    for (top_k, top_p), probabilities in expected.items():
        tokens, logprobs = next_tokens(logits, 1.0, False, top_k, top_p, torch.Generator().manual_seed(1))
        frequencies = torch.bincount(tokens, minlength=5).double() / len(tokens)
        assert (frequencies - probabilities).abs().max() < 0.005, (top_k, top_p, frequencies)
        assert torch.allclose(logprobs, full.log()[tokens], atol=1e-6)  # the unfiltered distribution's


def test_the_torch_engine_decodes_with_it_unless_a_rollout_is_partial(monkeypatch):
    """complete takes this loop in batches of sampling.batch_size rows, the rollout producer's `on_groups`
    included: each group handed over once, at the step that ends its last row, with the completions the
    call returns; a partial rollout (`refresh`) takes Hugging Face's forward (torch_engine.hf_decode)."""
    from rlpipe.engines import torch_engine

    calls = []
    monkeypatch.setattr(torch_engine, "decode", lambda *a, **k: calls.append(len(a[1])) or decode(*a, **k))
    loaded = LoadedModel(tiny("qwen2"), Tokens())
    sampling = Sampling(2, 4, batch_size=4)
    done = torch_engine.complete(loaded, PROMPTS, sampling, torch.Generator().manual_seed(0))
    assert calls == [2, 1] and len(done.token_ids) == 6  # two prompts' groups a batch
    published = []
    handed = torch_engine.complete(
        loaded, PROMPTS, sampling, torch.Generator().manual_seed(0), on_groups=lambda g, c: published.append((g, c))
    )
    assert calls == [2, 1, 2, 1] and (handed.token_ids, handed.logprobs) == (done.token_ids, done.logprobs)
    assert sorted(g for groups, _ in published for g in groups) == [0, 1, 2]
    for groups, completions in published:
        rows = [g * 2 + k for g in groups for k in range(2)]
        assert completions.token_ids == [done.token_ids[r] for r in rows]
        assert completions.logprobs == [done.logprobs[r] for r in rows]
        assert completions.finish_reasons == [done.finish_reasons[r] for r in rows]


class Tokens:
    eos_token_id, pad_token_id = 0, 23


def test_architectures_it_does_not_run_decode_with_hugging_faces_forward():
    import transformers

    windowed = transformers.MistralConfig(**{**SIZES, "sliding_window": 16})
    assert decoder_of(transformers.MistralForCausalLM(windowed), 32, {0}, 23) is None  # past its window
    assert decoder_of(transformers.MistralForCausalLM(windowed), 16, {0}, 23) is not None
    gemma = transformers.GemmaConfig(**SIZES, head_dim=16)  # scales its embeddings: not these layers
    assert decoder_of(transformers.GemmaForCausalLM(gemma), 32, {0}, 23) is None
