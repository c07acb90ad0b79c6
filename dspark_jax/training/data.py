"""Training data: tokenized conversations, anchor sampling and deterministic sharded batches.

Host-side numpy, deterministic from a seed. A :class:`Dataset` holds every usable conversation of a
JSONL file as token ids and a loss mask (True on what the target says, as DeepSpec builds them: see
``formats/records.py``), cut to ``max_length`` tokens. A :class:`BatchIterator` walks seeded permutations of it, one per epoch, and
yields this process's rows of each global batch with fixed shapes; anchors (block start positions,
DESIGN.md §3 "Training data layout") are sampled per row. :func:`make_global_batch` turns a process's
rows into global ``jax.Array``s.

Randomness: epoch ``e`` visits records in ``default_rng([seed, e]).permutation(n)``; the row at slot
``i`` of that permutation samples its anchors from ``default_rng([seed, e, i, 1])``. The trailing 1
keeps the two streams apart (SeedSequence pads entropy with zeros, so ``[s, e]`` equals
``[s, e, 0, 0]``). Anchors thus depend only on (seed, epoch, slot), not on batch size or process.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dspark_jax.errors import ConfigError, DataError
from dspark_jax.formats.records import TrainingExample, iter_jsonl, training_example
from dspark_jax.formats.tokenizer import END_OF_TEXT, Tokenizer

_ANCHOR_STREAM = 1  # last SeedSequence word of the anchor streams (see module docstring)
_STATE_KEYS = ("epoch", "position", "seed", "num_records", "lengths_sha256")


# ---------------------------------------------------------------------------
# Dataset


@dataclass(frozen=True)
class DatasetStats:
    """What happened to the records of a file.

    ``records_read = kept + skipped_bad + skipped_no_assistant + skipped_too_short``; a bad record
    (not JSON, no object, a conversation the rule refuses) is skipped, its error kept in
    ``Dataset.errors``; ``truncated`` counts kept
    records that were cut to ``max_length``. A record is too short when it has fewer than
    ``min_length`` tokens or no anchor candidate (two adjacent supervised positions) after the cut.
    """

    records_read: int
    kept: int
    skipped_bad: int
    skipped_no_assistant: int
    skipped_too_short: int
    truncated: int

    def as_dict(self) -> dict[str, int]:
        """The counts by name (for logs)."""
        return asdict(self)


@dataclass(frozen=True)
class Dataset:
    """Tokenized training conversations.

    input_ids[i]:  int32 [len_i], len_i <= max_length
    loss_masks[i]: bool  [len_i], True where the token is a training label (assistant content)
    pad_id: id used to pad rows of a batch (``<|endoftext|>`` when the tokenizer has it, else 0).
    """

    path: str
    input_ids: list[np.ndarray]
    loss_masks: list[np.ndarray]
    max_length: int
    pad_id: int
    stats: DatasetStats
    errors: tuple[str, ...] = ()  # why each bad record was skipped, with file and line

    def __len__(self) -> int:
        return len(self.input_ids)

    def fingerprint(self) -> dict[str, Any]:
        """Number of records and a hash of their lengths; iterator states carry it to detect changed data."""
        lengths = np.asarray([len(x) for x in self.input_ids], dtype="<i8")
        return {
            "num_records": len(self.input_ids),
            "lengths_sha256": hashlib.sha256(lengths.tobytes()).hexdigest(),
        }


def is_too_short(loss_mask: np.ndarray, min_length: int) -> bool:
    """Whether a record, already cut to max_length, is too short to train on (see :class:`DatasetStats`)."""
    return len(loss_mask) < min_length or not bool((loss_mask[:-1] & loss_mask[1:]).any())


def training_examples(path: str | Path, tokenizer: Tokenizer, *, enable_thinking: bool | None = None,
                      system_prompt: str | None = None
                      ) -> Iterator[tuple[str, Any, TrainingExample | DataError | None]]:
    """(file:line, the parsed line, its `training_example` or the DataError that refused it) per
    non-blank line of a JSONL file."""
    for line_no, obj in iter_jsonl(path):
        where = f"{path}:{line_no}"
        try:
            if isinstance(obj, DataError):
                raise obj
            if not isinstance(obj, dict):
                raise DataError(f"{where}: expected a JSON object, got {type(obj).__name__}")
            example = training_example(tokenizer, obj, where=where, enable_thinking=enable_thinking,
                                       system_prompt=system_prompt)
        except DataError as err:
            example = err
        yield where, obj, example


def load_conversations(path: str | Path, tokenizer: Tokenizer, *, max_length: int, min_length: int,
                       enable_thinking: bool | None = None, system_prompt: str | None = None
                       ) -> Dataset:
    """Tokenize every ``conversations``/``turns`` record of a JSONL file (see :class:`DatasetStats`).

    Records longer than ``max_length`` tokens are cut to it. Training callers pass
    ``min_length = block_size + 1``. ``enable_thinking`` is handed to the chat template when not None;
    ``system_prompt`` replaces the template family's default one ("": none) when not None.
    Raises DataError naming file and line for the first unreadable record, and naming the file and
    the skip counts when no record is usable.
    """
    if min_length < 2:
        raise ConfigError(f"data: min_length must be >= 2 (two tokens make one anchor), got {min_length}")
    if max_length < min_length:
        raise ConfigError(f"data: max_length ({max_length}) must be >= min_length ({min_length})")
    input_ids: list[np.ndarray] = []
    loss_masks: list[np.ndarray] = []
    read = no_assistant = too_short = truncated = 0
    errors: list[str] = []
    for _, _, example in training_examples(path, tokenizer, enable_thinking=enable_thinking,
                                           system_prompt=system_prompt):
        read += 1
        if isinstance(example, DataError):
            errors.append(str(example))
            continue
        if example is None:
            no_assistant += 1
            continue
        cut = len(example.input_ids) > max_length
        ids, mask = example.input_ids[:max_length], example.loss_mask[:max_length]
        if is_too_short(mask, min_length):
            too_short += 1
            continue
        truncated += cut
        input_ids.append(np.ascontiguousarray(ids, dtype=np.int32))
        loss_masks.append(np.ascontiguousarray(mask, dtype=bool))
    stats = DatasetStats(
        records_read=read,
        kept=len(input_ids),
        skipped_bad=len(errors),
        skipped_no_assistant=no_assistant,
        skipped_too_short=too_short,
        truncated=truncated,
    )
    if not input_ids:
        raise DataError(
            f"{path}: no usable training records ({read} read, {len(errors)} bad"
            + (f" (first: {errors[0]})" if errors else "") + f", {no_assistant} without an assistant turn, "
            f"{too_short} shorter than {min_length} tokens or with fewer than 2 adjacent supervised "
            f"tokens after cutting to {max_length})"
        )
    pad_id = tokenizer.backend.token_to_id(END_OF_TEXT)
    return Dataset(
        path=str(path),
        input_ids=input_ids,
        loss_masks=loss_masks,
        max_length=max_length,
        pad_id=0 if pad_id is None else int(pad_id),
        stats=stats,
        errors=tuple(errors),
    )


# ---------------------------------------------------------------------------
# Anchors


def sample_anchors(
    loss_mask_row: np.ndarray, num_anchors: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Anchor positions of one sequence and which of them are real.

    Candidates are positions p with ``loss_mask[p]`` and ``loss_mask[p+1]``. Draws ``num_anchors``
    of them uniformly without replacement, sorted ascending; with fewer candidates all are taken and
    the rest are dummy anchors at position 0.

    Returns anchors int32 [num_anchors] and keep bool [num_anchors] (False on dummies).
    """
    mask = np.asarray(loss_mask_row, dtype=bool)
    candidates = np.flatnonzero(mask[:-1] & mask[1:])
    anchors = np.zeros(num_anchors, dtype=np.int32)
    keep = np.zeros(num_anchors, dtype=bool)
    if len(candidates) > num_anchors:
        chosen = np.sort(rng.choice(candidates, size=num_anchors, replace=False))
    else:
        chosen = candidates
    anchors[: len(chosen)] = chosen
    keep[: len(chosen)] = True
    return anchors, keep


