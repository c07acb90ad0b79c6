"""Prompt and training records: JSONL reading, chat messages, and the token ids the engine decodes
from or the drafter trains on.

JSONL records (one JSON object per line, blank lines skipped; an optional ``"id"``, string or int,
names a record, else its 0-based index in the file):

* ``{"prompt": "..."}``: raw text fed to the model verbatim (no template).
* ``{"turns": ["...", ...]}``: eval-set style. Decoding (DeepSpec's evaluator): messages = [the
  first turn as a user message], no system prompt, generation prompt, ``enable_thinking`` (False
  unless asked). Training: the turns alternate user/assistant, starting with the user.
* ``{"conversations": [...], "tools": [...]}``: chat messages ``{"role", "content", ...}`` (roles
  system, user, assistant, tool; other keys such as ``tool_calls`` are handed to the template) or
  ShareGPT ``{"from": "human"|"gpt"|"system"|"tool", "value"}``; ``tools`` is optional.
  ``tool_calls`` and ``tools`` may be given as JSON strings, which are decoded first. Decoding:
  trailing assistant messages (reference answers) are dropped and the generation prompt appended.

Chats are rendered with the tokenizer's chat template (:mod:`dspark_jax.formats.chat_template`) and
the text is encoded as one string, as transformers' ``apply_chat_template(tokenize=True)`` does.

Training records are built as DeepSpec's parser builds them (DESIGN §9), with the template
family's settings (:data:`~dspark_jax.formats.chat_template.FAMILIES`):

1. the family's default system prompt (Qwen: "You are a helpful assistant."; Gemma4: none) is
   prepended unless the conversation starts with its own system message;
2. after the system message the first message must be the user's;
3. every assistant message gets the family's loss prefix (Qwen: none; Gemma4: the empty thought
   channel ``<|channel>thought\\n<channel|>``) put before its text unless the text starts with it
   (with a prefix, an assistant message must have text content); then the conversation is
   rendered whole: ``add_generation_prompt=False``, ``enable_thinking`` passed only when the
   training config sets it;
4. ``input_ids = encode(text)`` (the dataset cuts them to ``max_length``);
5. for every match of the family's assistant header (Qwen: ``<|im_start|>assistant\\n``; Gemma4:
   ``<|turn>model\\n``) followed by the shortest text ending in its turn end (``<|im_end|>\\n``;
   ``<turn|>\\n``) or the end of the text, with ``content_start`` just after the header (and after
   the loss prefix when the content starts with it) and ``content_end`` at the end of the match,
   the loss mask covers tokens ``len(encode(text[:content_start]))`` to
   ``len(encode(text[:content_end]))``: the assistant's content with whatever the template put in
   it (the prefix left out), the turn end and its newline.
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dspark_jax.errors import CheckpointError, DataError
from dspark_jax.formats.chat_template import FAMILIES, TemplateFamily
from dspark_jax.formats.tokenizer import Tokenizer

ROLES = ("system", "user", "assistant", "tool")
# ShareGPT speaker names; "user"/"assistant" appear in some ShareGPT dumps too.
SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
    "tool": "tool",
}
RECORD_KINDS = ("prompt", "turns", "conversations")


def _prefix(where: str, message: str) -> str:
    """Prefix ``message`` with a ``file:line`` location when one is known."""
    return f"{where}: {message}" if where else message


# ---------------------------------------------------------------------------
# JSONL


def iter_jsonl(path: str | Path, *, offset: int = 0, first_line: int = 1,
               num_lines: int | None = None) -> Iterator[tuple[int, Any]]:
    """Yield ``(1-based line number, parsed value)`` for each non-blank line of ``path``; a line
    that is not UTF-8 JSON yields its DataError instead, so a caller may skip it and go on.

    A piece of the file (what one tokenizing worker reads): ``num_lines`` lines (blank ones
    included; None: to the end) from byte ``offset``, which must be the start of line ``first_line``.
    """
    path = Path(path)
    try:
        handle = path.open("rb")
    except OSError as err:
        raise DataError(f"{path}: cannot open file ({err.strerror or err})") from err
    with handle:
        handle.seek(offset)
        for line_no, raw in enumerate(itertools.islice(handle, num_lines), start=first_line):
            try:
                # utf-8-sig drops a byte-order mark some editors put on line 1.
                line = raw.decode("utf-8-sig" if line_no == 1 else "utf-8")
            except UnicodeDecodeError as err:
                yield line_no, DataError(f"{path}:{line_no}: not valid UTF-8 ({err})")
                continue
            if not line.strip():
                continue
            try:
                yield line_no, json.loads(line)
            except json.JSONDecodeError as err:
                yield line_no, DataError(f"{path}:{line_no}: invalid JSON ({err})")


def read_jsonl(path: str | Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield ``(1-based line number, object)`` for each non-blank line; the first bad line raises."""
    for line_no, obj in iter_jsonl(path):
        if isinstance(obj, DataError):
            raise obj
        if not isinstance(obj, dict):
            raise DataError(f"{path}:{line_no}: expected a JSON object, got {type(obj).__name__}")
        yield line_no, obj


