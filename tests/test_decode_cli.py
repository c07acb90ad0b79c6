"""`python -m serve.decode` run the way a user runs it: a subprocess in the repository root, on a tiny
target/drafter pair (the `tiny_target` fixture's target plus a DSpark drafter trained briefly on the
`dspark-tiny` preset and exported in DeepSpec format).

Every decode that compiles costs seconds, so the decodes are few and shared: one speculative run
(fixed scheduler), one plain target run and one threshold-scheduler run on the same prompt file
(each checked on its own and compared for greedy equality), and one run on a file with bad
records. The flag and drafter errors stop before anything compiles.

Output accounting, as the engine defines it: a request's first token is sampled by the prefill,
every later token is committed by a decoding round, and `accepted[i]` is the number of tokens round
i committed for the request (accepted drafts plus the bonus token, after stop/budget cuts), so
`sum(accepted) == len(token_ids) - 1`; `verified[i]` is the number of drafts round i verified.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SLOTS, MAX_LEN, MAX_NEW, BLOCK = 4, 96, 12, 4  # BLOCK: the dspark-tiny drafter's block size
SIZES = ["--slots", str(SLOTS), "--max-len", str(MAX_LEN), "--prefill-buckets", f"32,{MAX_LEN}",
         "--max-new-tokens", str(MAX_NEW)]
KEYS = {"id", "prompt", "completion", "token_ids", "finish_reason", "accepted", "verified"}
METRIC_KEYS = {"tau", "acceptance_rate", "conditional_acceptance", "mean_verified",
               "output_tokens_per_s", "tokens_per_s_per_request", "rounds", "compilations",
               "compilations_after_warmup"}
SUMMARY_ROWS = ("requests", "bad records", "scheduler", "rounds", "tau (tokens / round)",
                "acceptance rate", "conditional acceptance", "mean verified drafts / round",
                "mean budget / request", "output tokens", "output tokens / s",
                "tokens / s per request", "warm-up (compile) s", "compilations",
                "compilations after warm-up")
WORDS = "apple silver cat dog red blue".split()


def decode_cli(*args, timeout=600) -> subprocess.CompletedProcess:
    """Runs the decode command; the persistent compilation cache is inherited from conftest."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1",
               JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, "-m", "serve.decode", *map(str, args)], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=timeout)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def word_cycle(tok, limit: int) -> str:
    """The longest cycle of WORDS (word by word, from `limit` words down) of at most `limit` tokens."""
    words = [WORDS[i % len(WORDS)] for i in range(limit)]
    while len(tok.encode(" ".join(words))) > limit:
        words.pop()
    return " ".join(words)


def text_of_exactly(tok, n: int) -> str:
    """A raw prompt of exactly n tokens (counting numbers, else a word cycle)."""
    count = 1
    while len(tok.encode(" ".join(map(str, range(count))))) < n:
        count += 1
    for text in (" ".join(map(str, range(count))), word_cycle(tok, n)):
        if len(tok.encode(text)) == n:
            return text
    raise AssertionError(f"could not build a prompt of exactly {n} tokens")


def chatml(*messages) -> str:
    """The ChatML prompt, written out independently of the template code."""
    return "".join(f"<|im_start|>{role}\n{text}<|im_end|>\n" for role, text in messages) + \
        "<|im_start|>assistant\n"


# --------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def pair(tiny_pair):
    """(target dir, exported drafter dir) of the session's tiny trained pair."""
    return tiny_pair[0], tiny_pair[2]


@pytest.fixture(scope="module")
def tok(pair):
    from dspark_jax.formats.tokenizer import load_tokenizer

    return load_tokenizer(pair[0])


