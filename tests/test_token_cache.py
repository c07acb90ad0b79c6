"""Tokenized caches (dspark_jax.training.token_cache): the JSONL file's records, bytes that do not
depend on the number of workers, resumption, the same batches and iterator states as from JSONL
(also through grain workers), and one clear error for each kind of damaged or stale cache."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from dspark_jax.errors import ConfigError, DataError
from dspark_jax.formats.tokenizer import load_tokenizer, train_bpe_tokenizer
from dspark_jax.training import token_cache
from dspark_jax.training.data import BatchIterator, load_conversations
from dspark_jax.training.synthetic import write_synthetic_conversations
from dspark_jax.training.token_cache import open_cache, open_training_data, read_manifest, tokenize_corpus

SETTINGS = {"max_length": 48, "min_length": 5, "system_prompt": "", "enable_thinking": None}
SHARD_LINES = 7


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """(tokenizer dir, JSONL file with 50 conversations and some bad, blank and unusable lines)."""
    root = tmp_path_factory.mktemp("token_cache")
    data = write_synthetic_conversations(root / "train.jsonl", 50, seed=0)
    texts = [m["content"] for line in data.read_text().splitlines() for m in json.loads(line)["conversations"]]
    train_bpe_tokenizer(texts, 400, root / "tok")
    lines = data.read_text().splitlines()
    lines[10:10] = ["{broken", "", json.dumps({"turns": ["a question only"]}), "[1, 2]",
                    # too short: the cut to 48 tokens leaves no supervised token
                    json.dumps({"conversations": [{"role": "user", "content": "apple " * 60},
                                                  {"role": "assistant", "content": "river"}]})]
    data.write_text("\n".join(lines) + "\n")
    return root / "tok", data


@pytest.fixture(scope="module")
def cache(corpus, tmp_path_factory):
    tok, data = corpus
    out = tmp_path_factory.mktemp("cache") / "c"
    tokenize_corpus(tok, [data], out, shard_lines=SHARD_LINES, **SETTINGS)
    return out


def file_hashes(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def opened(corpus, directory, **kwargs):
    tok, _ = corpus
    return open_cache(directory, load_tokenizer(tok), **{**SETTINGS, **kwargs})


def test_cache_holds_the_jsonl_records(corpus, cache):
    tok, data = corpus
    ds = load_conversations(data, load_tokenizer(tok), **SETTINGS)
    got = opened(corpus, cache)
    assert isinstance(open_training_data(cache, load_tokenizer(tok), **SETTINGS), token_cache.TokenizedCache)
    assert got.num_shards == 8 and len(got) == len(ds) == 50
    assert got.stats == ds.stats and got.stats.skipped_bad == 2 and got.stats.skipped_too_short == 1
    assert got.errors == ds.errors and got.errors[0].startswith(f"{data}:11: invalid JSON")
    assert got.fingerprint() == ds.fingerprint() and (got.max_length, got.pad_id) == (ds.max_length, ds.pad_id)
    np.testing.assert_array_equal(got.lengths, ds.lengths)
    for i in range(len(ds)):
        for a, b in zip(got.record(i), ds.record(i)):
            assert a.dtype == b.dtype
            np.testing.assert_array_equal(a, b)


def test_workers_do_not_change_a_byte(corpus, cache, tmp_path):
    tok, data = corpus
    tokenize_corpus(tok, [data], tmp_path / "w2", shard_lines=SHARD_LINES, workers=2, **SETTINGS)
    assert file_hashes(tmp_path / "w2") == file_hashes(cache)


def test_interrupted_tokenize_resumes(corpus, cache, tmp_path):
    tok, data = corpus
    work = tmp_path / "c"
    shutil.copytree(cache, work)
    # As if killed: no manifest or lengths yet, shard 3 never written, shard 5 written but not its
    # summary, shard 6 half written under its temporary name.
    for name in ("manifest.json", "lengths.npy", "shard-00003.arrayrecord", "shard-00003.json",
                 "shard-00005.json"):
        (work / name).unlink()
    (work / "shard-00006.arrayrecord.tmp").write_bytes(b"half a shard")
    with pytest.raises(DataError, match=r"an unfinished tokenized cache .* run the same `python -m "
                                        r"train.tokenize` command again"):
        read_manifest(work)
    logs = []
    tokenize_corpus(tok, [data], work, shard_lines=SHARD_LINES, log=logs.append, **SETTINGS)
    assert "6 done before, 2 to tokenize with 1 worker(s)" in logs[0], logs
    assert file_hashes(work) == file_hashes(cache)
    logs.clear()
    tokenize_corpus(tok, [data], work, shard_lines=SHARD_LINES, log=logs.append, **SETTINGS)
    assert logs == [f"{work}: already complete (50 records)"]


def test_output_of_other_inputs_or_settings_is_refused(corpus, cache, tmp_path):
    tok, data = corpus
    work = tmp_path / "c"
    shutil.copytree(cache, work)
    other = {**SETTINGS, "max_length": 40}
    with pytest.raises(DataError, match=r"manifest.json: a finished cache of other inputs or settings"):
        tokenize_corpus(tok, [data], work, shard_lines=SHARD_LINES, **other)
    (work / "manifest.json").unlink()
    with pytest.raises(DataError, match=r"shard-00000.json: a shard of an unfinished cache of other inputs"):
        tokenize_corpus(tok, [data], work, shard_lines=SHARD_LINES, **other)
    with pytest.raises(ConfigError, match=r"workers must be an int >= 1, got 0"):
        tokenize_corpus(tok, [data], work, workers=0, **SETTINGS)
    with pytest.raises(DataError, match=r"missing.jsonl: cannot open file"):
        tokenize_corpus(tok, [tmp_path / "missing.jsonl"], tmp_path / "x", **SETTINGS)


def take(it, k):
    return [next(it) for _ in range(k)]


def assert_batches_equal(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for key in x:
            assert x[key].dtype == y[key].dtype, key
            np.testing.assert_array_equal(x[key], y[key], err_msg=key)


@pytest.mark.parametrize("process_count", [1, 2])
def test_same_batches_and_states_as_jsonl(corpus, cache, process_count):
    """Over several epochs, cut to the global batch's longest record; each simulated process's
    rows; the state of either resumes the other."""
    tok, data = corpus
    ds, cached = load_conversations(data, load_tokenizer(tok), **SETTINGS), opened(corpus, cache)
    args = dict(global_batch_size=8, num_anchors=3, block_size=4, seed=5, pad_to_multiple=16,
                process_count=process_count)
    for k in range(process_count):
        a = BatchIterator(ds, process_index=k, **args)
        b = BatchIterator(cached, process_index=k, **args)
        assert_batches_equal(take(a, 9), take(b, 9))  # 6 steps per epoch
        assert a.state() == b.state()
        resumed = BatchIterator(cached, process_index=k, **args)
        resumed.restore(json.loads(json.dumps(a.state())))
        assert_batches_equal(take(a, 4), take(resumed, 4))


def test_grain_workers_build_the_same_batches(corpus, cache):
    """Batches built by 2 grain worker processes are those built in the loop; a state saved with 2
    workers resumes with 1."""
    cached = opened(corpus, cache)
    args = dict(global_batch_size=8, num_anchors=3, block_size=4, seed=5, pad_to_multiple=16,
                process_index=1, process_count=2)
    reference = take(BatchIterator(cached, **args), 10)
    two = BatchIterator(cached, workers=2, **args)
    try:
        assert_batches_equal(take(two, 7), reference[:7])
        state = two.state()
    finally:
        two.close()
    one = BatchIterator(cached, workers=1, **args)
    try:
        one.restore(state)
        assert_batches_equal(take(one, 3), reference[7:])
    finally:
        one.close()


def _flip_byte(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def _edit_manifest(work: Path, **changes) -> None:
    manifest = json.loads((work / "manifest.json").read_text())
    (work / "manifest.json").write_text(json.dumps({**manifest, **changes}))


def _other_template(corpus, tmp_path) -> Path:
    tok, _ = corpus
    other = tmp_path / "tok2"
    shutil.copytree(tok, other)
    config = json.loads((other / "tokenizer_config.json").read_text())
    config["chat_template"] += "{# another revision #}"
    (other / "tokenizer_config.json").write_text(json.dumps(config))
    return other


def _other_tokenizer(corpus, tmp_path) -> Path:
    tok, data = corpus
    texts = [m["content"] for line in data.read_text().splitlines()[:20] if line.startswith("{\"id\"")
             for m in json.loads(line)["conversations"]]
    train_bpe_tokenizer(texts, 300, tmp_path / "tok3")
    return tmp_path / "tok3"


SHARD = "shard-00001.arrayrecord"
DAMAGE = {
    "not a cache": (lambda w, c, t: [p.unlink() for p in w.iterdir()], {},
                    r"c: not a tokenized cache \(no manifest.json\)"),
    "manifest not JSON": (lambda w, c, t: (w / "manifest.json").write_text("{cut sho"), {},
                          r"manifest.json: corrupt manifest, not readable JSON"),
    "unknown version": (lambda w, c, t: _edit_manifest(w, version=99), {},
                        r"manifest.json: a tokenized cache of format version 99; this dspark-jax reads "
                        r"version 1"),
    "another tokenizer": (lambda w, c, t: None, {"tokenizer": _other_tokenizer},
                          r"c: made with another tokenizer \(.*tok/tokenizer.json, sha256 \w{12}\) than "
                          r"the run's .*tok3/tokenizer.json"),
    "stale template": (lambda w, c, t: None, {"tokenizer": _other_template},
                       r"c: stale: made with another chat template"),
    "stale settings": (lambda w, c, t: None, {"max_length": 40, "system_prompt": None},
                       r"c: stale: made with max_length 48 \(the run's: 40\), system_prompt '' \(the "
                       r"run's: None\); tokenize the data again"),
    "missing shard": (lambda w, c, t: (w / SHARD).unlink(), {},
                      rf"{SHARD}: missing shard \(2 of the 8 manifest.json lists\)"),
    "truncated shard": (lambda w, c, t: (w / SHARD).write_bytes((w / SHARD).read_bytes()[:1000]), {},
                        rf"{SHARD}: corrupt shard: 1000 bytes, manifest.json says \d+"),
    "damaged shard": (lambda w, c, t: _flip_byte(w / SHARD, 100), {},
                      rf"{SHARD}: corrupt shard: its sha256 is not the one manifest.json lists"),
    "missing lengths": (lambda w, c, t: (w / "lengths.npy").unlink(), {},
                        r"lengths.npy: missing"),
}


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_damaged_or_stale_cache_is_one_clear_error(corpus, cache, tmp_path, kind):
    damage, run, pattern = DAMAGE[kind]
    work = tmp_path / "c"
    shutil.copytree(cache, work)
    damage(work, corpus, tmp_path)
    tok = run["tokenizer"](corpus, tmp_path) if "tokenizer" in run else corpus[0]
    settings = {**SETTINGS, **{k: v for k, v in run.items() if k != "tokenizer"}}
    with pytest.raises(DataError, match=pattern) as err:
        open_cache(work, load_tokenizer(tok), **settings)
    assert "\n" not in str(err.value)


def test_damaged_record_is_refused_when_read_without_verify(corpus, cache, tmp_path):
    """verify=False skips the sha256; ArrayRecord's checksums still refuse the damaged record."""
    work = tmp_path / "c"
    shutil.copytree(cache, work)
    _flip_byte(work / SHARD, 100)
    cached = opened(corpus, work, verify=False)
    first = json.loads((work / "manifest.json").read_text())["shards"][0]["records"]
    with pytest.raises(DataError, match=rf"{SHARD}: record 0: cannot be read .*the cache is damaged"):
        cached.record(first)
    cached.record(0)  # the other shards are fine
    # Through a grain worker too: the same error reaches the training loop.
    it = BatchIterator(cached, global_batch_size=len(cached), num_anchors=3, block_size=4, seed=0, workers=1)
    try:
        with pytest.raises(DataError, match=rf"{SHARD}: record 0: cannot be read"):
            next(it)
    finally:
        it.close()
