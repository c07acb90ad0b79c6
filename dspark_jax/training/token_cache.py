"""Tokenized caches: a corpus tokenized once (``python -m train.tokenize``), read by every run.

Tokenizing a large corpus takes longer than a short training run, and every process of a job
would repeat it at every start (and hold all of it in memory); a cache is made once, by parallel
worker processes, and a run opens it in seconds and reads only the records of its own rows.

A cache directory::

    manifest.json            written last: a cache without one is unfinished
    lengths.npy              int32 [num_records], tokens of each record, in record order
    shard-00000.arrayrecord  the kept records of input lines [0, shard_lines) of the first file, ...
    shard-00000.json         that shard's summary: records, size, sha256, lengths, counts, errors

Records are in input order (files as given, lines in file order): for one file, exactly the records
and order of :func:`~dspark_jax.training.data.load_conversations`, tokenized by the same loop
(:func:`~dspark_jax.training.data.tokenize_jsonl`), so a run reads the same batches from the cache
as from the JSONL file, and either may resume the other's checkpoints. One ArrayRecord record
(group size 1, for random access) is ``uint32 L | int32 ids [L] | packbits(loss mask)``, little-endian.

A shard is the unit of work and of resumption: a worker tokenizes its lines into a temporary file,
renames it, then writes the summary; a rerun skips every shard whose summary carries the cache's
fingerprint, a sha256 over the format version, the tokenizer (``tokenizer.json`` bytes), the chat
template (source and special tokens), the settings (max_length, min_length, enable_thinking,
system_prompt), the shard size and each input file's size and sha256. What a shard holds does not
depend on the number of workers, so neither does any byte of the cache.

:func:`open_cache` refuses, each with one DataError naming the file: a directory without a manifest
(tokenizing was interrupted), a manifest of another format or version, a cache made with another
tokenizer, or with another chat template or settings than the run's (stale), a missing shard or
lengths file, a shard whose size, record count or sha256 is not the manifest's (corrupt). It runs
before a trainer touches its checkpoints. ``verify=False`` skips the sha256 (which reads every
byte); ArrayRecord's own checksums still refuse a damaged record when it is read.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import multiprocessing
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dspark_jax.errors import ConfigError, DataError
from dspark_jax.formats.tokenizer import Tokenizer, load_tokenizer
from dspark_jax.training.data import (
    Dataset,
    DatasetStats,
    check_lengths,
    check_usable,
    load_conversations,
    pad_id_of,
    records_fingerprint,
    tokenize_jsonl,
)

FORMAT = "dspark-jax tokenized conversations"
VERSION = 1
MANIFEST = "manifest.json"
LENGTHS = "lengths.npy"
DEFAULT_SHARD_LINES = 4096
MAX_ERRORS_KEPT = 1000  # skip reasons kept in the manifest (the counts are always complete)
_WRITER_OPTIONS = "group_size:1"  # one record per chunk: random access reads only that record
_MANIFEST_KEYS = ("fingerprint", "tokenizer", "settings", "num_records", "lengths", "shards", "stats",
                  "errors")


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.arrayrecord"


def _summary_name(index: int) -> str:
    return f"shard-{index:05d}.json"


# ----------------------------------------------------------------------------- records


def encode_record(ids: np.ndarray, mask: np.ndarray) -> bytes:
    """One record's bytes (see the module docstring)."""
    ids = np.asarray(ids, dtype="<i4")
    return (np.asarray([len(ids)], dtype="<u4").tobytes() + ids.tobytes()
            + np.packbits(np.asarray(mask, dtype=bool)).tobytes())


def decode_record(data: bytes, where: str) -> tuple[np.ndarray, np.ndarray]:
    """(ids int32 [L], loss mask bool [L]) of one record's bytes; DataError naming ``where`` when
    they are not a record."""
    n = int(np.frombuffer(data, dtype="<u4", count=1)[0]) if len(data) >= 4 else -1
    if n < 0 or len(data) != 4 + 4 * n + (n + 7) // 8:
        raise DataError(f"{where}: corrupt record ({len(data)} bytes are not a record of "
                        f"{max(n, 0)} tokens); the cache is damaged: tokenize the data again")
    ids = np.frombuffer(data, dtype="<i4", count=n, offset=4).astype(np.int32)
    mask = np.unpackbits(np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * n), count=n).astype(bool)
    return ids, mask


