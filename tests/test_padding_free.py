"""Padding-free micro-batches (trainer.padding_free): rows packed end to end with position ids compute what
the same rows compute right-padded — log-probs, entropies, gradients, a whole update — for grouped-query
attention, sliding windows shorter than a row, gradient checkpointing's recomputed forwards and a critic;
the token budget counts the rows' tokens; a model that cannot attend within packed rows is refused by name."""

import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForTokenClassification, MistralConfig, MistralForCausalLM, Qwen2ForCausalLM

from rlpipe.models.loading import build_char_tokenizer, build_tiny_model
from rlpipe.spec import TinyModelSpec, parse_spec
from rlpipe.training.batching import micro_batches, pack, row_length
from rlpipe.training.critic import token_values
from rlpipe.training.logprobs import completion_logprobs, completion_logprobs_and_entropy
from rlpipe.training.packed_attention import PACKED, packable, use_packed_attention
from rlpipe.training.trainer import packs_rows, train_on_batch

from .conftest import tiny_spec_dict
from .test_precision_and_memory import _batch, _make, _params


def _rows(count: int, seed: int = 0) -> list[dict]:
    """Rows of varied lengths, several of each length (the CPU path batches rows of one length)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        prompt = [1] + [rng.randrange(4, 19) for _ in range(rng.choice([3, 5, 8]))]
        completion = [rng.randrange(4, 19) for _ in range(rng.choice([1, 4, 6, 11]))]
        rows.append({"prompt_token_ids": prompt, "completion_token_ids": completion, "advantage": rng.uniform(-1, 1)})
    return rows


def _tiny() -> Qwen2ForCausalLM:
    spec = TinyModelSpec(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2, num_kv_heads=1)
    return build_tiny_model(spec, build_char_tokenizer(), seed=0)


def _sliding() -> MistralForCausalLM:
    """Grouped-query attention with a 4-token window: most rows are longer than it."""
    torch.manual_seed(0)
    config = MistralConfig(
        vocab_size=20, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=4, attn_implementation="sdpa",
    )  # fmt: skip
    return MistralForCausalLM(config)


def _logprobs_and_grads(model, mb, chunk_tokens):
    model.zero_grad()
    logprobs, entropy = completion_logprobs_and_entropy(model, mb, 1.0, chunk_tokens, entropy_grad=True)
    ((logprobs - 0.1 * entropy) * mb.completion_mask * mb.advantages).sum().backward()
    return logprobs.detach(), entropy.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("make", [_tiny, _sliding], ids=["qwen2", "mistral_window_4"])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_packed_rows_compute_what_padded_rows_compute(make, checkpointing: bool):
    model = make().train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert packable(model) is None
    use_packed_attention(model)
    assert model.config._attn_implementation == PACKED
    rows = _rows(24)
    padded, packed = pack(rows, pad_id=0), pack(rows, pad_id=0, packed=True)
    assert packed.input_ids.shape == (1, sum(map(row_length, rows))) and packed.attention is None
    assert padded.input_ids.numel() > packed.input_ids.numel() and packed.tokens == padded.tokens
    assert torch.equal(packed.targets * packed.completion_mask, padded.targets * padded.completion_mask)
    for chunk_tokens in (512, 7, None):  # the head on hidden states in chunks, or whole logits
        expected = _logprobs_and_grads(model, padded, chunk_tokens)
        found = _logprobs_and_grads(model, packed, chunk_tokens)
        mask = padded.completion_mask.bool()
        torch.testing.assert_close(found[0][mask], expected[0][mask], atol=2e-5, rtol=0)
        torch.testing.assert_close(found[1][mask], expected[1][mask], atol=2e-5, rtol=0)
        for name, grad in expected[2].items():
            torch.testing.assert_close(found[2][name], grad, atol=2e-5, rtol=1e-4, msg=name)
    # after packing, padded rows (sampling, evaluation) still get sdpa's masks: every row alone agrees
    together = completion_logprobs(model, rows, pad_id=0, temperature=1.0)
    for row, found in zip(rows[:4], together, strict=False):
        alone = completion_logprobs(model, [row], pad_id=0, temperature=1.0)[0]
        torch.testing.assert_close(torch.tensor(found), torch.tensor(alone), atol=2e-5, rtol=0)


def test_a_critic_values_packed_rows_as_padded_ones():
    torch.manual_seed(0)
    config = _tiny().config
    config.num_labels = 1
    critic = AutoModelForTokenClassification.from_config(config).eval()
    use_packed_attention(critic)
    rows = _rows(12, seed=1)
    padded, packed = pack(rows, pad_id=0), pack(rows, pad_id=0, packed=True)
    with torch.no_grad():
        expected, found = token_values(critic, padded), token_values(critic, packed)
    mask = padded.completion_mask.bool()
    torch.testing.assert_close(found[mask], expected[mask], atol=2e-5, rtol=0)


def test_packed_micro_batches_count_the_rows_tokens():
    rows = _rows(40, seed=2)
    for unit in (1, 2):
        groups = micro_batches(rows, 60, unit=unit, packed=True)
        assert sorted(map(id, (r for g in groups for r in g))) == sorted(map(id, rows))  # every row once
        for group in groups:
            assert sum(map(row_length, group)) <= 60 or len(group) == unit
        pairs = {(id(rows[i]), id(rows[i + 1])) for i in range(0, len(rows), 2)}
        assert unit == 1 or all((id(g[i]), id(g[i + 1])) in pairs for g in groups for i in range(0, len(g), 2))
    short, long = ({"prompt_token_ids": [1] * n, "completion_token_ids": [2]} for n in (1, 9))
    assert micro_batches([short, long], 12) == [[short], [long]]  # padded: 2 rows x 10 > 12
    assert micro_batches([short, long], 12, packed=True) == [[short, long]]  # packed: 2 + 10 tokens


@pytest.mark.parametrize("aggregation", ["sequence_mean", "token_mean"])
def test_a_packed_update_is_the_padded_update(tmp_path: Path, aggregation: str):
    """The whole update (2 optimizer steps, micro-batches, a KL to the reference): the same metrics and weights."""
    batch = _batch(tmp_path)
    algorithm = {"loss_aggregation": aggregation, "kl_coef": 0.05, "track_reference_kl": True}
    trained = {}
    for padding_free in (False, True):
        settings = {"mini_batches": 2, "warmup_steps": 0, "lr": 0.05, "micro_batch_tokens": 60}
        trainer = _make(parse_spec(tiny_spec_dict(tmp_path, algorithm=algorithm, trainer=settings | {
            "padding_free": padding_free}))
        )  # fmt: skip
        trainer.packed = packs_rows(trainer)
        assert trainer.packed is padding_free
        trained[padding_free] = train_on_batch(trainer, batch, iteration=1), _params(trainer)
    (padded, padded_weights), (packed, packed_weights) = trained[False], trained[True]
    assert packed["policy/micro_batches"] < padded["policy/micro_batches"]
    assert packed["policy/padding_share"] == 0 < padded["policy/padding_share"]
    for key in ("policy/loss", "policy/grad_norm", "policy/entropy", "kl/mean", "policy/ratio_mean"):
        assert packed[key] == pytest.approx(padded[key], rel=1e-4, abs=1e-6), key
    for name, weight in padded_weights.items():
        torch.testing.assert_close(packed_weights[name], weight, rtol=1e-4, atol=1e-5, msg=name)


def test_padding_free_true_refuses_a_model_that_cannot_attend_within_packed_rows(tmp_path: Path):
    trainer = _make(parse_spec(tiny_spec_dict(tmp_path, trainer={"padding_free": True})))
    trainer.policy.set_attn_implementation("eager")
    refused = r"trainer.padding_free: true.*'eager', not sdpa.*set trainer.padding_free to false"
    with pytest.raises(ValueError, match=refused):
        packs_rows(trainer)
    default = _make(parse_spec(tiny_spec_dict(tmp_path)))
    assert packs_rows(default) is False and default.policy.config._attn_implementation == "sdpa"  # padded
