"""Chat templates from the checkpoint (dspark_jax.formats.chat_template), with transformers'
`apply_chat_template` as the oracle: a Qwen3-style template (tests/qwen3_style.py) in a tokenizer
directory, our prompt ids against transformers' for turns and conversations records."""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from dspark_jax.errors import CheckpointError, DataError
from dspark_jax.formats.chat_template import FAMILIES, load_chat_template
from dspark_jax.formats.records import encode_prompt_record, load_prompts
from dspark_jax.formats.tokenizer import Tokenizer, load_tokenizer

from .qwen3_style import QWEN3_STYLE_TEMPLATE, make_qwen3_style_dir

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather <b>now</b> & here, in 'C'",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
HISTORY = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the weather like in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [CALL]},
    {"role": "tool", "content": '{"sky": "sunny", "degrees": 21}'},
    {"role": "tool", "content": "no wind"},
    {"role": "assistant", "content": "It is sunny, 21 degrees.", "reasoning_content": "The tool said so."},
    {"role": "user", "content": "And tomorrow?"},
]


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_qwen3_style_dir(tmp_path_factory.mktemp("qwen3_style"))


@pytest.fixture(scope="module")
def ours(qwen_dir: Path) -> Tokenizer:
    return load_tokenizer(qwen_dir)


@pytest.fixture(scope="module")
def oracle(qwen_dir: Path):
    return AutoTokenizer.from_pretrained(qwen_dir)


def hf_ids(tok, messages, **kwargs) -> list[int]:
    return list(tok.apply_chat_template(messages, tokenize=True, return_dict=False, add_generation_prompt=True,
                                        **kwargs))


@pytest.mark.parametrize("enable_thinking", [False, True])
def test_turns_record_matches_transformers(ours, oracle, enable_thinking: bool) -> None:
    record = {"turns": ["What is the weather like in Paris today?", "And tomorrow?"]}
    rec = encode_prompt_record(ours, record, enable_thinking=enable_thinking)
    user = [{"role": "user", "content": record["turns"][0]}]
    assert list(rec.token_ids) == hf_ids(oracle, user, enable_thinking=enable_thinking)
    tail = "<|im_start|>assistant\n" + ("" if enable_thinking else "<think>\n\n</think>\n\n")
    assert rec.prompt_text.startswith("<|im_start|>user\n") and rec.prompt_text.endswith(tail)
    if not enable_thinking:  # the think markers are their special ids
        assert rec.token_ids[-6:-2] == (ours.token_id("<think>"), *ours.encode("\n\n"), ours.token_id("</think>"))


def test_turns_default_is_thinking_off(ours) -> None:
    rec = encode_prompt_record(ours, {"turns": ["Hi"]})
    assert rec.prompt_text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


@pytest.mark.parametrize("enable_thinking", [False, True])
@pytest.mark.parametrize("with_tools", [False, True])
@pytest.mark.parametrize("with_system", [False, True])
def test_conversations_record_matches_transformers(ours, oracle, enable_thinking, with_tools, with_system) -> None:
    history = HISTORY if with_system else HISTORY[1:]
    # The record gives tool calls as a JSON string and ends with a reference answer (dropped).
    messages = [dict(m, tool_calls=json.dumps(m["tool_calls"])) if "tool_calls" in m else m for m in history]
    record = {"id": "w", "conversations": messages + [{"role": "assistant", "content": "Rain."}]}
    if with_tools:
        record["tools"] = TOOLS
    rec = encode_prompt_record(ours, record, enable_thinking=enable_thinking)
    expected = hf_ids(oracle, history, tools=TOOLS if with_tools else None, enable_thinking=enable_thinking)
    assert list(rec.token_ids) == expected
    assert rec.prompt_text == oracle.decode(expected)
    assert ("Weather <b>now</b> & here" in rec.prompt_text) == with_tools  # tojson keeps HTML as is


def test_sharegpt_and_tools_as_json_string(ours, oracle) -> None:
    record = {"conversations": [{"from": "human", "value": "Paris?"}], "tools": json.dumps(TOOLS)}
    rec = encode_prompt_record(ours, record)
    assert list(rec.token_ids) == hf_ids(oracle, [{"role": "user", "content": "Paris?"}], tools=TOOLS,
                                         enable_thinking=False)