@pytest.fixture(scope="module")
def prompts(tok, tmp_path_factory):
    """(prompt file, {id: (expected prompt text, raw prompt token count or None)})."""
    near_a, near_b, full = word_cycle(tok, MAX_LEN - 8), word_cycle(tok, MAX_LEN - 5), \
        text_of_exactly(tok, MAX_LEN)
    records = [
        ({"id": "raw-count", "prompt": "Count from 3 to 9."}, "raw-count", "Count from 3 to 9."),
        ({"turns": ["Repeat 'red blue' 3 times.", "And again, please."]}, "1",
         chatml(("user", "Repeat 'red blue' 3 times."))),
        ({"id": 7, "conversations": [
            {"role": "system", "content": "Answer exactly."},
            {"role": "user", "content": "Continue the pattern: cat dog"},
            {"role": "assistant", "content": "cat dog cat dog"}]}, "7",
         chatml(("system", "Answer exactly."), ("user", "Continue the pattern: cat dog"))),
        ({"conversations": [{"from": "human", "value": "Count from 10 to 20."}]}, "3",
         chatml(("user", "Count from 10 to 20."))),
        ({"id": "turns-id", "turns": ["Count from 1 to 8."]}, "turns-id",
         chatml(("user", "Count from 1 to 8."))),
        ({"prompt": near_a}, "5", near_a),  # close to the context: may end on "context"
        ({"id": "near-b", "prompt": near_b}, "near-b", near_b),
        ({"id": "full", "prompt": full}, "full", full),  # fills every position
    ]
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text("".join(json.dumps(rec) + "\n" for rec, _, _ in records), encoding="utf-8")
    expected = {rid: (text, len(tok.encode(text)) if "prompt" in rec else None)
                for rec, rid, text in records}
    return path, expected


@pytest.fixture(scope="module")
def runs(pair, prompts, tmp_path_factory):
    """Decodes the prompt file once per mode, on demand: mode -> (process, results by id, metrics)."""
    target, drafter = pair
    out_dir = tmp_path_factory.mktemp("decodes")
    modes = {"fixed": [drafter, "--scheduler", "fixed"],
             "none": ["none"],
             "threshold": [drafter, "--scheduler", "threshold", "--threshold", "0.3"],
             "async": [drafter]}  # the default scheduler: profiles the rounds at start-up
    done = {}

    def get(mode):
        if mode not in done:
            out, metrics = out_dir / mode / "nested" / "out.jsonl", out_dir / f"{mode}.json"
            drafter_arg, *extra = modes[mode]
            proc = decode_cli("--target", target, "--drafter", drafter_arg, "--prompts", prompts[0],
                              "--out", out, "--metrics", metrics, *SIZES, "--recompile-guard", *extra)
            assert proc.returncode == 0, proc.stdout + proc.stderr
            results = read_jsonl(out)
            by_id = {r["id"]: r for r in results}
            assert len(by_id) == len(results), "duplicate ids in the output"
            done[mode] = proc, by_id, json.loads(metrics.read_text())
        return done[mode]

    return get


# ------------------------------------------------------------------------------------ checks


def check_results(results: dict, expected: dict, tok, block: int) -> None:
    """The per-result contract (see the module docstring)."""
    stops = set(tok.stop_token_ids)
    assert set(results) == set(expected)
    for rid, r in results.items():
        assert set(r) == KEYS, r
        text, raw_len = expected[rid]
        assert r["prompt"] == text, rid
        ids = r["token_ids"]
        assert 1 <= len(ids) <= MAX_NEW, r
        assert r["completion"] == tok.decode(ids), r
        assert r["finish_reason"] in ("stop", "length", "context"), r
        assert sum(r["accepted"]) == len(ids) - 1, r  # the first token comes from the prefill
        assert len(r["accepted"]) == len(r["verified"]), r
        assert all(0 <= v <= block for v in r["verified"]), r
        # A round commits between 1 token (the target's own) and ℓ + 1 (all drafts + bonus).
        assert all(1 <= a <= v + 1 for a, v in zip(r["accepted"], r["verified"])), r
        assert not stops & set(ids[:-1]), r  # decoding ends at the first stop token
        if r["finish_reason"] == "length":
            assert len(ids) == MAX_NEW, r
        elif r["finish_reason"] == "stop":
            assert ids[-1] in stops, r
        else:  # context: every position holds the prompt or an output; the last token needs none
            assert raw_len is not None and raw_len + len(ids) == MAX_LEN + 1, r


