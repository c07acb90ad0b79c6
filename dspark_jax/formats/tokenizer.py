"""Tokenizer, Qwen chat template and prompt/training record readers.

The tokenizer wraps a Hugging Face ``tokenizer.json`` (via the ``tokenizers``
library) from a checkpoint directory and knows the checkpoint's stop tokens.

Chat messages use Qwen's ChatML layout::

    <|im_start|>{role}\\n{content}<|im_end|>\\n      (one per message)
    <|im_start|>assistant\\n                        (generation prompt)

Conversations are tokenized segment by segment (markers as their single ids,
text with :meth:`Tokenizer.encode`) so the training loss mask has exact token
boundaries. As with Hugging Face chat templates, a special-token marker written
literally inside message text is encoded as that special token.

JSONL record formats (one JSON object per line, blank lines skipped):

* ``{"prompt": "..."}``: raw text fed to the model verbatim (no template).
* ``{"turns": ["...", ...]}``: eval-set style. For decoding only the FIRST turn
  is used, as a user message followed by the generation prompt (multi-turn
  eval is not replayed here). For training the turns alternate user/assistant,
  starting with user.
* ``{"conversations": [...]}``: chat messages, either ``{"role", "content"}``
  or ShareGPT ``{"from": "human"|"gpt"|"system", "value"}``. For decoding,
  trailing assistant messages (reference answers) are dropped and the
  generation prompt is appended.

An optional ``"id"`` (string or int) names the record; otherwise its 0-based
index in the file is used.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import tokenizers

from dspark_jax.errors import CheckpointError, DataError

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
END_OF_TEXT = "<|endoftext|>"
GENERATION_PROMPT_ROLE = "assistant"

ROLES = ("system", "user", "assistant")
# ShareGPT speaker names; "user"/"assistant" appear in some ShareGPT dumps too.
SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
}
RECORD_KINDS = ("prompt", "turns", "conversations")


def _prefix(where: str, message: str) -> str:
    """Prefix ``message`` with a ``file:line`` location when one is known."""
    return f"{where}: {message}" if where else message


class Tokenizer:
    """A checkpoint's tokenizer plus its stop tokens."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        path: Path | str = "<memory>",
        eos_token_ids: Sequence[int] = (),
    ) -> None:
        """Wrap ``backend``; stop ids are ``eos_token_ids`` plus known end markers."""
        self.backend = backend
        self.path = Path(path)
        stop = {int(i) for i in eos_token_ids}
        # The target ends a chat turn with <|im_end|> and a document with
        # <|endoftext|>, whatever the config files list.
        for marker in (IM_END, END_OF_TEXT):
            marker_id = backend.token_to_id(marker)
            if marker_id is not None:
                stop.add(marker_id)
        self.stop_token_ids: tuple[int, ...] = tuple(sorted(stop))

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added/special tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; no special tokens are added (Qwen adds none)."""
        return self.backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int] | np.ndarray, skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; special tokens are dropped unless asked for."""
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_id(self, token: str) -> int:
        """Id of a single vocabulary entry such as ``<|im_end|>``."""
        token_id = self.backend.token_to_id(token)
        if token_id is None:
            raise CheckpointError(f"{self.path}: token {token!r} is not in the tokenizer vocabulary")
        return token_id

    def __repr__(self) -> str:
        return (
            f"Tokenizer(path={str(self.path)!r}, vocab_size={self.vocab_size}, "
            f"stop_token_ids={self.stop_token_ids})"
        )


def _read_eos_ids(path: Path) -> list[int]:
    """``eos_token_id`` (int, list of ints or null) from a JSON config; [] if absent."""
    if not path.is_file():
        return []
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{path}: cannot read JSON ({err})") from err
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(data).__name__}")
    value = data.get("eos_token_id")
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    for v in values:
        # bool is an int subclass; true/false here is a typo, not an id.
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise CheckpointError(
                f"{path}: 'eos_token_id' must be a non-negative int or a list of them, got {value!r}"
            )
    return list(values)


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    """Load ``model_dir/tokenizer.json`` and the stop ids from the config files."""
    model_dir = Path(model_dir)
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise CheckpointError(f"{path}: tokenizer file not found")
    try:
        backend = tokenizers.Tokenizer.from_file(str(path))
    except Exception as err:  # tokenizers raises a bare Exception for bad files
        raise CheckpointError(f"{path}: cannot read tokenizer ({err})") from err
    eos = _read_eos_ids(model_dir / "generation_config.json") + _read_eos_ids(model_dir / "config.json")
    return Tokenizer(backend, path=path, eos_token_ids=eos)