def test_load_prompts_passes_enable_thinking(ours, oracle, tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"turns": ["Count from 1 to 9."]}) + "\n" + json.dumps({"prompt": "raw"}) + "\n")
    user = [{"role": "user", "content": "Count from 1 to 9."}]
    for thinking in (False, True):
        recs = load_prompts(path, ours, enable_thinking=thinking)
        assert list(recs[0].token_ids) == hf_ids(oracle, user, enable_thinking=thinking)
        assert recs[1].prompt_text == "raw"
    assert load_prompts(path, ours)[0] == load_prompts(path, ours, enable_thinking=False)[0]


@pytest.mark.parametrize("form", ["jinja", "list"])
def test_template_forms(form: str, tmp_path: Path) -> None:
    # The jinja file wins over a config entry, as in transformers.
    config = {"chat_template": "{{ 'not this one' }}"} if form == "jinja" else None
    d = make_qwen3_style_dir(tmp_path / form, form=form, config=config)
    ours, oracle = load_tokenizer(d), AutoTokenizer.from_pretrained(d)
    rec = encode_prompt_record(ours, {"conversations": HISTORY})
    assert list(rec.token_ids) == hf_ids(oracle, HISTORY, enable_thinking=False)
    assert ours.chat_template.source == QWEN3_STYLE_TEMPLATE
    assert ours.chat_template.origin.startswith(str(d / ("chat_template.jinja" if form == "jinja" else
                                                         "tokenizer_config.json")))


