"""`python -m serve.bench concurrency` run the way a user runs it: a subprocess in the repository root
on the session's tiny trained pair. One small sweep (two levels, three schedulers, greedy sampling)
checks the four files it writes; the flag errors stop before anything is loaded."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import xla_flags

REPO = Path(__file__).resolve().parents[1]
PNG = b"\x89PNG\r\n\x1a\n"
LEVELS, SCHEDULERS = (1, 2), ("plain", "fixed", "async")
# async's start-up SPS profile needs room for 14 rounds of a block (+1) past its context, so 64
# positions are too few; one prefill bucket keeps the compilations (most of the test's time) few.
MAX_LEN = 80
MD_HEADER = "| c | T | plain | fixed | async | async budget | async / best | async / fixed |"


def bench_cli(*args, timeout=600) -> subprocess.CompletedProcess:
    """Runs the benchmark; the compilation and SPS caches are inherited from conftest."""
    env = dict(os.environ, XLA_FLAGS=xla_flags(1),
               JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, "-m", "serve.bench", *map(str, args)], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=timeout, check=False)


@pytest.fixture
def prompt_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    # Raw prompts in the chat layout the drafter was trained on, so that it gets drafts accepted.
    texts = ["Count from 3 to 9.", "Repeat 'red blue' 3 times.", "Continue the pattern: cat dog"]
    path.write_text("".join(json.dumps({"prompt": f"<|im_start|>user\n{t}<|im_end|>\n<|im_start|>"
                                                  "assistant\n"}) + "\n" for t in texts), encoding="utf-8")
    return path


def test_concurrency_sweep_writes_its_report(tiny_pair, prompt_file, tmp_path):
    target, _, drafter = tiny_pair
    out = tmp_path / "nested" / "bench"
    proc = bench_cli("concurrency", "--target", target, "--drafter", drafter, "--prompts", prompt_file,
                     "--out", out, "--levels", ",".join(map(str, LEVELS)), "--temperatures", "0",
                     "--schedulers", ",".join(SCHEDULERS), "--max-new-tokens", "8",
                     "--requests-per-slot", "2", "--min-requests", "3", "--repeats", "1", "--ignore-eos",
                     "--max-len", MAX_LEN,
                     "--prefill-buckets", MAX_LEN)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for name in ("concurrency.json", "concurrency.md", "throughput.png", "pareto.png"):
        assert (out / name).is_file(), name
    for name in ("throughput.png", "pareto.png"):
        assert (out / name).read_bytes().startswith(PNG), name

    report = json.loads((out / "concurrency.json").read_text())
    rows = report["rows"]
    assert sorted((r["level"], r["scheduler"]) for r in rows) == \
        sorted((c, s) for c in LEVELS for s in SCHEDULERS)
    for r in rows:
        assert r["temperature"] == 0 and r["requests"] == max(2 * r["level"], 3)  # --min-requests
        assert r["output_tokens_per_s"] > 0 and r["tokens_per_s_per_request"] > 0
        assert r["full_load_tokens_per_s"] > 0
        assert r["compilations_after_warmup"] == 0
        # Stop tokens are ignored, so every request decodes its whole budget of 8 tokens.
        assert r["output_tokens"] == 8 * r["requests"]
        assert sum(r["buckets"].values()) == r["rounds"]
    assert {r["describe"] for r in rows} == {"plain", "fixed(4)", "async"}
    # greedy speculative output is the target's own, token for token
    assert [r["same_as_plain"] for r in rows if r["scheduler"] != "plain"] == [True] * 4
    assert all(r["tau"] == 1 and r["mean_budget"] == r["full_load_mean_budget"] == 0
               for r in rows if r["scheduler"] == "plain")
    # fixed(4) proposes in every round, the full-load ones too
    assert all(r["full_load_mean_budget"] >= 4 for r in rows if r["scheduler"] == "fixed"), rows
    assert all(r["full_load_mean_budget"] is not None for r in rows)
    assert all(r["tau"] >= 1 for r in rows)
    assert all(r["mean_verified"] > 0 for r in rows if r["scheduler"] == "fixed"), rows
    assert len(report["ratios"]) == len(LEVELS)
    for q in report["ratios"]:
        assert q["async_over_best"] > 0 and q["async_over_fixed"] > 0
    assert report["jax_version"] and report["device"]["platform"] == "cpu"

    md = (out / "concurrency.md").read_text()
    lines = md.splitlines()
    assert lines[0] == f"`{report['command']}`"
    start = lines.index(MD_HEADER)
    data = [line for line in lines[start + 2:] if line.startswith("|")][:len(LEVELS)]
    assert [line.split(" | ")[0] for line in data] == [f"| {c}" for c in LEVELS]
    assert lines[start + 2 + len(LEVELS)] == ""  # exactly one row per level x temperature
    # stdout: the tables, then the exact command line; progress on stderr.
    assert proc.stdout.startswith(md)
    assert proc.stdout.splitlines()[-1] == f"command: {report['command']}"
    assert report["command"].startswith("python -m serve.bench concurrency --target ")
    assert "c=2 T=0 async:" in proc.stderr and "tok/s" not in proc.stdout


@pytest.mark.parametrize("flags, message", [
    (["--levels", "1,x"], "--levels '1,x': expected positive integers"),
    (["--levels", "0,2"], "--levels '0,2': expected positive integers"),
    (["--temperatures", "-1"], "--temperatures '-1': expected numbers >= 0"),
    (["--schedulers", "plain,bogus"], "--schedulers: unknown bogus; expected some of plain, fixed1"),
    (["--requests-per-slot", "1"], "--requests-per-slot 1: must be >= 2"),
    (["--min-requests", "-1"], "--min-requests -1: must be >= 0"),
    (["--max-new-tokens", "0"], "--max-new-tokens 0: must be >= 1"),
    (["--drafter", "none"], "--drafter none: without a drafter only --schedulers plain can run"),
    ([], "--out {out}: is a file; expected a directory"),
])
def test_bad_flags_exit_2_before_loading_anything(tmp_path, flags, message):
    # Nothing exists at these paths (but --out, a file when no flag is bad): a flag error comes first.
    out = tmp_path / "out"
    if not flags:
        out.write_text("not a directory")
    message = message.format(out=out)
    proc = bench_cli("concurrency", "--target", tmp_path / "no-target", "--drafter",
                     tmp_path / "no-drafter", "--prompts", tmp_path / "no-prompts.jsonl",
                     "--out", out, *flags, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "usage:" in proc.stderr and f"error: {message}" in proc.stderr, proc.stderr
    assert "not found" not in proc.stderr and "Traceback" not in proc.stderr
    assert out.is_file() if not flags else not out.exists()


def test_missing_prompt_file(tmp_path):
    missing = tmp_path / "missing.jsonl"
    proc = bench_cli("concurrency", "--target", tmp_path / "no-target", "--drafter",
                     tmp_path / "no-drafter", "--prompts", missing, "--out", tmp_path / "out",
                     timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"error: {missing}: prompt file not found" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "out").exists()


@pytest.mark.parametrize("flags, message", [
    (["--models", "dspark-b7,eagle"], "--models: unknown eagle; expected some of dspark-b7"),
    (["--thresholds", "0.5,2"], "--thresholds '0.5,2': expected numbers in [0, 1]"),
    (["--requests-per-slot", "1"], "--requests-per-slot 1: must be >= 2"),
    (["--min-requests", "-2"], "--min-requests -2: must be >= 0"),
    (["--eval-splits", "0"], "--eval-splits 0: must be >= 1"),
    (["--math-levels", "1,0"], "--math-levels '1,0': expected positive integers, e.g. 1,4,16 ('' skips"),
    (["--eagle3", "{tmp}/nowhere"], "--eagle3 {tmp}/nowhere: not a directory"),
    (["--out", "{tmp}/no/BENCHMARKS.md"], "--out {tmp}/no/BENCHMARKS.md: directory {tmp}/no does not exist"),
])
def test_reproduce_bad_flags_exit_2_before_anything_runs(tmp_path, flags, message):
    flags = [f.format(tmp=tmp_path) for f in flags]
    proc = bench_cli("reproduce", "--work", tmp_path / "work", *flags, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert f"error: {message.format(tmp=tmp_path)}" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "work").exists()


def test_without_target_and_drafter_the_bundled_pair_is_benchmarked(tmp_path):
    from dspark_jax import bundled
    from serve import bench

    args = bench.parse_args(["concurrency", "--out", str(tmp_path / "out"), "--levels", "1"])
    assert Path(args.target) == Path(bundled.resolve_target("tiny"))
    assert Path(args.drafter) == Path(bundled.resolve_drafter("tiny-dspark"))


def _timed_row(name, runs):
    """A concurrency row of one scheduler's timed runs (its median as the tabled figure)."""
    return {"level": 4, "temperature": 0.0, "scheduler": name, "tokens_per_s_runs": runs,
            "full_load_tokens_per_s": sorted(runs)[len(runs) // 2]}


def test_ratios_pair_each_repeat_so_a_drift_between_repeats_cancels():
    from serve import bench
    from serve.bench import ratios

    row = _timed_row

    # async is 1.02x plain and 1.53x fixed in every repeat; the machine's speed is 1.0, 0.6, 0.6
    # for the baselines' runs and 1.0, 1.0, 0.6 for async's (a slow spell ended in repeat 2).
    rows = [row("plain", [300, 180, 180]), row("fixed", [200, 120, 120]),
            row("async", [306, 306, 183.6])]
    (q,) = ratios(rows)
    assert q["async_over_best"] == pytest.approx(1.02)  # two of the three repeats say 1.02
    assert q["async_over_best_of_medians"] == pytest.approx(306 / 180)  # mixes the speeds
    assert q["async_over_fixed"] == pytest.approx(1.53)
    assert q["async_over_best_runs"] == sorted(q["async_over_best_runs"])
    assert bench.ratio_cell(q, "async_over_best") == "1.02 (1.02-1.70)"  # the spread, as tabled
    # Without per-run figures (or with a different count), the ratio of the medians stands.
    for r in rows:
        r["tokens_per_s_runs"] = r["tokens_per_s_runs"][:2] if r["scheduler"] == "async" else None
    (q,) = ratios(rows)
    assert q["async_over_best"] == q["async_over_best_of_medians"]
    assert bench.ratio_cell(q, "async_over_best") == "1.70"
    assert bench.ratio_cell({"async_over_best": None}, "async_over_best") == "–"


def test_ratios_compare_async_with_the_baseline_of_the_highest_median_in_every_repeat():
    from serve.bench import ratios

    row = _timed_row

    # plain and fixed1 tie within the noise; each repeat's faster of the two would be the
    # luckier figure (300, 300, 250: async at 0.83x), not the better scheduler.
    rows = [row("plain", [300, 200, 250]), row("fixed1", [200, 300, 240]),
            row("async", [250, 250, 250])]
    (q,) = ratios(rows)
    assert q["best"] == "plain"
    assert q["async_over_best_runs"] == pytest.approx([250 / 300, 1.0, 1.25])
    assert q["async_over_best"] == pytest.approx(1.0)
    assert q["async_over_fixed"] is None


def test_timed_runs_alternate_the_schedulers_order_between_repeats():
    import argparse

    from serve import bench

    calls = []

    class Timed:  # stands in for an engine: records when it ran
        profile_source = ""

        def __init__(self, name):
            self.name = name

        def generate(self, requests, on_result=None):
            calls.append(self.name)
            return {k: 1.0 for k in bench.RECORDED} | {"scheduler": self.name, "buckets": {}}

    args = argparse.Namespace(temperatures=[1.0], repeats=4, requests_per_slot=1, min_requests=1,
                              max_new_tokens=4)
    report = {"rows": []}
    bench.time_level(2, {n: Timed(n) for n in ("plain", "fixed", "async")},
                     lambda n, t, k, tag: [tag] * n, args, report)
    assert calls == ["plain", "fixed", "async", "async", "fixed", "plain"] * 2
    assert [r["scheduler"] for r in report["rows"]] == ["plain", "fixed", "async"]
