"""`serve.bench reproduce`'s verdicts and report from measured rows, and its held-out calibration
stage on the bundled pair (the other stages run the engine as tests/test_bench_cli.py and the
engine tests do on smaller models)."""

from pathlib import Path

from serve import reproduce


def _acceptance_row(ca, tau):
    reached = [100 - 10 * j for j in range(len(ca))]
    return {"domains": {d: {"tau": tau, "prompts": 3, "rounds": 9} for d in reproduce.DOMAINS},
            "tau_macro": tau, "tau_all": tau, "conditional_acceptance": ca, "reached": reached}


def _conc_row(level, temp, scheduler, tps, budget=0.0, same=None):
    return {"level": level, "temperature": temp, "scheduler": scheduler, "full_load_tokens_per_s": tps,
            "tokens_per_s_per_request": tps / level, "mean_budget": budget + 0.5,
            "full_load_mean_budget": budget, "same_as_plain": same,
            "describe": scheduler, "requests": 2 * level, "tau": 2.0, "acceptance_rate": 0.5}


def _result():
    flat7, falling7 = [0.8] * 7, [0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2]
    acc = {"dspark-b7@1": _acceptance_row(flat7, 3.3), "dflash-b7@1": _acceptance_row(falling7, 2.9),
           "dspark-b15@1": _acceptance_row([0.8] * 15, 3.6),
           "dflash-b15@1": _acceptance_row([0.8 - 0.04 * j for j in range(15)], 3.0),
           "eagle3@1": _acceptance_row([0.7 - 0.05 * j for j in range(7)], 2.5)}
    for key in list(acc):
        acc[key.replace("@1", "@0")] = acc[key]
    rows = []
    for level, plain, spec, budget in ((1, 100, 230, 6.0), (16, 400, 390, 0.5)):
        rows.append(_conc_row(level, 0.0, "plain", plain))
        rows.append(_conc_row(level, 0.0, "fixed", spec, 6.0, True))
        rows.append(_conc_row(level, 0.0, "async", spec + 5 * (level == 1) + 15 * (level == 16),
                              budget, True))
    conc = {"levels": [1, 16], "temperatures": [0.0], "schedulers": ["plain", "fixed", "async"],
            "rows": rows, "ratios": [{"level": 1, "temperature": 0.0, "async_over_best": 1.02,
                                      "async_over_fixed": 1.02},
                                     {"level": 16, "temperature": 0.0, "async_over_best": 0.99,
                                      "async_over_fixed": 1.01}]}
    cal = {"mean_ece_before": 0.05, "mean_ece_after": 0.012, "max_auc_shift": 0.002}
    math_rows = [_conc_row(level, 0.0, s, tps, budget, True) for level, s, tps, budget in (
        (1, "plain", 100, 0.0), (1, "fixed", 180, 7.0), (1, "async", 170, 6.0),
        (4, "plain", 200, 0.0), (4, "fixed", 300, 7.0), (4, "async", 310, 5.0))]
    math = {"levels": [1, 4], "temperatures": [0.0], "schedulers": ["plain", "fixed", "async"],
            "rows": math_rows, "ratios": [{"level": 1, "temperature": 0.0, "async_over_best": 0.94,
                                           "async_over_fixed": 0.94},
                                          {"level": 4, "temperature": 0.0, "async_over_best": 1.03,
                                           "async_over_fixed": 1.03}]}
    return {"acceptance": acc, "calibration": {"dspark-b7": cal}, "concurrency": conc,
            "concurrency_math": math}


