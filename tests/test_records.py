"""Prompt and training records (dspark_jax.formats.records, training.data.load_conversations,
python -m train.records). Training ids and loss masks are checked against an independent reading of
DESIGN §9's rule: transformers' apply_chat_template for the ids, and the supervised character spans
found by plain string search mapped to tokens through the tokenizer's offsets."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer

from dspark_jax.config import load_config, preset_path
from dspark_jax.errors import CheckpointError, DataError
from dspark_jax.formats.records import (
    PromptRecord,
    encode_chat_prompt,
    encode_conversation,
    encode_prompt_record,
    encode_training_record,
    load_prompts,
    read_jsonl,
    render_chat,
    training_example,
)
from dspark_jax.formats.tokenizer import Tokenizer, load_tokenizer, train_bpe_tokenizer
from dspark_jax.training.data import load_conversations

from .qwen3_style import make_qwen3_style_dir

REPO = Path(__file__).resolve().parents[1]
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello there! How are you today? What is two plus two? It is four.",
    "Count from 1 to 9: 1 2 3 4 5 6 7 8 9. The weather in Paris is sunny.",
    "user assistant system tool: get_weather city Paris, 21 degrees.",
]
SYSTEM = "You are a helpful assistant."
HEAD, END = "<|im_start|>assistant\n", "<|im_end|>\n"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_bpe_tokenizer(CORPUS * 5, 320, tmp_path_factory.mktemp("tiny_tok"))


@pytest.fixture(scope="module")
def tok(tiny_dir: Path) -> Tokenizer:
    return load_tokenizer(tiny_dir)


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_qwen3_style_dir(tmp_path_factory.mktemp("qwen3_style"))


def write_jsonl(path: Path, lines: list) -> Path:
    """Write lines (objects as JSON, strings raw: already JSON or deliberately broken) to ``path``."""
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n", encoding="utf-8")
    return path


def masked_text(tok: Tokenizer, ids: np.ndarray, mask: np.ndarray) -> str:
    """Decode only the loss-masked tokens, special tokens kept."""
    return tok.decode(ids[mask], skip_special_tokens=False)


def chat(*pairs: tuple[str, str]) -> list[dict]:
    return [{"role": role, "content": content} for role, content in pairs]


# ---------------------------------------------------------------------------
# Messages and prompts with the tiny tokenizer's template


def test_prompt_rendering_of_the_tiny_template(tok: Tokenizer) -> None:
    messages = chat(("system", "Be brief."), ("user", "What is two plus two?"))
    expected = ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is two plus two?<|im_end|>\n"
                "<|im_start|>assistant\n")
    assert render_chat(tok, messages, add_generation_prompt=True) == expected
    ids = encode_chat_prompt(tok, messages)
    assert ids == tok.encode(expected)
    assert tok.decode(ids, skip_special_tokens=False) == expected
    # No think blocks in the tiny template, whatever enable_thinking says.
    assert encode_chat_prompt(tok, messages, enable_thinking=True) == ids


def test_sharegpt_matches_role_content(tok: Tokenizer) -> None:
    share = [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hello"},
             {"from": "gpt", "value": "Hi!"}, {"from": "tool", "value": "42"}]
    plain = chat(("system", "Be brief."), ("user", "Hello"), ("assistant", "Hi!"), ("tool", "42"))
    a_ids, a_mask = encode_conversation(tok, share)
    b_ids, b_mask = encode_conversation(tok, plain)
    assert a_ids.tolist() == b_ids.tolist() and a_mask.tolist() == b_mask.tolist()


@pytest.mark.parametrize(
    ("messages", "pattern"),
    [
        ([{"role": "robot", "content": "x"}], r"unknown role 'robot'"),
        ([{"from": "bing", "value": "x"}], r"unknown role 'bing'"),
        ([{"role": "user", "content": 3}], r"'content' must be a string"),
        ([{"from": "human", "value": None}], r"'value' must be a string"),
        ([{"role": 1, "content": "x"}], r"'role' must be a string"),
        ([{"text": "x"}], r"needs 'role'/'content' or 'from'/'value'"),
        (["hello"], r"message 0 must be an object"),
        ([], r"no messages"),
        ([{"role": "user", "content": "q"}, {"role": "assistant", "content": None, "tool_calls": "[{"}],
         r"message 1: 'tool_calls' is a string but not valid JSON"),
        ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": {"name": "f"}}],
         r"message 1: 'tool_calls' must be a list of objects"),
        (chat(("assistant", "a"), ("user", "q")), r"after the system prompt must be the user's, got 'assistant'"),
        (chat(("system", "s"), ("tool", "t")), r"must be the user's, got 'tool'"),
        (chat(("system", "s")), r"must be the user's, got nothing"),
    ],
)
def test_conversation_errors(tok: Tokenizer, messages: list, pattern: str) -> None:
    with pytest.raises(DataError, match=r"^f\.jsonl:3: .*" + pattern):
        encode_conversation(tok, messages, where="f.jsonl:3")


def test_content_may_be_null_with_tool_calls(tok: Tokenizer) -> None:
    call = {"name": "f", "arguments": {"x": 1}}
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": None, "tool_calls": [call]}]
    ids, mask = encode_conversation(tok, messages)
    assert masked_text(tok, ids, mask) == '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call><|im_end|>\n'


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
# Training records: the rule, read independently


def expected_example(oracle, tok: Tokenizer, record: dict) -> tuple[list[int], list[bool]]:
    """Ids and loss mask of a training record by DESIGN §9, computed without dspark_jax's records code."""
    if "turns" in record:
        messages = [{"role": ("user", "assistant")[i % 2], "content": t} for i, t in enumerate(record["turns"])]
    else:
        roles = {"human": "user", "gpt": "assistant"}
        messages = [{"role": roles.get(m["from"], m["from"]), "content": m["value"]} if "from" in m else dict(m)
                    for m in record["conversations"]]
    for m in messages:
        if isinstance(m.get("tool_calls"), str):
            m["tool_calls"] = json.loads(m["tool_calls"])
    if messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": SYSTEM})
    text = oracle.apply_chat_template(messages, tools=record.get("tools"), tokenize=False)
    ids = oracle.apply_chat_template(messages, tools=record.get("tools"), tokenize=True, return_dict=False)
    spans, pos = [], 0
    while (head := text.find(HEAD, pos)) >= 0:
        start = head + len(HEAD)
        end = text.find(END, start)
        pos = len(text) if end < 0 else end + len(END)
        spans.append((start, pos))
    offsets = tok.backend.encode(text, add_special_tokens=False).offsets
    mask = [any(s <= a and b <= e for s, e in spans) for a, b in offsets]
    assert len(mask) == len(ids)
    return list(ids), mask


CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
VARIED = [
    {"id": "plain", "conversations": chat(("user", "What is two plus two?"), ("assistant", "It is four."))},
    {"id": "system", "conversations": chat(("system", "Be brief."), ("user", "Hello there!"), ("assistant", "Hi!"),
                                           ("user", "How are you today?"), ("assistant", "Fine, thanks."))},
    {"id": "calls-json", "tools": TOOLS, "conversations": [
        {"role": "user", "content": "The weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": json.dumps([CALL])},
        {"role": "tool", "content": "sunny, 21 degrees"},
        {"role": "assistant", "content": "It is sunny."}]},
    {"id": "calls-list", "conversations": [
        {"role": "user", "content": "Paris?"},
        {"role": "assistant", "content": "Let me see.", "tool_calls": [CALL, CALL["function"]]},
        {"role": "tool", "content": "sunny"}, {"role": "tool", "content": "21 degrees"},
        {"role": "assistant", "content": "Sunny, 21 degrees."}]},
    {"id": "empty", "conversations": chat(("user", "Say nothing."), ("assistant", ""), ("user", "Again."),
                                          ("assistant", ""))},
    {"id": "sharegpt", "conversations": [{"from": "human", "value": "Count from 1 to 9."},
                                         {"from": "gpt", "value": "1 2 3 4 5 6 7 8 9"}]},
    {"id": "turns", "turns": ["Hello there!", "Hi!", "What is two plus two?", "It is four."]},
    {"id": "reasoning", "conversations": [{"role": "user", "content": "Two plus two?"},
                                          {"role": "assistant", "content": "Four.", "reasoning_content": "2+2=4"}]},
    {"id": "long", "conversations": chat(("user", "Count from 1 to 300."),
                                         ("assistant", " ".join(str(i) for i in range(1, 301))))},
]
MAX_LENGTH = 400