# ---------------------------------------------------------------------------
# Messages


def _object_list(value: Any, what: str, where: str) -> list[dict[str, Any]]:
    """A list of objects, given as one or as a JSON string of one."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise DataError(_prefix(where, f"{what} is a string but not valid JSON ({err})")) from err
    if not isinstance(value, list) or not all(isinstance(v, Mapping) for v in value):
        raise DataError(_prefix(where, f"{what} must be a list of objects (or a JSON string of one), got {value!r:.80}"))
    return [dict(v) for v in value]


def normalize_messages(entries: Any, *, where: str = "") -> list[dict[str, Any]]:
    """Validate chat messages: ShareGPT entries become ``{"role", "content"}``, ``tool_calls`` given
    as a JSON string is decoded, keys whose value is null are dropped, other keys are kept."""
    if not isinstance(entries, list):
        raise DataError(_prefix(where, f"conversation must be a list of messages, got {type(entries).__name__}"))
    messages = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, Mapping):
            raise DataError(_prefix(where, f"message {i} must be an object, got {type(entry).__name__}"))
        if "role" in entry or "content" in entry:
            role_key, content_key = "role", "content"
        elif "from" in entry or "value" in entry:
            role_key, content_key = "from", "value"
        else:
            raise DataError(_prefix(where, f"message {i} needs 'role'/'content' or 'from'/'value' keys"))
        role = entry.get(role_key)
        if role_key == "from" and isinstance(role, str):
            if role not in SHAREGPT_ROLES:
                raise DataError(
                    _prefix(where, f"message {i}: unknown role {role!r} (expected one of {sorted(SHAREGPT_ROLES)})")
                )
            role = SHAREGPT_ROLES[role]
        if not isinstance(role, str):
            raise DataError(_prefix(where, f"message {i}: '{role_key}' must be a string, got {role!r}"))
        if role not in ROLES:
            raise DataError(_prefix(where, f"message {i}: unknown role {role!r} (expected one of {list(ROLES)})"))
        message: dict[str, Any] = {"role": role}
        content = entry.get(content_key)
        if isinstance(content, str):
            message["content"] = content
        elif content is not None or entry.get("tool_calls") is None:
            # Only a message that calls tools may go without text (OpenAI's content: null).
            raise DataError(
                _prefix(where, f"message {i}: '{content_key}' must be a string, got {type(content).__name__}")
            )
        for key, value in entry.items():
            if key not in (role_key, content_key) and value is not None:
                message[key] = value
        if "tool_calls" in message:
            message["tool_calls"] = _object_list(message["tool_calls"], f"message {i}: 'tool_calls'", where)
        messages.append(message)
    return messages


def _record_tools(record: Mapping[str, Any], where: str) -> list[dict[str, Any]] | None:
    """The record's ``tools`` (function schemas), or None."""
    if record.get("tools") is None:
        return None
    return _object_list(record["tools"], "'tools'", where)


def render_chat(
    tokenizer: Tokenizer,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = False,
    tools: Sequence[Mapping[str, Any]] | None = None,
    enable_thinking: bool | None = None,
    where: str = "",
) -> str:
    """Text of ``messages`` in the tokenizer's chat template (``enable_thinking`` passed when not None)."""
    return tokenizer.chat_template.render(
        normalize_messages(list(messages), where=where), add_generation_prompt=add_generation_prompt,
        tools=tools, enable_thinking=enable_thinking, where=where,
    )


def encode_chat_prompt(
    tokenizer: Tokenizer,
    messages: Sequence[Mapping[str, Any]],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    enable_thinking: bool = False,
    where: str = "",
) -> list[int]:
    """Ids of ``messages`` followed by the generation prompt (for decoding)."""
    text = render_chat(tokenizer, messages, add_generation_prompt=True, tools=tools,
                       enable_thinking=enable_thinking, where=where)
    return tokenizer.encode(text)


# ---------------------------------------------------------------------------
# Prompt records


@dataclass(frozen=True)
class PromptRecord:
    """One decoding prompt: its id, the exact text fed to the model and its ids."""

    id: str
    prompt_text: str
    token_ids: tuple[int, ...]


def _record_kind(record: Mapping[str, Any], where: str) -> str:
    """Which of prompt/turns/conversations the record holds (exactly one)."""
    kinds = [k for k in RECORD_KINDS if k in record]
    if not kinds:
        raise DataError(_prefix(where, f"record needs one of the keys {list(RECORD_KINDS)}, got {sorted(record)}"))
    if len(kinds) > 1:
        raise DataError(_prefix(where, f"record has more than one of the keys {kinds}; keep exactly one"))
    return kinds[0]