def test_verdicts_follow_the_measurements():
    verdicts = {what: (value, ok) for what, value, ok in reproduce.criteria(_result())}
    ratio7 = next(v for k, v in verdicts.items() if "block 7, T = 1 (≥ 1.10)" in k)
    assert ratio7 == (f"{3.3 / 2.9:.3f}", True)
    ratio15 = next(v for k, v in verdicts.items() if "at block 15, larger" in k)
    assert ratio15 == (f"{3.6 / 3.0:.3f}", True)
    assert next(v for k, v in verdicts.items() if "τ(Eagle3)" in k) == (f"{3.3 / 2.5:.3f}", True)
    falls = [v for k, v in verdicts.items() if "falls along the block" in k]
    assert [ok for _, ok in falls] == [True, True]
    assert falls[0][0] == "DSpark 0.000, DFlash 0.427"  # 0.8 - (35+24+15+8)/220: weighted by rounds
    speed = next(v for k, v in verdicts.items() if "batch 1, T = 0" in k)
    assert speed == ("2.35×, output identical", True)
    at16 = next(v for k, v in verdicts.items() if "below plain decoding at 16" in k)
    assert at16 == ("fixed 0.97×, async 1.01×", True)  # judged on the load-aware ones
    assert verdicts["async's mean budget per request falls as concurrency rises, T = 0"] == \
        ("6.00 → 0.50", True)
    assert verdicts["dspark-b7: mean ECE after STS on held-out rounds (≤ 1.5 %)"][1] is True
    # the math-prompts sweep is judged the same way, each line naming its load
    math = {k: v for k, v in verdicts.items() if k.startswith("math prompts only: ")}
    assert math["math prompts only: async's mean budget per request falls as concurrency rises, "
                "T = 0"] == ("6.00 → 5.00", True)
    assert math["math prompts only: async ≥ 0.97 × the best of plain, fixed(1), fixed(γ) at every "
                "level (paired by repeat)"] == ("lowest 0.94 (c = 1, T = 0)", False)
    speed = next(v for k, v in math.items() if "batch 1, T = 0" in k)
    assert speed == ("1.80×, output identical", False)
    assert not any("16 requests" in k for k in math)  # no level 16 in that sweep


def test_a_different_greedy_output_fails_the_speedup_finding():
    res = _result()
    next(r for r in res["concurrency"]["rows"] if r["scheduler"] == "async" and r["level"] == 1)[
        "same_as_plain"] = False
    speed = next((v, ok) for k, v, ok in reproduce.criteria(res) if "batch 1, T = 0" in k)
    assert speed == ("2.35×, output DIFFERENT", False)


def test_acceptance_by_position_counts_as_the_engine_tally_does():
    import numpy as np

    from dspark_jax.decoding.metrics import Tally, acceptance_by_position
    from dspark_jax.decoding.requests import Result

    rounds = [(4, 0), (4, 4), (2, 2), (4, 1), (3, 3), (4, 2)]  # (ℓ verified, k accepted)
    res = Result(id="a", token_ids=[], finish_reason="", accepted=[], verified=[ell for ell, _ in rounds],
                 drafts_accepted=[k for _, k in rounds])
    tally = Tally(4)
    for ell, k in rounds:
        tally.slot(k + 1, ell, k)
    reached, accepted, taus = acceptance_by_position([res], 4)
    assert reached.tolist() == [6, 5, 3, 1] and accepted.tolist() == [5, 4, 2, 1]
    np.testing.assert_allclose(accepted / reached, tally.summary()["conditional_acceptance"])
    assert np.mean(taus) == tally.summary()["tau"]


