"""Tests for dspark_jax.formats.safetensors_io, with the `safetensors` package and torch as the oracle."""

from __future__ import annotations

import json
import math
import pathlib
import struct
from collections.abc import Iterator

import ml_dtypes
import numpy as np
import pytest
import safetensors
import safetensors.numpy
import safetensors.torch
import torch

from dspark_jax.errors import CheckpointError
from dspark_jax.formats.safetensors_io import (
    CheckpointFiles,
    SafetensorsFile,
    TensorInfo,
    save_dir,
    save_file,
)

_RNG = np.random.default_rng(0)


def _sample(dtype: np.dtype, shape: tuple[int, ...] = (3, 5)) -> np.ndarray:
    """Random array of `dtype`, built from random bits for floats so NaN/inf patterns appear."""
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return _RNG.integers(0, 2, shape).astype(bool)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return _RNG.integers(info.min, info.max, shape, dtype=dtype, endpoint=True)
    bits = _RNG.integers(0, 256, math.prod(shape) * dtype.itemsize, dtype=np.uint8)
    return bits.view(dtype).reshape(shape)


def _bits(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a).tobytes()


ALL_DTYPES = [np.float64, np.float32, np.float16, ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn,
              ml_dtypes.float8_e5m2, np.int64, np.int32, np.int16, np.int8, np.uint64, np.uint32,
              np.uint16, np.uint8, np.bool_, np.complex64]


def _raw_file(path: pathlib.Path, header: object, data: bytes = b"", *,
              header_bytes: bytes | None = None) -> pathlib.Path:
    """Hand-build a (possibly broken) safetensors file."""
    blob = json.dumps(header).encode() if header_bytes is None else header_bytes
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data)
    return path


# ------------------------------------------------------------------------------ round trips


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=lambda d: np.dtype(d).name)
def test_round_trip_every_dtype(tmp_path: pathlib.Path, dtype: type) -> None:
    tensors = {"a": _sample(dtype), "scalar": _sample(dtype, ()), "empty": _sample(dtype, (0, 4))}
    save_file(tmp_path / "x.safetensors", tensors, metadata={"k": "v"})
    f = SafetensorsFile(tmp_path / "x.safetensors")
    assert f.keys() == ["a", "empty", "scalar"] and f.metadata == {"k": "v"}
    for name, want in tensors.items():
        got = f.array(name)
        assert f.info(name) == TensorInfo(np.dtype(dtype), want.shape)
        assert got.dtype == np.dtype(dtype) and got.shape == want.shape
        assert _bits(got) == _bits(want)