# ---------------------------------------------------------------------------
# Chat template


CHAT_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>")  # ids 0..3


def train_bpe_tokenizer(texts: Sequence[str], vocab_size: int, out_dir: str | Path) -> Path:
    """Trains a small byte-level BPE `tokenizer.json` (ChatML special tokens first) into out_dir.

    For the tiny test and demo models only; real models ship their own tokenizer.
    """
    from tokenizers import decoders, models, pre_tokenizers, trainers

    backend = tokenizers.Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(CHAT_SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    backend.train_from_iterator(list(texts) + ["user assistant system"], trainer=trainer)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    backend.save(str(out / "tokenizer.json"))
    return out


def normalize_messages(entries: Any, *, where: str = "") -> list[dict[str, str]]:
    """Validate chat messages and map ShareGPT entries to ``{"role", "content"}``."""
    if not isinstance(entries, list):
        raise DataError(_prefix(where, f"conversation must be a list of messages, got {type(entries).__name__}"))
    messages = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, Mapping):
            raise DataError(_prefix(where, f"message {i} must be an object, got {type(entry).__name__}"))
        if "role" in entry or "content" in entry:
            role, content = entry.get("role"), entry.get("content")
            role_key, content_key = "role", "content"
        elif "from" in entry or "value" in entry:
            role, content = entry.get("from"), entry.get("value")
            role_key, content_key = "from", "value"
            if isinstance(role, str):
                if role not in SHAREGPT_ROLES:
                    raise DataError(
                        _prefix(where, f"message {i}: unknown role {role!r} (expected one of {sorted(SHAREGPT_ROLES)})")
                    )
                role = SHAREGPT_ROLES[role]
        else:
            raise DataError(_prefix(where, f"message {i} needs 'role'/'content' or 'from'/'value' keys"))
        if not isinstance(role, str):
            raise DataError(_prefix(where, f"message {i}: '{role_key}' must be a string, got {role!r}"))
        if role not in ROLES:
            raise DataError(_prefix(where, f"message {i}: unknown role {role!r} (expected one of {list(ROLES)})"))
        if not isinstance(content, str):
            raise DataError(
                _prefix(where, f"message {i}: '{content_key}' must be a string, got {type(content).__name__}")
            )
        messages.append({"role": role, "content": content})
    return messages