def test_a_saved_sweep_is_reused_only_for_the_same_settings_models_and_code(tmp_path):
    import json

    from serve import bench

    def cargs(*extra):
        return bench.parse_args(["concurrency", "--drafter", "tiny-dspark", "--out", str(tmp_path),
                                 "--temperatures", "0", "--max-len", "512", "--max-new-tokens", "96",
                                 "--repeats", "3", "--requests-per-slot", "3", *extra])

    saved = cargs("--levels", "1,16")
    rows = [_conc_row(c, 0.0, s, 100.0) for c in (1, 16) for s in ("plain", "async")]
    report = {"max_new_tokens": 96, "repeats": 3, "requests_per_slot": 3, "min_requests": 32,
              "temperatures": [0.0],
              "schedulers": saved.schedulers, "max_len": 512, "drafter": saved.drafter,
              "ignore_eos": False, "prompt_order": bench.PROMPT_ORDER, "prompt_files": saved.prompts,
              "levels": [1, 16], "rows": rows, "fingerprint": bench.fingerprint(saved),
              "ratios": [{"level": c, "temperature": 0.0} for c in (1, 16)]}
    path = tmp_path / "concurrency.json"
    assert reproduce.reusable(path, saved) is None  # nothing saved yet
    path.write_text(json.dumps(report))
    cut = reproduce.reusable(path, cargs("--levels", "1"))
    assert cut["levels"] == [1] and {r["level"] for r in cut["rows"]} == {1} and len(cut["ratios"]) == 1
    assert reproduce.reusable(path, cargs("--levels", "1,16,32")) is None  # a level not measured
    assert reproduce.reusable(path, cargs("--levels", "1", "--repeats", "2")) is None
    assert reproduce.reusable(path, cargs("--levels", "1", "--ignore-eos")) is None
    assert reproduce.reusable(path, cargs("--levels", "1", "--min-requests", "8")) is None
    assert reproduce.reusable(path, cargs("--levels", "1", "--prompts", "math")) is None  # another load
    assert reproduce.reusable(path, cargs("--levels", "1", "--sts", "none")) is None  # raw confidences
    # the same settings with a refitted sts.json, or measured by another version of the code
    import shutil

    drafter = tmp_path / "drafter"
    shutil.copytree(Path(saved.drafter), drafter)
    path.write_text(json.dumps({**report, "drafter": str(drafter.resolve()),
                                "fingerprint": bench.fingerprint(cargs("--drafter", str(drafter)))}))
    assert reproduce.reusable(path, cargs("--levels", "1", "--drafter", str(drafter))) is not None
    sts = json.loads((drafter / "sts.json").read_text())
    (drafter / "sts.json").write_text(json.dumps({**sts, "biases": [b - 0.1 for b in sts["biases"]]}))
    assert reproduce.reusable(path, cargs("--levels", "1", "--drafter", str(drafter))) is None
    path.write_text(json.dumps({**report, "fingerprint": {**report["fingerprint"], "code": "0" * 16}}))
    assert reproduce.reusable(path, cargs("--levels", "1")) is None
    path.write_text(json.dumps({k: v for k, v in report.items() if k != "fingerprint"}))  # before it
    assert reproduce.reusable(path, cargs("--levels", "1")) is None
    path.write_text(json.dumps({**report, "prompt_order": "file order"}))  # an older sweep's
    assert reproduce.reusable(path, cargs("--levels", "1")) is None
    old_rows = [{k: v for k, v in r.items() if k != "full_load_mean_budget"} for r in rows]
    path.write_text(json.dumps({**report, "rows": old_rows}))  # before the full-load budget
    assert reproduce.reusable(path, cargs("--levels", "1")) is None


def test_a_reused_sweep_is_listed_with_the_time_it_took_when_measured(tmp_path):
    import argparse
    import json

    from serve import bench

    args = argparse.Namespace(max_len=512, max_new_tokens=96, repeats=3, requests_per_slot=3,
                              min_requests=32, seed=0, limit=0, no_compile_cache=False, fresh=False)
    cargs = bench.parse_args(["concurrency", "--drafter", "tiny-dspark", "--out", str(tmp_path),
                              "--levels", "1", "--temperatures", "0,1", "--max-len", "512",
                              "--max-new-tokens", "96", "--repeats", "3", "--requests-per-slot", "3",
                              "--min-requests", "32", "--seed", "0"])
    report = {"max_new_tokens": 96, "repeats": 3, "requests_per_slot": 3, "min_requests": 32,
              "temperatures": [0.0, 1.0], "schedulers": cargs.schedulers, "max_len": 512,
              "drafter": cargs.drafter, "ignore_eos": False, "prompt_order": bench.PROMPT_ORDER,
              "prompt_files": cargs.prompts, "levels": [1], "device": {"kind": "cpu", "count": 1},
              "rows": [_conc_row(1, t, s, 100.0) for t in (0.0, 1.0) for s in cargs.schedulers],
              "ratios": [], "stage_seconds": 812.5, "command": "python -m serve.bench concurrency",
              "fingerprint": bench.fingerprint(cargs)}
    (tmp_path / "concurrency.json").write_text(json.dumps(report))

    def stage(*_):
        raise AssertionError("a reusable sweep must not be measured again")

    stages = []
    saved = reproduce.concurrency_stage(stage, stages, "tiny-dspark", tmp_path, "1", [], args)
    assert saved["levels"] == [1]
    assert stages == [{"stage": "concurrency (reused: measured by an earlier run, same settings, "
                                "models and code)".replace("concurrency", tmp_path.name, 1),
                       "seconds": 812.5}]


