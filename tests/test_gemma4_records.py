"""Training and prompt records for the `gemma4` chat template family, against the golden Gemma4 target
(reference/golden/README.md, "Chat parsing with DeepSpec's `gemma4` entry"): DeepSpec's parser's ids and
loss mask of a two-turn conversation, its evaluator's prompt ids of the first user turn, the assistant loss
prefix (the empty thought channel) put once and left out of the loss, and the records the regenerate step
writes going through the same rules."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from dspark_jax.decoding import regenerate as rg
from dspark_jax.errors import DataError
from dspark_jax.formats.chat_template import FAMILIES
from dspark_jax.formats.records import (
    encode_chat_prompt,
    encode_conversation,
    encode_prompt_record,
    load_prompts,
    supervised_spans,
    training_example,
)
from dspark_jax.formats.tokenizer import Tokenizer, load_tokenizer
from dspark_jax.training.data import load_conversations
from tests.conftest import GOLDEN

TARGET = GOLDEN / "gemma4" / "target"
if not (TARGET / "chat_template.jinja").is_file():
    pytest.skip(f"golden Gemma4 target not found at {TARGET}", allow_module_level=True)

TENSORS = load_file(GOLDEN / "gemma4" / "golden.safetensors")
CHAT = json.loads((GOLDEN / "golden.json").read_text())["gemma4"]["chat"]
PREFIX = CHAT["assistant_loss_prefix"]
# The golden conversation (golden.json's rendered_training_text, read back into messages).
TURNS = ["What is 2 plus 3?", "2 plus 3 is 5.", "And 4 plus 4?", "It is 8."]
MESSAGES = [{"role": ("user", "assistant")[i % 2], "content": t} for i, t in enumerate(TURNS)]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return load_tokenizer(TARGET)


def golden(name: str) -> list[int]:
    return TENSORS[name][0].tolist()


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def test_the_template_is_of_the_gemma4_family(tok: Tokenizer) -> None:
    family = tok.chat_template.family
    assert family is FAMILIES["gemma4"]
    assert family.assistant_start == "<|turn>model\n" and family.turn_end == "<turn|>\n"
    assert family.default_system_prompt is None and family.assistant_loss_prefix == PREFIX
    assert FAMILIES["qwen"].assistant_loss_prefix == ""


def test_bos_comes_from_the_template_once(tok: Tokenizer) -> None:
    bos = tok.token_id("<bos>")
    # tokenizer.json's post-processor puts <bos> first when asked for special tokens; our encode never
    # asks, so the template's own {{ bos_token }} is the only one.
    assert tok.backend.encode("Hi", add_special_tokens=True).ids == [bos, *tok.encode("Hi")]
    assert bos not in tok.encode("Hi")
    ids, _ = encode_conversation(tok, MESSAGES)
    assert ids[0] == bos and int((ids == bos).sum()) == 1
    qwen = GOLDEN / "target" / "tokenizer.json"
    if qwen.is_file():  # Qwen3's tokenizer adds nothing, even when asked
        qwen_tok = load_tokenizer(qwen.parent)
        assert qwen_tok.backend.encode("Hi", add_special_tokens=True).ids == qwen_tok.encode("Hi")


@pytest.mark.parametrize("form", ["conversations", "turns", "sharegpt"])
def test_golden_conversation_gives_the_parser_ids_and_mask(tok: Tokenizer, form: str) -> None:
    record = {
        "conversations": {"conversations": MESSAGES},
        "turns": {"turns": TURNS},
        "sharegpt": {"conversations": [{"from": ("human", "gpt")[i % 2], "value": t}
                                       for i, t in enumerate(TURNS)]},
    }[form]
    example = training_example(tok, record)
    assert example.text == CHAT["rendered_training_text"]  # no system prompt added
    assert example.input_ids.tolist() == golden("parser_input_ids")
    assert example.loss_mask.astype(int).tolist() == golden("parser_loss_mask")
    assert tok.decode(example.input_ids[example.loss_mask], skip_special_tokens=False) == CHAT["loss_text"]
    # The spans start after the prefix: the header and the empty thought channel are not supervised.
    assert [example.text[a:b] for a, b in example.spans] == ["2 plus 3 is 5.<turn|>\n", "It is 8.<turn|>\n"]


def test_prefixed_answers_are_not_prefixed_twice(tok: Tokenizer) -> None:
    prefixed = [dict(m, content=PREFIX + m["content"]) if m["role"] == "assistant" else m for m in MESSAGES]
    mixed = [prefixed[0], prefixed[1], MESSAGES[2], MESSAGES[3]]
    for messages in (prefixed, mixed):
        example = training_example(tok, {"conversations": messages})
        assert example.text == CHAT["rendered_training_text"] and example.text.count(PREFIX) == 2
        assert example.input_ids.tolist() == golden("parser_input_ids")
        assert example.loss_mask.astype(int).tolist() == golden("parser_loss_mask")
    # The record itself is left as it was.
    assert MESSAGES[1]["content"] == "2 plus 3 is 5."


def test_empty_answer_supervises_the_end_of_turn(tok: Tokenizer) -> None:
    ids, mask = encode_conversation(tok, [MESSAGES[0], {"role": "assistant", "content": ""}])
    assert tok.decode(ids[mask], skip_special_tokens=False) == "<turn|>\n"
    ids, mask = encode_conversation(tok, [MESSAGES[0], {"role": "assistant", "content": PREFIX}])
    assert tok.decode(ids[mask], skip_special_tokens=False) == "<turn|>\n"


def test_own_system_message_and_unfinished_last_turn(tok: Tokenizer) -> None:
    messages = [{"role": "system", "content": "Be brief."}, *MESSAGES[:2]]
    example = training_example(tok, {"conversations": messages})
    assert example.text.startswith("<bos><|turn>system\nBe brief.<turn|>\n<|turn>user\n")
    assert tok.decode(example.input_ids[example.loss_mask], skip_special_tokens=False) == "2 plus 3 is 5.<turn|>\n"
    # A text cut inside an answer: the span runs to its end; a cut inside the prefix supervises nothing.
    family = FAMILIES["gemma4"]
    head = "<|turn>user\nq<turn|>\n<|turn>model\n"
    start = len(head + PREFIX)
    assert supervised_spans(head + PREFIX + "It is", family) == [(start, start + len("It is"))]
    assert supervised_spans(head + PREFIX[:5], family) == [(len(head), len(head) + 5)]


def test_assistant_message_without_text_is_refused(tok: Tokenizer, tmp_path: Path) -> None:
    call = {"type": "function", "function": {"name": "f", "arguments": {"x": 1}}}
    messages = [MESSAGES[0], {"role": "assistant", "content": None, "tool_calls": [call]}, *MESSAGES[2:]]
    pattern = (r"message 1: an assistant message needs text 'content' in the gemma4 chat template family, which "
               + re.escape(f"puts {PREFIX!r} before every answer; this one has only tool_calls") + "$")
    with pytest.raises(DataError, match=r"^d\.jsonl:4: " + pattern):
        encode_conversation(tok, messages, where="d.jsonl:4")
    path = write_jsonl(tmp_path / "d.jsonl", [{"conversations": MESSAGES}, {"conversations": messages}])
    ds = load_conversations(path, tok, max_length=128, min_length=2)
    assert ds.stats.kept == 1 and ds.stats.skipped_bad == 1
    assert re.match(rf"^{re.escape(str(path))}:2: " + pattern, ds.errors[0]), ds.errors
    assert ds.input_ids[0].tolist() == golden("parser_input_ids")


def test_first_user_turn_as_a_prompt_gives_the_evaluators_ids(tok: Tokenizer, tmp_path: Path) -> None:
    want = golden("eval_prompt_ids")
    assert encode_chat_prompt(tok, MESSAGES[:1]) == want
    rec = encode_prompt_record(tok, {"turns": [TURNS[0], TURNS[2]]})
    assert rec.prompt_text == CHAT["eval_prompt_text"] and list(rec.token_ids) == want
    assert rec.prompt_text.endswith("<|turn>model\n" + PREFIX)  # thinking off: the empty thought channel
    path = write_jsonl(tmp_path / "p.jsonl", [{"id": "t", "turns": TURNS[::2]},
                                              {"id": "c", "conversations": MESSAGES[:2]}])
    assert [list(r.token_ids) for r in load_prompts(path, tok)] == [want, want]  # the reference answer dropped
    # With thinking on, the generation prompt stops at the header.
    thinking = encode_prompt_record(tok, {"turns": TURNS[:1]}, enable_thinking=True)
    assert thinking.prompt_text == CHAT["eval_prompt_text"].removesuffix(PREFIX)
    # The prompt is the training text up to the first answer.
    assert golden("parser_input_ids")[: len(want)] == want


def test_regenerated_records_train_on_what_the_target_was_asked(tok: Tokenizer, tmp_path: Path) -> None:
    """What train.regenerate writes for a Gemma4 target goes through the same rules: its prompts are
    rendered with the template, thinking off, and each answer (the target's tokens up to its <turn|>
    stop, decoded without special tokens) becomes an assistant message the parser prefixes again."""
    conv = rg.parse_record({"id": 7, "turns": TURNS[::2]}, where="r.jsonl:1", index=0)
    ids = golden("parser_input_ids")
    mask = np.asarray(golden("parser_loss_mask"), dtype=bool)
    # The target's tokens of each answer, as the engine returns them: each masked run up to its stop
    # token <turn|> (the newline after it is the template's, not sampled).
    stop = tok.token_id("<turn|>")
    assert stop in tok.stop_token_ids
    runs = np.split(np.asarray(ids)[mask], np.flatnonzero(np.diff(np.flatnonzero(mask)) > 1) + 1)
    answers = [tok.decode(run[: run.tolist().index(stop) + 1].tolist()) for run in runs]
    assert answers == [TURNS[1], TURNS[3]]
    done = rg.Regenerated(conv, [])
    for message, answer in zip(conv.messages, answers):
        done.messages.append(dict(message))
        # The prompt regenerate sends (its step), then the answer it appends (its on_result).
        prompt = encode_chat_prompt(tok, done.messages, enable_thinking=False, where=conv.where)
        if len(done.messages) == 1:
            assert prompt == golden("eval_prompt_ids")
        assert prompt[-len(tok.encode("<|turn>model\n" + PREFIX)):] == tok.encode("<|turn>model\n" + PREFIX)
        done.messages.append({"role": "assistant", "content": answer})
    path = write_jsonl(tmp_path / "regen.jsonl", [done.record()])
    ds = load_conversations(path, tok, max_length=128, min_length=2)
    assert ds.stats.kept == 1
    assert ds.input_ids[0].tolist() == ids and ds.loss_masks[0].tolist() == mask.tolist()
