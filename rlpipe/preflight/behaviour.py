"""What the loop runs: the algorithm, the rewards, the environment, the evaluation and its gate, and the steps
cluster.secrets names."""

from __future__ import annotations

import importlib.util
import re
from typing import Any

from rlpipe.preflight.inputs import tokenizer_is_local
from rlpipe.preflight.probe import CheckFailed
from rlpipe.spec import RunSpec


def check_algorithm(spec: RunSpec) -> str:
    """algorithm.name is registered (or its module registers it), and it reads every option set."""
    from rlpipe.algorithms import get_algorithm, resolve_options
    from rlpipe.dpo_loop import check_dpo_spec, is_offline_dpo

    try:
        algorithm = get_algorithm(spec.algorithm.name)
        resolve_options(spec)
        if is_offline_dpo(spec):
            check_dpo_spec(spec)
    except ValueError as err:
        raise CheckFailed(str(err)) from None
    return f"algorithm {algorithm.name}"


def check_secrets(spec: RunSpec) -> str:
    """cluster.secrets gives each secret to steps that exist (rlpipe.steps.check_secret_steps)."""
    from rlpipe.steps import check_secret_steps

    try:
        check_secret_steps(spec)
    except ValueError as err:
        raise CheckFailed(str(err)) from None
    return f"cluster.secrets: {len(spec.cluster.secrets)}, each for steps of the pipeline"