def test_special_tokens_and_globals_match_transformers(tmp_path: Path) -> None:
    template = ("{{ bos_token }}{% for m in messages %}[{{ m.role }}|{{ m.content }}]{{ eos_token }}{% endfor %}"
                "{% if pad_token is defined %}<pad={{ pad_token }}>{% endif %}{{ unk_token is defined }}"
                "{% for x in [1, 2, 3] %}{% if x == 2 %}{% break %}{% endif %}{{ x }}{% endfor %}"
                "{% generation %}G{% endgeneration %}{{ strftime_now('%Y')[:2] }}{{ {'a': '<&>'} | tojson }}")
    d = make_qwen3_style_dir(tmp_path / "tok", template=template, config={
        "bos_token": {"__type": "AddedToken", "content": "<|endoftext|>", "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False, "special": True}})
    messages = [{"role": "user", "content": "hi"}]
    ours = load_tokenizer(d)
    rec = encode_prompt_record(ours, {"conversations": messages})
    oracle = AutoTokenizer.from_pretrained(d)
    assert rec.prompt_text == oracle.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rec.prompt_text.startswith("<|endoftext|>[user|hi]<|im_end|><pad=<|endoftext|>>False1G20")
    assert rec.prompt_text.endswith('{"a": "<&>"}')


def test_no_template_falls_back_to_chatml_with_a_warning(qwen_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_bytes((qwen_dir / "tokenizer.json").read_bytes())
    tok = load_tokenizer(tmp_path)
    with pytest.warns(UserWarning, match=re.escape(str(tmp_path / "tokenizer.json")) + r".*no chat template"):
        rec = encode_prompt_record(tok, {"turns": ["Hi"]})
    assert rec.prompt_text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per tokenizer
        encode_prompt_record(tok, {"turns": ["Again"]})
    assert load_chat_template(tmp_path) is None


def test_raise_exception_names_template_and_record_line(tmp_path: Path) -> None:
    template = ("{% for m in messages %}{% if m.role == 'user' and m.content == 'bad' %}"
                "{{ raise_exception('Conversation roles must alternate') }}{% endif %}{{ m.content }}{% endfor %}")
    d = make_qwen3_style_dir(tmp_path / "tok", template=template)
    tok = load_tokenizer(d)
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"turns": ["good"]}) + "\n\n" + json.dumps({"turns": ["bad"]}) + "\n")
    config = re.escape(str(d / "tokenizer_config.json"))
    with pytest.raises(DataError, match=rf"^{re.escape(str(path))}:3: chat template {config} .*"
                                        r"refused the conversation: Conversation roles must alternate$"):
        load_prompts(path, tok)


def test_template_runtime_error_is_one_data_error(tmp_path: Path) -> None:
    d = make_qwen3_style_dir(tmp_path / "tok", template="{{ messages[0].content + 1 }}")
    with pytest.raises(DataError, match=r"^f\.jsonl:2: chat template .*tokenizer_config\.json.* failed to render"):
        encode_prompt_record(load_tokenizer(d), {"turns": ["x"]}, where="f.jsonl:2")


@pytest.mark.parametrize("form", ["config", "jinja"])
def test_template_syntax_error_names_file(form: str, tmp_path: Path) -> None:
    d = make_qwen3_style_dir(tmp_path / "tok", template="{% for m in messages %}{{ m.content }}\n{% endif %}",
                             form=form)
    name = "chat_template.jinja" if form == "jinja" else "tokenizer_config.json"
    with pytest.raises(CheckpointError, match=rf"^{re.escape(str(d / name))}.*chat template does not parse "
                                              r"\(template line 2: "):
        load_tokenizer(d)


@pytest.mark.parametrize(("config", "pattern"), [
    ({"chat_template": 3}, r"'chat_template' must be a string or a list"),
    ({"chat_template": [{"name": "rag", "template": "x"}]}, r"'chat_template' has no template named 'default' \(has \['rag'\]\)"),
    ({"chat_template": [{"name": "default"}]}, r"'chat_template' entry 0 must be"),
    ({"eos_token": 5}, r"'eos_token' must be a .*string"),
    ({"bos_token": {"special": True}}, r"'bos_token' is an object without a string 'content'"),
])
def test_bad_tokenizer_config(config: dict, pattern: str, tmp_path: Path) -> None:
    d = make_qwen3_style_dir(tmp_path / "tok", template=None, config=config)
    with pytest.raises(CheckpointError, match=rf"^{re.escape(str(d / 'tokenizer_config.json'))}: {pattern}"):
        load_tokenizer(d)


def test_family_table(ours) -> None:
    assert ours.chat_template.family is FAMILIES["qwen"]
    assert FAMILIES["qwen"].default_system_prompt == "You are a helpful assistant."


GEMMA4_DIR = Path(__file__).resolve().parents[2] / "shared/reference/golden/gemma4/target"


@pytest.mark.parametrize("enable_thinking", [False, True])
def test_golden_gemma4_template_matches_transformers(enable_thinking: bool) -> None:
    if not (GEMMA4_DIR / "chat_template.jinja").is_file():
        pytest.skip(f"golden Gemma4 target not found at {GEMMA4_DIR}")
    ours, oracle = load_tokenizer(GEMMA4_DIR), AutoTokenizer.from_pretrained(GEMMA4_DIR)
    assert ours.chat_template.family is FAMILIES["gemma4"]  # records: tests/test_gemma4_records.py
    history = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    for record, messages in (({"turns": ["Hello there"]}, history[1:]), ({"conversations": history}, history)):
        rec = encode_prompt_record(ours, record, enable_thinking=enable_thinking)
        assert list(rec.token_ids) == hf_ids(oracle, messages, enable_thinking=enable_thinking)


def test_serve_prompt_files_switch_thinking(ours: Tokenizer, tmp_path: Path) -> None:
    """serve.decode's reading of a prompt file: thinking off by default (the generation prompt ends
    with the empty think block, as DeepSpec's evaluator renders it), on with --enable-thinking."""
    from dspark_jax.formats.records import encode_chat_prompt
    from serve import cli

    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"id": "q", "turns": ["What is 2 + 2?"]}) + "\n")
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    for thinking in (False, True):
        reqs, texts, errors = cli.read_requests(path, ours, lambda r: None, max_new_tokens=4,
                                                enable_thinking=thinking)
        assert not errors and texts["q"].endswith("<think>\n\n</think>\n\n") is not thinking
        assert list(reqs[0].prompt_ids) == encode_chat_prompt(ours, messages, enable_thinking=thinking)


def test_prompt_file_limit_stops_reading(ours: Tokenizer, tmp_path: Path, capsys) -> None:
    """--limit N (serve.bench, train.calibrate): the first N usable prompts; a bad record before
    them is reported and skipped, and the records after them are not read, so not reported."""
    from serve import cli

    path = tmp_path / "p.jsonl"
    lines = [{"id": "a", "turns": ["one"]}, {"id": "b"}, {"id": "c", "turns": ["two"]},
             {"id": "d", "turns": ["three"]}]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n{not json\n")
    reqs, _, errors = cli.read_requests(path, ours, lambda r: None, max_new_tokens=4, limit=2)
    assert [r.id for r in reqs] == ["a", "c"]
    assert len(errors) == 1 and f"{path}:2" in errors[0]
    assert f"{path}:2" in capsys.readouterr().err
    everything, _, errors = cli.read_requests(path, ours, lambda r: None, max_new_tokens=4)
    assert [r.id for r in everything] == ["a", "c", "d"]
    assert len(errors) == 2 and f"{path}:5" in errors[1]
