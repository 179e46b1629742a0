"""The log-probs check: a replica must report log-probs at rollout.temperature (log softmax(z / T), as the
trainer computes them), not at temperature 1, or every importance ratio compares two distributions. Each
replica is probed once per temperature before it first samples for a run."""

from __future__ import annotations

import requests

from rlpipe.engines.sampler_requests import SamplerError, post, sampled_choices
from rlpipe.store.run_root import join, read_json, write_json

PROBE = {"n": 4, "max_tokens": 8, "logprobs": 2, "seed": 0, "detokenize": False}
LOGPROBS_CHECKED = "logprobs_checked.json"  # <run root>/samplers/: {replica URL: the temperature it passed at}


def logprob_gaps(choice: dict, prompt_logprobs: list[dict | None], prompt_length: int) -> list[tuple[float, float]]:
    """At each completion position of `choice`, (reported gap, temperature-1 gap): the sampled token's log-prob
    minus another token's, as the choice reports them and as the prompt log-probs of prompt + completion have
    them. vLLM computes prompt log-probs from the raw logits whatever its --logprobs-mode: at temperature 1."""
    gaps = []
    for position, entry in enumerate(choice["logprobs"]["content"]):
        listed = prompt_logprobs[prompt_length + position] or {}
        at_one = {int(token): value["logprob"] for token, value in listed.items()}
        sampled = entry["token_id"]
        for other in entry.get("top_logprobs") or []:
            if other["token_id"] != sampled and {sampled, other["token_id"]} <= at_one.keys():
                reported = entry["logprob"] - other["logprob"]
                gaps.append((reported, at_one[sampled] - at_one[other["token_id"]]))
    return gaps


def at_temperature(gaps: list[tuple[float, float]], temperature: float) -> bool | None:
    """Whether the reported log-probs are log softmax(z / T), as the trainer computes them, rather than log
    softmax(z): the gap between two tokens is then (z_a - z_b) / T, the temperature-1 gap over T, where
    temperature-1 log-probs report that gap itself. Judged by which of the two the gaps are nearer; None
    without a gap to judge by."""
    if not gaps:
        return None
    scaled = sum(abs(reported - at_one / temperature) for reported, at_one in gaps)
    unscaled = sum(abs(reported - at_one) for reported, at_one in gaps)
    return scaled < unscaled


def probe_logprobs(url: str, prompt: list[int], temperature: float, timeout_s: float) -> bool | None:
    """at_temperature for a few completions of `prompt` the replica samples at `temperature`."""
    with requests.Session() as session:
        choices = sampled_choices(url, session, prompt, {**PROBE, "temperature": temperature}, timeout_s, None)
    gaps = []
    for choice in choices:
        params = {"max_tokens": 1, "prompt_logprobs": PROBE["logprobs"], "detokenize": False}
        body = {"token_ids": prompt + choice["token_ids"], "sampling_params": params, "output_mode": "tokens"}
        response = post(url, "/inference/v1/generate", timeout_s, json=body)
        gaps += logprob_gaps(choice, response.json()["prompt_logprobs"], len(prompt))
    return at_temperature(gaps, temperature)


def check_logprobs(urls: list[str], run_root: str, prompt: list[int], temperature: float, timeout_s: float) -> None:
    """Refuse replicas that report log-probs at temperature 1 rather than at rollout.temperature (a vLLM server
    started without --logprobs-mode processed_logprobs): the trainer's importance ratios and mismatch/ metrics
    would compare two distributions. Each replica is probed once per temperature, before it first samples for
    the run (<run root>/samplers/logprobs_checked.json; a probe with no gap to judge by is repeated at the next
    generate); at temperature 1 the two agree."""
    if temperature == 1.0:
        return
    record = join(run_root, "samplers", LOGPROBS_CHECKED)
    checked = read_json(record) or {}
    wrong = []
    for url in [u for u in urls if checked.get(u) != temperature]:
        try:
            verdict = probe_logprobs(url, prompt, temperature, timeout_s)
        except (requests.RequestException, KeyError, TypeError) as err:
            why = f"{type(err).__name__}: {err}"
            raise SamplerError(f"sampler {url} failed the log-probs check ({why}); rerun to resume") from None
        if verdict is False:
            wrong.append(url)
        elif verdict:
            checked[url] = temperature
            write_json(record, checked)
    if wrong:
        who = f"sampler {wrong[0]} reports" if len(wrong) == 1 else f"samplers {', '.join(wrong)} report"
        raise SamplerError(
            f"{who} log-probs at temperature 1, not at rollout.temperature "
            f"{temperature:g}, so every importance ratio would be off: restart it with --logprobs-mode "
            "processed_logprobs (vLLM's default, raw_logprobs, ignores the temperature), then rerun to resume."
        )
