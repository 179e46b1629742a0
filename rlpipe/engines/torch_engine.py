"""The torch generation engine: batched sampling with a KV cache, recording sampling log-probs."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable, Protocol

import torch

from rlpipe.engines import LoadedModel, Sampled, SampleRequest, Sampling, sampled_trajectories
from rlpipe.engines.decode import GroupPublisher, decode, decoder_of, filter_logits, left_padded, next_tokens
from rlpipe.environments import Codec, environment_factory, run_trajectories
from rlpipe.rollouts import Completions

if TYPE_CHECKING:  # transformers is imported through rlpipe.models.loading (rlpipe.models.optional_imports)
    from transformers import PreTrainedModel

    from rlpipe.environments import Trajectory
    from rlpipe.spec import EnvironmentSpec


def generation_end_ids(model: PreTrainedModel) -> set[int]:
    """The ids the model's generation_config ends generation at (eos_token_id: an int or a list), where
    vLLM stops too: a chat model's end of turn (Llama 3's <|eot_id|>, Gemma's <end_of_turn>) besides its
    tokenizer's eos."""
    ends = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if ends is None:
        return set()
    return {int(end) for end in ([ends] if isinstance(ends, int) else ends)}


@torch.no_grad()
def hf_decode(
    model: PreTrainedModel,
    prompts: list[list[int]],
    max_new_tokens: int,
    eos_id: int,
    pad_id: int,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    greedy: bool = False,
    generator: torch.Generator | None = None,
    bf16: bool = False,
    samples: int = 1,
    stop_ids: set[int] | frozenset[int] = frozenset(),
    refresh: Refresh | None = None,
    on_groups: Callable[[list[int], Completions], None] | None = None,
) -> Completions:
    """Sample `samples` completions per prompt, prompt-major, each through its first end: eos or a stop id
    (generation_config's end ids, a multi-turn environment's end of turn: the callers'). Prompts are
    left-padded so every row's last prompt token sits at the same column; each is prefilled once and its KV
    cache repeated for its `samples` rows. The recorded log-prob is log softmax(logits / T) at the sampled
    token: the distribution the update recomputes (top-k/top-p only restrict which tokens can be drawn).
    `bf16`: forward passes autocast to bfloat16, as the update's are with trainer.dtype bfloat16 (log-probs
    still taken in fp32).
    `refresh` (partial rollouts): asked between decode steps; once it returns a newer version's (model,
    version), the rows go on under it (`prefilled_again`), each token's version in `token_versions`.
    `on_groups` (the rollout producer's): each group handed over as it finishes (`GroupPublisher`)."""
    rows = len(prompts)
    device = model.device  # `generator`, when given, lives there too
    input_ids, attention = (t.to(device) for t in left_padded(prompts, pad_id))
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16)
    with autocast:  # logits of the last position only: all of them are rows x width x vocab (40 GB at 512 x 256 x 152k)
        out = model(
            input_ids=input_ids, attention_mask=attention, position_ids=positions, use_cache=True, logits_to_keep=1
        )
    cache, logits = out.past_key_values, out.logits[:, -1, :]
    if samples > 1:
        cache.batch_repeat_interleave(samples)
        logits, attention, positions = (t.repeat_interleave(samples, dim=0) for t in (logits, attention, positions))
        rows *= samples
    next_position = positions[:, -1:] + 1
    ends_set = {eos_id, *stop_ids}
    ends = torch.tensor(sorted(ends_set), device=device)
    finished = torch.zeros(rows, dtype=torch.bool, device=device)
    version = refresh.version if refresh is not None else 0
    tokens, logprobs = [], []  # per decode step: [rows] tokens, log-probs; the version sampling
    step_versions: list[int] = []
    versions = step_versions if refresh else None  # recorded for partial rollouts only
    publish = GroupPublisher(on_groups, samples, rows) if on_groups is not None else None
    for _ in range(max_new_tokens):
        logp = torch.log_softmax(logits.float() / temperature, dim=-1)
        if greedy:
            token = logp.argmax(-1)
        else:
            allowed = filter_logits(logp, top_k, top_p)
            token = torch.multinomial(torch.softmax(allowed, dim=-1), 1, generator=generator).squeeze(-1)
        token = torch.where(finished, torch.full_like(token, pad_id), token)
        tokens.append(token)
        logprobs.append(logp.gather(-1, token.unsqueeze(-1)).squeeze(-1))
        step_versions.append(version)
        finished |= torch.isin(token, ends)
        if publish is not None:
            publish(finished, steps_completions(tokens, logprobs, ends_set, versions))
        if bool(finished.all()):
            break
        attention = torch.cat([attention, attention.new_ones((rows, 1))], dim=-1)
        swapped = refresh.newer() if refresh is not None else None
        with autocast:
            if swapped is not None:
                model, version = swapped
                out = prefilled_again(model, input_ids.repeat_interleave(samples, dim=0), tokens, attention)
            else:
                decode_inputs = {"attention_mask": attention, "position_ids": next_position, "past_key_values": cache}
                out = model(input_ids=token.unsqueeze(-1), use_cache=True, **decode_inputs)
        cache, logits = out.past_key_values, out.logits[:, -1, :]
        next_position = next_position + 1
    if publish is not None:  # the groups that ran to max_new_tokens
        publish(torch.ones_like(finished), steps_completions(tokens, logprobs, ends_set, versions))
    return completions_through_end(tokens, logprobs, ends_set, versions)