def test_the_report_shows_both_loads_with_their_commands():
    res = _result()
    for key, cmd in (("concurrency", "python -m serve.bench concurrency --levels 1,16"),
                     ("concurrency_math", "python -m serve.bench concurrency --prompts math")):
        res[key].update(command=cmd, device={"kind": "cpu", "count": 1}, max_new_tokens=96,
                        ignore_eos=False, requests_per_slot=4, min_requests=32, repeats=3)
    res.update(command="python -m serve.bench reproduce", figures_rel="benchmarks/figures",
               machine={"platform": "cpu", "device_kind": "cpu", "devices": 1, "cpu_cores": 2, "cpu": "x86_64",
                        "jax": "0.10.2", "python": "3.11.7", "date": "2026-12-03"},
               drafters={name: "" for name in reproduce.MODELS}, max_new_tokens=96, slots=16,
               prompt_counts={d: 3 for d in reproduce.DOMAINS}, calibration={},
               stages=[{"stage": "concurrency-math", "seconds": 1.0}])
    res["criteria"] = reproduce.criteria(res)
    text = reproduce.render(res)
    mixed, math = text.split("## Throughput against concurrency, math prompts alone")
    assert "`python -m serve.bench concurrency --levels 1,16`" in mixed
    assert "`python -m serve.bench concurrency --prompts math`" in math
    assert "benchmarks/figures/throughput-math.png" in math
    assert "| 4 | 0 | 200.0 | 300.0 | 310.0 | 5.00 | 1.03 | 1.03 |" in math
    assert "| math prompts only: async ≥ 0.97 × the best of plain" in mixed  # among the findings


def _eval_cal(after, shifts):
    def split(seed, ece, shift):
        return {"seed": seed, "rounds_fit": 700, "rounds_eval": 300, "mean_ece_before": 0.08,
                "mean_ece_after": ece, "mean_ece_floor": 0.004, "max_auc_shift": shift,
                "mean_brier_before": 0.07, "mean_brier_after": 0.055}

    splits = [split(seed, ece, shift) for seed, (ece, shift) in enumerate(zip(after, shifts))]
    return {"dir": "../shared/eval", "limit": 150, "prompts": {"gsm8k": 150, "mbpp": 120},
            "tau": 2.1, "methods": {"sts-rank": splits,
                                    "sts-bias": [dict(s, max_auc_shift=0.006, mean_ece_after=0.009,
                                                      mean_brier_after=0.053) for s in splits],
                                    "sts": [dict(s, max_auc_shift=0.03) for s in splits]}}