def _record_id(record: Mapping[str, Any], index: int, where: str) -> str:
    """The record's ``id`` as a string, or its 0-based index when it has none."""
    if "id" not in record:
        return str(index)
    value = record["id"]
    if isinstance(value, bool) or not isinstance(value, (str, int)) or value == "":
        raise DataError(_prefix(where, f"'id' must be a non-empty string or an int, got {value!r}"))
    return str(value)


def _turns(record: Mapping[str, Any], where: str) -> list[str]:
    """The record's non-empty list of string turns."""
    turns = record["turns"]
    if not isinstance(turns, list):
        raise DataError(_prefix(where, f"'turns' must be a list of strings, got {type(turns).__name__}"))
    if not turns:
        raise DataError(_prefix(where, "'turns' is empty"))
    for i, turn in enumerate(turns):
        if not isinstance(turn, str):
            raise DataError(_prefix(where, f"turn {i} must be a string, got {type(turn).__name__}"))
    return turns


def _check_record(record: Any, where: str) -> str:
    if not isinstance(record, Mapping):
        raise DataError(_prefix(where, f"record must be an object, got {type(record).__name__}"))
    return _record_kind(record, where)


def encode_prompt_record(
    tokenizer: Tokenizer, record: Mapping[str, Any], *, where: str = "", index: int = 0,
    enable_thinking: bool = False,
) -> PromptRecord:
    """Turn a prompt record into the ids to decode from (see the module docstring)."""
    kind = _check_record(record, where)
    record_id = _record_id(record, index, where)
    if kind == "prompt":
        text = record["prompt"]
        if not isinstance(text, str):
            raise DataError(_prefix(where, f"'prompt' must be a string, got {type(text).__name__}"))
        if not text:
            raise DataError(_prefix(where, "'prompt' is empty"))
        return PromptRecord(record_id, text, tuple(tokenizer.encode(text)))
    tools = None
    if kind == "turns":
        first = _turns(record, where)[0]
        if not first:
            raise DataError(_prefix(where, "first turn is empty"))
        messages = [{"role": "user", "content": first}]
    else:
        messages = normalize_messages(record["conversations"], where=where)
        tools = _record_tools(record, where)
        # Trailing assistant messages are reference answers: the model is
        # asked to produce them, so they are not part of the prompt.
        while messages and messages[-1]["role"] == "assistant":
            messages.pop()
        if not messages:
            raise DataError(_prefix(where, "'conversations' has no user or system message to prompt with"))
    text = render_chat(tokenizer, messages, add_generation_prompt=True, tools=tools,
                       enable_thinking=enable_thinking, where=where)
    return PromptRecord(record_id, text, tuple(tokenizer.encode(text)))


def load_prompts(path: str | Path, tokenizer: Tokenizer, *, enable_thinking: bool = False) -> list[PromptRecord]:
    """Read every prompt record of a JSONL file; ids must be unique."""
    records: list[PromptRecord] = []
    seen: dict[str, int] = {}
    for index, (line_no, obj) in enumerate(read_jsonl(path)):
        where = f"{path}:{line_no}"
        rec = encode_prompt_record(tokenizer, obj, where=where, index=index, enable_thinking=enable_thinking)
        # Outputs are keyed by id, so a duplicate would silently overwrite one.
        if rec.id in seen:
            raise DataError(f"{where}: duplicate id {rec.id!r} (first used on line {seen[rec.id]})")
        seen[rec.id] = line_no
        records.append(rec)
    if not records:
        raise DataError(f"{path}: no prompt records")
    return records


# ---------------------------------------------------------------------------
# Training records


@dataclass(frozen=True)
class TrainingExample:
    """A training conversation as the drafter sees it (before the cut to ``max_length``).

    text:      the rendered conversation
    input_ids: int32 [T], ``encode(text)``
    loss_mask: bool  [T], True on supervised tokens (rule 5 of the module docstring)
    spans:     [start, end) character spans of ``text`` that rule 5 supervises
    """

    text: str
    input_ids: np.ndarray
    loss_mask: np.ndarray
    spans: tuple[tuple[int, int], ...]


def _template_family(tokenizer: Tokenizer) -> TemplateFamily:
    template = tokenizer.chat_template
    family = template.family
    if family is None:
        markers = {name: f.marker for name, f in FAMILIES.items()}
        raise CheckpointError(
            f"{template.origin}: chat template is of no known family (it contains none of the markers "
            f"{markers}), so its assistant turns cannot be found for the loss mask"
        )
    return family