def render_chat(messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = False) -> str:
    """ChatML text of ``messages`` (optionally followed by the generation prompt)."""
    text = "".join(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n" for m in normalize_messages(list(messages)))
    if add_generation_prompt:
        text += f"{IM_START}{GENERATION_PROMPT_ROLE}\n"
    return text


def _encode_messages(
    tokenizer: Tokenizer, messages: list[dict[str, str]], add_generation_prompt: bool
) -> tuple[list[int], list[bool]]:
    """Token ids and loss mask of already-normalized messages."""
    im_start, im_end = tokenizer.token_id(IM_START), tokenizer.token_id(IM_END)
    newline = tokenizer.encode("\n")
    ids: list[int] = []
    mask: list[bool] = []

    def add(segment: list[int], trained: bool) -> None:
        ids.extend(segment)
        mask.extend([trained] * len(segment))

    for m in messages:
        is_assistant = m["role"] == "assistant"
        add([im_start] + tokenizer.encode(m["role"] + "\n"), False)
        add(tokenizer.encode(m["content"]), is_assistant)
        # The target emits <|im_end|> to finish its turn, so the drafter must
        # learn it; the newline after it is template glue and is not trained.
        add([im_end], is_assistant)
        add(newline, False)
    if add_generation_prompt:
        add([im_start] + tokenizer.encode(GENERATION_PROMPT_ROLE + "\n"), False)
    return ids, mask


def encode_conversation(
    tokenizer: Tokenizer, messages: Sequence[Mapping[str, Any]], *, where: str = ""
) -> tuple[np.ndarray, np.ndarray]:
    """ChatML ids (int32) and loss mask (bool, True on assistant content + its ``<|im_end|>``)."""
    normalized = normalize_messages(list(messages), where=where)
    if not normalized:
        raise DataError(_prefix(where, "conversation has no messages"))
    ids, mask = _encode_messages(tokenizer, normalized, add_generation_prompt=False)
    return np.asarray(ids, dtype=np.int32), np.asarray(mask, dtype=bool)


def encode_chat_prompt(tokenizer: Tokenizer, messages: Sequence[Mapping[str, Any]], *, where: str = "") -> list[int]:
    """ChatML ids of ``messages`` followed by the generation prompt (for decoding)."""
    ids, _ = _encode_messages(tokenizer, normalize_messages(list(messages), where=where), add_generation_prompt=True)
    return ids


# ---------------------------------------------------------------------------
# JSONL records


def iter_jsonl(path: str | Path) -> Iterator[tuple[int, Any]]:
    """Yield ``(1-based line number, parsed value)`` for each non-blank line of ``path``; a line
    that is not UTF-8 JSON yields its DataError instead, so a caller may skip it and go on."""
    path = Path(path)
    try:
        handle = path.open("rb")
    except OSError as err:
        raise DataError(f"{path}: cannot open file ({err.strerror or err})") from err
    with handle:
        for line_no, raw in enumerate(handle, start=1):
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


def encode_prompt_record(
    tokenizer: Tokenizer, record: Mapping[str, Any], *, where: str = "", index: int = 0
) -> PromptRecord:
    """Turn a prompt record into the ids to decode from (see the module docstring)."""
    if not isinstance(record, Mapping):
        raise DataError(_prefix(where, f"record must be an object, got {type(record).__name__}"))
    kind = _record_kind(record, where)
    record_id = _record_id(record, index, where)
    if kind == "prompt":
        text = record["prompt"]
        if not isinstance(text, str):
            raise DataError(_prefix(where, f"'prompt' must be a string, got {type(text).__name__}"))
        if not text:
            raise DataError(_prefix(where, "'prompt' is empty"))
        return PromptRecord(record_id, text, tuple(tokenizer.encode(text)))
    if kind == "turns":
        first = _turns(record, where)[0]
        if not first:
            raise DataError(_prefix(where, "first turn is empty"))
        messages = [{"role": "user", "content": first}]
    else:
        messages = normalize_messages(record["conversations"], where=where)
        # Trailing assistant messages are reference answers: the model is
        # asked to produce them, so they are not part of the prompt.
        while messages and messages[-1]["role"] == "assistant":
            messages.pop()
        if not messages:
            raise DataError(_prefix(where, "'conversations' has no user or system message to prompt with"))
    text = render_chat(messages, add_generation_prompt=True)
    ids = encode_chat_prompt(tokenizer, messages, where=where)
    return PromptRecord(record_id, text, tuple(ids))


def load_prompts(path: str | Path, tokenizer: Tokenizer) -> list[PromptRecord]:
    """Read every prompt record of a JSONL file; ids must be unique."""
    records: list[PromptRecord] = []
    seen: dict[str, int] = {}
    for index, (line_no, obj) in enumerate(read_jsonl(path)):
        where = f"{path}:{line_no}"
        rec = encode_prompt_record(tokenizer, obj, where=where, index=index)
        # Outputs are keyed by id, so a duplicate would silently overwrite one.
        if rec.id in seen:
            raise DataError(f"{where}: duplicate id {rec.id!r} (first used on line {seen[rec.id]})")
        seen[rec.id] = line_no
        records.append(rec)
    if not records:
        raise DataError(f"{path}: no prompt records")
    return records


def encode_training_record(
    tokenizer: Tokenizer, record: Mapping[str, Any], *, where: str = ""
) -> tuple[np.ndarray, np.ndarray] | None:
    """ChatML ids and loss mask of a chat record; None when it has no assistant turn."""
    if not isinstance(record, Mapping):
        raise DataError(_prefix(where, f"record must be an object, got {type(record).__name__}"))
    kind = _record_kind(record, where)
    if kind == "prompt":
        raise DataError(_prefix(where, "training records need 'conversations' or 'turns', not raw 'prompt'"))
    if kind == "turns":
        messages = [
            {"role": "user" if i % 2 == 0 else "assistant", "content": turn}
            for i, turn in enumerate(_turns(record, where))
        ]
    else:
        messages = normalize_messages(record["conversations"], where=where)
    if not any(m["role"] == "assistant" for m in messages):
        return None
    return encode_conversation(tokenizer, messages, where=where)
