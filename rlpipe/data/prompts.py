"""Each row's prompt as the model sees it: the text (a column, a template over columns, or chat
messages through the tokenizer's chat template) and its token ids, computed once by prepare.

The chat template renders as transformers' `apply_chat_template(..., add_generation_prompt=True)`
does: a sandboxed jinja2 environment with trim_blocks, lstrip_blocks, loop controls, the `tojson`
filter and `raise_exception`/`strftime_now`, given `messages` and the special tokens.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from rlpipe.rollouts import ROLLOUT_SCHEMA, SCORED_COLUMNS

if TYPE_CHECKING:
    from rlpipe.models.files import PromptTokenizer
    from rlpipe.spec import DataSpec

# A data column named as a rollout column, or one the score and advantages steps add, would be
# overwritten; prepare refuses it (prompt and prompt_token_ids are the ones prepare writes).
RESERVED_COLUMNS = tuple(n for n in ROLLOUT_SCHEMA.names if n not in ("prompt", "prompt_token_ids")) + SCORED_COLUMNS


def is_chat(value: Any) -> bool:
    """Chat messages: a list of {role, content} mappings."""
    return isinstance(value, list) and bool(value) and all(isinstance(m, dict) and "role" in m for m in value)


@lru_cache(maxsize=8)
def _compiled(template: str):
    from jinja2.exceptions import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def render_chat(template: str, messages: list[dict[str, Any]], special_tokens: dict[str, str]) -> str:
    """The chat template applied to `messages`, ending with the assistant's generation prompt."""
    return _compiled(template).render(messages=messages, add_generation_prompt=True, **special_tokens)


def prompt_text(row: dict[str, Any], data: DataSpec, tokenizer: PromptTokenizer) -> tuple[str, bool]:
    """(the prompt's text, whether the chat template rendered it) for one row."""
    prompt: Any  # a column's value: text or chat messages (checked below)
    if data.prompt_template is not None:
        try:
            prompt = data.prompt_template.format(**row)
        except KeyError as err:
            raise ValueError(
                f"data.prompt_template names column {err} that the rows lack; columns: {', '.join(row)}"
            ) from None
    elif data.prompt in row:
        prompt = row[data.prompt]
    else:
        raise ValueError(
            f"data.prompt: the rows have no column {data.prompt!r}; columns: {', '.join(row)}. Set data.prompt to "
            "the prompt's column, or data.prompt_template to build it from columns"
        )
    chat = is_chat(prompt)
    use_template = data.chat_template if data.chat_template is not None else (chat or data.system_prompt is not None)
    if not use_template:
        if chat:
            raise ValueError("data.chat_template is false but the prompts are chat messages; set it to null or true")
        if not isinstance(prompt, str):
            raise ValueError(f"data.prompt: expected text or chat messages, got {type(prompt).__name__}: {prompt!r}")
        return prompt, False
    if tokenizer.chat_template is None:
        raise ValueError(
            "the prompts need a chat template (chat messages, data.system_prompt or data.chat_template: true) "
            "but the model's tokenizer has none; use a chat model or text prompts"
        )
    messages: list[dict[str, Any]] = list(prompt) if chat else [{"role": "user", "content": str(prompt)}]
    if data.system_prompt is not None and messages[0].get("role") != "system":
        messages.insert(0, {"role": "system", "content": data.system_prompt})
    return render_chat(tokenizer.chat_template, messages, tokenizer.special_tokens), True


def encode_prompts(
    rows: list[dict[str, Any]], data: DataSpec, tokenizer: PromptTokenizer
) -> tuple[list[dict[str, Any]], int]:
    """(rows with `prompt` = the rendered text and `prompt_token_ids`, prompts dropped as longer
    than data.max_prompt_tokens). A rendered chat prompt carries its own special tokens, so it is
    tokenized without adding any (as vLLM and TRL do); a text prompt gets the tokenizer's (e.g. bos)."""
    if rows:
        clashing = sorted(set(rows[0]) & set(RESERVED_COLUMNS))
        if clashing:
            raise ValueError(f"data: columns {clashing} clash with rollout columns; rename them in the data")
    kept, dropped = [], 0
    for row in rows:
        text, rendered = prompt_text(row, data, tokenizer)
        ids = tokenizer.tokenizer.encode(text, add_special_tokens=not rendered).ids
        if data.max_prompt_tokens is not None and len(ids) > data.max_prompt_tokens:
            dropped += 1
            continue
        kept.append(row | {"prompt": text, "prompt_token_ids": ids})
    return kept, dropped
