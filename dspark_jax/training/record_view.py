"""Training records as the drafter will train on them: each record of a JSONL file rendered,
tokenized and cut the way :func:`dspark_jax.training.data.load_conversations` does it, with its
supervised spans, or why it is skipped; a text view of one, and the JSONL of the kept ones.

Unlike ``load_conversations``, a bad record does not stop the walk: it is reported and skipped.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dspark_jax.errors import DataError
from dspark_jax.formats.records import TrainingExample
from dspark_jax.formats.tokenizer import Tokenizer
from dspark_jax.training.data import is_too_short, training_examples

SKIP_NO_ASSISTANT = "no assistant turn"
_ANSI_SUPERVISED, _ANSI_DIM, _ANSI_RESET = "\x1b[1;32m", "\x1b[2m", "\x1b[0m"


@dataclass(frozen=True)
class RecordView:
    """One record of a training file.

    where: ``file:line``; id: the record's ``id`` or its 0-based index.
    example: the rendered conversation before the cut (None when it could not be built).
    input_ids, loss_mask: int32 / bool [min(T, max_length)], what the dataset holds (None without example).
    skipped: why the record is not trained on ("" when it is).
    """

    where: str
    id: str
    example: TrainingExample | None
    input_ids: np.ndarray | None
    loss_mask: np.ndarray | None
    skipped: str

    @property
    def kept(self) -> bool:
        return not self.skipped

    @property
    def truncated(self) -> bool:
        return self.example is not None and len(self.example.input_ids) > len(self.input_ids)


def view_records(
    path: str | Path, tokenizer: Tokenizer, *, max_length: int, min_length: int = 2,
    enable_thinking: bool | None = None, system_prompt: str | None = None, limit: int = 0,
) -> Iterator[RecordView]:
    """A :class:`RecordView` per non-blank line of ``path`` (the first ``limit`` when > 0)."""
    examples = training_examples(path, tokenizer, enable_thinking=enable_thinking,
                                 system_prompt=system_prompt)
    for index, (where, obj, example) in enumerate(examples):
        if limit and index >= limit:
            return
        record_id = str(obj["id"]) if isinstance(obj, dict) and "id" in obj else str(index)
        if isinstance(example, DataError):
            yield RecordView(where, record_id, None, None, None, str(example))
            continue
        if example is None:
            yield RecordView(where, record_id, None, None, None, SKIP_NO_ASSISTANT)
            continue
        ids, mask = example.input_ids[:max_length], example.loss_mask[:max_length]
        skipped = ""
        if is_too_short(mask, min_length):
            skipped = (f"too short: {len(ids)} tokens and {int(mask.sum())} supervised after the cut to "
                       f"{max_length} (need >= {min_length} tokens and 2 adjacent supervised ones)")
        yield RecordView(where, record_id, example, ids, mask, skipped)


def _marked_text(tokenizer: Tokenizer, view: RecordView, color: bool) -> str:
    """The rendered text up to the cut, supervised tokens marked (ANSI colour or ⟦ ⟧)."""
    example = view.example
    enc = tokenizer.backend.encode(example.text, add_special_tokens=False)
    offsets = enc.offsets[: len(view.input_ids)]
    if enc.ids[: len(offsets)] != view.input_ids.tolist():  # a tokenizer that cannot give offsets
        return example.text
    open_, close = (_ANSI_SUPERVISED, _ANSI_RESET) if color else ("⟦", "⟧")
    pieces, pos, i = [], 0, 0
    while i < len(offsets):
        if not view.loss_mask[i]:
            i += 1
            continue
        j = i
        while j + 1 < len(offsets) and view.loss_mask[j + 1]:
            j += 1
        start, end = offsets[i][0], offsets[j][1]
        pieces += [example.text[pos:start], open_, example.text[start:end], close]
        pos, i = end, j + 1
    cut = offsets[-1][1] if offsets else 0
    pieces.append(example.text[pos:cut])
    if view.truncated:
        rest = len(example.input_ids) - len(view.input_ids)
        note = f"[cut at max_length: {rest} more tokens not trained on]"
        pieces.append(f"\n{_ANSI_DIM}{note}{_ANSI_RESET}" if color else f"\n{note}")
    return "".join(pieces)


def format_view(tokenizer: Tokenizer, view: RecordView, *, color: bool = False) -> str:
    """A header line (where, id, token and supervised counts or the skip reason) and the marked text."""
    if view.example is None:
        reason = view.skipped.removeprefix(f"{view.where}: ")
        return f"{view.where} id={view.id}: skipped: {reason}"
    n, supervised = len(view.input_ids), int(view.loss_mask.sum())
    cut = f" (cut from {len(view.example.input_ids)})" if view.truncated else ""
    status = f"; skipped: {view.skipped}" if view.skipped else ""
    header = f"{view.where} id={view.id}: {n} tokens{cut}, {supervised} supervised{status}"
    return f"{header}\n{_marked_text(tokenizer, view, color)}"


def summarize(views: Iterable[RecordView]) -> dict[str, int]:
    """Counts over views: records, kept, tokens and supervised tokens of the kept, truncated, skips by kind."""
    out = {"records": 0, "kept": 0, "tokens": 0, "supervised": 0, "truncated": 0,
           "errors": 0, "no_assistant": 0, "too_short": 0}
    for v in views:
        out["records"] += 1
        if v.kept:
            out["kept"] += 1
            out["tokens"] += len(v.input_ids)
            out["supervised"] += int(v.loss_mask.sum())
            out["truncated"] += v.truncated
        elif v.example is not None:
            out["too_short"] += 1
        elif v.skipped == SKIP_NO_ASSISTANT:
            out["no_assistant"] += 1
        else:
            out["errors"] += 1
    return out


def check_output(out: str | Path, source: str | Path) -> None:
    """DataError unless ``out`` can be written without overwriting ``source``."""
    out, source = Path(out), Path(source)
    if out.resolve() == source.resolve() or (out.exists() and source.exists() and os.path.samefile(out, source)):
        raise DataError(f"{out}: the output would overwrite the input data file; choose another path")
    if not out.parent.is_dir():
        raise DataError(f"{out}: directory {out.parent} does not exist")


def write_training_jsonl(views: Iterable[RecordView], out: str | Path, *, source: str | Path) -> int:
    """Write ``{"id", "input_ids", "loss_mask"}`` (mask as 0/1) per kept view to ``out`` through a
    temporary file renamed into place; refuses to overwrite ``source``. Returns the lines written."""
    check_output(out, source)
    out = Path(out)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp")
    written = 0
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for v in views:
                if v.kept:
                    row = {"id": v.id, "input_ids": v.input_ids.tolist(), "loss_mask": v.loss_mask.astype(int).tolist()}
                    f.write(json.dumps(row) + "\n")
                    written += 1
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return written