def test_header_padded_and_order_preserved(tmp_path: pathlib.Path) -> None:
    save_file(tmp_path / "x.safetensors", {"z": np.ones(3, np.int8), "a": np.ones(1, np.float32)})
    raw = (tmp_path / "x.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    assert (8 + n) % 8 == 0
    header = json.loads(raw[8:8 + n])
    assert list(header) == ["z", "a"] and header["a"]["data_offsets"] == [3, 7]


def test_writer_converts_layout_and_byte_order(tmp_path: pathlib.Path) -> None:
    base = np.arange(24, dtype=np.float32).reshape(4, 6)
    tensors = {"t": base.T, "be": base.astype(">i4"), "list": [[1.5, 2.5]], "s": np.float32(7)}
    save_file(tmp_path / "x.safetensors", tensors)
    f = SafetensorsFile(tmp_path / "x.safetensors")
    np.testing.assert_array_equal(f.array("t"), base.T)
    assert f.info("be").dtype == np.dtype("<i4")
    np.testing.assert_array_equal(f.array("be"), base.astype(np.int32))
    np.testing.assert_array_equal(f.array("list"), [[1.5, 2.5]])
    assert f.array("s").shape == () and f.array("s") == 7


def test_array_is_readonly_memmap(tmp_path: pathlib.Path) -> None:
    save_file(tmp_path / "x.safetensors", {"w": np.zeros((2, 2), np.float32)})
    a = SafetensorsFile(tmp_path / "x.safetensors").array("w")
    assert isinstance(a, np.memmap) and not a.flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        a[0, 0] = 1.0


def test_failed_save_keeps_old_file(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "x.safetensors"
    save_file(path, {"w": np.ones(2, np.float32)})
    with pytest.raises(CheckpointError, match=r"tensor 'bad'.*unsupported dtype"):
        save_file(path, {"w": np.zeros(2, np.float32), "bad": np.array(["s"])})
    np.testing.assert_array_equal(SafetensorsFile(path).array("w"), [1, 1])
    assert [p.name for p in tmp_path.iterdir()] == ["x.safetensors"]


# -------------------------------------------------------------------- interop with the oracle


def test_reads_safetensors_numpy_files(tmp_path: pathlib.Path) -> None:
    # safetensors.numpy has no bf16/f8 (ml_dtypes); those are covered by the torch test below.
    numpy_dtypes = [d for d in ALL_DTYPES
                    if not np.dtype(d).name.startswith(("bfloat16", "float8"))]
    tensors = {f"t_{np.dtype(d).name}": _sample(d, (2, 3, 4)) for d in numpy_dtypes}
    safetensors.numpy.save_file(tensors, str(tmp_path / "x.safetensors"), metadata={"m": "1"})
    f = SafetensorsFile(tmp_path / "x.safetensors")
    assert f.keys() == sorted(tensors) and f.metadata == {"m": "1"}
    for name, want in tensors.items():
        assert f.array(name).dtype == want.dtype and _bits(f.array(name)) == _bits(want)


def test_reads_safetensors_torch_files_including_bf16(tmp_path: pathlib.Path) -> None:
    g = torch.Generator().manual_seed(0)
    tensors = {"bf16": torch.randn(5, 7, generator=g).to(torch.bfloat16),
               "f32": torch.randn(3, generator=g), "i64": torch.arange(6).reshape(2, 3),
               "f16": torch.randn(2, 2, generator=g).half(), "bool": torch.tensor([True, False])}
    safetensors.torch.save_file(tensors, str(tmp_path / "x.safetensors"), metadata={"format": "pt"})
    f = SafetensorsFile(tmp_path / "x.safetensors")
    assert f.metadata == {"format": "pt"}
    assert f.info("bf16") == TensorInfo(np.dtype(ml_dtypes.bfloat16), (5, 7))
    assert _bits(f.array("bf16")) == tensors["bf16"].view(torch.int16).numpy().tobytes()
    for name in ("f32", "i64", "f16", "bool"):
        assert _bits(f.array(name)) == tensors[name].numpy().tobytes()


def test_float8_matches_torch(tmp_path: pathlib.Path) -> None:
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))
    tensors = {"e4m3": x.to(torch.float8_e4m3fn), "e5m2": x.to(torch.float8_e5m2)}
    safetensors.torch.save_file(tensors, str(tmp_path / "t.safetensors"))
    f = SafetensorsFile(tmp_path / "t.safetensors")
    assert f.info("e4m3").dtype == np.dtype(ml_dtypes.float8_e4m3fn)
    assert f.info("e5m2").dtype == np.dtype(ml_dtypes.float8_e5m2)
    for name, t in tensors.items():
        assert _bits(f.array(name)) == t.view(torch.uint8).numpy().tobytes()
    save_file(tmp_path / "o.safetensors", {k: f.array(k) for k in f.keys()})
    with safetensors.safe_open(str(tmp_path / "o.safetensors"), framework="pt") as g:
        for name, t in tensors.items():
            assert g.get_tensor(name).dtype == t.dtype and torch.equal(
                g.get_tensor(name).view(torch.uint8), t.view(torch.uint8))


def test_our_files_read_by_safetensors(tmp_path: pathlib.Path) -> None:
    tensors = {"w": _sample(np.float32, (4, 3)), "ids": _sample(np.int64, (5,)),
               "mask": _sample(np.bool_, (2, 2)), "s": np.float16(1.5), "ünï": _sample(np.uint8)}
    bf16 = _sample(ml_dtypes.bfloat16, (3, 8))
    meta = {"format": "pt", "note": "hé"}
    path = str(tmp_path / "x.safetensors")
    save_file(path, {**tensors, "bf16": bf16}, metadata=meta)
    with safetensors.safe_open(path, framework="pt") as f:
        assert f.metadata() == meta and set(f.keys()) == set(tensors) | {"bf16"}
        got = f.get_tensor("bf16")
        assert got.dtype == torch.bfloat16
        assert got.view(torch.int16).numpy().tobytes() == _bits(bf16)
        for name, want in tensors.items():
            assert f.get_tensor(name).numpy().tobytes() == _bits(want)
    with safetensors.safe_open(path, framework="numpy") as f:
        assert f.metadata() == meta
        for name, want in tensors.items():
            got = f.get_tensor(name)
            assert got.dtype == want.dtype and got.shape == want.shape
            assert _bits(got) == _bits(want)


