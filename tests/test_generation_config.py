"""Sampling defaults and stop ids from a checkpoint directory, as transformers and vLLM take them,
and a request's sampling settings (defaults < flags < its record's own keys)."""

import json
import re
from pathlib import Path

import pytest

from dspark_jax.errors import CheckpointError, DataError
from dspark_jax.formats.generation_config import (
    SamplingSettings,
    sampling_defaults,
    stop_token_ids,
    tokenizer_eos_token,
)

VOCAB = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2, "</s>": 9}


def checkpoint(tmp_path: Path, **files) -> Path:
    """A directory with the given JSON files: name (without .json) -> object or raw text."""
    for name, content in files.items():
        text = content if isinstance(content, str) else json.dumps(content)
        (tmp_path / f"{name}.json").write_text(text)
    return tmp_path


def stops(directory: Path) -> tuple[int, ...]:
    return stop_token_ids(directory, VOCAB.get)


# ------------------------------------------------------------------ stop ids


def test_generation_config_eos_ids_win_over_config(tmp_path):
    d = checkpoint(tmp_path, generation_config={"eos_token_id": [2, 7]}, config={"eos_token_id": 0})
    assert stops(d) == (2, 7)


def test_config_eos_when_generation_config_is_silent(tmp_path):
    assert stops(checkpoint(tmp_path, config={"eos_token_id": 5})) == (5,)
    d = checkpoint(tmp_path, generation_config={"eos_token_id": None, "temperature": 0.7})
    assert stops(d) == (5,)


def test_tokenizer_eos_token_string_or_added_token(tmp_path):
    d = checkpoint(tmp_path, generation_config={"eos_token_id": 2},
                   tokenizer_config={"eos_token": "</s>"})
    assert stops(d) == (2, 9)
    checkpoint(tmp_path, tokenizer_config={"eos_token": {"content": "<|im_end|>", "lstrip": False,
                                                         "special": True}})
    assert stops(d) == (2,)
    assert tokenizer_eos_token(d) == "<|im_end|>"


def test_nothing_more_than_the_files_list(tmp_path):
    # No end markers are added: an empty directory has no stop ids at all.
    assert stops(tmp_path) == ()
    assert stops(checkpoint(tmp_path, tokenizer_config={"eos_token": None})) == ()


@pytest.mark.parametrize("name, content, message", [
    ("generation_config", {"eos_token_id": "2"}, "generation_config.json: 'eos_token_id' must be"),
    ("config", {"eos_token_id": [1, True]}, "config.json: 'eos_token_id' must be"),
    ("config", "{oops", "config.json: cannot read JSON"),
    ("generation_config", [1], "generation_config.json: expected a JSON object, got list"),
    ("tokenizer_config", {"eos_token": 3}, "tokenizer_config.json: 'eos_token' must be a token"),
    ("tokenizer_config", {"eos_token": "<eos>"},
     "tokenizer_config.json: 'eos_token' '<eos>' is not in the tokenizer vocabulary"),
])
def test_bad_stop_files_name_file_and_key(tmp_path, name, content, message):
    d = checkpoint(tmp_path, **{name: content})
    with pytest.raises(CheckpointError, match=re.escape(str(tmp_path)) + ".*" + re.escape(message)):
        stops(d)


# ------------------------------------------------------------------ sampling defaults


def test_defaults_without_a_file_are_greedy(tmp_path):
    assert sampling_defaults(tmp_path) == {"temperature": 0.0, "top_p": 1.0, "top_k": 0}


def test_defaults_from_generation_config(tmp_path):
    d = checkpoint(tmp_path, generation_config={"do_sample": True, "temperature": 0.6,
                                                "top_p": 0.95, "top_k": 20, "eos_token_id": 2})
    assert sampling_defaults(d) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    checkpoint(tmp_path, generation_config={"top_p": 0.8})  # the rest stays greedy's
    assert sampling_defaults(d) == {"temperature": 0.0, "top_p": 0.8, "top_k": 0}


