"""`python -m serve.decode` run the way a user runs it: a subprocess in the repository root, on a tiny
target/drafter pair (the `tiny_target` fixture's target plus a DSpark drafter trained briefly on the
`dspark-tiny` preset and exported in DeepSpec format).

Every decode that compiles costs seconds, so the decodes are few and shared: one speculative run
(fixed scheduler), one plain target run and one threshold-scheduler run on the same prompt file
(each checked on its own and compared for greedy equality), one run on a file with bad
records, one with records of their own settings, stop strings, stop ids from generation_config and
--logprobs, and two runs interrupted by a signal. The flag, output-path and drafter errors stop
before anything compiles; an empty prompt file before anything loads.

Output accounting, as the engine defines it: a request's first token is sampled by the prefill,
every later token is committed by a decoding round, and `accepted[i]` is the number of tokens round
i committed for the request (accepted drafts plus the bonus token, after stop/budget cuts), so
`sum(accepted) == len(token_ids) - 1`; `verified[i]` is the number of drafts round i verified.
"""

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest

from tests.conftest import xla_flags

REPO = Path(__file__).resolve().parents[1]
SLOTS, MAX_LEN, MAX_NEW, BLOCK = 4, 96, 12, 4  # BLOCK: the dspark-tiny drafter's block size
SIZES = ["--slots", str(SLOTS), "--max-len", str(MAX_LEN), "--prefill-buckets", f"32,{MAX_LEN}",
         "--max-new-tokens", str(MAX_NEW)]
KEYS = {"id", "prompt", "completion", "token_ids", "finish_reason", "accepted", "verified",
        "sampling"}