# ----------------------------------------------------------------------------- identity


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _sha256_json(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


def tokenizer_identity(tokenizer: Tokenizer) -> dict[str, Any]:
    """What of a tokenizer decides the records: its ``tokenizer.json`` bytes and its chat template."""
    template = tokenizer.chat_template
    return {
        "dir": str(tokenizer.path.parent),
        "tokenizer_sha256": _sha256_file(tokenizer.path),
        "chat_template": template.origin,
        "chat_template_sha256": _sha256_json({"source": template.source,
                                              "special_tokens": dict(template.special_tokens)}),
        "vocab_size": tokenizer.vocab_size,
        "pad_id": pad_id_of(tokenizer),
    }


def cache_settings(*, max_length: int, min_length: int, enable_thinking: bool | None,
                   system_prompt: str | None) -> dict[str, Any]:
    """The settings a cache is made with and must match (the trainer's: ``train.max_length``,
    ``drafter.block_size + 1``, ``train.enable_thinking``, ``train.system_prompt``)."""
    return {"max_length": max_length, "min_length": min_length, "enable_thinking": enable_thinking,
            "system_prompt": system_prompt}


# ----------------------------------------------------------------------------- writing


@dataclass(frozen=True)
class Piece:
    """The input lines of one shard: ``num_lines`` lines of ``file`` from byte ``offset`` (line ``first_line``)."""

    index: int
    file: str
    offset: int
    first_line: int
    num_lines: int


def scan_sources(paths: Sequence[str | Path], shard_lines: int) -> tuple[list[dict], list[Piece]]:
    """({path, size, lines, sha256} per input file, the pieces they split into)."""
    sources, pieces = [], []
    for path in paths:
        try:
            handle = open(path, "rb")
        except OSError as err:
            raise DataError(f"{path}: cannot open file ({err.strerror or err})") from err
        h, offset, lines, starts = hashlib.sha256(), 0, 0, []
        with handle:
            for raw in handle:
                if lines % shard_lines == 0:
                    starts.append((offset, lines + 1))
                h.update(raw)
                offset += len(raw)
                lines += 1
        for start, first in starts:
            pieces.append(Piece(len(pieces), str(path), start, first, min(shard_lines, lines - first + 1)))
        sources.append({"path": str(path), "size": offset, "lines": lines, "sha256": h.hexdigest()})
    return sources, pieces


def _write_json(path: Path, value: Any) -> None:
    """Write-then-rename: a reader sees the old file or the whole new one."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value, indent=1) + "\n")
    os.replace(tmp, path)


def write_shard(piece: Piece, *, tokenizer: Tokenizer, settings: dict, out: Path,
                fingerprint: str) -> dict[str, Any]:
    """Tokenizes one piece into its shard and summary; returns the summary."""
    from array_record.python.array_record_module import ArrayRecordWriter

    records = tokenize_jsonl(piece.file, tokenizer, **settings, offset=piece.offset,
                             first_line=piece.first_line, num_lines=piece.num_lines)
    name = shard_name(piece.index)
    tmp = out / (name + ".tmp")
    writer = ArrayRecordWriter(str(tmp), _WRITER_OPTIONS)
    for ids, mask in zip(records.input_ids, records.loss_masks):
        writer.write(encode_record(ids, mask))
    writer.close()
    summary = {"fingerprint": fingerprint, "index": piece.index, "file": name,
               "records": len(records.input_ids), "size": tmp.stat().st_size,
               "sha256": _sha256_file(tmp), "lengths": [len(x) for x in records.input_ids],
               "stats": records.stats.as_dict(), "errors": list(records.errors[:MAX_ERRORS_KEPT])}
    os.replace(tmp, out / name)
    _write_json(out / _summary_name(piece.index), summary)
    return summary


_WORKER: dict[str, Any] = {}  # a tokenizing worker process's tokenizer and settings


def _init_worker(tokenizer_dir: str, settings: dict, out: str, fingerprint: str) -> None:
    _WORKER.update(tokenizer=load_tokenizer(tokenizer_dir), settings=settings, out=Path(out),
                   fingerprint=fingerprint)


def _write_shard_in_worker(piece: Piece) -> dict[str, Any]:
    return write_shard(piece, **_WORKER)


def _finished_shard(out: Path, index: int, fingerprint: str) -> dict | None:
    """The summary of a shard a previous run finished, or None; DataError when it belongs to a
    cache of other inputs or settings."""
    path = out / _summary_name(index)
    try:
        summary = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return None  # cut short while written: make the shard again
    if not isinstance(summary, dict) or summary.get("fingerprint") != fingerprint:
        raise DataError(f"{path}: a shard of an unfinished cache of other inputs or settings; give "
                        f"another output directory or remove {out}")
    shard = out / summary.get("file", "")
    if not shard.is_file() or shard.stat().st_size != summary.get("size"):
        return None
    return summary


def tokenize_corpus(tokenizer_dir: str | Path, data_files: Sequence[str | Path], out_dir: str | Path, *,
                    max_length: int, min_length: int, enable_thinking: bool | None = None,
                    system_prompt: str | None = None, workers: int = 1,
                    shard_lines: int = DEFAULT_SHARD_LINES,
                    log: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """Tokenizes JSONL conversation files into a cache at ``out_dir`` (see the module docstring)
    with ``workers`` processes (1: in this one); returns its manifest.

    Resumes an unfinished cache of the same inputs and settings; a finished one is returned as it
    is. Refuses (DataError) a directory holding a cache of other inputs or settings, and, as
    :func:`~dspark_jax.training.data.load_conversations` does, inputs without a usable record.
    """
    check_lengths(max_length, min_length)
    for name, value in (("workers", workers), ("shard_lines", shard_lines)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"tokenize: {name} must be an int >= 1, got {value!r}")
    if not data_files:
        raise ConfigError("tokenize: no data files given")
    tokenizer = load_tokenizer(tokenizer_dir)
    settings = cache_settings(max_length=max_length, min_length=min_length,
                              enable_thinking=enable_thinking, system_prompt=system_prompt)
    identity = {**tokenizer_identity(tokenizer), "dir": str(tokenizer_dir)}
    sources, pieces = scan_sources(data_files, shard_lines)
    fingerprint = _sha256_json({"format": FORMAT, "version": VERSION, "tokenizer":
                                {k: identity[k] for k in ("tokenizer_sha256", "chat_template_sha256")},
                                "settings": settings, "shard_lines": shard_lines,
                                "sources": [{k: s[k] for k in ("size", "sha256")} for s in sources]})
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if (out / MANIFEST).exists():
        manifest = read_manifest(out)
        if manifest["fingerprint"] == fingerprint:
            log(f"{out}: already complete ({manifest['num_records']} records)")
            return manifest
        raise DataError(f"{out / MANIFEST}: a finished cache of other inputs or settings (fingerprint "
                        f"{str(manifest['fingerprint'])[:12]}; these make {fingerprint[:12]}); give "
                        f"another output directory or remove {out}")
    for stale in out.glob("*.tmp"):  # what a killed run was writing
        stale.unlink()
    done = {p.index: s for p in pieces if (s := _finished_shard(out, p.index, fingerprint))}
    todo = [p for p in pieces if p.index not in done]
    log(f"{len(pieces)} shards of up to {shard_lines} lines from {len(sources)} file(s): "
        f"{len(done)} done before, {len(todo)} to tokenize with {workers} worker(s)")
    t0, lines = time.perf_counter(), 0
    for summary in _tokenize_pieces(todo, workers, tokenizer, tokenizer_dir, settings, out, fingerprint):
        done[summary["index"]] = summary
        lines += summary["stats"]["records_read"]
        log(f"{summary['file']}: {summary['records']} records ({len(done)}/{len(pieces)} shards, "
            f"{lines / max(time.perf_counter() - t0, 1e-9):,.0f} records read/s)")
    return _finish(out, [done[p.index] for p in pieces], sources, identity, settings, shard_lines,
                   fingerprint)


def _tokenize_pieces(todo: list[Piece], workers: int, tokenizer: Tokenizer, tokenizer_dir,
                     settings: dict, out: Path, fingerprint: str) -> Iterator[dict]:
    """Shard summaries as the pieces are done, in any order."""
    if workers == 1 or len(todo) <= 1:
        for piece in todo:
            yield write_shard(piece, tokenizer=tokenizer, settings=settings, out=out, fingerprint=fingerprint)
        return
    # spawn: the caller may have imported jax, whose threads a forked child would not have.
    context = multiprocessing.get_context("spawn")
    with context.Pool(min(workers, len(todo)), initializer=_init_worker,
                      initargs=(str(tokenizer_dir), settings, str(out), fingerprint)) as pool:
        yield from pool.imap_unordered(_write_shard_in_worker, todo)


def _finish(out: Path, summaries: list[dict], sources: list[dict], identity: dict, settings: dict,
            shard_lines: int, fingerprint: str) -> dict[str, Any]:
    """Writes lengths.npy, then the manifest, from the shards' summaries."""
    stats = DatasetStats.sum([DatasetStats(**s["stats"]) for s in summaries])
    errors = [e for s in summaries for e in s["errors"]][:MAX_ERRORS_KEPT]
    check_usable(", ".join(s["path"] for s in sources), stats, errors,
                 max_length=settings["max_length"], min_length=settings["min_length"])
    lengths = np.asarray([n for s in summaries for n in s["lengths"]], dtype="<i4")
    tmp = out / (LENGTHS + ".tmp")
    with open(tmp, "wb") as f:
        np.save(f, lengths, allow_pickle=False)
    os.replace(tmp, out / LENGTHS)
    manifest = {
        "format": FORMAT, "version": VERSION, "fingerprint": fingerprint, "tokenizer": identity,
        "settings": settings, "shard_lines": shard_lines, "sources": sources,
        "num_records": len(lengths), "records_fingerprint": records_fingerprint(lengths),
        "lengths": {"file": LENGTHS, "sha256": _sha256_file(out / LENGTHS)},
        "shards": [{k: s[k] for k in ("file", "records", "size", "sha256")} for s in summaries],
        "stats": stats.as_dict(), "errors": errors,
    }
    _write_json(out / MANIFEST, manifest)
    return manifest


# ----------------------------------------------------------------------------- reading


def read_manifest(directory: str | Path) -> dict[str, Any]:
    """The manifest of a cache directory; DataError when there is none or it is not one we read."""
    directory = Path(directory)
    path = directory / MANIFEST
    if not path.is_file():
        if any(directory.glob("shard-*.json")):
            raise DataError(f"{directory}: an unfinished tokenized cache (no {MANIFEST}: tokenizing was "
                            "interrupted); run the same `python -m train.tokenize` command again to finish it")
        raise DataError(f"{directory}: not a tokenized cache (no {MANIFEST}); make one with "
                        "`python -m train.tokenize`, or give a JSONL file")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise DataError(f"{path}: corrupt manifest, not readable JSON ({err})") from err
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise DataError(f"{path}: not a manifest of a dspark-jax tokenized cache (expected "
                        f"format {FORMAT!r})")
    if manifest.get("version") != VERSION:
        raise DataError(f"{path}: a tokenized cache of format version {manifest.get('version')!r}; this "
                        f"dspark-jax reads version {VERSION}: tokenize the data again")
    missing = [k for k in _MANIFEST_KEYS if k not in manifest]
    if missing:
        raise DataError(f"{path}: corrupt manifest, missing keys {missing}")
    return manifest


def _check_identity(directory: Path, manifest: dict, tokenizer: Tokenizer, settings: dict) -> None:
    """Another tokenizer, or another chat template or settings than the run's (stale), is refused."""
    made, now = manifest["tokenizer"], tokenizer_identity(tokenizer)
    again = "tokenize the data again (`python -m train.tokenize`) with the run's tokenizer and settings"
    if made.get("tokenizer_sha256") != now["tokenizer_sha256"]:
        raise DataError(f"{directory}: made with another tokenizer ({made.get('dir')}/tokenizer.json, "
                        f"sha256 {str(made.get('tokenizer_sha256'))[:12]}) than the run's {tokenizer.path} "
                        f"(sha256 {now['tokenizer_sha256'][:12]}); {again}")
    if made.get("chat_template_sha256") != now["chat_template_sha256"]:
        raise DataError(f"{directory}: stale: made with another chat template ({made.get('chat_template')}) "
                        f"than the run's ({now['chat_template']}); {again}")
    diff = [f"{k} {manifest['settings'].get(k)!r} (the run's: {v!r})" for k, v in settings.items()
            if manifest["settings"].get(k) != v]
    if diff:
        raise DataError(f"{directory}: stale: made with " + ", ".join(diff) + f"; {again}")


def _load_lengths(directory: Path, manifest: dict) -> np.ndarray:
    entry = manifest["lengths"]
    path = directory / str(entry.get("file"))
    if not path.is_file():
        raise DataError(f"{path}: missing (the lengths file {MANIFEST} lists); tokenize the data again")
    if _sha256_file(path) != entry.get("sha256"):
        raise DataError(f"{path}: corrupt (sha256 is not the one {MANIFEST} lists); tokenize the data again")
    lengths = np.load(path, allow_pickle=False)
    counts = [s.get("records") for s in manifest["shards"]]
    if lengths.ndim != 1 or len(lengths) != manifest["num_records"] or sum(counts) != len(lengths):
        raise DataError(f"{directory}: corrupt: {len(lengths)} lengths, {manifest['num_records']} records "
                        f"and {sum(counts)} shard records in {MANIFEST} should agree")
    return lengths.astype(np.int64)


def _check_shards(directory: Path, manifest: dict, verify: bool) -> None:
    from array_record.python.array_record_module import ArrayRecordReader

    shards = manifest["shards"]
    for k, entry in enumerate(shards):
        path = directory / str(entry.get("file"))
        if not path.is_file():
            raise DataError(f"{path}: missing shard ({k + 1} of the {len(shards)} {MANIFEST} lists); "
                            "tokenize the data again")
        size = path.stat().st_size
        if size != entry.get("size"):
            raise DataError(f"{path}: corrupt shard: {size} bytes, {MANIFEST} says {entry.get('size')}; "
                            "tokenize the data again")
        try:
            reader = ArrayRecordReader(str(path))
            count = reader.num_records()
            reader.close()
        except Exception as err:  # noqa: BLE001 (riegeli reports damage as RuntimeError or worse)
            raise DataError(f"{path}: corrupt shard, not readable ArrayRecord ({err})") from err
        if count != entry.get("records"):
            raise DataError(f"{path}: corrupt shard: {count} records, {MANIFEST} says "
                            f"{entry.get('records')}; tokenize the data again")
        if verify and _sha256_file(path) != entry.get("sha256"):
            raise DataError(f"{path}: corrupt shard: its sha256 is not the one {MANIFEST} lists; "
                            "tokenize the data again")


class TokenizedCache:
    """A checked cache directory, as a record source (:class:`~dspark_jax.training.data.RecordSource`).

    Records are read through grain's ArrayRecordDataSource on first use; a pickled copy (what a
    grain worker gets) carries paths and lengths, not open files.
    """

    def __init__(self, directory: Path, manifest: dict, lengths: np.ndarray) -> None:
        self.path = str(directory)
        self.max_length = int(manifest["settings"]["max_length"])
        self.pad_id = int(manifest["tokenizer"]["pad_id"])
        self.stats = DatasetStats(**manifest["stats"])
        self.errors = tuple(manifest["errors"])
        self.num_shards = len(manifest["shards"])
        self._lengths = lengths
        nonempty = [s for s in manifest["shards"] if s["records"]]
        self._files = [str(directory / s["file"]) for s in nonempty]
        self._ends = np.cumsum([s["records"] for s in nonempty]).tolist()
        self._source = None

    def __len__(self) -> int:
        return len(self._lengths)

    @property
    def lengths(self) -> np.ndarray:
        return self._lengths

    def fingerprint(self) -> dict[str, Any]:
        return records_fingerprint(self._lengths)

    def _where(self, index: int) -> str:
        k = bisect.bisect_right(self._ends, index)
        return f"{self._files[k]}: record {index - (self._ends[k - 1] if k else 0)}"

    def record(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        if self._source is None:
            import grain

            self._source = grain.sources.ArrayRecordDataSource(self._files)
        try:
            data = self._source[index]
        except Exception as err:  # noqa: BLE001 (riegeli reports damage as RuntimeError)
            raise DataError(f"{self._where(index)}: cannot be read ({err}); the cache is damaged: "
                            "tokenize the data again") from err
        ids, mask = decode_record(data, self._where(index))
        if len(ids) != self._lengths[index]:
            raise DataError(f"{self._where(index)}: corrupt record of {len(ids)} tokens, {LENGTHS} "
                            f"says {self._lengths[index]}; tokenize the data again")
        return ids, mask

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_source": None}


def open_cache(directory: str | Path, tokenizer: Tokenizer, *, max_length: int, min_length: int,
               enable_thinking: bool | None = None, system_prompt: str | None = None,
               verify: bool = True) -> TokenizedCache:
    """A cache directory checked against the run's tokenizer and settings (see the module docstring)."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    _check_identity(directory, manifest, tokenizer, cache_settings(
        max_length=max_length, min_length=min_length, enable_thinking=enable_thinking,
        system_prompt=system_prompt))
    lengths = _load_lengths(directory, manifest)
    _check_shards(directory, manifest, verify)
    return TokenizedCache(directory, manifest, lengths)


def open_training_data(path: str | Path, tokenizer: Tokenizer, *, max_length: int, min_length: int,
                       enable_thinking: bool | None = None, system_prompt: str | None = None,
                       verify: bool = True) -> Dataset | TokenizedCache:
    """A JSONL file tokenized in memory, or a tokenized cache directory (checked): the same records."""
    kwargs = dict(max_length=max_length, min_length=min_length, enable_thinking=enable_thinking,
                  system_prompt=system_prompt)
    if Path(path).is_dir():
        return open_cache(path, tokenizer, **kwargs, verify=verify)
    return load_conversations(path, tokenizer, **kwargs)
