"""Strict, zero-copy reader and writer of the safetensors checkpoint format.

Layout: 8-byte little-endian u64 N, N bytes of UTF-8 JSON header ({name: {"dtype", "shape",
"data_offsets": [begin, end]}} with byte offsets relative to the data buffer, plus an optional
"__metadata__": {str: str}), then the little-endian, C-contiguous tensor data.

We avoid the `safetensors` package at run time: each tensor is a read-only np.memmap view (no copy,
paged in on demand), BF16/F8 map to ml_dtypes, and every malformed input raises CheckpointError
naming the file (and key) and the problem.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import pathlib
import re
import secrets
import struct
import tempfile
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

import ml_dtypes
import numpy as np

from dspark_jax.errors import CheckpointError

__all__ = ["TensorInfo", "SafetensorsFile", "CheckpointFiles", "save_file", "save_dir"]

SINGLE_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
# safetensors dtype code -> numpy dtype, little-endian (1-byte and ml_dtypes types have no order).
_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn), "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "I16": np.dtype("<i2"), "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"), "U32": np.dtype("<u4"), "U16": np.dtype("<u2"), "U8": np.dtype("u1"),
    "BOOL": np.dtype(bool), "C64": np.dtype("<c8"),
}
_MAX_HEADER_BYTES = 100_000_000  # same cap as the reference reader: a corrupt length can't OOM us
_ALIGN = 8  # writers pad the header so the data buffer starts 8-byte aligned
_WRITE_CHUNK = 1 << 26  # 64 MiB per write(): the OS caps one write() at ~2 GiB
_SHARD_RE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
_TRUNCATED = "(corrupt or truncated safetensors file)"


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """dtype (numpy; BF16 -> ml_dtypes.bfloat16) and shape of one stored tensor."""

    dtype: np.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        """Size of the tensor data in bytes."""
        return math.prod(self.shape) * self.dtype.itemsize


def _reject_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # json.loads silently keeps the last duplicate; in a header that would hide a tensor.
    if len(out := dict(pairs)) != len(pairs):
        raise ValueError(f"duplicate key {Counter(k for k, _ in pairs).most_common(1)[0][0]!r}")
    return out


class _Tensors:
    """Name lookup shared by SafetensorsFile and CheckpointFiles."""

    _table: dict[str, Any]  # tensor name -> where to find it
    _where: pathlib.Path  # named in errors

    def keys(self) -> list[str]:
        """Tensor names, sorted."""
        return sorted(self._table)

    def __contains__(self, key: object) -> bool:
        return key in self._table

    def _lookup(self, key: str) -> Any:
        if key not in self._table:
            close = difflib.get_close_matches(str(key), list(self._table), n=3)
            hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
            raise CheckpointError(f"{self._where}: no tensor named {key!r}{hint}")
        return self._table[key]


class SafetensorsFile(_Tensors):
    """One .safetensors file opened read-only; tensors are np.memmap views (no copy)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = self._where = pathlib.Path(path)
        if not self.path.is_file():
            raise CheckpointError(f"{self.path}: file not found")
        with open(self.path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 8:
                raise self._fail(f"file is {size} bytes, shorter than the 8-byte header length "
                                 + _TRUNCATED)
            (n,) = struct.unpack("<Q", f.read(8))
            if n > size - 8 or n > _MAX_HEADER_BYTES:
                limit = f"file size {size}" if n > size - 8 else f"{_MAX_HEADER_BYTES} bytes"
                raise self._fail(f"header length {n} exceeds {limit} {_TRUNCATED}")
            self._table: dict[str, tuple[TensorInfo, int]] = {}  # -> (info, file offset)
            self.metadata: dict[str, str] = self._parse_header(f.read(n), 8 + n, size - 8 - n)
            # Map the handle we validated, not the path: it may be replaced meanwhile.
            self._mmap = np.memmap(f, dtype=np.uint8, mode="r")

    def _fail(self, problem: str) -> CheckpointError:
        return CheckpointError(f"{self.path}: {problem}")

    def _parse_header(self, raw: bytes, data_start: int, data_size: int) -> dict[str, str]:
        """Validate the header and fill self._table; returns __metadata__."""
        try:
            header = json.loads(raw.decode("utf-8"), object_pairs_hook=_reject_duplicate_keys)
        except UnicodeDecodeError as e:
            raise self._fail(f"header is not valid UTF-8 ({e})") from None
        except ValueError as e:
            raise self._fail(f"header is not valid JSON ({e})") from None
        if not isinstance(header, dict):
            raise self._fail(f"header is a JSON {type(header).__name__}, expected an object")
        meta = header.pop("__metadata__", None)
        if meta is not None and not (
                isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
            raise self._fail(f"__metadata__ must map str to str, got {meta!r}")
        for name, entry in header.items():
            missing = [k for k in ("dtype", "shape", "data_offsets")
                       if not isinstance(entry, dict) or k not in entry]
            if missing:
                raise self._fail(f"tensor {name!r}: header entry lacks {', '.join(missing)}")
            code, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
            if not isinstance(code, str) or code not in _DTYPES:
                raise self._fail(f"tensor {name!r}: unknown dtype {code!r} "
                                 f"(supported: {', '.join(_DTYPES)})")
            if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
                raise self._fail(f"tensor {name!r}: shape {shape!r} is not a list of ints >= 0")
            if not (isinstance(offsets, list) and len(offsets) == 2
                    and all(type(o) is int for o in offsets) and 0 <= offsets[0] <= offsets[1]):
                raise self._fail(f"tensor {name!r}: data_offsets {offsets!r} is not "
                                 "[begin, end] with 0 <= begin <= end")
            info, (begin, end) = TensorInfo(_DTYPES[code], tuple(shape)), offsets
            if end - begin != info.nbytes:
                raise self._fail(f"tensor {name!r}: data_offsets {offsets} span {end - begin} "
                                 f"bytes but {code} x {shape} needs {info.nbytes}")
            if end > data_size:
                raise self._fail(f"tensor {name!r}: data_offsets {offsets} outside the data "
                                 f"buffer of {data_size} bytes {_TRUNCATED}")
            self._table[name] = (info, data_start + begin)
        spans = sorted((s, s + i.nbytes, k) for k, (i, s) in self._table.items() if i.nbytes)
        for (_, end_a, a), (begin_b, _, b) in zip(spans, spans[1:]):
            if begin_b < end_a:
                raise self._fail(f"tensors {a!r} and {b!r} have overlapping data_offsets")
        return meta or {}

    def info(self, key: str) -> TensorInfo:
        """dtype and shape of `key`, without touching its data."""
        return self._lookup(key)[0]

    def array(self, key: str) -> np.ndarray:
        """Read-only np.memmap view of `key` with its stored dtype and shape (no copy)."""
        info, start = self._lookup(key)
        return self._mmap[start:start + info.nbytes].view(info.dtype).reshape(info.shape)


class CheckpointFiles(_Tensors):
    """All tensors of a checkpoint directory: `model.safetensors`, or shards listed by
    `model.safetensors.index.json` ({"metadata": ..., "weight_map": {tensor: shard_filename}}).
    If both exist the single file wins, as in transformers (save_dir never leaves both)."""

    def __init__(self, directory: str | os.PathLike[str], *, index_name: str = INDEX_NAME,
                 single_name: str = SINGLE_NAME) -> None:
        self.directory = self._where = pathlib.Path(directory)
        single, index = self.directory / single_name, self.directory / index_name
        weight_map: dict[str, str] = {}
        shards: dict[str, SafetensorsFile] = {}
        if single.is_file():
            self.files = [SafetensorsFile(single)]
        elif index.is_file():
            try:
                data = json.loads(index.read_text(encoding="utf-8"))
            except (OSError, ValueError) as e:  # ValueError covers JSON and UTF-8 errors
                raise CheckpointError(f"{index}: not a valid JSON index file ({e})") from None
            weight_map = data.get("weight_map") if isinstance(data, dict) else None
            if not (isinstance(weight_map, dict)
                    and all(isinstance(v, str) for v in weight_map.values())):
                raise CheckpointError(f'{index}: lacks a "weight_map" object mapping tensor '
                                      "names to shard file names")
            for shard in sorted(set(weight_map.values())):
                if not (self.directory / shard).is_file():
                    raise CheckpointError(f"{index}: shard {shard!r} listed in the index does not "
                                          f"exist ({self.directory / shard})")
                shards[shard] = SafetensorsFile(self.directory / shard)
            self.files = list(shards.values())
        else:
            why = "no checkpoint" if self.directory.is_dir() else "directory does not exist"
            raise CheckpointError(f"{self.directory}: {why} (looked for {single_name} "
                                  f"or {index_name})")
        self._table: dict[str, SafetensorsFile] = {}
        for f in self.files:
            for key in f.keys():
                if key in self._table:
                    raise CheckpointError(f"tensor {key!r} is stored in both "
                                          f"{self._table[key].path} and {f.path}")
                self._table[key] = f
        for key, shard in weight_map.items():
            if key not in shards[shard]:
                raise CheckpointError(f"{index}: tensor {key!r} is listed for shard {shard!r} but "
                                      f"absent from {self.directory / shard}")

    def info(self, key: str) -> TensorInfo:
        """dtype and shape of `key`."""
        return self._lookup(key).info(key)

    def array(self, key: str) -> np.ndarray:
        """Read-only memmap view of `key` (see SafetensorsFile.array)."""
        return self._lookup(key).array(key)


_Prepared = tuple[str, str, np.ndarray]  # (name, dtype code, little-endian C-contiguous array)


def _prepare(name: object, value: object, where: pathlib.Path) -> _Prepared:
    if not isinstance(name, str) or not name or name == "__metadata__":
        raise CheckpointError(f"{where}: invalid tensor name {name!r} "
                              "(need a non-empty str other than '__metadata__')")
    try:
        arr = np.asarray(value)
    except Exception as e:  # ragged lists, exotic objects: any failure means "not a tensor"
        raise CheckpointError(f"{where}: tensor {name!r} cannot be converted to a numpy array "
                              f"({type(e).__name__}: {e})") from e
    # Match ignoring byte order: '>f4' is still F32, it just gets byte-swapped below.
    dtype = arr.dtype.newbyteorder("=") if arr.dtype.byteorder in "<>" else arr.dtype
    code = next((c for c, dt in _DTYPES.items() if dt == dtype), None)
    if code is None:
        raise CheckpointError(f"{where}: tensor {name!r} has unsupported dtype {arr.dtype} "
                              f"(supported: {', '.join(_DTYPES)})")
    # astype(order="C"), not np.ascontiguousarray: the latter turns 0-d arrays into 1-d.
    return name, code, arr.astype(_DTYPES[code], order="C", copy=False)


def _atomic_write(path: pathlib.Path, chunks: Iterable[Any]) -> None:
    """Write `chunks` (bytes-like) to `path` via temp file + fsync + rename: never half-written."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        # mkstemp creates the file 0600; give it the mode any other new file gets (umask applied).
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        pathlib.Path(tmp).unlink(missing_ok=True)
        raise


def _umask() -> int:
    """The process's umask (reading it means setting it: set straight back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _write(path: pathlib.Path, items: list[_Prepared], metadata: Mapping[str, str] | None) -> None:
    header: dict[str, Any] = {}
    if metadata:
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise CheckpointError(f"{path}: metadata must map str to str, got {dict(metadata)!r}")
        header["__metadata__"] = dict(metadata)
    offset = 0
    for name, code, arr in items:
        header[name] = {"dtype": code, "shape": list(arr.shape),
                        "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
    blob = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    blob += b" " * (-len(blob) % _ALIGN)
    flat = [arr.reshape(-1).view(np.uint8) for _, _, arr in items]  # byte views, no copies
    _atomic_write(path, [struct.pack("<Q", len(blob)) + blob] + [
        b[i:i + _WRITE_CHUNK] for b in flat for i in range(0, b.size, _WRITE_CHUNK)])


def save_file(path: str | os.PathLike[str], tensors: Mapping[str, Any],
              metadata: Mapping[str, str] | None = None) -> None:
    """Write `tensors` (name -> array-like, in the given order) to `path` atomically."""
    path = pathlib.Path(path)
    _write(path, [_prepare(name, value, path) for name, value in tensors.items()], metadata)


def save_dir(directory: str | os.PathLike[str],
             tensors: Iterable[tuple[str, Any]] | Mapping[str, Any], *,
             metadata: Mapping[str, str] | None = None,
             max_shard_bytes: int | None = None) -> list[pathlib.Path]:
    """Write a checkpoint directory readable by CheckpointFiles and transformers.

    One `model.safetensors` if max_shard_bytes is None or all tensor bytes fit in one shard, else
    shards `model-0000i-of-0000N.safetensors` + `model.safetensors.index.json`. `tensors` may be a
    generator: only the current shard's tensors are held. `metadata` goes into every file's
    __metadata__. Stale files of an earlier write are removed. Returns the .safetensors paths.
    """
    directory = pathlib.Path(directory)
    if max_shard_bytes is not None and max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    directory.mkdir(parents=True, exist_ok=True)
    limit = math.inf if max_shard_bytes is None else max_shard_bytes
    token = secrets.token_hex(4)  # temp shard names: N is unknown until the stream ends
    written: list[tuple[pathlib.Path, list[str]]] = []  # temp shard files, their tensor names
    current: list[_Prepared] = []
    seen: set[str] = set()
    current_bytes = total_bytes = 0

    def flush() -> None:
        tmp = directory / f".model-{len(written) + 1:05d}.{token}.safetensors.partial"
        written.append((tmp, [name for name, _, _ in current]))
        _write(tmp, current, metadata)

    try:
        for name, value in (tensors.items() if isinstance(tensors, Mapping) else tensors):
            item = _prepare(name, value, directory)  # validates `name` before hashing it
            if name in seen:
                raise CheckpointError(f"{directory}: tensor {name!r} given twice")
            seen.add(name)
            if current and current_bytes + item[2].nbytes > limit:
                flush()
                current, current_bytes = [], 0
            current.append(item)
            current_bytes += item[2].nbytes
            total_bytes += item[2].nbytes
        if not written:
            final = [directory / SINGLE_NAME]
            _write(final[0], current, metadata)
            (directory / INDEX_NAME).unlink(missing_ok=True)
        else:
            flush()
            n = len(written)
            final = [directory / f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
            for (tmp, _), dst in zip(written, final):
                os.replace(tmp, dst)
            # Drop the single file before the index appears: readers prefer it when both exist.
            (directory / SINGLE_NAME).unlink(missing_ok=True)
            weight_map = {key: dst.name for dst, (_, keys) in zip(final, written) for key in keys}
            text = json.dumps({"metadata": {"total_size": total_bytes}, "weight_map": weight_map},
                              indent=2, sort_keys=True) + "\n"
            _atomic_write(directory / INDEX_NAME, [text.encode("utf-8")])
        for p in directory.iterdir():  # shards of an earlier write would contradict this one
            if _SHARD_RE.fullmatch(p.name) and p not in final:
                p.unlink(missing_ok=True)
        return final
    finally:
        for tmp, _ in written:
            tmp.unlink(missing_ok=True)  # no-op after the renames; cleans up after an error