def check_metrics(metrics: dict, results: dict, block: int) -> None:
    assert METRIC_KEYS <= set(metrics), sorted(metrics)
    assert metrics["requests"] == len(results) and metrics["errors"] == []
    verified = [v for r in results.values() for v in r["verified"]]
    accepted = [a for r in results.values() for a in r["accepted"]]
    assert metrics["output_tokens"] == sum(len(r["token_ids"]) for r in results.values())
    assert metrics["rounds"] >= max(len(r["accepted"]) for r in results.values())
    assert metrics["mean_verified"] == pytest.approx(sum(verified) / len(verified))
    assert len(metrics["conditional_acceptance"]) == block
    assert all(0 <= c <= 1 for c in metrics["conditional_acceptance"])
    assert 0 <= metrics["acceptance_rate"] <= 1
    # tau = mean(k + 1) over request-rounds, acceptance = Σk / Σℓ, so tau = 1 + rate * mean ℓ;
    # commits are cut at stops and budgets, so tau bounds the committed tokens per request-round.
    assert metrics["tau"] == pytest.approx(1 + metrics["acceptance_rate"] * metrics["mean_verified"])
    assert metrics["tau"] * len(accepted) >= sum(accepted) - 1e-6
    assert metrics["output_tokens_per_s"] > 0 and metrics["tokens_per_s_per_request"] > 0
    assert metrics["compilations"] > 0
    assert metrics["compilations_after_warmup"] == 0


def test_speculative_run_writes_every_record(runs, prompts, tok):
    proc, results, metrics = runs("fixed")
    _, expected = prompts
    assert f"{len(expected)} requests, speculative, block {BLOCK}, fixed({BLOCK}), " \
           f"{SLOTS} slots x {MAX_LEN} positions" in proc.stderr
    check_results(results, expected, tok, BLOCK)
    check_metrics(metrics, results, BLOCK)
    # The context limit was reached, and a prompt filling every position still gets one token.
    assert "context" in {results["5"]["finish_reason"], results["near-b"]["finish_reason"]}
    assert len(results["full"]["token_ids"]) == 1
    assert results["full"]["finish_reason"] in ("context", "stop")
    assert {r["finish_reason"] for r in results.values()} >= {"length", "context"}
    # The summary table goes to stdout (the progress bar to stderr).
    lines = proc.stdout.splitlines()
    assert [line.split("  ")[0].rstrip() for line in lines] == list(SUMMARY_ROWS), proc.stdout
    assert lines[0].split()[-1] == str(len(expected))
    assert lines[-1].split()[-1] == "0"  # compilations after warm-up
    assert "tok/s" in proc.stderr and "tok/s" not in proc.stdout


def test_greedy_output_is_the_targets_whatever_the_drafter(runs, prompts, tok):
    _, fixed, _ = runs("fixed")
    plain_proc, plain, plain_metrics = runs("none")
    thr_proc, thr, thr_metrics = runs("threshold")
    async_proc, asy, async_metrics = runs("async")
    _, expected = prompts
    assert "plain target decoding" in plain_proc.stderr
    assert "threshold(0.3)" in thr_proc.stderr
    assert f"block {BLOCK}, async, " in async_proc.stderr
    assert "SPS profile: measured at start-up, cached in" in async_proc.stderr
    for rid in expected:
        for other in (fixed, thr, asy):
            assert other[rid]["token_ids"] == plain[rid]["token_ids"], rid
            assert other[rid]["finish_reason"] == plain[rid]["finish_reason"], rid
    for results, metrics in ((thr, thr_metrics), (asy, async_metrics)):
        check_results(results, expected, tok, BLOCK)
        check_metrics(metrics, results, BLOCK)
    assert async_metrics["scheduler"] == "async" and async_metrics["sps_profile"]
    assert sum(async_metrics["buckets"].values()) == async_metrics["rounds"]
    # Without a drafter every round verifies nothing and commits exactly the target's token.
    check_results(plain, expected, tok, 0)
    for r in plain.values():
        assert r["accepted"] == [1] * (len(r["token_ids"]) - 1) and set(r["verified"]) <= {0}
    assert plain_metrics["tau"] == 1 and plain_metrics["mean_verified"] == 0
    assert plain_metrics["acceptance_rate"] == 0 and plain_metrics["conditional_acceptance"] == []
    assert plain_metrics["compilations_after_warmup"] == 0