SAMPLING_KEYS = {"temperature", "top_p", "top_k", "max_new_tokens", "stop", "seed"}
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
    env = dict(os.environ, XLA_FLAGS=xla_flags(1),
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


# A raw prompt (used verbatim) that the tiny target answers at length: a chat written out by hand.
RAW_COUNT = "<|im_start|>user\nCount from 3 to 9.<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def prompts(tok, tmp_path_factory):
    """(prompt file, {id: (expected prompt text, raw prompt token count or None)})."""
    near_a, near_b, full = word_cycle(tok, MAX_LEN - 8), word_cycle(tok, MAX_LEN - 5), \
        text_of_exactly(tok, MAX_LEN)
    records = [
        ({"id": "raw-count", "prompt": RAW_COUNT}, "raw-count", RAW_COUNT),
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
            out.parent.mkdir(parents=True)
            drafter_arg, *extra = modes[mode]
            proc = decode_cli("--target", target, "--drafter", drafter_arg, "--prompts", prompts[0],
                              "--out", out, "--metrics", metrics, *SIZES, "--recompile-guard", *extra)
            assert proc.returncode == 0, proc.stdout + proc.stderr
            assert sorted(p.name for p in out.parent.iterdir()) == ["out.jsonl"]  # no .partial
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
        # Greedy by default: the tiny target's generation_config names no sampling settings.
        assert r["sampling"] == {"temperature": 0.0, "top_p": 1.0, "top_k": 0,
                                 "max_new_tokens": MAX_NEW, "stop": [],
                                 "seed": r["sampling"]["seed"]}, r
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
    (["--logprobs", "21"], "--logprobs 21: must be in [0, 20]"),
    (["--stop", "a", "--stop", ""], "--stop '': a stop string must not be empty"),
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


# ------------------------------------------- generation settings, stop strings, logprobs


def test_records_settings_stops_and_logprobs(runs, pair, tok, tmp_path):
    """One run (speculative, fixed, --logprobs 2) on a copy of the target whose generation_config
    sets top-p/top-k defaults and one more stop id, with --stop and records of their own settings;
    checked against the greedy fixed run (its outputs cut where the new stops say)."""
    _, fixed, _ = runs("fixed")
    target, drafter = pair
    base = fixed["raw-count"]
    # A stop id the target emits in "7"'s greedy output (and not in the two outputs cut by stop
    # strings below); a stop string inside "raw-count"'s output, another in "turns-id"'s.
    others = set(base["token_ids"]) | set(fixed["turns-id"]["token_ids"]) | {0, 2}
    extra_id = next(t for t in fixed["7"]["token_ids"][1:] if t not in others)
    stop_ids = {2, 0, extra_id}
    text = base["completion"]
    stop = text[len(text) // 2:len(text) // 2 + 2]
    flag_stop = fixed["turns-id"]["completion"][1:3]
    assert stop.strip() and len(flag_stop) == 2, (base, fixed["turns-id"])
    copy = shutil.copytree(target, tmp_path / "target")
    (copy / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.9, "top_p": 0.8, "top_k": 7,
         "eos_token_id": sorted(stop_ids)}))
    records = [
        {"id": "raw-count", "prompt": RAW_COUNT, "stop": [stop, "\u2603never"]},
        {"id": "7", "conversations": [
            {"role": "system", "content": "Answer exactly."},
            {"role": "user", "content": "Continue the pattern: cat dog"}], "stop": []},
        {"id": "flag-stop", "turns": ["Count from 1 to 8."]},
        {"id": "sampled", "prompt": RAW_COUNT, "temperature": 0.7, "top_p": 0.9,
         "top_k": 5, "max_new_tokens": 5, "seed": 11},
        {"id": "bad-t", "prompt": "x", "temperature": -1},
        {"id": "bad-stop", "prompt": "x", "stop": ["ok", 3]},
        {"id": "bad-seed", "prompt": "x", "seed": "s"},
    ]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    out = tmp_path / "out.jsonl"
    proc = decode_cli("--target", copy, "--drafter", drafter, "--prompts", path, "--out", out,
                      *SIZES, "--scheduler", "fixed", "--temperature", "0", "--logprobs", "2",
                      "--stop", flag_stop, "--recompile-guard")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [
        f"error: {path}:5: 'temperature' must be a finite number >= 0 (0 = greedy), got -1",
        f"error: {path}:6: 'stop' must be a non-empty string or a list of them, got ['ok', 3]",
        f"error: {path}:7: 'seed' must be an integer in [0, 2^32), got 's'"], proc.stderr
    assert "sampling by default: temperature 0, top-p 0.8, top-k 7" in proc.stderr
    results = {r["id"]: r for r in read_jsonl(out)}
    assert set(results) == {"raw-count", "7", "flag-stop", "sampled"}
    # The flag gives T = 0; top-p/top-k default to generation_config's; records override.
    defaults = {"temperature": 0.0, "top_p": 0.8, "top_k": 7, "max_new_tokens": MAX_NEW}
    want_settings = {"raw-count": {**defaults, "stop": [stop, "\u2603never"]},
                     "7": {**defaults, "stop": []}, "flag-stop": {**defaults, "stop": [flag_stop]},
                     "sampled": {"temperature": 0.7, "top_p": 0.9, "top_k": 5, "max_new_tokens": 5,
                                 "stop": [flag_stop], "seed": 11}}
    for rid, r in results.items():
        assert set(r) == KEYS | {"logprobs", "top_logprobs"}, r
        got, want = dict(r["sampling"]), dict(want_settings[rid])
        # Without a seed of its own, a request's stream is derived from its id.
        assert got.pop("seed") == want.pop("seed", zlib.crc32(rid.encode())), rid
        assert got == want, rid
        n = len(r["token_ids"])
        assert r["completion"] == tok.decode(r["token_ids"]) or rid in ("raw-count", "flag-stop")
        assert len(r["logprobs"]) == len(r["top_logprobs"]) == n
        for lp, top in zip(r["logprobs"], r["top_logprobs"]):
            assert len(top) == 2 and all(isinstance(i, int) and v <= 0 for i, v in top)
            assert top[0][1] >= top[1][1] and lp <= top[0][1] + 1e-5
            if r["sampling"]["temperature"] == 0:
                assert lp == pytest.approx(top[0][1], abs=1e-5)  # greedy takes the most likely
    assert len(results["sampled"]["token_ids"]) <= 5

    def cut_at_ids(ids):
        first = next((i for i, t in enumerate(ids) if t in stop_ids), None)
        return ids if first is None else ids[:first + 1]

    # Stop ids as generation_config lists them: "7" ends at the extra id, with "stop".
    r7 = results["7"]
    assert r7["token_ids"] == cut_at_ids(fixed["7"]["token_ids"]) and r7["finish_reason"] == "stop"
    assert r7["token_ids"][-1] == extra_id and r7["prompt"] == fixed["7"]["prompt"]
    # Stop strings: the text ends just before the first one; the ids are what produce that text.
    for rid, ref, stops in (("raw-count", base, [stop]), ("flag-stop", fixed["turns-id"], [flag_stop])):
        r, ref_ids = results[rid], cut_at_ids(ref["token_ids"])
        ref_text = tok.decode(ref_ids)
        cut = min(ref_text.find(s) for s in stops if s in ref_text)
        assert r["completion"] == ref_text[:cut] and r["finish_reason"] == "stop", (r, ref_text)
        ids = r["token_ids"]
        assert ids == ref_ids[:len(ids)] and tok.decode(ids).startswith(r["completion"])
        assert not tok.decode(ids[:-1]).startswith(r["completion"]) or not ids


# ------------------------------------------------------------------ never losing data


def plain_args(pair, prompts, out, *extra):
    return ("--target", pair[0], "--drafter", "none", "--prompts", prompts, "--out", out, *SIZES,
            *extra)


@pytest.mark.parametrize("case", ["out-is-prompts", "out-is-prompts-other-spelling",
                                  "metrics-is-prompts", "metrics-dir-missing", "out-dir-missing",
                                  "out-is-a-dir", "out-is-metrics"])
def test_output_paths_checked_before_loading(tmp_path, case):
    """Nothing is loaded (the target does not exist) and nothing is touched."""
    prompts = tmp_path / "sub" / "prompts.jsonl"
    prompts.parent.mkdir()
    prompts.write_text('{"prompt": "keep me"}\n')
    out, metrics = tmp_path / "out.jsonl", None
    message = {
        "out-is-prompts": f"--out {prompts}: is the input --prompts {prompts}",
        "out-is-prompts-other-spelling": "is the input --prompts",
        "metrics-is-prompts": f"--metrics {prompts}: is the input --prompts",
        "metrics-dir-missing": f"--metrics {tmp_path}/gone/m.json: directory {tmp_path}/gone "
                               "does not exist",
        "out-dir-missing": f"--out {tmp_path}/gone/o.jsonl: directory {tmp_path}/gone does not exist",
        "out-is-a-dir": f"--out {tmp_path}: is a directory",
        "out-is-metrics": f"--metrics {out}: is the output --out {out}",
    }[case]
    if case == "out-is-prompts":
        out = prompts
    elif case == "out-is-prompts-other-spelling":
        out = tmp_path / "sub" / ".." / "sub" / "prompts.jsonl"
    elif case == "metrics-is-prompts":
        metrics = prompts
    elif case == "metrics-dir-missing":
        metrics = tmp_path / "gone" / "m.json"
    elif case == "out-dir-missing":
        out = tmp_path / "gone" / "o.jsonl"
    elif case == "out-is-a-dir":
        out = tmp_path
    else:
        metrics = out
    args = ["--target", tmp_path / "no-target", "--drafter", "none", "--prompts", prompts,
            "--out", out] + (["--metrics", metrics] if metrics else [])
    proc = decode_cli(*args, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "usage:" in proc.stderr and message in proc.stderr, proc.stderr
    assert "not found" not in proc.stderr and "Traceback" not in proc.stderr
    assert prompts.read_text() == '{"prompt": "keep me"}\n'
    assert not (tmp_path / "gone").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sub"]


@pytest.mark.parametrize("content, errors", [
    ("\n  \n", ["{path}: no prompt records (the file is empty); nothing to decode"]),  # stderr whole
    ('{"prompt": ""}\n{"prompt": "x", "top_k": -2}\n',
     ["{path}:1: 'prompt' is empty", "{path}:2: 'top_k' must be an integer >= 0 (0 = off), got -2",
      "{path}: no record could be decoded (2 bad)"]),
], ids=["empty file", "only bad records"])
def test_nothing_to_decode_stops_before_compiling(pair, tmp_path, content, errors):
    """An empty prompt file, or one whose every record is bad: exit 1 with one line per problem,
    before anything compiles, and no output file."""
    path = tmp_path / "prompts.jsonl"
    path.write_text(content)
    out = tmp_path / "out.jsonl"
    proc = decode_cli(*plain_args(pair, path, out), timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    want = [f"error: {line.format(path=path)}" for line in errors]
    lines = proc.stderr.splitlines()
    assert (lines if content.strip() == "" else lines[-len(want):]) == want, proc.stderr
    assert "compiling" not in proc.stderr and proc.stdout == ""
    assert not out.exists() and not Path(f"{out}.partial").exists()


# Runs serve.decode with SIGINT raising KeyboardInterrupt whatever the parent did: a test run
# started in the background by a non-interactive shell ignores SIGINT, an ignored signal stays
# ignored across exec, and Python then installs no handler for it (the decode would run to its end).
DECODE_WITH_SIGINT = ("import runpy, signal; "
                      "signal.signal(signal.SIGINT, signal.default_int_handler); "
                      "runpy.run_module('serve.decode', run_name='__main__', alter_sys=True)")


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)],
                         ids=["SIGTERM", "SIGINT"])
