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

Records come from a :class:`RecordSource`: a :class:`Dataset`, or a tokenized cache
(:mod:`dspark_jax.training.token_cache`) holding the same records in the same order, so one
iterator yields the same batches from either. One function builds batches, :class:`LocalBatches`;
with ``workers > 0`` grain worker processes run it for the next batches while a step runs. The
iterator's state is its own (epoch, position), not grain's, so a run may resume with another
number of workers, or from a cache of the data it was started on from JSONL.

Why not grain's ``IndexSampler`` with ``ShardByJaxProcess``: it gives each process a contiguous
range of the *records* before shuffling, so what a process trains on would depend on the number of
processes, and a 2-process run would not see the batches of a 1-process run. Here every process
derives the same global permutation and builds only its own rows of each global batch.

jax is imported only where global arrays are made: the tokenizing workers of
:mod:`~dspark_jax.training.token_cache` import this module and need none of it.
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from dspark_jax.errors import ConfigError, DataError
from dspark_jax.formats.records import TrainingExample, iter_jsonl, training_example
from dspark_jax.formats.tokenizer import END_OF_TEXT, Tokenizer

if TYPE_CHECKING:
    import jax
    from jax.sharding import Mesh

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

    @classmethod
    def sum(cls, parts: Sequence[DatasetStats]) -> DatasetStats:
        """The counts of the pieces of a file, or of several files, together."""
        return cls(**{f.name: sum(getattr(p, f.name) for p in parts) for f in fields(cls)})


def records_fingerprint(lengths: np.ndarray) -> dict[str, Any]:
    """Number of records and a hash of their lengths; iterator states carry it to detect changed data."""
    lengths = np.asarray(lengths, dtype="<i8")
    return {"num_records": len(lengths), "lengths_sha256": hashlib.sha256(lengths.tobytes()).hexdigest()}