def test_bad_records_are_reported_and_the_rest_decoded(pair, tok, tmp_path):
    target, drafter = pair
    too_long = text_of_exactly(tok, MAX_LEN + 4)
    lines = [
        json.dumps({"id": "good", "prompt": "Count from 1 to 8."}),
        '{"id": "broken", "prompt": "Count from',  # 2: malformed JSON
        json.dumps({"id": "empty", "prompt": ""}),  # 3
        json.dumps({"id": "long", "prompt": too_long}),  # 4
        json.dumps({"id": "good", "turns": ["Count from 2 to 9."]}),  # 5: duplicate id
        "",  # blank lines are skipped
        json.dumps({"turns": [""]}),  # 7: empty chat turn
        json.dumps(["not", "an", "object"]),  # 8
        json.dumps({"conversations": [{"role": "user", "content": "Count from 2 to 9."}]}),  # 9
    ]
    path = tmp_path / "prompts.jsonl"
    path.write_bytes(("\n".join(lines) + "\n").encode() + b'{"id": "latin1", "prompt": "caf\xe9"}\n')
    out, metrics = tmp_path / "out.jsonl", tmp_path / "metrics.json"
    proc = decode_cli("--target", target, "--drafter", drafter, "--prompts", path, "--out", out,
                      "--metrics", metrics, *SIZES)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    errors = [line[len("error: "):] for line in proc.stderr.splitlines() if line.startswith("error: ")]
    wanted = [f"{path}:2: invalid JSON",
              f"{path}:3: 'prompt' is empty",
              f"{path}:4: request long: prompt of {MAX_LEN + 4} tokens is longer than the context "
              f"({MAX_LEN} positions)",
              f"{path}:5: duplicate id 'good'",
              f"{path}:7: first turn is empty",
              f"{path}:8: record must be an object, got list",
              f"{path}:10: not valid UTF-8"]
    assert len(errors) == len(wanted), proc.stderr
    for got, want in zip(errors, wanted):
        assert got.startswith(want), (got, want)
    assert "Traceback" not in proc.stderr
    # The good records are decoded; an id-less record is named by its index among the records.
    results = {r["id"]: r for r in read_jsonl(out)}
    assert set(results) == {"good", "7"}
    assert results["good"]["prompt"] == "Count from 1 to 8."  # the first "good", not the duplicate
    assert results["7"]["prompt"] == chatml(("user", "Count from 2 to 9."))
    for r in results.values():
        assert sum(r["accepted"]) == len(r["token_ids"]) - 1
    m = json.loads(metrics.read_text())
    assert m["requests"] == 2 and m["errors"] == errors
    assert proc.stdout.splitlines()[1].split()[-1] == str(len(wanted))  # "bad records" row


@pytest.mark.parametrize("flags, message", [
    (["--temperature", "-1"], "--temperature -1.0: must be >= 0"),
    (["--top-p", "0"], "--top-p 0.0: must be in (0, 1]"),
    (["--top-p", "1.5"], "--top-p 1.5: must be in (0, 1]"),
    (["--max-len", "-4"], "--max-len -4: must be >= 1"),
    (["--prefill-buckets", "32,abc"], "--prefill-buckets '32,abc': expected positive integers"),
])
def test_bad_flags_exit_2_before_loading_anything(tmp_path, flags, message):
    # Nothing exists at these paths: a flag error must come first.
    out = tmp_path / "out.jsonl"
    proc = decode_cli("--target", tmp_path / "no-target", "--drafter", tmp_path / "no-drafter",
                      "--prompts", tmp_path / "no-prompts.jsonl", "--out", out, *flags, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "usage:" in proc.stderr and f"error: {message}" in proc.stderr, proc.stderr
    assert "not found" not in proc.stderr and "Traceback" not in proc.stderr
    assert not out.exists()


@pytest.mark.parametrize("field, value, message", [
    ("hidden_size", 32, "drafter does not fit the target: hidden_size 32 != target 64"),
    ("vocab_size", 256, "drafter does not fit the target: vocab_size 256 != target 320"),
    ("target_layer_ids", [0, 5], "target_layer_ids: [5] out of range"),
])
def test_drafter_that_does_not_fit_the_target(pair, prompts, tmp_path, field, value, message):
    target, drafter = pair
    bad = shutil.copytree(drafter, tmp_path / "drafter")
    config = json.loads((bad / "config.json").read_text())
    config[field] = value
    (bad / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out.jsonl"
    proc = decode_cli("--target", target, "--drafter", bad, "--prompts", prompts[0], "--out", out,
                      *SIZES, timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert message in proc.stderr, proc.stderr
    assert f"{bad}/config.json" in proc.stderr
    assert "Traceback" not in proc.stderr and not out.exists()


def test_missing_prompt_file(pair, tmp_path):
    target, drafter = pair
    missing = tmp_path / "missing.jsonl"
    out = tmp_path / "out.jsonl"
    proc = decode_cli("--target", target, "--drafter", drafter, "--prompts", missing, "--out", out,
                      *SIZES, timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"error: {missing}: prompt file not found" in proc.stderr
    assert "Traceback" not in proc.stderr and not out.exists()