def test_interrupted_run_keeps_its_finished_results(pair, tok, tmp_path, sig, code):
    """Signalled mid-run: OUT is never written, OUT.partial holds whole lines of finished
    requests only."""
    path = tmp_path / "many.jsonl"
    n = 2000
    path.write_text("".join(json.dumps({"prompt": f"Count from {i} to {i + 40}."}) + "\n"
                            for i in range(n)))
    out = tmp_path / "out.jsonl"
    partial = Path(f"{out}.partial")
    env = dict(os.environ, XLA_FLAGS=xla_flags(1),
               JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-c", DECODE_WITH_SIGINT,
                             *map(str, plain_args(pair, path, out, "--max-new-tokens", "48"))],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        deadline = time.monotonic() + 300
        while not (partial.exists() and partial.read_text().count("\n") >= 3):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        proc.send_signal(sig)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == code, stdout + stderr
    assert "interrupted" in stderr and f"were written to {partial}" in stderr, stderr
    assert not out.exists()
    raw = partial.read_text(encoding="utf-8")
    assert raw.endswith("\n")
    lines = [json.loads(line) for line in raw.splitlines()]
    assert 3 <= len(lines) < n
    for r in lines:
        assert r["completion"] == tok.decode(r["token_ids"]) and r["finish_reason"]


