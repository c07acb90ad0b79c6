"""The built-in three-domain corpus and `python -m train.target` (the bundled demo target's
trainer), on a short run of the tiny preset."""

import ast
import json
import re

import numpy as np
import pytest

from dspark_jax.training import corpus


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    out = tmp_path_factory.mktemp("corpus")
    counts = corpus.write_corpus(out, seed=3, math_items=300)
    return out, counts


def _records(path):
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_every_domain_has_training_and_held_out_items(written):
    out, counts = written
    assert set(counts) == set(corpus.DOMAINS)
    for domain, c in counts.items():
        assert c["train"] > 0 and c["held_out"] > 0, domain
        assert len(_records(out / f"{domain}.jsonl")) == c["held_out"]
        prompts = _records(out / "prompts" / f"{domain}.jsonl")
        assert len(prompts) == c["held_out"]
        assert all(p["domain"] == domain and len(p["turns"]) == 1 for p in prompts)
    assert len(_records(out / "train.jsonl")) == sum(c["train"] for c in counts.values())


def test_held_out_items_never_train(written):
    out, _ = written
    train_ids = {r["id"] for r in _records(out / "train.jsonl")}
    train_questions = {r["conversations"][0]["content"] for r in _records(out / "train.jsonl")}
    for domain in corpus.DOMAINS:
        for rec in _records(out / f"{domain}.jsonl"):
            assert rec["id"] not in train_ids
        for p in _records(out / "prompts" / f"{domain}.jsonl"):
            assert p["id"] not in train_ids and p["turns"][0] not in train_questions


def test_the_corpus_is_deterministic_in_the_seed(written, tmp_path):
    out, _ = written
    corpus.write_corpus(tmp_path, seed=3, math_items=300)
    for name in ("train.jsonl", "math.jsonl", "code.jsonl", "chat.jsonl", "prompts/math.jsonl"):
        assert (tmp_path / name).read_bytes() == (out / name).read_bytes(), name
    other = corpus.domain_items("math", seed=4, math_items=50)
    assert other != corpus.domain_items("math", seed=3, math_items=50)


def test_math_solutions_are_worked_and_right():
    """Every step `a op b = c` holds and the boxed answer is the last step's result."""
    ops = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "×": lambda a, b: a * b,
           "÷": lambda a, b: a / b}
    for item in corpus.domain_items("math", seed=0, math_items=400):
        assert item["question"].endswith(corpus.MATH_SUFFIX)
        steps = re.findall(r"(\d+) ([-+×÷]) (\d+)(?: ÷ (\d+))? = \$?(\d+)", item["answer"])
        assert steps, item["answer"]
        for a, op, b, div, c in steps:
            value = ops[op](int(a), int(b))
            if div:
                value /= int(div)
            assert value == int(c), item["answer"]
        boxed = re.findall(r"\\boxed\{(\d+)\}", item["answer"])
        assert boxed == [steps[-1][-1]], item["answer"]


def test_code_answers_are_the_functions_they_ask_for():
    code, chat = corpus.stdlib_items()
    assert len(code) > 200 and len(chat) > 100
    for item in code[:300]:
        body = item["answer"].removeprefix("```python\n").removesuffix("\n```")
        tree = ast.parse(body)
        name = item["id"].rsplit(".", 1)[1]
        assert isinstance(tree.body[0], ast.FunctionDef) and tree.body[0].name == name
        assert item["question"].startswith(f"Write a python function `{name}(")
        assert len(body) <= corpus.MAX_CODE_CHARS
    for item in chat:
        assert corpus.MIN_PROSE_CHARS <= len(item["answer"]) <= corpus.MAX_PROSE_CHARS
        assert ">>>" not in item["answer"]


def test_train_target_writes_a_qwen3_directory_that_decodes(tmp_path):
    """A short run of the tiny preset: the HF directory loads (bf16 weights, chat template,
    stop ids), its training report has the loss curve, and serve.decode reads its prompts."""
    from dspark_jax.formats import hf_checkpoint
    from dspark_jax.formats.tokenizer import load_tokenizer
    from train import target

    out = tmp_path / "demo"
    assert target.main(["--out", str(out), "--preset", "tiny", "--steps", "3", "--batch-size", "4",
                        "--max-length", "64", "--math-items", "40", "--warmup-steps", "1"]) == 0
    tcfg, params = hf_checkpoint.load_target(out / "target")
    assert tcfg.vocab_size == 320 and tcfg.dtype == "bfloat16"
    from safetensors import safe_open

    with safe_open(out / "target" / "model.safetensors", "np") as f:  # numpy has no bf16: read the header
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    matrices = [params["embed"], params["lm_head"]] + [params["layers"][k] for k in ("wq", "w_up")]
    assert {str(x.dtype) for x in matrices} == {"bfloat16"}  # (norms are read in float32)
    tok = load_tokenizer(out / "target")
    assert tok.chat_template is not None and tok.token_id("<|im_end|>") in tok.stop_token_ids
    report = json.loads((out / "target" / "training.json").read_text())
    assert report["steps"] == 3 and report["command"].startswith("python -m train.target ")
    assert np.isfinite(report["final_loss"]) and report["curve"][-1]["step"] == 3
    for domain in corpus.DOMAINS:
        assert (out / "data" / "prompts" / f"{domain}.jsonl").stat().st_size > 0


@pytest.mark.parametrize("flags, message", [
    (["--steps", "0"], "--steps 0: must be >= 1"),
    (["--learning-rate", "-1"], "--learning-rate -1.0: must be > 0"),
])
def test_train_target_rejects_bad_flags(tmp_path, capsys, flags, message):
    from train import target

    with pytest.raises(SystemExit):
        target.main(["--out", str(tmp_path / "x")] + flags)
    assert message in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_train_target_refuses_to_overwrite_a_model(tmp_path, capsys):
    from train import target

    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "model.safetensors").write_bytes(b"keep me")
    with pytest.raises(SystemExit):
        target.main(["--out", str(tmp_path)])
    assert "already holds a model" in capsys.readouterr().err
    assert (tmp_path / "target" / "model.safetensors").read_bytes() == b"keep me"


def test_packed_batches_cover_the_stream_once_an_epoch_without_padding():
    from dspark_jax.training.pretrain import packed_batches

    seqs = [np.arange(10 * i, 10 * i + n) for i, n in enumerate((3, 7, 2, 9, 5, 4, 6, 8))]
    stream = np.concatenate([np.append(s, -1) for s in seqs])  # -1: the separator
    it = packed_batches(seqs, row_length=6, batch_size=2, separator=-1, seed=0)
    rows = len(stream) // 6
    first = [next(it) for _ in range(rows // 2)]
    got = np.concatenate([b["input_ids"] for b in first])
    assert sorted(map(tuple, got)) == sorted(map(tuple, stream[:rows * 6].reshape(rows, 6)))
    assert all(b["loss_mask"].all() and b["input_ids"].shape == (2, 6) for b in first)
    second = np.concatenate([next(it)["input_ids"] for _ in range(rows // 2)])
    assert sorted(map(tuple, second)) == sorted(map(tuple, got))  # the next epoch, reshuffled
    assert not np.array_equal(second, got)
    with pytest.raises(ValueError, match="need at least a batch of 64"):
        next(packed_batches(seqs, row_length=6, batch_size=64, separator=-1, seed=0))