def prefilled_again(
    model: PreTrainedModel, prompt_ids: torch.Tensor, tokens: list[torch.Tensor], attention: torch.Tensor
) -> Any:
    """The sequences so far (prompts, then the decode steps' tokens) through `model`, a newer version:
    its KV cache and next-token logits, so every later token is that version's alone."""
    sequences = torch.cat([prompt_ids, torch.stack(tokens, dim=1)], dim=-1)
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    return model(
        input_ids=sequences, attention_mask=attention, position_ids=positions, use_cache=True, logits_to_keep=1
    )


def steps_completions(
    tokens: list[torch.Tensor], logprobs: list[torch.Tensor], end_ids: set[int], step_versions: list[int] | None
) -> Callable[[torch.Tensor], Completions]:
    """The completions of the rows indexed, from the decode steps so far (what GroupPublisher hands over)."""
    return lambda at: completions_through_end(
        [t[at] for t in tokens], [lp[at] for lp in logprobs], end_ids, step_versions
    )


def completions_through_end(
    tokens: list[torch.Tensor], logprobs: list[torch.Tensor], end_ids: set[int], step_versions: list[int] | None
) -> Completions:
    """Each row's decode-step tokens (and log-probs, versions) through its first end id: "stop" when it
    sampled one, else "length"."""
    result = Completions([], [], [], [] if step_versions is not None else None)
    for row_tokens, row_logprobs in zip(torch.stack(tokens, dim=1).tolist(), torch.stack(logprobs, dim=1).tolist()):
        end = next((k + 1 for k, token in enumerate(row_tokens) if token in end_ids), len(row_tokens))
        stopped = bool(row_tokens) and row_tokens[end - 1] in end_ids
        result.token_ids.append(row_tokens[:end])
        result.logprobs.append(row_logprobs[:end])
        result.finish_reasons.append("stop" if stopped else "length")
        if result.token_versions is not None and step_versions is not None:  # both or neither
            result.token_versions.append(step_versions[:end])
    return result


class Refresh(Protocol):
    """A partial rollout's view of the published versions (rlpipe.services.producer.server.LatestVersion): `model` at
    `version`, the one held; `newer()`, between decode steps: (model, version) once it has loaded a newer
    one, else None."""

    model: PreTrainedModel
    version: int

    def newer(self) -> tuple[PreTrainedModel, int] | None: ...


def hf_decode_in_batches(
    model: PreTrainedModel, prompts: list[list[int]], batch_size: int, samples: int = 1, **kwargs
) -> Completions:
    """`samples` completions per prompt (prompt-major), `hf_decode` over chunks of at most `batch_size`
    rows (bounds activation and KV-cache memory): whole groups when a batch holds one, else the
    prompts repeated (and `on_groups` is not called: the caller takes the groups at the end). A batch
    after a `refresh` swapped the weights starts with the new model."""
    if samples > batch_size:
        kwargs.pop("on_groups", None)
        prompts, samples = [ids for ids in prompts for _ in range(samples)], 1
    per_batch = batch_size // samples
    refresh, on_groups = kwargs.get("refresh"), kwargs.pop("on_groups", None)
    result = Completions([], [], [], [] if refresh is not None else None)
    for start in range(0, len(prompts), per_batch):
        current = refresh.model if refresh is not None else model
        batch = prompts[start : start + per_batch]
        result.extend(hf_decode(current, batch, samples=samples, on_groups=batch_on_groups(on_groups, start), **kwargs))
    return result


def batch_on_groups(
    on_groups: Callable[[list[int], Completions], None] | None, start: int
) -> Callable[[list[int], Completions], None] | None:
    """`on_groups` for a batch whose first prompt is prompt `start` of the call's: its group indices shifted."""
    if on_groups is None:
        return None
    return lambda groups, done: on_groups([start + g for g in groups], done)