class RecordSource(Protocol):
    """Random access to tokenized training records: a :class:`Dataset` or a tokenized cache.

    lengths: int [n], tokens of each record (<= max_length)
    record(i): (input ids int32 [lengths[i]], loss mask bool [lengths[i]])
    """

    path: str
    max_length: int
    pad_id: int
    stats: DatasetStats
    errors: tuple[str, ...]

    def __len__(self) -> int: ...

    @property
    def lengths(self) -> np.ndarray: ...

    def record(self, index: int) -> tuple[np.ndarray, np.ndarray]: ...

    def fingerprint(self) -> dict[str, Any]: ...


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

    @functools.cached_property
    def lengths(self) -> np.ndarray:
        """int64 [n]: tokens of each record."""
        return np.asarray([len(x) for x in self.input_ids], dtype=np.int64)

    def record(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """(input ids, loss mask) of record ``index``."""
        return self.input_ids[index], self.loss_masks[index]

    def fingerprint(self) -> dict[str, Any]:
        """See :func:`records_fingerprint`."""
        return records_fingerprint(self.lengths)


def is_too_short(loss_mask: np.ndarray, min_length: int) -> bool:
    """Whether a record, already cut to max_length, is too short to train on (see :class:`DatasetStats`)."""
    return len(loss_mask) < min_length or not bool((loss_mask[:-1] & loss_mask[1:]).any())


def training_examples(path: str | Path, tokenizer: Tokenizer, *, enable_thinking: bool | None = None,
                      system_prompt: str | None = None, offset: int = 0, first_line: int = 1,
                      num_lines: int | None = None
                      ) -> Iterator[tuple[str, Any, TrainingExample | DataError | None]]:
    """(file:line, the parsed line, its `training_example` or the DataError that refused it) per
    non-blank line of a JSONL file, or of the piece of it that ``offset``, ``first_line`` and
    ``num_lines`` name (see :func:`~dspark_jax.formats.records.iter_jsonl`)."""
    for line_no, obj in iter_jsonl(path, offset=offset, first_line=first_line, num_lines=num_lines):
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


def check_lengths(max_length: int, min_length: int) -> None:
    """The cut and the shortest record a dataset keeps must make sense together."""
    if min_length < 2:
        raise ConfigError(f"data: min_length must be >= 2 (two tokens make one anchor), got {min_length}")
    if max_length < min_length:
        raise ConfigError(f"data: max_length ({max_length}) must be >= min_length ({min_length})")


@dataclass(frozen=True)
class TokenizedRecords:
    """What tokenizing a file, or a piece of one, gives: the kept records, counts and skip reasons."""

    input_ids: list[np.ndarray]
    loss_masks: list[np.ndarray]
    stats: DatasetStats
    errors: tuple[str, ...]


def tokenize_jsonl(path: str | Path, tokenizer: Tokenizer, *, max_length: int, min_length: int,
                   enable_thinking: bool | None = None, system_prompt: str | None = None,
                   offset: int = 0, first_line: int = 1, num_lines: int | None = None
                   ) -> TokenizedRecords:
    """Tokenize every ``conversations``/``turns`` record of a JSONL file, or of a piece of it (see
    :func:`training_examples`), as :func:`load_conversations` does, without its check that some
    record is usable. The one tokenizing loop of JSONL files and tokenized caches."""
    check_lengths(max_length, min_length)
    input_ids: list[np.ndarray] = []
    loss_masks: list[np.ndarray] = []
    read = no_assistant = too_short = truncated = 0
    errors: list[str] = []
    for _, _, example in training_examples(path, tokenizer, enable_thinking=enable_thinking,
                                           system_prompt=system_prompt, offset=offset,
                                           first_line=first_line, num_lines=num_lines):
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
    return TokenizedRecords(input_ids, loss_masks, stats, tuple(errors))


def check_usable(path: str | Path, stats: DatasetStats, errors: Sequence[str], *, max_length: int,
                 min_length: int) -> None:
    """DataError naming ``path`` and the skip counts when no record was kept."""
    if stats.kept:
        return
    raise DataError(
        f"{path}: no usable training records ({stats.records_read} read, {stats.skipped_bad} bad"
        + (f" (first: {errors[0]})" if errors else "")
        + f", {stats.skipped_no_assistant} without an assistant turn, "
        f"{stats.skipped_too_short} shorter than {min_length} tokens or with fewer than 2 adjacent "
        f"supervised tokens after cutting to {max_length})"
    )


def pad_id_of(tokenizer: Tokenizer) -> int:
    """Id that pads rows of a batch: ``<|endoftext|>`` when the tokenizer has it, else 0."""
    pad_id = tokenizer.backend.token_to_id(END_OF_TEXT)
    return 0 if pad_id is None else int(pad_id)


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
    records = tokenize_jsonl(path, tokenizer, max_length=max_length, min_length=min_length,
                             enable_thinking=enable_thinking, system_prompt=system_prompt)
    check_usable(path, records.stats, records.errors, max_length=max_length, min_length=min_length)
    return Dataset(
        path=str(path),
        input_ids=records.input_ids,
        loss_masks=records.loss_masks,
        max_length=max_length,
        pad_id=pad_id_of(tokenizer),
        stats=records.stats,
        errors=records.errors,
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

_ENDLESS = 1 << 62  # "length" of the endless stream of batches grain indexes
_BUFFER_PER_WORKER = 2  # batches each grain worker builds ahead


class LocalBatches:
    """This process's batches from a point of the stream on, by index: element ``j`` is the ``j``-th
    batch a :class:`BatchIterator` at (``epoch``, ``position``) yields (see its docstring for the
    layout). The one place batches are built, whether by the iterator itself or by grain's worker
    processes, which get a pickled copy (a :class:`Dataset` travels whole; a cache by its paths)."""

    def __init__(self, source: RecordSource, *, global_batch_size: int, process_index: int,
                 process_count: int, num_anchors: int, seed: int, drop_remainder: bool, pad_id: int,
                 pad_to_multiple: int, epoch: int, position: int) -> None:
        self.source = source
        self.global_batch_size = global_batch_size
        self.local_batch_size = global_batch_size // process_count
        self.process_index = process_index
        self.num_anchors = num_anchors
        self.seed = seed
        self.drop_remainder = drop_remainder
        self.pad_id = pad_id
        self.pad_to_multiple = pad_to_multiple
        self.epoch, self.position = epoch, position
        self._perm_epoch = -1
        self._perm = np.empty(0, dtype=np.int64)

    def __len__(self) -> int:
        return _ENDLESS

    def __repr__(self) -> str:
        return (f"LocalBatches({self.source.path!r}, rows {self.process_index} x {self.local_batch_size} "
                f"of {self.global_batch_size}, seed {self.seed}, from epoch {self.epoch} slot {self.position})")

    @property
    def steps_per_epoch(self) -> int:
        n, g = len(self.source), self.global_batch_size
        return n // g if self.drop_remainder else math.ceil(n / g)

    def locate(self, j: int) -> tuple[int, int]:
        """(epoch, first slot) of batch ``j``: the epoch's permutation slot where its global batch starts."""
        n, g = len(self.source), self.global_batch_size
        left = (n - self.position) // g if self.drop_remainder else math.ceil((n - self.position) / g)
        if j < left:
            return self.epoch, self.position + j * g
        j -= left
        return self.epoch + 1 + j // self.steps_per_epoch, (j % self.steps_per_epoch) * g

    def permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(len(self.source))
            self._perm_epoch = epoch
        return self._perm

    def batch_length(self, epoch: int, position: int) -> int:
        """L of the global batch at (epoch, position): from the lengths of all its records, so
        every process agrees although each reads only its own rows."""
        max_length, m = self.source.max_length, self.pad_to_multiple
        if not m:
            return max_length
        slots = self.permutation(epoch)[position:position + self.global_batch_size]
        longest = int(self.source.lengths[slots].max())
        return min(-(-longest // m) * m, max_length)

    def __getitem__(self, j: int) -> dict[str, np.ndarray]:
        epoch, position = self.locate(int(j))
        n, b, length = len(self.source), self.local_batch_size, self.batch_length(epoch, position)
        perm = self.permutation(epoch)
        input_ids = np.full((b, length), self.pad_id, dtype=np.int32)
        loss_mask = np.zeros((b, length), dtype=bool)
        attention_mask = np.zeros((b, length), dtype=bool)
        anchors = np.zeros((b, self.num_anchors), dtype=np.int32)
        anchor_keep = np.zeros((b, self.num_anchors), dtype=bool)
        first_slot = position + self.process_index * b
        for row in range(b):
            slot = first_slot + row
            if slot >= n:  # padding row of a partial last batch
                continue
            ids, mask = self.source.record(int(perm[slot]))
            input_ids[row, : len(ids)] = ids
            loss_mask[row, : len(mask)] = mask
            attention_mask[row, : len(ids)] = True
            if self.num_anchors:
                rng = np.random.default_rng([self.seed, epoch, slot, _ANCHOR_STREAM])
                anchors[row], anchor_keep[row] = sample_anchors(mask, self.num_anchors, rng)
        batch = {"input_ids": input_ids, "loss_mask": loss_mask, "attention_mask": attention_mask}
        if self.num_anchors:
            batch.update(anchors=anchors, anchor_keep=anchor_keep)
        return batch


def _prefetching(batches: LocalBatches, workers: int):
    """A grain iterator over ``batches`` whose ``workers`` processes build the next ones ahead."""
    import grain
    from absl import flags

    # grain's worker processes read absl flags; outside an absl app nobody has parsed them.
    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
    ds = grain.MapDataset.source(batches).to_iter_dataset(
        grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
    return iter(ds.mp_prefetch(grain.MultiprocessingOptions(
        num_workers=workers, per_worker_buffer_size=_BUFFER_PER_WORKER)))


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

    ``workers > 0``: that many grain worker processes build the batches (the same ones) ahead of
    ``next()``; :meth:`close` stops them.
    """

    def __init__(
        self,
        dataset: RecordSource,
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
        workers: int = 0,
    ) -> None:
        n = len(dataset)
        if global_batch_size < 1 or num_anchors < 0 or block_size < 1:
            raise ConfigError(
                f"data: global_batch_size ({global_batch_size}) and block_size ({block_size}) must be "
                f">= 1, num_anchors ({num_anchors}) >= 0"
            )
        if pad_to_multiple < 0:
            raise ConfigError(f"data: pad_to_multiple must be >= 0, got {pad_to_multiple}")
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
            raise ConfigError(f"data: workers must be a non-negative int, got {workers!r}")
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
        self.workers = workers
        self._fingerprint = dataset.fingerprint()
        self.epoch = 0
        self.position = 0  # slot of the permutation where the next global batch starts
        self._restart()

    def _restart(self) -> None:
        """Build batches from (epoch, position) on; stops the workers of the stream before."""
        self.close()
        self._batches = LocalBatches(
            self.dataset, global_batch_size=self.global_batch_size, process_index=self.process_index,
            process_count=self.process_count, num_anchors=self.num_anchors, seed=self.seed,
            drop_remainder=self.drop_remainder, pad_id=self.pad_id,
            pad_to_multiple=self.pad_to_multiple, epoch=self.epoch, position=self.position)
        self._taken = 0  # batches of self._batches yielded so far

    @property
    def steps_per_epoch(self) -> int:
        """Global batches in one epoch."""
        return self._batches.steps_per_epoch

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        return self

    def batch_length(self) -> int:
        """L of the next global batch (see the class docstring)."""
        return self._batches.batch_length(self.epoch, self.position)

    def __next__(self) -> dict[str, np.ndarray]:
        if not self.workers:
            batch = self._batches[self._taken]
        else:
            if self._loader is None:
                self._loader = _prefetching(self._batches, self.workers)
            # Out of grain's shared memory at once: its blocks are freed when the arrays are.
            batch = {k: np.array(v) for k, v in next(self._loader).items()}
        self._taken += 1
        self._advance()
        return batch

    def close(self) -> None:
        """Stops the worker processes, if any (the next ``next()`` starts new ones)."""
        loader, self._loader = getattr(self, "_loader", None), None
        if loader is not None:
            loader.close()

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
        self._restart()


# ---------------------------------------------------------------------------
# Global arrays


def make_global_batch(
    local_batch: Mapping[str, np.ndarray], mesh: Mesh, batch_axes: Sequence[str] = ("data", "fsdp")
) -> dict[str, jax.Array]:
    """Global arrays, dim 0 sharded over ``batch_axes``, from this process's rows of each entry."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

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