def test_dtype_flag_computes_a_bf16_checkpoint_in_float32_on_cpu(pair, tmp_path):
    """--dtype auto on CPU: a bfloat16 target and drafter are served in float32 (XLA's CPU bf16
    matmuls are several times slower); --dtype checkpoint keeps bfloat16; norms stay float32."""
    import argparse

    from dspark_jax.formats import deepspec, hf_checkpoint
    from serve import cli

    target, drafter = pair
    tcfg, tparams, dcfg, dparams = deepspec.load_pair(target, drafter)
    bf16 = tmp_path / "bf16"
    hf_checkpoint.save_target(tparams, dataclasses.replace(tcfg, dtype="bfloat16"), bf16 / "target",
                              tokenizer_dir=target)
    deepspec.save_drafter(dparams, tcfg, dcfg, tparams, bf16 / "drafter", dtype="bfloat16")
    for flag, want in (("auto", "float32"), ("checkpoint", "bfloat16"), ("float32", "float32")):
        args = argparse.Namespace(target=str(bf16 / "target"), drafter=str(bf16 / "drafter"),
                                  dtype=flag, sts="none")
        t, tp, d, dp, _, _ = cli.load_models(args, None)
        assert (t.dtype, d.dtype) == (want, want), flag
        assert str(tp["embed"].dtype) == want and str(tp["layers"]["wq"].dtype) == want
        assert str(tp["final_norm"].dtype) == "float32"