# ---------------------------------------------------------------------------
# Batches


class BatchIterator:
    """Endless fixed-shape batches of this process's rows, epoch after epoch.

    Each ``next()`` yields::

        input_ids:      int32 [B_local, L]  (pad_id after each sequence)
        loss_mask:      bool  [B_local, L]  (False on padding)
        attention_mask: bool  [B_local, L]  (True on the sequence, False on padding)
        anchors:        int32 [B_local, num_anchors] (ascending; 0 on dummies)
        anchor_keep:    bool  [B_local, num_anchors]

    with ``B_local = global_batch_size // process_count``. A global batch is the next
    ``global_batch_size`` slots of the epoch's permutation; process ``k`` takes its rows
    ``[k * B_local, (k + 1) * B_local)``. With ``drop_remainder`` an epoch ends before a partial
    batch; without it the last batch is filled with padding rows (no loss, no kept anchor). With
    ``num_anchors = 0`` (drafters trained on every position: Eagle3) there are no anchors and no
    ``anchors``/``anchor_keep`` entries.

    ``L`` is ``max_length``, or with ``pad_to_multiple`` m > 0 the longest record of the *global*
    batch rounded up to a multiple of m (at most ``max_length``): the positions cut off are padding
    only, which no loss, anchor or attended key reads, so a step computes what it would on the
    full length, at a cost that follows the data (one compiled step per distinct L). Every process
    derives L from the same permutation and record lengths, so all agree on the global shape.
    """

    def __init__(
        self,
        dataset: Dataset,
        *,
        global_batch_size: int,
        num_anchors: int,
        block_size: int,
        seed: int,
        process_index: int = 0,
        process_count: int = 1,
        drop_remainder: bool = True,
        pad_id: int | None = None,
        pad_to_multiple: int = 0,
    ) -> None:
        n = len(dataset)
        if global_batch_size < 1 or num_anchors < 0 or block_size < 1:
            raise ConfigError(
                f"data: global_batch_size ({global_batch_size}) and block_size ({block_size}) must be "
                f">= 1, num_anchors ({num_anchors}) >= 0"
            )
        if pad_to_multiple < 0:
            raise ConfigError(f"data: pad_to_multiple must be >= 0, got {pad_to_multiple}")
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ConfigError(f"data: seed must be a non-negative int, got {seed!r}")
        if process_count < 1 or not 0 <= process_index < process_count:
            raise ConfigError(f"data: process_index {process_index} is not in [0, {process_count})")
        if global_batch_size % process_count:
            raise ConfigError(
                f"data: global_batch_size {global_batch_size} is not divisible by the {process_count} processes"
            )
        if drop_remainder and n < global_batch_size:
            raise DataError(
                f"{dataset.path}: {n} usable records are fewer than one global batch of {global_batch_size} "
                "(use a smaller batch, more data, or drop_remainder=False)"
            )
        self.dataset = dataset
        self.global_batch_size = global_batch_size
        self.local_batch_size = global_batch_size // process_count
        self.num_anchors = num_anchors
        self.block_size = block_size
        self.seed = int(seed)
        self.process_index = process_index
        self.process_count = process_count
        self.drop_remainder = drop_remainder
        self.pad_id = dataset.pad_id if pad_id is None else int(pad_id)
        self.pad_to_multiple = int(pad_to_multiple)
        self._fingerprint = dataset.fingerprint()
        self.epoch = 0
        self.position = 0  # slot of the permutation where the next global batch starts
        self._perm_epoch = -1
        self._perm = np.empty(0, dtype=np.int64)

    @property
    def steps_per_epoch(self) -> int:
        """Global batches in one epoch."""
        n = len(self.dataset)
        return n // self.global_batch_size if self.drop_remainder else math.ceil(n / self.global_batch_size)

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(len(self.dataset))
            self._perm_epoch = epoch
        return self._perm

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        return self

    def batch_length(self) -> int:
        """L of the next global batch (see the class docstring)."""
        longest, m = self.dataset.max_length, self.pad_to_multiple
        if m:
            perm = self._permutation(self.epoch)
            slots = perm[self.position:min(self.position + self.global_batch_size, len(self.dataset))]
            longest = max(len(self.dataset.input_ids[r]) for r in slots)
            longest = -(-longest // m) * m
        return min(longest, self.dataset.max_length)

    def __next__(self) -> dict[str, np.ndarray]:
        n, b, length = len(self.dataset), self.local_batch_size, self.batch_length()
        perm = self._permutation(self.epoch)
        input_ids = np.full((b, length), self.pad_id, dtype=np.int32)
        loss_mask = np.zeros((b, length), dtype=bool)
        attention_mask = np.zeros((b, length), dtype=bool)
        anchors = np.zeros((b, self.num_anchors), dtype=np.int32)
        anchor_keep = np.zeros((b, self.num_anchors), dtype=bool)
        first_slot = self.position + self.process_index * b
        for row in range(b):
            slot = first_slot + row
            if slot >= n:  # padding row of a partial last batch
                continue
            record = perm[slot]
            ids, mask = self.dataset.input_ids[record], self.dataset.loss_masks[record]
            input_ids[row, : len(ids)] = ids
            loss_mask[row, : len(mask)] = mask
            attention_mask[row, : len(ids)] = True
            if self.num_anchors:
                rng = np.random.default_rng([self.seed, self.epoch, slot, _ANCHOR_STREAM])
                anchors[row], anchor_keep[row] = sample_anchors(mask, self.num_anchors, rng)
        self._advance()
        batch = {"input_ids": input_ids, "loss_mask": loss_mask, "attention_mask": attention_mask}
        if self.num_anchors:
            batch.update(anchors=anchors, anchor_keep=anchor_keep)
        return batch

    def _advance(self) -> None:
        """Move to the next global batch, rolling over to the next epoch when this one is done."""
        n, g = len(self.dataset), self.global_batch_size
        self.position += g
        if self.position >= n or (self.drop_remainder and self.position + g > n):
            self.epoch += 1
            self.position = 0

    def state(self) -> dict[str, Any]:
        """JSON-serialisable position of the iterator (the next batch it will yield) and data fingerprint."""
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, **self._fingerprint}

    def restore(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state()`` of an iterator over the same data; the next batch is the one it would yield."""
        if not isinstance(state, Mapping):
            raise DataError(f"data iterator state must be a mapping, got {type(state).__name__}")
        missing = [k for k in _STATE_KEYS if k not in state]
        if missing:
            raise DataError(f"data iterator state is missing keys {missing} (has {sorted(state)})")
        if (state["num_records"], state["lengths_sha256"]) != (
            self._fingerprint["num_records"],
            self._fingerprint["lengths_sha256"],
        ):
            raise DataError(
                f"{self.dataset.path}: the training data changed since the iterator state was saved "
                f"(saved for {state['num_records']} records with lengths hash {str(state['lengths_sha256'])[:12]}, "
                f"now {self._fingerprint['num_records']} records with lengths hash "
                f"{self._fingerprint['lengths_sha256'][:12]}); resuming would not replay the same batches"
            )
        if state["seed"] != self.seed:
            raise DataError(
                f"data iterator state was saved with seed {state['seed']}, but this iterator uses {self.seed}"
            )
        epoch, position = state["epoch"], state["position"]
        for name, value in (("epoch", epoch), ("position", position)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise DataError(f"data iterator state: '{name}' must be a non-negative int, got {value!r}")
        if position >= len(self.dataset):
            raise DataError(f"data iterator state: position {position} is past the {len(self.dataset)} records")
        self.epoch, self.position = epoch, position
        if self.drop_remainder and position + self.global_batch_size > len(self.dataset):
            # Saved with a smaller global batch: this epoch has no full batch left.
            self.epoch, self.position = epoch + 1, 0


# ---------------------------------------------------------------------------
# Global arrays


def make_global_batch(
    local_batch: Mapping[str, np.ndarray], mesh: Mesh, batch_axes: Sequence[str] = ("data", "fsdp")
) -> dict[str, jax.Array]:
    """Global arrays, dim 0 sharded over ``batch_axes``, from this process's rows of each entry."""
    spec = PartitionSpec(tuple(batch_axes))
    sharding = NamedSharding(mesh, spec)
    shards = math.prod(mesh.shape[a] for a in batch_axes)
    out = {}
    for name, x in local_batch.items():
        global_rows = x.shape[0] * jax.process_count()
        if global_rows % shards:
            raise ConfigError(
                f"data: global batch of {global_rows} rows ('{name}') is not divisible by the {shards} "
                f"devices of mesh axes {tuple(batch_axes)}"
            )
        out[name] = jax.make_array_from_process_local_data(sharding, x)
    return out