def test_the_held_out_calibration_is_judged_on_its_worst_split():
    res = _result()
    res["calibration_eval"] = _eval_cal([0.008, 0.0102], [0.004, 0.0049])
    rows = {what: (value, ok) for what, value, ok in reproduce.criteria(res) if "benchmark prompts" in what}
    where = ("dspark-b7 on held-out benchmark prompts (270 prompts of ../shared/eval, 30 % held out, "
             "2 random splits)")
    assert rows[f"{where}: mean ECE after STS, `sts-rank` (≤ 1.5 %)"] == (
        "8.00 % → 0.80-1.02 % (a perfectly calibrated head would show 0.40 %; sts-bias: 0.90 %; "
        "sts: 0.80-1.02 %); Brier 0.0550 (sts-bias: 0.0530; sts: 0.0550)", True)
    assert rows[f"{where}: AUC per position unchanged by STS, `sts-rank` (within 0.005)"] == (
        "largest shift 0.0040-0.0049 (sts-bias: 0.0060; sts: 0.0300)", True)
    res["calibration_eval"] = _eval_cal([0.008, 0.016], [0.004, 0.0053])  # one split fails each
    assert [ok for what, _, ok in reproduce.criteria(res) if "benchmark prompts" in what] == [False, False]
    text = reproduce.render_eval_calibration(res["calibration_eval"], "figs")
    assert "| sts-rank | 1 | 700 | 300 | 8.00 % | 1.60 % | 0.40 % | 0.0700 | 0.0550 | 0.0053 |" \
        in "\n".join(text)
    assert "figs/reliability-eval.png" in "\n".join(text)
    res["calibration_eval"]["shipped"] = {"file": "x/dspark/sts.json", "rounds": 1000,
                                          "mean_ece_before": 0.08, "mean_ece_after": 0.03,
                                          "mean_ece_floor": 0.004, "max_auc_shift": 0.002}
    shipped = [(value, ok) for what, value, ok in reproduce.criteria(res) if "shipped" in what]
    assert shipped == [("ECE 8.00 % → 3.00 %, largest AUC shift 0.0020", None)]


def test_without_the_held_out_prompts_the_calibration_says_it_was_not_measured(tmp_path, capsys):
    import argparse

    args = argparse.Namespace(eval_prompts=str(tmp_path / "eval"))
    cal = reproduce.eval_calibration_stage(None, "", tmp_path, args)  # nothing loaded
    assert cal == {"skipped": f"{tmp_path / 'eval'}: not found"}
    assert "calibration on held-out prompts skipped" in capsys.readouterr().out
    (tmp_path / "eval").mkdir()
    assert reproduce.eval_calibration_stage(None, "", tmp_path, args) == \
        {"skipped": f"{tmp_path / 'eval'}: no *.jsonl files"}
    res = _result()
    res["calibration_eval"] = cal
    verdict = [(value, ok) for what, value, ok in reproduce.criteria(res) if "benchmark prompts" in what]
    assert verdict == [(f"not measured ({tmp_path / 'eval'}: not found)", None)]
    assert reproduce.render_eval_calibration(cal, "figs")[2] == \
        f"Not measured: {tmp_path / 'eval'}: not found."


def test_the_held_out_calibration_fits_every_method_on_every_split(tmp_path):
    """The stage on the bundled pair, a few short prompts of two files standing for ../shared/eval."""
    import argparse
    import itertools

    from dspark_jax import bundled

    folder = tmp_path / "eval"
    folder.mkdir()
    for domain in ("math", "chat"):
        lines = Path(bundled.PROMPTS[domain]).read_text().splitlines()
        (folder / f"{domain}.jsonl").write_text("\n".join(itertools.islice(lines, 4)) + "\n")
    args = argparse.Namespace(eval_prompts=str(folder), eval_limit=3, eval_splits=2, slots=2,
                              max_new_tokens=12, seed=0, limit=0)
    cal = reproduce.eval_calibration_stage(reproduce.Models(args), bundled.resolve_drafter("tiny-dspark"),
                                           tmp_path, args)
    assert cal["prompts"] == {"chat": 3, "math": 3} and cal["limit"] == 3
    assert list(cal["methods"]) == ["sts-rank", "sts-bias", "sts"]
    for splits in cal["methods"].values():
        assert [s["seed"] for s in splits] == [0, 1]
        assert all(s["rounds_eval"] > 0 and 0 <= s["mean_ece_after"] <= 1 for s in splits)
    assert all(b == 0 for b in cal["methods"]["sts"][0]["biases"])  # temperatures alone
    ranked = cal["methods"]["sts-rank"]
    assert all(s["form"] == "survival" and s["max_auc_shift"] == 0.0 for s in ranked)
    rounds = cal["methods"]["sts"][0]
    assert cal["shipped"]["rounds"] == rounds["rounds_fit"] + rounds["rounds_eval"]  # every round
    assert cal["shipped"]["file"].endswith("sts.json")
    assert (tmp_path / "reliability-eval.png").stat().st_size > 0
