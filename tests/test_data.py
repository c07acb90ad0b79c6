"""Tests for dspark_jax.training.data: dataset loading, anchor sampling, deterministic sharded batches."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from dspark_jax.errors import ConfigError, DataError
from dspark_jax.formats.records import encode_training_record
from dspark_jax.formats.tokenizer import Tokenizer, load_tokenizer, train_bpe_tokenizer
from dspark_jax.training.data import (
    BatchIterator,
    Dataset,
    is_too_short,
    load_conversations,
    make_global_batch,
    sample_anchors,
)
from dspark_jax.training.synthetic import write_synthetic_conversations

BLOCK = 4


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    """A tiny byte-level BPE tokenizer trained on synthetic chat text."""
    path = tmp_path_factory.mktemp("data_tok")
    corpus = write_synthetic_conversations(path / "corpus.jsonl", 200, seed=123)
    texts = [m["content"] for line in corpus.read_text().splitlines() for m in json.loads(line)["conversations"]]
    train_bpe_tokenizer(texts, 400, path)
    return load_tokenizer(path)


@pytest.fixture(scope="module")
def synthetic(tok: Tokenizer, tmp_path_factory: pytest.TempPathFactory) -> Dataset:
    """40 synthetic conversations, capped at 48 tokens."""
    path = write_synthetic_conversations(tmp_path_factory.mktemp("data") / "train.jsonl", 40, seed=0)
    return load_conversations(path, tok, max_length=48, min_length=BLOCK + 1, system_prompt="")  # as dspark-tiny


def write_records(path: Path, records: list) -> Path:
    """One JSON line per record (strings are written raw)."""
    lines = [r if isinstance(r, str) else json.dumps(r) for r in records]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def chat(user: str, assistant: str) -> dict:
    """A one-exchange record with a short system message of its own (no default system prompt)."""
    return {"conversations": [{"role": "system", "content": "Answer exactly."}, {"role": "user", "content": user},
                              {"role": "assistant", "content": assistant}]}


def iterator(ds: Dataset, **kwargs) -> BatchIterator:
    args = {"global_batch_size": 8, "num_anchors": 3, "block_size": BLOCK, "seed": 7}
    return BatchIterator(ds, **{**args, **kwargs})


def take(it: BatchIterator, k: int) -> list[dict[str, np.ndarray]]:
    return [next(it) for _ in range(k)]


def assert_batches_equal(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for key in x:
            np.testing.assert_array_equal(x[key], y[key], err_msg=key)


# ---------------------------------------------------------------------------
# Loading


def test_loss_mask_only_on_assistant(tok: Tokenizer, tmp_path: Path) -> None:
    record = {"turns": ["Count from 3 to 9.", "3 4 5 6 7 8 9", "Repeat 'lamp' 3 times.", "lamp lamp lamp"]}
    ds = load_conversations(write_records(tmp_path / "a.jsonl", [record]), tok, max_length=200, min_length=5)
    ids, mask = ds.input_ids[0], ds.loss_masks[0]
    assert ids.dtype == np.int32 and mask.dtype == np.bool_ and ids.shape == mask.shape
    assert tok.decode(ids[mask], skip_special_tokens=False) == "3 4 5 6 7 8 9<|im_end|>\nlamp lamp lamp<|im_end|>\n"
    # A turns record has no system message: the template family's default one is prepended.
    assert tok.decode(ids, skip_special_tokens=False).startswith(
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nCount from 3 to 9.")
    # Each supervised run starts right after an assistant header and ends with that turn's <|im_end|>.
    starts = np.flatnonzero(mask & ~np.concatenate([[False], mask[:-1]]))
    for start in starts:
        assert tok.decode(ids[:start], skip_special_tokens=False).endswith("<|im_start|>assistant\n")
    assert ds.stats.as_dict() == {
        "records_read": 1,
        "kept": 1,
        "skipped_bad": 0,
        "skipped_no_assistant": 0,
        "skipped_too_short": 0,
        "truncated": 0,
    }


def test_length_cap(tok: Tokenizer, tmp_path: Path) -> None:
    long = chat("Count from 1 to 40.", " ".join(str(i) for i in range(1, 41)))
    short = chat("Hi", "apple river stone")
    path = write_records(tmp_path / "c.jsonl", [long, short])
    full = encode_training_record(tok, long)
    assert full is not None and len(full[0]) > 40
    ds = load_conversations(path, tok, max_length=40, min_length=5)
    assert [len(x) for x in ds.input_ids] == [40, len(encode_training_record(tok, short)[0])]
    np.testing.assert_array_equal(ds.input_ids[0], full[0][:40])
    np.testing.assert_array_equal(ds.loss_masks[0], full[1][:40])
    assert ds.stats.truncated == 1 and ds.stats.kept == 2 and ds.max_length == 40


def test_skip_counts(tok: Tokenizer, tmp_path: Path) -> None:
    max_length, min_length = 40, 32

    def first_supervised(record: dict) -> int:
        return int(np.flatnonzero(encode_training_record(tok, record)[1])[0])

    # A record whose cut keeps exactly one supervised token (the first of its answer).
    one_left = next(r for r in (chat("apple " * k, "river stone") for k in range(1, 40))
                    if first_supervised(r) == max_length - 1)
    records = [
        chat("Count from 1 to 9.", "1 2 3 4 5 6 7 8 9"),  # kept, cut to max_length
        {"turns": ["only a question"]},  # no assistant turn
        {"conversations": [{"from": "human", "value": "q"}]},  # no assistant turn
        chat("a", ""),  # fewer than min_length tokens: too short
        one_left,  # one supervised token after the cut, no anchor: too short
        chat("apple " * 40, "river stone"),  # the cut removes the assistant turn: too short
        chat("Repeat", "lamp lamp lamp lamp"),  # kept
    ]
    encoded = [encode_training_record(tok, r) for r in records]
    lengths = [None if e is None else len(e[0]) for e in encoded]
    # The premises of the comments above, for this tokenizer.
    assert lengths[0] > max_length and encoded[0][1][:max_length].sum() >= 2
    assert min_length <= lengths[6] <= max_length
    assert lengths[3] < min_length and encoded[3][1].sum() >= 2
    assert not encoded[5][1][:max_length].any()
    path = write_records(tmp_path / "s.jsonl", records)
    ds = load_conversations(path, tok, max_length=max_length, min_length=min_length)
    assert ds.stats.as_dict() == {
        "records_read": 7,
        "kept": 2,
        "skipped_bad": 0,
        "skipped_no_assistant": 2,
        "skipped_too_short": 3,
        "truncated": 1,
    }
    assert [len(x) for x in ds.input_ids] == [max_length, lengths[6]]


def test_is_too_short() -> None:
    assert is_too_short(np.array([False, True, True]), 3) is False
    assert is_too_short(np.array([False, True, False, True]), 2) is True  # no two adjacent
    assert is_too_short(np.array([True, True]), 3) is True  # fewer than min_length tokens


def test_no_usable_records_names_file_and_counts(tok: Tokenizer, tmp_path: Path) -> None:
    path = write_records(tmp_path / "none.jsonl", [{"turns": ["q"]}, chat("a", ""), ""])
    pattern = rf"^{re.escape(str(path))}: no usable training records \(2 read, 0 bad, 1 without an assistant turn, 1 shorter"
    with pytest.raises(DataError, match=pattern):
        load_conversations(path, tok, max_length=64, min_length=len(encode_training_record(tok, chat("a", ""))[0]) + 1)


def test_bad_records_are_skipped_with_file_and_line(tok: Tokenizer, tmp_path: Path) -> None:
    """A malformed line or record is skipped and reported; the good ones are kept; a file of only
    bad records is one error naming the first."""
    good = chat("a", "b c d e")
    path = write_records(tmp_path / "bad.jsonl", [good, "", "{broken", [1, 2], good])
    ds = load_conversations(path, tok, max_length=64, min_length=5)
    assert ds.stats.kept == 2 and ds.stats.skipped_bad == 2 and ds.stats.records_read == 4
    assert ds.errors[0].startswith(f"{path}:3: invalid JSON")
    assert ds.errors[1] == f"{path}:4: expected a JSON object, got list"
    bad_role = write_records(tmp_path / "role.jsonl", [{"conversations": [{"role": "bot", "content": "x"}]}])
    with pytest.raises(DataError, match=rf"^{re.escape(str(bad_role))}: no usable training records \(1 read, 1 bad "
                                        rf"\(first: {re.escape(str(bad_role))}:1: .*unknown role 'bot'"):
        load_conversations(bad_role, tok, max_length=64, min_length=5)
    missing = tmp_path / "missing.jsonl"
    with pytest.raises(DataError, match=rf"^{re.escape(str(missing))}: cannot open file"):
        load_conversations(missing, tok, max_length=64, min_length=5)


def test_bad_lengths(tok: Tokenizer, tmp_path: Path) -> None:
    path = write_records(tmp_path / "x.jsonl", [chat("a", "b c d e")])
    with pytest.raises(ConfigError, match=r"max_length \(4\) must be >= min_length \(5\)"):
        load_conversations(path, tok, max_length=4, min_length=5)


def test_synthetic_writer(tok: Tokenizer, tmp_path: Path) -> None:
    a = write_synthetic_conversations(tmp_path / "a.jsonl", 30, seed=1)
    b = write_synthetic_conversations(tmp_path / "b.jsonl", 30, seed=1)
    c = write_synthetic_conversations(tmp_path / "c.jsonl", 30, seed=2)
    assert a.read_text() == b.read_text() != c.read_text()
    records = [json.loads(line) for line in a.read_text().splitlines()]
    assert len(records) == 30
    for rec in records:
        turns = rec["conversations"]
        for user, answer in zip(turns, turns[1:]):
            if user["role"] == "user" and user["content"].startswith("Count from "):
                lo, hi = map(int, re.findall(r"\d+", user["content"]))
                assert answer["content"] == " ".join(str(i) for i in range(lo, hi + 1))
    ds = load_conversations(a, tok, max_length=128, min_length=BLOCK + 1, system_prompt="")
    assert ds.stats.kept == 30 and ds.stats.truncated == 0


# ---------------------------------------------------------------------------
# Anchors


def candidates_of(mask: np.ndarray) -> set[int]:
    return set(np.flatnonzero(mask[:-1] & mask[1:]).tolist())


def test_sample_anchors_valid_sorted_unique() -> None:
    gen = np.random.default_rng(0)
    for _ in range(200):
        length = int(gen.integers(2, 40))
        mask = gen.random(length) < 0.6
        k = int(gen.integers(1, 8))
        anchors, keep = sample_anchors(mask, k, np.random.default_rng(int(gen.integers(1 << 30))))
        assert anchors.shape == keep.shape == (k,)
        assert anchors.dtype == np.int32 and keep.dtype == np.bool_
        cands = candidates_of(mask)
        real = anchors[keep]
        assert len(real) == min(k, len(cands))
        assert set(real.tolist()) <= cands
        assert len(set(real.tolist())) == len(real)  # without replacement
        assert (np.diff(real) > 0).all()  # sorted
        # Real anchors come first; dummies sit at position 0 and are not kept.
        assert keep.tolist() == sorted(keep.tolist(), reverse=True)
        assert (anchors[~keep] == 0).all()
        for p in real:
            assert mask[p] and mask[p + 1]


def test_sample_anchors_padding_and_exact() -> None:
    mask = np.array([0, 0, 1, 1, 1, 0, 1, 0], dtype=bool)  # candidates 2, 3
    anchors, keep = sample_anchors(mask, 4, np.random.default_rng(0))
    assert anchors.tolist() == [2, 3, 0, 0] and keep.tolist() == [True, True, False, False]
    anchors, keep = sample_anchors(mask, 2, np.random.default_rng(0))
    assert anchors.tolist() == [2, 3] and keep.all()
    anchors, keep = sample_anchors(np.zeros(5, dtype=bool), 3, np.random.default_rng(0))
    assert anchors.tolist() == [0, 0, 0] and not keep.any()
    # The last position is never an anchor: it has no next label.
    anchors, keep = sample_anchors(np.array([0, 1, 1], dtype=bool), 2, np.random.default_rng(0))
    assert anchors.tolist() == [1, 0] and keep.tolist() == [True, False]


def test_sample_anchors_uniform() -> None:
    mask = np.ones(6, dtype=bool)  # candidates 0..4
    counts = np.zeros(6)
    rng = np.random.default_rng(3)
    for _ in range(3000):
        anchors, _ = sample_anchors(mask, 2, rng)
        counts[anchors] += 1
    assert counts[5] == 0
    np.testing.assert_allclose(counts[:5] / 3000, 0.4, atol=0.04)


# ---------------------------------------------------------------------------
# Batches


def test_batch_shapes_and_contents(synthetic: Dataset) -> None:
    it = iterator(synthetic)
    batch = next(it)
    assert batch["input_ids"].shape == batch["loss_mask"].shape == (8, 48)
    assert batch["anchors"].shape == batch["anchor_keep"].shape == (8, 3)
    assert batch["input_ids"].dtype == np.int32 and batch["anchors"].dtype == np.int32
    assert batch["loss_mask"].dtype == np.bool_ and batch["anchor_keep"].dtype == np.bool_
    perm = np.random.default_rng([7, 0]).permutation(len(synthetic))
    pad = synthetic.pad_id
    assert pad == 0  # <|endoftext|> is the first special token of the fixture
    for row, record in enumerate(perm[:8]):
        ids, mask = synthetic.input_ids[record], synthetic.loss_masks[record]
        np.testing.assert_array_equal(batch["input_ids"][row, : len(ids)], ids)
        np.testing.assert_array_equal(batch["loss_mask"][row, : len(ids)], mask)
        assert (batch["input_ids"][row, len(ids) :] == pad).all()
        assert not batch["loss_mask"][row, len(ids) :].any()
        real = batch["anchors"][row][batch["anchor_keep"][row]]
        assert set(real.tolist()) <= candidates_of(mask)


def test_epochs_follow_seeded_permutations(synthetic: Dataset) -> None:
    n = len(synthetic)  # 40 records, 5 batches of 8 per epoch
    it = iterator(synthetic)
    assert it.steps_per_epoch == 5
    lookup = {synthetic.input_ids[i].tobytes(): i for i in range(n)}
    assert len(lookup) == n
    for epoch in range(3):
        seen = []
        for batch in take(it, 5):
            for row in range(8):
                ids = batch["input_ids"][row][: int((batch["input_ids"][row] != 0).sum())]
                seen.append(lookup[ids.tobytes()])
        assert seen == np.random.default_rng([7, epoch]).permutation(n).tolist()
        assert it.state()["epoch"] == epoch + 1 and it.state()["position"] == 0


def test_determinism_by_seed(synthetic: Dataset) -> None:
    a, b, c = take(iterator(synthetic), 7), take(iterator(synthetic), 7), take(iterator(synthetic, seed=8), 7)
    assert_batches_equal(a, b)
    assert not np.array_equal(a[0]["input_ids"], c[0]["input_ids"])
    assert not all(np.array_equal(x["anchors"], y["anchors"]) for x, y in zip(a, c))


def test_anchors_differ_across_epochs(synthetic: Dataset) -> None:
    # The same record in a later epoch gets fresh anchors.
    it = iterator(synthetic, global_batch_size=40, num_anchors=2)
    e0, e1 = next(it), next(it)
    record_rows = {}
    for batch in (e0, e1):
        for row in range(40):
            record_rows.setdefault(batch["input_ids"][row].tobytes(), []).append(batch["anchors"][row].tolist())
    assert any(a != b for a, b in record_rows.values())


@pytest.mark.parametrize("split", [2, 4, 5, 6, 13])
def test_state_restore(synthetic: Dataset, split: int) -> None:
    """Restoring mid-epoch (2, 4, 6, 13) or right at the epoch boundary (5) replays the same stream."""
    reference = take(iterator(synthetic), 16)
    first = iterator(synthetic)
    take(first, split)
    state = json.loads(json.dumps(first.state()))  # survives a JSON round trip
    assert set(state) == {"epoch", "position", "seed", "num_records", "lengths_sha256"}
    resumed = iterator(synthetic)
    resumed.restore(state)
    assert_batches_equal(take(resumed, 16 - split), reference[split:])


def test_restore_changed_dataset_errors(synthetic: Dataset, tok: Tokenizer, tmp_path: Path) -> None:
    state = iterator(synthetic).state()
    path = write_synthetic_conversations(tmp_path / "other.jsonl", 40, seed=99)
    other = load_conversations(path, tok, max_length=48, min_length=BLOCK + 1, system_prompt="")
    with pytest.raises(DataError, match=r"other\.jsonl: the training data changed since the iterator state was saved"):
        iterator(other).restore(state)
    fewer = Dataset(
        path="fewer",
        input_ids=synthetic.input_ids[:-1],
        loss_masks=synthetic.loss_masks[:-1],
        max_length=synthetic.max_length,
        pad_id=synthetic.pad_id,
        stats=synthetic.stats,
    )
    with pytest.raises(DataError, match=r"saved for 40 records .* now 39 records"):
        iterator(fewer).restore(state)
    with pytest.raises(DataError, match=r"saved with seed 7, but this iterator uses 8"):
        iterator(synthetic, seed=8).restore(state)
    with pytest.raises(DataError, match=r"missing keys \['lengths_sha256'\]"):
        iterator(synthetic).restore({k: v for k, v in state.items() if k != "lengths_sha256"})


@pytest.mark.parametrize("process_count", [2, 4])
def test_process_shards_partition_global_batch(synthetic: Dataset, process_count: int) -> None:
    steps = 7  # crosses an epoch boundary
    single = take(iterator(synthetic), steps)
    parts = [
        take(iterator(synthetic, process_index=i, process_count=process_count), steps) for i in range(process_count)
    ]
    for step in range(steps):
        for key in single[step]:
            local = [p[step][key] for p in parts]
            assert all(x.shape[0] == 8 // process_count for x in local)
            np.testing.assert_array_equal(np.concatenate(local), single[step][key], err_msg=key)


@pytest.mark.parametrize("process_count", [1, 2])
def test_pad_to_multiple_cuts_only_padding(synthetic: Dataset, tok: Tokenizer, process_count: int) -> None:
    """Each batch is the full-length batch cut to its longest record rounded up to the multiple
    (the same on every process: the global batch's longest), and the cut-off part is padding."""
    steps, m = 7, 16
    synthetic = load_conversations(synthetic.path, tok, max_length=256, min_length=BLOCK + 1, system_prompt="")
    full = take(iterator(synthetic), steps)
    parts = [take(iterator(synthetic, pad_to_multiple=m, process_index=i, process_count=process_count), steps)
             for i in range(process_count)]
    lengths = set()
    for step in range(steps):
        longest = int(full[step]["attention_mask"].sum(1).max())
        L = min(-(-longest // m) * m, synthetic.max_length)
        lengths.add(L)
        for key in full[step]:
            local = np.concatenate([p[step][key] for p in parts])
            assert all(p[step]["input_ids"].shape[1] == L for p in parts if key == "input_ids")
            width = L if full[step][key].shape[1] == synthetic.max_length else full[step][key].shape[1]
            np.testing.assert_array_equal(local, full[step][key][:, :width], err_msg=key)
        assert not full[step]["attention_mask"][:, L:].any() and not full[step]["loss_mask"][:, L:].any()
    assert max(lengths) < synthetic.max_length and len(lengths) > 1, lengths  # the option did something


def test_pad_to_multiple_must_not_be_negative(synthetic: Dataset) -> None:
    with pytest.raises(ConfigError, match="pad_to_multiple must be >= 0, got -1"):
        iterator(synthetic, pad_to_multiple=-1)


def test_process_count_must_divide_batch(synthetic: Dataset) -> None:
    with pytest.raises(ConfigError, match=r"global_batch_size 8 is not divisible by the 3 processes"):
        iterator(synthetic, process_count=3)
    with pytest.raises(ConfigError, match=r"process_index 2 is not in \[0, 2\)"):
        iterator(synthetic, process_index=2, process_count=2)


def test_drop_remainder(synthetic: Dataset) -> None:
    # 40 records, global batch 16: two full batches, then the epoch rolls over.
    it = iterator(synthetic, global_batch_size=16)
    assert it.steps_per_epoch == 2
    take(it, 2)
    assert it.state()["epoch"] == 1 and it.state()["position"] == 0
    # Without dropping, a third batch holds 8 records and 8 padding rows.
    keep = iterator(synthetic, global_batch_size=16, drop_remainder=False)
    assert keep.steps_per_epoch == 3
    last = take(keep, 3)[-1]
    assert last["loss_mask"][:8].any(axis=1).all()
    assert (last["input_ids"][8:] == synthetic.pad_id).all()
    assert not last["loss_mask"][8:].any() and not last["anchor_keep"][8:].any()
    assert keep.state()["epoch"] == 1
    with pytest.raises(DataError, match=r"40 usable records are fewer than one global batch of 64"):
        iterator(synthetic, global_batch_size=64)


# ---------------------------------------------------------------------------
# Global arrays


def test_make_global_batch_single_device(synthetic: Dataset) -> None:
    mesh = Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1, 1), ("data", "fsdp", "tensor"))
    local = next(iterator(synthetic))
    out = make_global_batch(local, mesh)
    assert set(out) == set(local)
    for key, x in local.items():
        assert isinstance(out[key], jax.Array)
        assert out[key].shape == x.shape and out[key].dtype == x.dtype
        np.testing.assert_array_equal(np.asarray(out[key]), x)


def test_make_global_batch_sharded(synthetic: Dataset) -> None:
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 (fake) devices")
    mesh = Mesh(np.asarray(jax.devices()[:8]).reshape(2, 2, 2), ("data", "fsdp", "tensor"))
    local = next(iterator(synthetic))
    out = make_global_batch(local, mesh)
    ids = out["input_ids"]
    assert ids.shape == (8, 48)
    assert {s.data.shape for s in ids.addressable_shards} == {(2, 48)}
    np.testing.assert_array_equal(np.asarray(ids), local["input_ids"])
    with pytest.raises(ConfigError, match=r"global batch of 6 rows .* not divisible by the 4 devices"):
        make_global_batch({k: v[:6] for k, v in local.items()}, mesh)