def supervised_spans(text: str, family: TemplateFamily) -> list[tuple[int, int]]:
    """[content_start, content_end) of every assistant turn of ``text`` (rule 5)."""
    turn = re.compile(re.escape(family.assistant_start) + "(.*?)(?:" + re.escape(family.turn_end) + r"|\Z)", re.DOTALL)
    prefix = family.assistant_loss_prefix
    spans = []
    for m in turn.finditer(text):
        start = m.start(1)
        if prefix and text.startswith(prefix, start, m.end()):
            start += len(prefix)
        spans.append((start, m.end()))
    return spans


def _with_loss_prefix(messages: list[dict[str, Any]], family: TemplateFamily,
                      where: str) -> list[dict[str, Any]]:
    """``messages`` with the family's loss prefix put before every assistant text that does not
    start with it (rule 3)."""
    prefix = family.assistant_loss_prefix
    if not prefix:
        return messages
    out = []
    for i, message in enumerate(messages):
        if message["role"] == "assistant":
            content = message.get("content")
            if not isinstance(content, str):  # normalize_messages lets tool calls go without text
                raise DataError(_prefix(where, (
                    f"message {i}: an assistant message needs text 'content' in the {family.name} chat "
                    f"template family, which puts {prefix!r} before every answer; this one has "
                    f"{'only tool_calls' if 'tool_calls' in message else 'none'}")))
            if not content.startswith(prefix):
                message = {**message, "content": prefix + content}
        out.append(message)
    return out


def conversation_example(
    tokenizer: Tokenizer,
    messages: Sequence[Mapping[str, Any]],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    enable_thinking: bool | None = None,
    system_prompt: str | None = None,
    where: str = "",
) -> TrainingExample:
    """Rules 1-5 of the module docstring applied to chat messages. ``system_prompt`` replaces the
    family's default system prompt of rule 1 ("": none); None keeps it."""
    messages = normalize_messages(list(messages), where=where)
    if not messages:
        raise DataError(_prefix(where, "conversation has no messages"))
    family = _template_family(tokenizer)
    messages = _with_loss_prefix(messages, family, where)
    default = family.default_system_prompt if system_prompt is None else system_prompt
    if messages[0]["role"] != "system" and default:
        messages.insert(0, {"role": "system", "content": default})
    first = 1 if messages[0]["role"] == "system" else 0
    if len(messages) <= first or messages[first]["role"] != "user":
        got = repr(messages[first]["role"]) if len(messages) > first else "nothing"
        raise DataError(_prefix(where, f"the first message after the system prompt must be the user's, got {got}"))
    text = tokenizer.chat_template.render(messages, add_generation_prompt=False, tools=tools,
                                          enable_thinking=enable_thinking, where=where)
    ids = np.asarray(tokenizer.encode(text), dtype=np.int32)
    mask = np.zeros(len(ids), dtype=bool)
    spans = supervised_spans(text, family)
    for start, end in spans:
        mask[len(tokenizer.encode(text[:start])) : len(tokenizer.encode(text[:end]))] = True
    return TrainingExample(text=text, input_ids=ids, loss_mask=mask, spans=tuple(spans))


def encode_conversation(
    tokenizer: Tokenizer, messages: Sequence[Mapping[str, Any]], *, where: str = "",
    enable_thinking: bool | None = None, system_prompt: str | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Ids (int32) and loss mask (bool) of chat messages as a training conversation."""
    example = conversation_example(tokenizer, messages, where=where, enable_thinking=enable_thinking,
                                   system_prompt=system_prompt)
    return example.input_ids, example.loss_mask


def training_example(
    tokenizer: Tokenizer, record: Mapping[str, Any], *, where: str = "", enable_thinking: bool | None = None,
    system_prompt: str | None = None,
) -> TrainingExample | None:
    """The training example of a ``conversations``/``turns`` record; None when it has no assistant turn."""
    kind = _check_record(record, where)
    if kind == "prompt":
        raise DataError(_prefix(where, "training records need 'conversations' or 'turns', not raw 'prompt'"))
    tools = None
    if kind == "turns":
        messages = [
            {"role": "user" if i % 2 == 0 else "assistant", "content": turn}
            for i, turn in enumerate(_turns(record, where))
        ]
    else:
        messages = normalize_messages(record["conversations"], where=where)
        tools = _record_tools(record, where)
    if not any(m["role"] == "assistant" for m in messages):
        return None
    return conversation_example(tokenizer, messages, tools=tools, enable_thinking=enable_thinking,
                                system_prompt=system_prompt, where=where)


def encode_training_record(
    tokenizer: Tokenizer, record: Mapping[str, Any], *, where: str = "", enable_thinking: bool | None = None,
    system_prompt: str | None = None,
) -> tuple[np.ndarray, np.ndarray] | None:
    """Ids and loss mask of a chat record (see :func:`training_example`); None without an assistant turn."""
    example = training_example(tokenizer, record, where=where, enable_thinking=enable_thinking,
                               system_prompt=system_prompt)
    return None if example is None else (example.input_ids, example.loss_mask)