def complete(
    loaded: LoadedModel,
    prompts: list[list[int]],
    sampling: Sampling,
    generator: torch.Generator | None,
    greedy: bool = False,
    stop_ids: set[int] | frozenset[int] = frozenset(),
    **partial: Any,
) -> Completions:
    """`sampling.samples` completions per prompt, ending at the tokenizer's eos, the model's generation end ids
    and `stop_ids`: a Llama-family model over a preallocated KV cache (rlpipe.engines.decode), its groups
    handed to the rollout producer's `on_groups` as they end; other models, and partial rollouts (`refresh`:
    a newer version mid-batch), with `hf_decode_in_batches`."""
    model, tokenizer = loaded.model, loaded.tokenizer
    stop_ids = set(stop_ids) | generation_end_ids(model)
    length = max(map(len, prompts)) + sampling.max_new_tokens
    ends, pad_id = {tokenizer.eos_token_id, *stop_ids}, tokenizer.pad_token_id
    on_groups = partial.get("on_groups")
    if partial.get("refresh") is None and (fast := decoder_of(model, length, ends, pad_id)):

        def pick(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return next_tokens(logits, sampling.temperature, greedy, sampling.top_k, sampling.top_p, generator)

        per_batch = max(sampling.batch_size // sampling.samples, 1)  # a group larger than a batch: one batch
        result = Completions([], [], [], None)
        for start in range(0, len(prompts), per_batch):
            batch_groups = batch_on_groups(on_groups, start)
            result.extend(decode(fast, prompts[start : start + per_batch], sampling, pick, on_groups=batch_groups))
        return result
    return hf_decode_in_batches(
        model,
        prompts,
        batch_size=sampling.batch_size,
        samples=sampling.samples,
        max_new_tokens=sampling.max_new_tokens,
        eos_id=tokenizer.eos_token_id,
        pad_id=pad_id,
        temperature=sampling.temperature,
        top_k=sampling.top_k,
        top_p=sampling.top_p,
        greedy=greedy,
        generator=generator,
        bf16=sampling.bf16,
        stop_ids=stop_ids,
        **partial,
    )


def complete_groups(loaded: LoadedModel, prompt_ids: list[list[int]], sampling: Sampling, seed: int) -> Completions:
    """`sampling.samples` completions per prompt (prompt-major), drawn from a generator seeded `seed`
    (the generate step's, and offline DPO's preference sampling)."""
    generator = torch.Generator(device=loaded.model.device).manual_seed(seed)
    return complete(loaded, prompt_ids, sampling, generator, refresh=loaded.refresh, on_groups=loaded.publish)


def sample_trajectories(
    loaded: LoadedModel,
    rows: list[dict],
    sampling: Sampling,
    seed: int,
    environment: EnvironmentSpec,
    greedy: bool = False,
) -> list[Trajectory]:
    """`sampling.samples` multi-turn trajectories per row (prompt-major) against `environment`, each
    turn drawn with `hf_decode` from one generator seeded `seed` (rlpipe.environments.run_trajectories)."""
    generator = torch.Generator(device=loaded.model.device).manual_seed(seed)

    def sample_turn(sequences: list[list[int]], max_new_tokens: int, stop_ids: set[int]) -> Completions:
        turn = replace(sampling, samples=1, max_new_tokens=max_new_tokens)  # the rows are already repeated
        return complete(loaded, sequences, turn, generator, greedy, stop_ids)

    repeated = [row for row in rows for _ in range(sampling.samples)]
    prompts = [list(row["prompt_token_ids"]) for row in repeated]
    return run_trajectories(
        sample_turn,
        environment_factory(environment),
        repeated,
        prompts,
        Codec.of(loaded.tokenizer),
        environment,
        sampling.max_new_tokens,
    )


def sample_prompts(request: SampleRequest) -> Sampled:
    """rollout.samples_per_prompt completions per prompt with the policy at `weights` (`loaded`:
    one already in memory at them, the resident trainer's); with rollout.environment, multi-turn
    trajectories of `rows` (their prompt_token_ids are `prompt_ids`)."""
    from rlpipe.models.loading import load_weights

    spec, weights, loaded, rows = request.spec, request.weights, request.loaded, request.rows
    prompt_ids, iteration, cache_root = request.prompt_ids, request.stream, request.cache_root
    if loaded is None:
        loaded = LoadedModel(*load_weights(weights, cache_root, spec.trainer.threads, spec.trainer.device))
    model, tokenizer = loaded.model, loaded.tokenizer
    was_training = model.training
    model.eval()
    loaded_at = time.time()
    seed = spec.seed * 1_000_003 + iteration
    environment = spec.rollout.environment
    if environment is not None:
        trajectories = sample_trajectories(loaded, rows or [], Sampling.of(spec), seed, environment)
        model.train(was_training)
        return sampled_trajectories(trajectories, Codec.of(tokenizer), loaded_at)
    completions = complete_groups(loaded, prompt_ids, Sampling.of(spec), seed)
    model.train(was_training)
    texts = tokenizer.batch_decode(completions.token_ids, skip_special_tokens=True)
    if completions.token_versions is None:
        return Sampled(completions, texts, loaded_at, {})
    return Sampled(completions, texts, loaded_at, {}, {"token_versions": completions.token_versions})
