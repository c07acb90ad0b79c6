"""`python -m train.calibrate` and `python -m serve.profile` run as a user runs them (subprocesses on
the session's tiny trained pair), and serve.decode applying what they wrote."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import xla_flags

REPO = Path(__file__).resolve().parents[1]
SIZES = ["--slots", "4", "--max-len", "96", "--prefill-buckets", "96"]
ASKS = ["Count from 3 to 17.", "Repeat 'green river' 4 times.", "Continue the pattern: a b c d",
        "Count from 21 to 40.", "Repeat 'music' 6 times.", "Continue the pattern: cat dog"]


def run(module, *args, timeout=600) -> subprocess.CompletedProcess:
    env = dict(os.environ, XLA_FLAGS=xla_flags(1),
               JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, "-m", module, *map(str, args)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    path = tmp_path_factory.mktemp("calib") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"turns": [ASKS[i % len(ASKS)] * (1 + i % 2)]}) + "\n"
                            for i in range(24)))
    return path


@pytest.fixture(scope="module")
def calibrated(tiny_pair, prompts, tmp_path_factory):
    target, _, drafter = tiny_pair
    out = tmp_path_factory.mktemp("calibration")
    proc = run("train.calibrate", "--target", target, "--drafter", drafter, "--prompts", prompts,
               "--out", out, "--max-new-tokens", 48, "--temperature", 1, "--splits", 2, "--samples", 2, *SIZES)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc, out


def test_calibration_writes_temperatures_report_and_diagram(calibrated):
    proc, out = calibrated
    sts = json.loads((out / "sts.json").read_text())
    assert sts["format"] == "dspark-sts" and len(sts["temperatures"]) == 4 == sts["block_size"]
    assert all(t > 0 for t in sts["temperatures"])
    # the default fit: on the log prefix survival, so the held-out AUC is the raw one exactly
    assert sts["method"] == "sts-rank" and sts["form"] == "survival"
    assert sts["serving_temperature"] == 1 and sts["prompts_fit"] + sts["prompts_eval"] == 24
    assert sts["prompts_eval"] == round(0.3 * 24)
    report = json.loads((out / "calibration.json").read_text())
    for key in ("ece_before", "ece_after", "auc", "brier", "n"):
        assert len(report[key]) == 4, key
    assert report["n"][0] == report["rounds_eval"] > 0
    assert report["mean_ece_after"] == pytest.approx(sum(report["ece_after"]) / 4)
    assert all(0 <= v <= 1 for key in ("ece_before", "ece_after", "brier") for v in report[key])
    assert (out / "reliability.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "mean ECE before" in proc.stdout and f"wrote {out / 'sts.json'}" in proc.stdout
    # --splits 2: the written calibration is the first split's; the second one is measured beside
    first, second = report["splits"]
    assert (first["seed"], second["seed"]) == (0, 1)
    assert first["mean_ece_after"] == report["mean_ece_after"]
    assert first["temperatures"] == sts["temperatures"] == report["temperatures"]
    assert first["rounds_eval"] == report["rounds_eval"]
    assert first["max_auc_shift"] == pytest.approx(max(
        abs(a - b) for a, b in zip(report["auc"], report["auc_before"]) if a is not None and b is not None))
    assert first["max_auc_shift"] == second["max_auc_shift"] == 0.0
    assert second["rounds_fit"] + second["rounds_eval"] == first["rounds_fit"] + first["rounds_eval"]
    assert "2 random splits of the same rounds:" in proc.stdout
    # --samples 2: every prompt decoded twice, its samples on one side of the split
    assert sts["samples"] == 2 and "2 samples a prompt" in proc.stdout


def test_decode_applies_the_calibration_and_refuses_a_wrong_one(tiny_pair, calibrated, prompts,
                                                                tmp_path):
    target, _, drafter = tiny_pair
    _, out = calibrated
    args = ["--target", target, "--drafter", drafter, "--prompts", prompts, "--max-new-tokens", 8,
            "--scheduler", "threshold", *SIZES]
    proc = run("serve.decode", *args, "--out", tmp_path / "a.jsonl", "--sts", out / "sts.json")
    assert proc.returncode == 0, proc.stderr
    assert f"calibrated by {out / 'sts.json'}" in proc.stderr
    wrong = tmp_path / "sts.json"
    sts = json.loads((out / "sts.json").read_text())
    wrong.write_text(json.dumps({**sts, "temperatures": [1.0, 2.0, 3.0], "block_size": 3}))
    proc = run("serve.decode", *args, "--out", tmp_path / "b.jsonl", "--sts", wrong)
    assert proc.returncode == 2
    assert (f"error: {wrong}: 3 temperatures for a drafter with block size 4; was it fitted for "
            "another drafter?") in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "b.jsonl").exists()


def test_calibrate_flag_errors(tmp_path):
    afile = tmp_path / "file"
    afile.write_text("x")
    for flags, message in [(["--eval-fraction", "1.5"], "--eval-fraction 1.5: must be in (0, 1)"),
                           (["--max-new-tokens", "1"], "--max-new-tokens 1: must be >= 2"),
                           (["--splits", "0"], "--splits 0: must be >= 1"),
                           (["--samples", "0"], "--samples 0: must be >= 1"),
                           (["--samples", "2"], "--samples 2: greedy decoding (--temperature 0) "
                                                "gives every sample the same rounds")]:
        proc = run("train.calibrate", "--target", tmp_path, "--drafter", tmp_path, "--prompts",
                   afile, *flags, timeout=120)
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    proc = run("train.calibrate", "--target", tmp_path, "--drafter", tmp_path, "--prompts", afile,
               "--out", afile, timeout=120)
    assert proc.returncode == 2 and f"--out {afile}: exists and is not a directory" in proc.stderr


def test_profile_command_writes_a_table_decode_uses(tiny_pair, prompts, tmp_path):
    target, _, drafter = tiny_pair
    table = tmp_path / "sps.json"
    proc = run("serve.profile", "--target", target, "--drafter", drafter, "--out", table,
               "--trials", 1, "--min-ms", 0, "--context", 32, *SIZES)
    assert proc.returncode == 0, proc.stderr
    prof = json.loads(table.read_text())
    assert prof["measured_on"]["slots"] == 4 and prof["measured_on"]["context"] == 32
    assert set(prof["seconds"]["spec"]) == {"2", "4", "8", "16", "20"}
    assert set(prof["seconds"]["plain"]) == {"1", "2", "4"}
    assert "spec" in proc.stdout and f"wrote {table}" in proc.stdout
    proc = run("serve.decode", "--target", target, "--drafter", drafter, "--prompts", prompts,
               "--out", tmp_path / "o.jsonl", "--max-new-tokens", 8, "--sps", table, *SIZES)
    assert proc.returncode == 0, proc.stderr
    assert f"SPS profile: {table}" in proc.stderr
    # The same table is refused by an engine of another slot count.
    proc = run("serve.decode", "--target", target, "--drafter", drafter, "--prompts", prompts,
               "--out", tmp_path / "p.jsonl", "--max-new-tokens", 8, "--sps", table,
               "--slots", 2, "--max-len", 96, "--prefill-buckets", 96)
    assert proc.returncode == 2
    assert f"error: {table}: measured for slots 4; this engine has 2" in proc.stderr
    assert "compiled" not in proc.stderr  # refused before the minutes of compiling