@pytest.mark.parametrize("kind", ["tiny", "qwen3-style"])
def test_training_ids_and_masks_follow_the_rule(kind: str, tiny_dir: Path, qwen_dir: Path, tmp_path: Path) -> None:
    directory = tiny_dir if kind == "tiny" else qwen_dir
    tok, oracle = load_tokenizer(directory), AutoTokenizer.from_pretrained(directory)
    expected = [expected_example(oracle, tok, r) for r in VARIED]
    # Premises: only the last record is longer than MAX_LENGTH, and it is cut inside its answer.
    assert [len(ids) > MAX_LENGTH for ids, _ in expected] == [False] * (len(VARIED) - 1) + [True]
    assert expected[-1][1][MAX_LENGTH - 1]
    ds = load_conversations(write_jsonl(tmp_path / "varied.jsonl", VARIED), tok, max_length=MAX_LENGTH,
                            min_length=2)
    assert ds.stats.kept == len(VARIED) and ds.stats.truncated == 1
    for record, (ids, mask), got_ids, got_mask in zip(VARIED, expected, ds.input_ids, ds.loss_masks):
        assert got_ids.tolist() == ids[:MAX_LENGTH], record["id"]
        assert got_mask.tolist() == mask[:MAX_LENGTH], record["id"]
    think = "" if kind == "tiny" else "<think>\n\n</think>\n\n"  # Qwen3 puts one in the last answer
    texts = {r["id"]: masked_text(tok, ids, mask) for r, ids, mask in zip(VARIED, ds.input_ids, ds.loss_masks)}
    assert texts["plain"] == f"{think}It is four.<|im_end|>\n"
    assert texts["system"] == f"Hi!<|im_end|>\n{think}Fine, thanks.<|im_end|>\n"
    assert texts["empty"] == f"<|im_end|>\n{think}<|im_end|>\n"
    assert texts["turns"] == f"Hi!<|im_end|>\n{think}It is four.<|im_end|>\n"
    if kind == "qwen3-style":
        assert texts["reasoning"] == "<think>\n2+2=4\n</think>\n\nFour.<|im_end|>\n"
    # The default system prompt only when the conversation has none of its own.
    rendered = {r["id"]: tok.decode(ids, skip_special_tokens=False) for r, ids in zip(VARIED, ds.input_ids)}
    assert rendered["plain"].startswith(f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n")
    assert rendered["system"].startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n")
    assert SYSTEM not in rendered["system"]


def test_training_example_spans(tok: Tokenizer) -> None:
    record = {"conversations": chat(("user", "Hi"), ("assistant", "Hello there!"))}
    example = training_example(tok, record)
    assert [example.text[a:b] for a, b in example.spans] == ["Hello there!<|im_end|>\n"]
    # A text that ends inside an answer: the span runs to the end.
    record = {"conversations": chat(("system", "s"), ("user", "Hi"), ("assistant", "Hello"))}
    full = training_example(tok, record)
    assert full.text.endswith("Hello<|im_end|>\n") and full.spans[-1][1] == len(full.text)


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
        ({"conversations": chat(("system", "s"), ("assistant", "a"), ("user", "q"))},
         r"first message after the system prompt must be the user's, got 'assistant'"),
        ({"conversations": [{"role": "user", "content": "q"},
                            {"role": "assistant", "content": "", "tool_calls": '[{"name": "f",'}]},
         r"message 1: 'tool_calls' is a string but not valid JSON"),
        ({"tools": "{bad", "conversations": chat(("user", "q"), ("assistant", "a"))}, r"'tools' is a string but not"),
    ],
)
def test_training_record_errors(tok: Tokenizer, record: dict, pattern: str) -> None:
    with pytest.raises(DataError, match=r"^t\.jsonl:2: .*" + pattern):
        encode_training_record(tok, record, where="t.jsonl:2")


def test_load_conversations_skips_a_bad_record_and_says_where(tok: Tokenizer, tmp_path: Path) -> None:
    good = {"conversations": chat(("user", "q"), ("assistant", "It is four."))}
    bad_order = {"conversations": chat(("assistant", "a"), ("user", "q"))}
    bad_calls = {"conversations": [{"role": "user", "content": "q"},
                                   {"role": "assistant", "content": "", "tool_calls": "[oops"}]}
    for bad, pattern in ((bad_order, "must be the user's"), (bad_calls, "'tool_calls' is a string but not valid")):
        path = write_jsonl(tmp_path / "bad.jsonl", [good, "", bad, good])
        ds = load_conversations(path, tok, max_length=64, min_length=2)
        assert ds.stats.kept == 2 and ds.stats.skipped_bad == 1
        assert re.match(rf"^{re.escape(str(path))}:3: .*{pattern}", ds.errors[0]), ds.errors


def test_enable_thinking_reaches_the_template_only_when_set(tmp_path: Path) -> None:
    template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
                "{% if enable_thinking is defined %}[thinking={{ enable_thinking }}]{% endif %}<|im_end|>\n"
                "{% endfor %}")
    tok = load_tokenizer(make_qwen3_style_dir(tmp_path / "tok", template=template))
    path = write_jsonl(tmp_path / "d.jsonl", [{"conversations": chat(("user", "q"), ("assistant", "a b c"))}])
    for thinking, tag in ((None, ""), (True, "[thinking=True]"), (False, "[thinking=False]")):
        ds = load_conversations(path, tok, max_length=128, min_length=2, enable_thinking=thinking)
        assert masked_text(tok, ds.input_ids[0], ds.loss_masks[0]) == f"a b c{tag}<|im_end|>\n"
    cfg = load_config(preset_path("dspark-tiny"), ["train.enable_thinking=false"])
    assert cfg.train.enable_thinking is False
    assert load_config(preset_path("dspark-tiny")).train.enable_thinking is None