def test_do_sample_false_means_greedy(tmp_path):
    d = checkpoint(tmp_path, generation_config={"do_sample": False, "temperature": 0.6,
                                                "top_p": 0.95, "top_k": 20})
    assert sampling_defaults(d) == {"temperature": 0.0, "top_p": 1.0, "top_k": 0}


@pytest.mark.parametrize("key, value", [("temperature", -0.5), ("temperature", "hot"),
                                        ("top_p", 0), ("top_p", 1.5), ("top_k", 2.5),
                                        ("top_k", -1), ("top_k", True)])
def test_bad_defaults_name_file_and_key(tmp_path, key, value):
    d = checkpoint(tmp_path, generation_config={key: value})
    with pytest.raises(CheckpointError, match=rf"generation_config\.json: '{key}' must be"):
        sampling_defaults(d)


# ------------------------------------------------------------------ a request's settings


def test_record_overrides_defaults():
    base = SamplingSettings(temperature=0.6, top_p=0.9, top_k=20, max_new_tokens=64, stop=("x",))
    got = base.with_record({"prompt": "hi", "temperature": 0, "top_k": 0, "stop": "END",
                            "seed": 7, "max_new_tokens": 3})
    assert got == SamplingSettings(temperature=0.0, top_p=0.9, top_k=0, max_new_tokens=3,
                                   stop=("END",), seed=7)
    assert base.with_record({"prompt": "hi", "stop": ["a", "b"]}).stop == ("a", "b")
    assert base.with_record({"prompt": "hi", "stop": []}).stop == ()
    assert base.with_record({"prompt": "hi"}) == base
    assert got.to_json() == {"temperature": 0.0, "top_p": 0.9, "top_k": 0, "max_new_tokens": 3,
                             "stop": ["END"], "seed": 7}


@pytest.mark.parametrize("key, value, expected", [
    ("temperature", -1, "a finite number >= 0"), ("temperature", float("nan"), "a finite number"),
    ("top_p", 0, "in (0, 1]"), ("top_k", 1.5, "an integer >= 0"),
    ("max_new_tokens", 0, "an integer >= 1"), ("max_new_tokens", "8", "an integer >= 1"),
    ("stop", "", "a non-empty string or a list of them"), ("stop", ["a", 3], "a non-empty string"),
    ("seed", -1, "an integer in [0, 2^32)"), ("seed", 2 ** 32, "an integer in [0, 2^32)"),
])
def test_bad_record_values_name_where_key_and_what(key, value, expected):
    with pytest.raises(DataError) as err:
        SamplingSettings().with_record({"prompt": "hi", key: value}, where="p.jsonl:4")
    assert str(err.value).startswith(f"p.jsonl:4: '{key}' must be ") and expected in str(err.value)


# ------------------------------------------------------------------ stop strings

PIECES = ["He", "llo", " wo", "rld", "!", "é"]


def toy_decode(ids):
    return "".join(PIECES[i] for i in ids)


@pytest.mark.parametrize("stops, ids, text, stopped", [
    ([], [0, 1, 2, 3, 4, 5], "Hello world!é", False),
    (["xyz"], [0, 1, 2, 3, 4, 5], "Hello world!é", False),
    (["o w"], [0, 1], "Hell", True),  # " wo" straddles the cut: "llo" is needed, " wo" is not
    (["rld", "llo"], [0], "He", True),  # the earliest of several
    (["He"], [], "", True),  # at the very start: nothing is kept
    (["!"], [0, 1, 2, 3], "Hello world", True),
    (["d!"], [0, 1, 2, 3], "Hello worl", True),
])
def test_cut_at_stop(stops, ids, text, stopped):
    from dspark_jax.decoding.stop_strings import cut_at_stop, find_stop

    assert cut_at_stop([0, 1, 2, 3, 4, 5], toy_decode, stops) == (ids, text, stopped)
    assert (find_stop("Hello world!é", stops) is not None) == stopped