# ------------------------------------------------------------------------------ directories


def _layer_tensors(n: int) -> dict[str, np.ndarray]:
    return {f"layer.{i}.w": np.full((4, 4), i, np.float32) for i in range(n)}  # 64 bytes each


def test_save_dir_sharded_matches_transformers_layout(tmp_path: pathlib.Path) -> None:
    tensors = _layer_tensors(5)
    tensors["big"] = np.zeros(100, np.float32)  # 400 bytes > limit: a shard of its own
    paths = save_dir(tmp_path, tensors, max_shard_bytes=150, metadata={"format": "pt"})
    assert [p.name for p in paths] == [f"model-{i:05d}-of-00004.safetensors" for i in (1, 2, 3, 4)]
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["metadata"] == {"total_size": 5 * 64 + 400}
    assert index["weight_map"] == {
        "layer.0.w": paths[0].name, "layer.1.w": paths[0].name, "layer.2.w": paths[1].name,
        "layer.3.w": paths[1].name, "layer.4.w": paths[2].name, "big": paths[3].name}
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [p.name for p in paths] + ["model.safetensors.index.json"])
    ckpt = CheckpointFiles(tmp_path)
    assert ckpt.keys() == sorted(tensors) and len(ckpt.files) == 4 and "big" in ckpt
    for name, want in tensors.items():
        np.testing.assert_array_equal(ckpt.array(name), want)
    assert ckpt.info("layer.3.w") == TensorInfo(np.dtype(np.float32), (4, 4))
    with safetensors.safe_open(str(paths[1]), framework="numpy") as f:  # shards are standard
        assert f.metadata() == {"format": "pt"} and sorted(f.keys()) == ["layer.2.w", "layer.3.w"]


def test_sharded_dir_loads_with_huggingface_hub(tmp_path: pathlib.Path) -> None:
    hub = pytest.importorskip("huggingface_hub.serialization")
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    want = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    save_dir(tmp_path, {k: v + 1 for k, v in want.items()}, max_shard_bytes=300)
    assert len(list(tmp_path.glob("model-*-of-*.safetensors"))) > 1
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    hub.load_torch_model(model, tmp_path, strict=True)  # reads our index.json + shards
    for k, v in model.state_dict().items():
        np.testing.assert_array_equal(v.numpy(), want[k] + 1)


def test_save_dir_streams_from_generator(tmp_path: pathlib.Path) -> None:
    produced: list[str] = []

    def gen() -> Iterator[tuple[str, np.ndarray]]:
        for i in range(6):
            produced.append(f"t{i}")
            yield f"t{i}", np.full(10, i, np.int16)  # 20 bytes each

    paths = save_dir(tmp_path, gen(), max_shard_bytes=40)
    assert produced == [f"t{i}" for i in range(6)] and len(paths) == 3
    ckpt = CheckpointFiles(tmp_path)
    assert ckpt.keys() == produced
    for i in range(6):
        np.testing.assert_array_equal(ckpt.array(f"t{i}"), np.full(10, i, np.int16))


