"""Tests for dspark_jax.formats.tokenizer: loading, encode/decode, stop ids, the tiny tokenizer's chat template."""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer as HFTokenizer

from dspark_jax.errors import CheckpointError
from dspark_jax.formats.chat_template import TINY_CHAT_TEMPLATE
from dspark_jax.formats.records import encode_conversation, render_chat
from dspark_jax.formats.tokenizer import Tokenizer, load_tokenizer, train_bpe_tokenizer

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello there! How are you today?",
    "Speculative decoding drafts several tokens and the target verifies them.",
    "user assistant system: what is two plus two? It is four.",
    "Naïve café — unicode text also works, 123 456.",
]
GOLDEN_DIR = Path(__file__).resolve().parents[2] / "shared/reference/golden/target"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint dir with a tiny byte-level BPE tokenizer and config files."""
    path = tmp_path_factory.mktemp("tiny_ckpt")
    train_bpe_tokenizer(CORPUS * 5, 300, path)
    tok = HFTokenizer.from_file(str(path / "tokenizer.json"))
    im_end = tok.token_to_id("<|im_end|>")
    (path / "config.json").write_text(json.dumps({"eos_token_id": im_end}))
    # 7 is an ordinary token listed as an extra eos id, to check the union.
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [im_end, 7]}))
    return path


@pytest.fixture(scope="module")
def tok(model_dir: Path) -> Tokenizer:
    """The tiny tokenizer, loaded through the public API."""
    return load_tokenizer(model_dir)


# ---------------------------------------------------------------------------
# Loading, encode/decode, stop ids


def test_round_trip(tok: Tokenizer) -> None:
    for text in CORPUS + ["unseen words: zebra quartz!\n\tindent", ""]:
        ids = tok.encode(text)
        assert all(isinstance(i, int) for i in ids)
        assert tok.decode(ids) == text


def test_no_special_tokens_added(tok: Tokenizer) -> None:
    ids = tok.encode("Hello")
    assert not set(ids) & {tok.token_id(s) for s in SPECIALS}


def test_decode_skips_special_tokens_by_default(tok: Tokenizer) -> None:
    ids = [tok.token_id("<|im_start|>")] + tok.encode("Hello") + [tok.token_id("<|im_end|>")]
    assert tok.decode(ids) == "Hello"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>Hello<|im_end|>"
    assert tok.decode(np.asarray(ids, dtype=np.int32)) == "Hello"


def test_vocab_size_includes_added_tokens(tok: Tokenizer) -> None:
    assert tok.vocab_size == tok.backend.get_vocab_size(with_added_tokens=True)
    assert all(tok.token_id(s) < tok.vocab_size for s in SPECIALS)
    assert 260 < tok.vocab_size <= 300


def test_token_id_missing_names_token(tok: Tokenizer) -> None:
    with pytest.raises(CheckpointError, match=r"'<\|nope\|>'.*not in the tokenizer vocabulary"):
        tok.token_id("<|nope|>")


def test_stop_ids_union_sorted(tok: Tokenizer) -> None:
    # generation_config's eos ids (config.json's are not read then) and tokenizer_config's eos_token
    # (<|im_end|>); no end markers added beyond them (the rule: tests/test_generation_config.py).
    assert tok.stop_token_ids == tuple(sorted({tok.token_id("<|im_end|>"), 7}))


def test_stop_ids_without_config_files(model_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_bytes((model_dir / "tokenizer.json").read_bytes())
    assert load_tokenizer(tmp_path).stop_token_ids == ()


def test_stop_ids_null_eos(model_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_bytes((model_dir / "tokenizer.json").read_bytes())
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": None}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 5}))
    t = load_tokenizer(tmp_path)
    assert 5 in t.stop_token_ids


def test_load_missing_tokenizer(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"tokenizer\.json: tokenizer file not found"):
        load_tokenizer(tmp_path)
    with pytest.raises(CheckpointError, match=re.escape(str(tmp_path / "absent"))):
        load_tokenizer(tmp_path / "absent")


def test_load_unreadable_tokenizer(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"tokenizer\.json: cannot read tokenizer"):
        load_tokenizer(tmp_path)


@pytest.mark.parametrize(
    ("name", "content", "pattern"),
    [
        ("config.json", "{oops", r"config\.json: cannot read JSON"),
        ("generation_config.json", json.dumps({"eos_token_id": "2"}), r"generation_config\.json: 'eos_token_id'"),
        ("config.json", json.dumps({"eos_token_id": [1, True]}), r"config\.json: 'eos_token_id'"),
        ("config.json", json.dumps([1, 2]), r"config\.json: expected a JSON object"),
    ],
)
def test_load_bad_config(model_dir: Path, tmp_path: Path, name: str, content: str, pattern: str) -> None:
    (tmp_path / "tokenizer.json").write_bytes((model_dir / "tokenizer.json").read_bytes())
    (tmp_path / name).write_text(content)
    with pytest.raises(CheckpointError, match=pattern):
        load_tokenizer(tmp_path)


# ---------------------------------------------------------------------------
# The tiny tokenizer's chat template


def test_tiny_tokenizer_carries_a_chat_template(model_dir: Path, tok: Tokenizer) -> None:
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert config["chat_template"] == TINY_CHAT_TEMPLATE
    assert config["eos_token"] == "<|im_end|>" and config["pad_token"] == "<|endoftext|>"
    assert tok.chat_template.origin.startswith(str(model_dir / "tokenizer_config.json"))
    assert tok.chat_template.family.name == "qwen" and not tok.chat_template.builtin
    # ids 0..3 stay the chat specials; no think tokens were added.
    assert [tok.token_id(s) for s in SPECIALS] == [0, 1, 2, 3]
    assert tok.backend.token_to_id("<think>") is None


def test_tokenizer_without_template_falls_back_to_chatml_with_one_warning(model_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_bytes((model_dir / "tokenizer.json").read_bytes())
    t = load_tokenizer(tmp_path)
    with pytest.warns(UserWarning, match=r"no chat template.*built-in ChatML") as caught:
        first = t.chat_template
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per tokenizer
        assert t.chat_template is first
    assert len(caught) == 1 and first.builtin


# ---------------------------------------------------------------------------
# Real checkpoint tokenizer (shared golden reference), when present


def test_golden_tokenizer() -> None:
    if not (GOLDEN_DIR / "tokenizer.json").is_file():
        pytest.skip(f"golden reference tokenizer not found at {GOLDEN_DIR}")
    t = load_tokenizer(GOLDEN_DIR)
    assert t.token_id("<|im_end|>") in t.stop_token_ids
    text = "Hello, world!"
    assert t.decode(t.encode(text)) == text
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    with pytest.warns(UserWarning, match="built-in ChatML"):  # the golden target ships no template
        ids, mask = encode_conversation(t, messages)
    assert t.decode(ids, skip_special_tokens=False) == render_chat(
        t, [{"role": "system", "content": "You are a helpful assistant."}, *messages])
    assert t.decode(ids[mask], skip_special_tokens=False) == "Hello<|im_end|>\n"