def test_unknown_template_family_cannot_train(tmp_path: Path) -> None:
    d = make_qwen3_style_dir(tmp_path / "tok", template="{% for m in messages %}<turn>{{ m.content }}{% endfor %}")
    tok = load_tokenizer(d)
    assert encode_prompt_record(tok, {"turns": ["q"]}).prompt_text == "<turn>q"  # decoding is fine
    with pytest.raises(CheckpointError, match=r"tokenizer_config\.json.*no known family.*<\|im_start\|>"):
        encode_training_record(tok, {"conversations": chat(("user", "q"), ("assistant", "a"))})


# ---------------------------------------------------------------------------
# python -m train.records


def run_records(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-m", "train.records", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120, check=False)


def test_records_cli(tok: Tokenizer, tiny_dir: Path, tmp_path: Path) -> None:
    records = [
        {"id": "a", "conversations": chat(("user", "What is two plus two?"), ("assistant", "It is four."))},
        {"id": "b", "conversations": chat(("assistant", "a"), ("user", "q"))},  # bad: reported, skipped
        "{broken",
        {"id": "c", "turns": ["only a question"]},
        VARIED[-1],
    ]
    data = write_jsonl(tmp_path / "data.jsonl", records)
    out = tmp_path / "out.jsonl"
    proc = run_records("--target", str(tiny_dir), "--data", str(data), "--jsonl", str(out), "--max-length", "96")
    assert proc.returncode == 0, proc.stderr
    stdout = proc.stdout
    assert "⟦It is four.<|im_end|>\n⟧" in stdout and "\x1b[" not in stdout  # not a TTY: brackets
    ds = load_conversations(write_jsonl(tmp_path / "good.jsonl", [records[0], records[4]]), tok,
                            max_length=96, min_length=2)
    n0, s0 = len(ds.input_ids[0]), int(ds.loss_masks[0].sum())
    full = len(training_example(tok, VARIED[-1]).input_ids)
    assert f"{data}:1 id=a: {n0} tokens, {s0} supervised\n" in stdout
    assert f"{data}:5 id=long: 96 tokens (cut from {full}), {int(ds.loss_masks[1].sum())} supervised" in stdout
    assert f"{data}:2 id=b: skipped: the first message after the system prompt must be the user's" in stdout
    assert f"{data}:3 id=2: skipped: invalid JSON" in stdout
    assert f"{data}:4 id=c: skipped: no assistant turn" in stdout
    assert "5 records: 2 kept" in stdout and "skipped 2 bad, 1 without an assistant turn, 0 too short" in stdout
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == ["a", "long"]
    for row, ids, mask in zip(rows, ds.input_ids, ds.loss_masks):
        assert row["input_ids"] == ids.tolist() and row["loss_mask"] == mask.astype(int).tolist()
    assert not list(tmp_path.glob(".out.jsonl.*"))  # the temporary file was renamed
    before = data.read_text()
    refused = run_records("--target", str(tiny_dir), "--data", str(data), "--jsonl", str(data))
    assert refused.returncode == 2 and "would overwrite the input data file" in refused.stderr
    assert data.read_text() == before and refused.stdout == ""
    colored = run_records("--target", str(tiny_dir), "--data", str(data), "--limit", "1", "--color", "always")
    assert colored.returncode == 0 and "\x1b[1;32mIt is four." in colored.stdout
    assert "1 records: 1 kept" in colored.stdout


def test_system_prompt_setting_replaces_or_drops_the_default(tok: Tokenizer, tmp_path: Path) -> None:
    """train.system_prompt: None keeps the family's default, a string replaces it, "" drops it;
    a conversation's own system message wins over all three."""
    def rendered(record, system_prompt):
        return training_example(tok, record, system_prompt=system_prompt).text

    plain = {"conversations": chat(("user", "hi"), ("assistant", "hello"))}
    assert "You are a helpful assistant." in rendered(plain, None)
    assert "Be brief." in rendered(plain, "Be brief.")
    assert "Be brief." not in rendered(plain, None)
    assert rendered(plain, "").startswith("<|im_start|>user\n")
    own = {"conversations": [{"role": "system", "content": "Mine."}] + chat(("user", "hi"), ("assistant", "hello"))}
    for setting in (None, "", "Be brief."):
        text = rendered(own, setting)
        assert "Mine." in text and "Be brief." not in text and "helpful" not in text
    path = write_jsonl(tmp_path / "one.jsonl", [plain])
    short = load_conversations(path, tok, max_length=200, min_length=2, system_prompt="")
    full = load_conversations(path, tok, max_length=200, min_length=2)
    assert len(full.input_ids[0]) > len(short.input_ids[0])