def test_save_dir_single_file_and_stale_cleanup(tmp_path: pathlib.Path) -> None:
    save_dir(tmp_path, _layer_tensors(6), max_shard_bytes=100)
    assert len(list(tmp_path.glob("model-*.safetensors"))) == 6
    # Everything fits now: one file, and the old shards/index must not linger.
    paths = save_dir(tmp_path, _layer_tensors(2), max_shard_bytes=10_000)
    assert paths == [tmp_path / "model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]
    assert CheckpointFiles(tmp_path).keys() == ["layer.0.w", "layer.1.w"]
    # And back to shards: the single file goes away.
    save_dir(tmp_path, _layer_tensors(3), max_shard_bytes=64)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert "model.safetensors" not in names and "model-00003-of-00003.safetensors" in names
    assert len(CheckpointFiles(tmp_path).files) == 3


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_saved_files_get_the_umask_mode(tmp_path: pathlib.Path, umask: int) -> None:
    """Weights get the mode every other new file gets (not mkstemp's 0600), single and sharded."""
    import os

    old = os.umask(umask)
    try:
        save_file(tmp_path / "one.safetensors", {"w": np.ones(3, np.float32)})
        save_dir(tmp_path / "sharded", _layer_tensors(3), max_shard_bytes=64)
        (tmp_path / "plain.txt").write_text("x")
    finally:
        os.umask(old)
    want = 0o666 & ~umask
    assert (tmp_path / "plain.txt").stat().st_mode & 0o777 == want
    files = [tmp_path / "one.safetensors", *(tmp_path / "sharded").iterdir()]
    assert len(files) == 5  # three shards and the index
    for f in files:
        assert f.stat().st_mode & 0o777 == want, f


def test_save_dir_error_leaves_no_temp_files(tmp_path: pathlib.Path) -> None:
    def gen() -> Iterator[tuple[str, object]]:
        yield "a", np.zeros(100, np.uint8)
        yield "b", np.zeros(100, np.uint8)
        yield "a", np.zeros(1, np.uint8)

    with pytest.raises(CheckpointError, match="'a' given twice"):
        save_dir(tmp_path / "out", gen(), max_shard_bytes=100)
    assert list((tmp_path / "out").iterdir()) == []


# ----------------------------------------------------------------------------- error cases


def _ok_header() -> dict[str, object]:
    return {"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}


@pytest.mark.parametrize("header,data,header_bytes,match", [
    (None, b"", b"{\"a\"", r"not valid JSON"),
    (None, b"", b"\xff\xfe{}", r"not valid UTF-8"),
    ([1, 2], b"", None, r"JSON list, expected an object"),
    (None, b"", b'{"a": {}, "a": {}}', r"duplicate key 'a'"),
    ({"w": {"dtype": "F32", "shape": [2]}}, bytes(8), None, r"tensor 'w'.*lacks data_offsets"),
    ({"w": {"shape": [2], "data_offsets": [0, 8]}}, bytes(8), None, r"tensor 'w'.*lacks dtype"),
    ({"w": {"dtype": "Q7", "shape": [2], "data_offsets": [0, 8]}}, bytes(8), None,
     r"tensor 'w': unknown dtype 'Q7'"),
    ({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, bytes(12), None,
     r"tensor 'w'.*span 8 bytes but F32 x \[3\] needs 12"),
    (_ok_header(), bytes(4), None, r"tensor 'w'.*outside the data buffer of 4 bytes"),
    ({"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 8]}}, bytes(8), None, r"shape"),
    ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}}, bytes(8), None,
     r"data_offsets"),
    ({**_ok_header(), "v": {"dtype": "I32", "shape": [2], "data_offsets": [4, 12]}}, bytes(12),
     None, r"overlapping"),
    ({"__metadata__": {"a": 1}}, b"", None, r"__metadata__ must map str to str"),
])
def test_corrupt_headers(tmp_path: pathlib.Path, header: object, data: bytes,
                         header_bytes: bytes | None, match: str) -> None:
    path = _raw_file(tmp_path / "bad.safetensors", header, data, header_bytes=header_bytes)
    with pytest.raises(CheckpointError, match=match) as exc:
        SafetensorsFile(path)
    assert str(path) in str(exc.value)


def test_missing_short_and_truncated_files(tmp_path: pathlib.Path) -> None:
    with pytest.raises(CheckpointError, match=r"nope\.safetensors: file not found"):
        SafetensorsFile(tmp_path / "nope.safetensors")
    (tmp_path / "short.safetensors").write_bytes(b"\x01\x02\x03")
    with pytest.raises(CheckpointError, match=r"short\.safetensors: file is 3 bytes, shorter"):
        SafetensorsFile(tmp_path / "short.safetensors")
    (tmp_path / "huge.safetensors").write_bytes(struct.pack("<Q", 10**12) + b"{}")
    with pytest.raises(CheckpointError, match=r"huge\.safetensors: header length 1000000000000 "
                                              r"exceeds file size 10 \(corrupt or truncated"):
        SafetensorsFile(tmp_path / "huge.safetensors")


def test_unknown_key_names_key_and_location(tmp_path: pathlib.Path) -> None:
    save_dir(tmp_path, {"layer.0.weight": np.zeros(2, np.float32)})
    f = SafetensorsFile(tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"model\.safetensors: no tensor named 'layer\.0\.wieght'.*"
                                              r"did you mean 'layer\.0\.weight'"):
        f.array("layer.0.wieght")
    ckpt = CheckpointFiles(tmp_path)
    for method in (ckpt.array, ckpt.info):
        with pytest.raises(CheckpointError, match=rf"{tmp_path}: no tensor named 'missing'"):
            method("missing")
    assert "missing" not in ckpt and "layer.0.weight" in ckpt


def _sharded(tmp_path: pathlib.Path) -> pathlib.Path:
    save_dir(tmp_path, _layer_tensors(3), max_shard_bytes=64)
    return tmp_path / "model.safetensors.index.json"


def test_directory_errors(tmp_path: pathlib.Path) -> None:
    with pytest.raises(CheckpointError, match=r"no checkpoint \(looked for model\.safetensors or "
                                              r"model\.safetensors\.index\.json\)"):
        CheckpointFiles(tmp_path)
    with pytest.raises(CheckpointError, match=r"gone: directory does not exist"):
        CheckpointFiles(tmp_path / "gone")


def test_index_errors(tmp_path: pathlib.Path) -> None:
    index = _sharded(tmp_path)
    good = json.loads(index.read_text())
    index.write_text("{not json")
    with pytest.raises(CheckpointError, match=rf"{index}: not a valid JSON index"):
        CheckpointFiles(tmp_path)
    index.write_text(json.dumps({"metadata": {}}))
    with pytest.raises(CheckpointError, match=rf'{index}: lacks a "weight_map"'):
        CheckpointFiles(tmp_path)
    index.write_text(json.dumps({"weight_map": {**good["weight_map"], "x": "model-gone.safetensors"}}))
    with pytest.raises(CheckpointError, match=rf"{index}: shard 'model-gone\.safetensors' listed "
                                              r"in the index does not exist"):
        CheckpointFiles(tmp_path)
    index.write_text(json.dumps({"weight_map": {**good["weight_map"],
                                                "ghost": "model-00002-of-00003.safetensors"}}))
    with pytest.raises(CheckpointError, match=r"tensor 'ghost' is listed for shard "
                                              r"'model-00002-of-00003\.safetensors' but absent"):
        CheckpointFiles(tmp_path)


def test_duplicate_key_across_shards_names_both(tmp_path: pathlib.Path) -> None:
    index = _sharded(tmp_path)
    save_file(tmp_path / "model-00003-of-00003.safetensors",
              {"layer.2.w": np.zeros(1, np.float32), "layer.0.w": np.zeros(1, np.float32)})
    with pytest.raises(CheckpointError, match=r"'layer\.0\.w' is stored in both .*"
                                              r"model-00001-of-00003\.safetensors and .*"
                                              r"model-00003-of-00003\.safetensors"):
        CheckpointFiles(tmp_path)
    assert index.exists()


def test_writer_errors(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "x.safetensors"
    with pytest.raises(CheckpointError, match=r"x\.safetensors: tensor 'c' has unsupported dtype"):
        save_file(path, {"c": np.zeros(2, np.complex128)})
    with pytest.raises(CheckpointError, match=r"tensor 'r' cannot be converted"):
        save_file(path, {"r": [[1, 2], [3]]})
    with pytest.raises(CheckpointError, match=r"tensor 'o' has unsupported dtype object"):
        save_file(path, {"o": np.array([object()])})
    with pytest.raises(CheckpointError, match=r"invalid tensor name '__metadata__'"):
        save_file(path, {"__metadata__": np.zeros(1)})
    with pytest.raises(CheckpointError, match=r"metadata must map str to str"):
        save_file(path, {"a": np.zeros(1)}, metadata={"n": 1})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="max_shard_bytes"):
        save_dir(tmp_path, {}, max_shard_bytes=0)
    assert not path.exists()