def _sample_columns(spec: RunSpec) -> tuple[list[str], list[str], dict[str, list], list[dict]]:
    """A few train rows laid out as the score step hands them to reward functions (rollout columns
    and the data's), each with the warm start's completion (when the columns make one) and an empty
    one; and a few held-out rows for the verifier."""
    from rlpipe.data import task_rows
    from rlpipe.rollouts import ROLLOUT_SCHEMA

    train, held_out = task_rows(spec)
    rows = [row for row in train[:2] for _ in range(2)]
    completions = [_completion(row, spec) if i % 2 == 0 else "" for i, row in enumerate(rows)]
    n = len(rows)
    columns: dict[str, list[Any]] = {
        "prompt_id": list(range(n)),
        "group_id": [i // 2 for i in range(n)],
        "sample_index": [i % 2 for i in range(n)],
        "prompt_token_ids": [[] for _ in rows],
        "completion_token_ids": [[] for _ in rows],
        "logprobs": [[] for _ in rows],
        "finish_reason": ["stop"] * n,
        "weights_version": [0] * n,
        "iteration": [1] * n,
    }
    columns |= {k: [row.get(k) for row in rows] for k in rows[0] if k not in ROLLOUT_SCHEMA.names}
    if spec.rollout.environment is not None:  # trajectories carry their environment's reward ({type: environment})
        columns |= {"environment_reward": [0.0] * n, "environment_error": [""] * n}
    return [str(row.get(spec.data.prompt, "")) for row in rows], completions, columns, held_out[:4]


def _completion(row: dict, spec: RunSpec) -> str:
    try:
        return spec.model.warm_start.completion.format(**row)
    except (KeyError, IndexError, ValueError):
        return ""


def check_rewards(spec: RunSpec) -> str:
    """Every reward function and the verifier import and score a tiny sample."""
    from rlpipe.rewards import RewardError, call_reward

    try:
        prompts, completions, columns, held_out = _sample_columns(spec)
    except ValueError:
        raise CheckFailed("reward: not checked, the data gave no sample rows (see data above)") from None
    problems = []
    for target in spec.reward.functions:
        try:
            call_reward(target, prompts, completions, columns, "reward.functions", spec.reward.timeout_s)
        except RewardError as err:
            problems.append(str(err))
    verifier_columns = {key: [row[key] for row in held_out] for key in held_out[0] if key != "prompt"}
    try:
        scores = call_reward(
            spec.reward.verifier,
            [str(row.get(spec.data.prompt, "")) for row in held_out],
            [_completion(row, spec) for row in held_out],
            verifier_columns,
            "reward.verifier",
            spec.reward.timeout_s,
        )
    except RewardError as err:
        problems.append(str(err))
    else:
        if not all(0.0 <= s <= 1.0 for s in scores):
            problems.append(f"reward.verifier: {spec.reward.verifier} returned {scores}; a verifier returns 0..1")
    if problems:
        raise CheckFailed("\n    ".join(problems))
    names = ", ".join(f if isinstance(f, str) else str(f.get("type")) for f in spec.reward.functions)
    return f"rewards {names} and verifier {spec.reward.verifier} score a sample"


def check_environment(spec: RunSpec) -> str:
    """rollout.environment builds, each of its stop strings is one token of the model's tokenizer, a
    remote one's service and an OpenEnv server answer, and an MCP server starts and lists its tools."""
    environment = spec.rollout.environment
    if environment is None:
        return "environment: none (single-turn rollouts)"
    from rlpipe.environments import Codec, environment_factory, stop_token_ids
    from rlpipe.models.files import load_prompt_tokenizer

    try:
        built = environment_factory(environment)()
        if tokenizer_is_local(spec):
            tokenizer = load_prompt_tokenizer(spec.model.path, spec.cache_root).tokenizer
            codec = Codec(lambda text: tokenizer.encode(text, add_special_tokens=False).ids, tokenizer.decode)
            stop_token_ids(codec, tuple(built.stop))
        built.close()
    except ValueError as err:
        raise CheckFailed(str(err)) from None
    service = ""
    if environment.type == "remote":  # any answer will do: the service is there
        from rlpipe.http_json import Unreachable, request_json

        url = environment.options["url"].rstrip("/")
        try:
            request_json("GET", f"{url}/health", connect_timeout_s=5, read_timeout_s=5)
        except Unreachable as err:
            raise CheckFailed(
                f"rollout.environment.options.url {url} is not reachable ({err}); start the environment "
                "service (rlpipe serve-environment) or fix the URL"
            ) from None
        service = f", service {url} answers"
    if environment.type == "openenv":
        service = f", OpenEnv server {openenv_answers(environment.options['url'].rstrip('/'))} answers"
    if environment.type == "tools" and "mcp" in environment.options:  # the server starts and lists its tools
        from rlpipe.environments import EnvironmentFailure
        from rlpipe.environments.mcp_tools import listed_tools, mcp_server

        try:
            names = listed_tools(mcp_server(environment.options["mcp"], "rollout.environment.options.mcp"))
        except EnvironmentFailure as err:
            raise CheckFailed(f"rollout.environment.options.mcp: {err}") from None
        service = f", MCP tools {', '.join(names)}"
    stops = list(built.stop)
    return f"environment {environment.type}: turns end at eos or {stops}, at most {environment.max_turns}{service}"


OPENENV_PROBE_S = 3.0  # for connecting, and for the answer: not the run's options.timeout_s (30 s, retried)


def openenv_answers(url: str) -> str:
    """`url` when an OpenEnv server (openenv-core's create_app) answers GET {url}/health with 200 within
    OPENENV_PROBE_S; else CheckFailed naming rollout.environment.options.url."""
    from rlpipe.http_json import Unreachable, request_json

    try:
        status, _ = request_json(
            "GET", f"{url}/health", connect_timeout_s=OPENENV_PROBE_S, read_timeout_s=OPENENV_PROBE_S
        )
        reason = "" if status == 200 else f"GET {url}/health answered HTTP {status}"
    except Unreachable as err:
        reason = str(err)
    if reason:
        raise CheckFailed(
            f"rollout.environment.options.url {url}: no OpenEnv server answers there ({reason}); start the "
            "environment server or fix rollout.environment.options.url"
        )
    return url


def check_evaluation(spec: RunSpec) -> str:
    """loop.stop_when names a metric the spec's evals record (else the loop never stops), and
    evaluation.harness's tasks exist in lm_eval's registry or its include_path."""
    problems = []
    if spec.loop.stop_when and (problem := gate_problem(spec)):
        problems.append(problem)
    harness = spec.evaluation.harness
    if harness is not None and importlib.util.find_spec("lm_eval") is None:
        if not (spec.trainer.resident and spec.trainer.endpoint):  # the evaluate step runs here
            problems.append(
                "evaluation.harness runs EleutherAI's lm-evaluation-harness, which is not installed: "
                "pip install -e '.[harness]', or remove evaluation.harness"
            )
    elif harness is not None:
        from lm_eval.tasks import TaskManager

        from rlpipe.evaluation.harness import task_manager, unknown_tasks

        try:
            manager = task_manager(TaskManager, harness.include_path, harness.tasks)
        except Exception as err:  # noqa: BLE001 (a task YAML lm_eval cannot read)
            problems.append(f"evaluation.harness.include_path {harness.include_path}: lm_eval cannot index it ({err})")
        else:
            if problem := unknown_tasks(harness, manager.all_tasks):
                problems.append(problem)
    if problems:
        raise CheckFailed("\n    ".join(problems))
    gate = f"loop.stop_when {spec.loop.stop_when!r}" if spec.loop.stop_when else "no eval gate"
    return f"evaluation: {gate}" + (f", harness tasks {list(harness.tasks)}" if harness else "")


def gate_problem(spec: RunSpec) -> str | None:
    """What to change when loop.stop_when names a metric no eval of the spec records, or None. A harness
    metric, harness/<task>/<metric>, is known only once lm_eval ran: its task is one of evaluation.harness's
    (or of a group there: its name extends the group's)."""
    import difflib

    from rlpipe.evaluation.accuracy import recorded_metrics
    from rlpipe.evaluation.stopping import parse_gate

    assert spec.loop.stop_when is not None  # check_evaluation asks only of a set gate
    name, _, _ = parse_gate(spec.loop.stop_when)
    harness = spec.evaluation.harness
    if name.startswith("harness/"):
        task = name.split("/")[1] if name.count("/") >= 2 else ""
        tasks = list(harness.tasks) if harness else []
        if any(task.startswith(listed) for listed in tasks):
            return None
        return (
            f"loop.stop_when {spec.loop.stop_when!r}: {name} is harness/<task>/<metric> of a task that "
            f"evaluation.harness.tasks ({tasks or 'no harness section'}) does not run, so the loop would never "
            "stop; name one of its tasks, or add the task to evaluation.harness.tasks"
        )
    recorded = recorded_metrics(spec)
    if name in recorded:
        return None
    sets = [held_out.name for held_out in spec.evaluation.sets]
    parts = name.split("/")
    hint = ""
    if len(parts) == 3 and parts[0] == "eval" and parts[1] not in sets:
        hint = f" (evaluation.sets has no set named {parts[1]!r}; its sets: {sets or 'none'})"
    elif parts[0] == "eval" and (sampled := re.fullmatch(r"(?:pass|mean|maj)_at_(\d+)", parts[-1])):
        key = "evaluation.samples" if len(parts) == 2 else f"the samples of evaluation.sets' {parts[1]}"
        hint = f" ({parts[-1]} needs {key}: {sampled.group(1)})"
    elif close := difflib.get_close_matches(name, recorded, 1):
        hint = f" (did you mean {close[0]}?)"
    harness_names = ", and harness/<task>/<metric> of evaluation.harness.tasks" if harness else ""
    return (
        f"loop.stop_when {spec.loop.stop_when!r}: no eval of this spec records {name}, so the loop would never "
        f"stop{hint}. Its evals record {', '.join(recorded)}{harness_names}"
    )
