"""Tests for dspark_jax.formats.tokenizer: loading, stop ids, ChatML rendering, loss masks and record readers."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer as HFTokenizer

from dspark_jax.errors import CheckpointError, DataError
from dspark_jax.formats.tokenizer import (
    PromptRecord,
    Tokenizer,
    encode_chat_prompt,
    encode_conversation,
    encode_prompt_record,
    encode_training_record,
    load_prompts,
    load_tokenizer,
    read_jsonl,
    render_chat,
    train_bpe_tokenizer,
)

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


def write_jsonl(path: Path, lines: list[str]) -> Path:
    """Write raw lines (already JSON or deliberately broken) to ``path``."""
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def masked_text(tok: Tokenizer, ids: np.ndarray, mask: np.ndarray) -> str:
    """Decode only the loss-masked tokens, special tokens kept."""
    return tok.decode(ids[mask], skip_special_tokens=False)


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
    expected = sorted({tok.token_id("<|im_end|>"), tok.token_id("<|endoftext|>"), 7})
    assert tok.stop_token_ids == tuple(expected)


def test_stop_ids_without_config_files(model_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_bytes((model_dir / "tokenizer.json").read_bytes())
    t = load_tokenizer(tmp_path)
    assert t.stop_token_ids == tuple(sorted({t.token_id("<|im_end|>"), t.token_id("<|endoftext|>")}))


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
# Chat template and loss mask


def test_chat_rendering(tok: Tokenizer) -> None:
    messages = [
        {"role": "system", "content": "You are helpful."},
        {"role": "user", "content": "What is two plus two?"},
        {"role": "assistant", "content": "It is four."},
    ]
    expected = (
        "<|im_start|>system\nYou are helpful.<|im_end|>\n"
        "<|im_start|>user\nWhat is two plus two?<|im_end|>\n"
        "<|im_start|>assistant\nIt is four.<|im_end|>\n"
    )
    assert render_chat(messages) == expected
    ids, mask = encode_conversation(tok, messages)
    assert ids.dtype == np.int32 and mask.dtype == np.bool_ and ids.shape == mask.shape
    assert tok.decode(ids, skip_special_tokens=False) == expected
    # Segment-wise encoding agrees with encoding the whole rendered string here.
    assert ids.tolist() == tok.encode(expected)
    assert masked_text(tok, ids, mask) == "It is four.<|im_end|>"


def test_mask_boundaries_exact(tok: Tokenizer) -> None:
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there!"}]
    ids, mask = encode_conversation(tok, messages)
    content = tok.encode("Hello there!")
    im_end = tok.token_id("<|im_end|>")
    trained = ids[mask].tolist()
    assert trained == content + [im_end]
    # Trained tokens are one contiguous run ending at the assistant's <|im_end|>;
    # the final newline after it is not trained.
    where = np.flatnonzero(mask)
    assert (np.diff(where) == 1).all()
    assert ids[where[-1]] == im_end
    assert not mask[where[-1] + 1 :].any()
    header = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(ids[: where[0]], skip_special_tokens=False) == header


def test_multi_turn_mask(tok: Tokenizer) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hi!"},
        {"role": "user", "content": "How are you?"},
        {"role": "assistant", "content": "Fine, thanks."},
    ]
    ids, mask = encode_conversation(tok, messages)
    assert masked_text(tok, ids, mask) == "Hi!<|im_end|>Fine, thanks.<|im_end|>"
    assert int((ids[mask] == tok.token_id("<|im_end|>")).sum()) == 2
    assert int((ids == tok.token_id("<|im_end|>")).sum()) == 5
    assert tok.decode(ids, skip_special_tokens=False) == render_chat(messages)


def test_empty_assistant_content_trains_im_end(tok: Tokenizer) -> None:
    ids, mask = encode_conversation(tok, [{"role": "user", "content": "x"}, {"role": "assistant", "content": ""}])
    assert ids[mask].tolist() == [tok.token_id("<|im_end|>")]


def test_sharegpt_matches_role_content(tok: Tokenizer) -> None:
    share = [
        {"from": "system", "value": "Be brief."},
        {"from": "human", "value": "Hello"},
        {"from": "gpt", "value": "Hi!"},
    ]
    plain = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hi!"},
    ]
    a_ids, a_mask = encode_conversation(tok, share)
    b_ids, b_mask = encode_conversation(tok, plain)
    assert a_ids.tolist() == b_ids.tolist() and a_mask.tolist() == b_mask.tolist()


def test_encode_chat_prompt(tok: Tokenizer) -> None:
    messages = [{"role": "user", "content": "Hello"}]
    ids = encode_chat_prompt(tok, messages)
    expected = "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"
    assert render_chat(messages, add_generation_prompt=True) == expected
    assert tok.decode(ids, skip_special_tokens=False) == expected
    assert ids == tok.encode(expected)


@pytest.mark.parametrize(
    ("messages", "pattern"),
    [
        ([{"role": "tool", "content": "x"}], r"unknown role 'tool'"),
        ([{"from": "bing", "value": "x"}], r"unknown role 'bing'"),
        ([{"role": "user", "content": 3}], r"'content' must be a string"),
        ([{"from": "human", "value": None}], r"'value' must be a string"),
        ([{"role": 1, "content": "x"}], r"'role' must be a string"),
        ([{"text": "x"}], r"needs 'role'/'content' or 'from'/'value'"),
        (["hello"], r"message 0 must be an object"),
        ([], r"no messages"),
    ],
)
def test_conversation_errors(tok: Tokenizer, messages: list, pattern: str) -> None:
    with pytest.raises(DataError, match=pattern):
        encode_conversation(tok, messages, where="f.jsonl:3")
    with pytest.raises(DataError, match=r"^f\.jsonl:3: "):
        encode_conversation(tok, messages, where="f.jsonl:3")


# ---------------------------------------------------------------------------
# Prompt records


def test_prompt_record_raw(tok: Tokenizer) -> None:
    text = "<|im_start|>user\nHi<|im_end|>\nraw"
    rec = encode_prompt_record(tok, {"prompt": text, "id": "abc"})
    assert rec == PromptRecord("abc", text, tuple(tok.encode(text)))
    # Raw text is verbatim: no template, markers map to their special ids.
    assert rec.token_ids[0] == tok.token_id("<|im_start|>")


def test_prompt_record_turns_uses_first_turn(tok: Tokenizer) -> None:
    rec = encode_prompt_record(tok, {"turns": ["First question?", "Second?"], "id": 5}, index=9)
    expected = "<|im_start|>user\nFirst question?<|im_end|>\n<|im_start|>assistant\n"
    assert rec.id == "5"
    assert rec.prompt_text == expected
    assert tok.decode(rec.token_ids, skip_special_tokens=False) == expected


def test_prompt_record_conversations(tok: Tokenizer) -> None:
    record = {
        "conversations": [
            {"from": "system", "value": "Be brief."},
            {"from": "human", "value": "Hello"},
            {"from": "gpt", "value": "Reference answer."},
        ]
    }
    rec = encode_prompt_record(tok, record, index=4)
    expected = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"
    assert rec.id == "4"
    assert rec.prompt_text == expected
    assert tok.decode(rec.token_ids, skip_special_tokens=False) == expected


@pytest.mark.parametrize(
    ("record", "pattern"),
    [
        ({"text": "x"}, r"needs one of the keys \['prompt', 'turns', 'conversations'\]"),
        ({"prompt": "x", "turns": ["y"]}, r"more than one of the keys"),
        ({"prompt": ""}, r"'prompt' is empty"),
        ({"prompt": 3}, r"'prompt' must be a string"),
        ({"turns": []}, r"'turns' is empty"),
        ({"turns": "x"}, r"'turns' must be a list"),
        ({"turns": [1]}, r"turn 0 must be a string"),
        ({"turns": [""]}, r"first turn is empty"),
        ({"conversations": "x"}, r"conversation must be a list"),
        ({"conversations": [{"from": "gpt", "value": "a"}]}, r"no user or system message"),
        ({"conversations": [{"role": "robot", "content": "a"}]}, r"unknown role 'robot'"),
        ({"prompt": "x", "id": 1.5}, r"'id' must be a non-empty string or an int"),
        ({"prompt": "x", "id": True}, r"'id' must be"),
    ],
)
def test_prompt_record_errors(tok: Tokenizer, record: dict, pattern: str) -> None:
    with pytest.raises(DataError, match=r"^p\.jsonl:7: .*" + pattern):
        encode_prompt_record(tok, record, where="p.jsonl:7")


def test_load_prompts(tok: Tokenizer, tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "p.jsonl",
        [
            json.dumps({"prompt": "raw text"}),
            "",
            json.dumps({"turns": ["Q1", "Q2"], "id": "q"}),
            "   ",
            json.dumps({"conversations": [{"role": "user", "content": "Hi"}]}),
        ],
    )
    recs = load_prompts(path, tok)
    assert [r.id for r in recs] == ["0", "q", "2"]
    assert recs[0].prompt_text == "raw text"
    assert recs[1].prompt_text.startswith("<|im_start|>user\nQ1<|im_end|>")
    assert all(isinstance(r.token_ids, tuple) for r in recs)


def test_load_prompts_errors_name_file_and_line(tok: Tokenizer, tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "p.jsonl", [json.dumps({"prompt": "a"}), "", json.dumps({"prompt": ""})])
    with pytest.raises(DataError, match=rf"^{re.escape(str(path))}:3: 'prompt' is empty"):
        load_prompts(path, tok)
    dup = write_jsonl(
        tmp_path / "d.jsonl", [json.dumps({"prompt": "a", "id": "x"}), json.dumps({"prompt": "b", "id": "x"})]
    )
    with pytest.raises(DataError, match=rf"^{re.escape(str(dup))}:2: duplicate id 'x' \(first used on line 1\)"):
        load_prompts(dup, tok)
    empty = write_jsonl(tmp_path / "e.jsonl", [""])
    with pytest.raises(DataError, match=rf"^{re.escape(str(empty))}: no prompt records"):
        load_prompts(empty, tok)


# ---------------------------------------------------------------------------
# JSONL reading


def test_read_jsonl(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "r.jsonl", ['{"a": 1}', "", '  {"b": 2}  '])
    assert list(read_jsonl(path)) == [(1, {"a": 1}), (3, {"b": 2})]


def test_read_jsonl_bom(tmp_path: Path) -> None:
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"a": 1}\n')
    assert list(read_jsonl(path)) == [(1, {"a": 1})]


@pytest.mark.parametrize(
    ("lines", "pattern"),
    [
        (['{"a": 1}', "{broken"], r":2: invalid JSON \("),
        (["", '["list"]'], r":2: expected a JSON object, got list"),
        (['"text"'], r":1: expected a JSON object, got str"),
    ],
)
def test_read_jsonl_errors(tmp_path: Path, lines: list[str], pattern: str) -> None:
    path = write_jsonl(tmp_path / "bad.jsonl", lines)
    with pytest.raises(DataError, match="^" + re.escape(str(path)) + pattern):
        list(read_jsonl(path))


def test_read_jsonl_bad_utf8(tmp_path: Path) -> None:
    path = tmp_path / "bin.jsonl"
    path.write_bytes(b'{"a": 1}\n{"b": "\xff"}\n')
    with pytest.raises(DataError, match=rf"^{re.escape(str(path))}:2: not valid UTF-8"):
        list(read_jsonl(path))


def test_read_jsonl_missing(tmp_path: Path) -> None:
    path = tmp_path / "missing.jsonl"
    with pytest.raises(DataError, match=rf"^{re.escape(str(path))}: cannot open file"):
        list(read_jsonl(path))


# ---------------------------------------------------------------------------
# Training records


def test_training_record_conversations(tok: Tokenizer) -> None:
    record = {"conversations": [{"from": "human", "value": "Hello"}, {"from": "gpt", "value": "Hi!"}]}
    ids, mask = encode_training_record(tok, record)
    assert masked_text(tok, ids, mask) == "Hi!<|im_end|>"


def test_training_record_turns_alternate(tok: Tokenizer) -> None:
    out = encode_training_record(tok, {"turns": ["Q1", "A1", "Q2", "A2"]})
    assert out is not None
    ids, mask = out
    assert masked_text(tok, ids, mask) == "A1<|im_end|>A2<|im_end|>"
    assert tok.decode(ids, skip_special_tokens=False) == (
        "<|im_start|>user\nQ1<|im_end|>\n<|im_start|>assistant\nA1<|im_end|>\n"
        "<|im_start|>user\nQ2<|im_end|>\n<|im_start|>assistant\nA2<|im_end|>\n"
    )


def test_training_record_without_assistant_is_none(tok: Tokenizer) -> None:
    assert encode_training_record(tok, {"turns": ["only a question"]}) is None
    assert encode_training_record(tok, {"conversations": [{"role": "user", "content": "q"}]}) is None


@pytest.mark.parametrize(
    ("record", "pattern"),
    [
        ({"prompt": "x"}, r"need 'conversations' or 'turns'"),
        ({"turns": []}, r"'turns' is empty"),
        ({"conversations": [{"role": "bot", "content": "x"}]}, r"unknown role 'bot'"),
        ({"other": 1}, r"needs one of the keys"),
    ],
)
def test_training_record_errors(tok: Tokenizer, record: dict, pattern: str) -> None:
    with pytest.raises(DataError, match=r"^t\.jsonl:2: .*" + pattern):
        encode_training_record(tok, record, where="t.jsonl:2")


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
    ids, mask = encode_conversation(t, messages)
    assert t.decode(ids, skip_special_tokens=False) == render_chat(messages)
    assert t.decode(ids[mask], skip_special_tokens=False) == "Hello<|im_end|>"
