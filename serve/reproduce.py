"""`python -m serve.bench reproduce`: the paper's findings measured on the bundled models, written to
BENCHMARKS.md with its figures.

    python -m serve.bench reproduce [--out BENCHMARKS.md] [--figures benchmarks/figures]
        [--work runs/reproduce] [--levels 1,2,4,8,16] [--math-levels 1,4,16] [--fresh]
        [--thresholds 0.1,0.3,0.5,0.7,0.9]
        [--max-new-tokens 96] [--max-len 512] [--repeats 3] [--requests-per-slot 3]
        [--min-requests 32] [--slots 16]
        [--dflash-b15 DIR] [--eagle3 DIR] [--train-steps 800] [--no-compile-cache]
        [--eval-prompts DIR] [--eval-limit 150] [--eval-splits 3]

Models: the bundled target `tiny` and drafters `tiny-dspark`, `tiny-dflash` (block 7) and
`tiny-dspark-b15`; the block-15 DFlash baseline and the Eagle3 baseline (a chain of 7) are not
bundled (the 50 MB budget) and are trained here first with the bundled drafters' recipe
(`configs/dflash-demo-b15.yaml`, `configs/eagle3-demo.yaml`: the bundled regenerated data, the same
steps and seed; 11-15 minutes each on 2 cores, kept in WORK/drafters/NAME for the next run) unless
--dflash-b15 / --eagle3 name one. Prompts: the bundled held-out prompts per domain (math,
code, chat). Stages, in order:

  acceptance     every drafter decodes every prompt with its whole block verified (fixed(γ)) at
                 T = 0 and T = 1: τ per domain (Table 1), conditional acceptance per position (Fig. 2)
  calibration    STS refitted on the T = 1 rounds of the DSpark drafters (70 % of the prompts) and
                 measured on the rest: ECE and AUC per position, reliability diagrams (Fig. 6)
  calibration (held-out benchmark prompts)  the bundled DSpark's raw confidences on the first
                 --eval-limit prompts of every JSONL file in --eval-prompts (default ../shared/eval
                 beside the repository, skipped with a message when absent): STS fitted on 70 % of
                 them, measured on the rest, on --eval-splits random splits, both fits (the
                 scheduling issue's calibration criterion: mean ECE ≤ 1.5 %, AUC within 0.005)
  threshold      the threshold scheduler at each --thresholds value, calibrated, T = 1: acceptance
                 rate, τ and drafts verified per round (Fig. 5)
  concurrency    `serve.bench concurrency` with every scheduler over --levels, T = 0 and 1, with the
                 T = 0 outputs compared with plain decoding's token for token (Fig. 7, 8), from which
                 speculative over plain decoding at batch 1 and 16
  concurrency (math)  the same on the math prompts alone at --math-levels ('' skips it): the load
                 where this machine's drafts are long enough for speculation to pay, beside the
                 mixed one where it mostly does not (what async must do in each regime)

Every table and figure in the output names the command and the machine it came from; the raw
numbers go to WORK/reproduce.json, WORK/concurrency/ and WORK/concurrency-math/.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import shlex
import shutil
import sys
import time
from pathlib import Path

import numpy as np

from dspark_jax import bundled
from dspark_jax.errors import DSparkError
from serve import cli

DOMAINS = ("math", "code", "chat")
# name -> (bundled drafter name, or the preset it is trained here with; family; drafts per round)
MODELS = {"dspark-b7": ("tiny-dspark", "DSpark", 7), "dflash-b7": ("tiny-dflash", "DFlash", 7),
          "dspark-b15": ("tiny-dspark-b15", "DSpark", 15), "dflash-b15": ("dflash-demo-b15", "DFlash", 15),
          "eagle3": ("eagle3-demo", "Eagle3", 7)}
DEMO_DRAFTER_STEPS = 800  # what train.demo_models trained the bundled drafters for
# the concurrency sweeps in the results (key, the load named in their findings: "" the mixed one)
LOADS = (("concurrency", ""), ("concurrency_math", "math prompts only"))
# held-out benchmark prompts beside the repository (the project's workspace); never required
EVAL_PROMPTS = "../shared/eval"
EVAL_METHODS = ("sts-rank", "sts-bias", "sts")  # the default fit first
FIT_WORDS = {"sts-rank": "`sts-rank` (a temperature and a bias per position on the log prefix "
                         "survival: each position's ranking kept exactly)",
             "sts-bias": "`sts-bias` (a temperature and a bias per position on each confidence "
                         "factor)",
             "sts": "`sts` (the paper's temperatures alone)"}


def add_parser(sub) -> None:
    r = sub.add_parser("reproduce", help="the paper's findings on the bundled models -> BENCHMARKS.md",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    r.add_argument("--out", default="BENCHMARKS.md")
    r.add_argument("--figures", default="benchmarks/figures", help="directory for the PNGs")
    r.add_argument("--work", default="runs/reproduce", help="raw results, the trained baseline")
    r.add_argument("--levels", default="1,2,4,8,16", help="concurrencies")
    r.add_argument("--math-levels", default="1,4,16",
                   help="concurrencies of the math-prompts sweep ('' skips it)")
    r.add_argument("--thresholds", default="0.1,0.3,0.5,0.7,0.9")
    r.add_argument("--max-new-tokens", type=int, default=96)
    r.add_argument("--max-len", type=int, default=512, help="context positions per slot")
    r.add_argument("--repeats", type=int, default=3, help="timed runs per concurrency cell")
    r.add_argument("--requests-per-slot", type=int, default=3)
    r.add_argument("--min-requests", type=int, default=32, help="timed requests per concurrency "
                   "cell at least")
    r.add_argument("--slots", type=int, default=16, help="slots of the acceptance/threshold runs")
    r.add_argument("--limit", type=int, default=0, help="at most this many prompts per domain")
    r.add_argument("--dflash-b15", default="", help="a trained block-15 DFlash drafter to use")
    r.add_argument("--eagle3", default="", help="a trained Eagle3 drafter for the bundled target to use")
    r.add_argument("--train-steps", type=int, default=DEMO_DRAFTER_STEPS,
                   help="steps of the baselines trained here (the bundled drafters' budget)")
    r.add_argument("--models", default=",".join(MODELS), help="subset of " + ", ".join(MODELS))
    r.add_argument("--fresh", action="store_true",
                   help="measure the concurrency sweep again even when WORK holds one with these "
                        "settings, models and code")
    r.add_argument("--no-compile-cache", action="store_true")
    r.add_argument("--eval-prompts", default=EVAL_PROMPTS,
                   help="directory of held-out JSONL prompt files to measure the calibration on "
                        "(default: ../shared/eval, skipped when absent; '' skips it)")
    r.add_argument("--eval-limit", type=int, default=150, help="at most this many prompts per file")
    r.add_argument("--eval-splits", type=int, default=3, help="random fit/held-out splits")
    r.add_argument("--seed", type=int, default=0)


def check_args(args) -> list[str]:
    problems = []
    args.models = [m for m in args.models.split(",") if m]
    unknown = [m for m in args.models if m not in MODELS]
    if unknown or not args.models:
        problems.append(f"--models: unknown {', '.join(unknown) or '(none)'}; expected some of "
                        f"{', '.join(MODELS)}")
    try:
        thresholds = [float(t) for t in args.thresholds.split(",") if t]
        if not thresholds or not all(0 <= t <= 1 for t in thresholds):
            raise ValueError
        args.thresholds = thresholds
    except ValueError:
        problems.append(f"--thresholds {args.thresholds!r}: expected numbers in [0, 1]")
    for flag in ("levels", "math_levels"):  # checked here, not after the stages before the sweeps
        text = getattr(args, flag)
        values = [v.strip() for v in text.split(",") if v.strip()]
        if (text or flag == "levels") and not (values and all(v.isdigit() and int(v) >= 1 for v in values)):
            problems.append(f"--{flag.replace('_', '-')} {text!r}: expected positive integers, e.g. 1,4,16"
                            + (" ('' skips the sweep)" if flag == "math_levels" else ""))
    for flag in ("max_new_tokens", "max_len", "repeats", "slots", "train_steps"):
        if getattr(args, flag) < 1:
            problems.append(f"--{flag.replace('_', '-')} {getattr(args, flag)}: must be >= 1")
    if args.requests_per_slot < 2:
        problems.append(f"--requests-per-slot {args.requests_per_slot}: must be >= 2")
    if args.min_requests < 0:
        problems.append(f"--min-requests {args.min_requests}: must be >= 0")
    for flag in ("eval_limit", "eval_splits"):
        if getattr(args, flag) < 1:
            problems.append(f"--{flag.replace('_', '-')} {getattr(args, flag)}: must be >= 1")
    for flag, path in given_drafters(args).items():
        if path and not Path(path).is_dir():
            problems.append(f"--{flag} {path}: not a directory")
    if Path(args.figures).exists() and not Path(args.figures).is_dir():
        problems.append(f"--figures {args.figures}: is a file; expected a directory")
    problems += cli.output_problems({"--out": args.out}, {})
    return problems


def machine() -> dict:
    import jax

    device = jax.devices()[0]
    return {"platform": device.platform, "device_kind": device.device_kind,
            "devices": jax.device_count(), "cpu": platform.processor() or platform.machine(),
            "cpu_cores": os.cpu_count(), "python": platform.python_version(),
            "jax": jax.__version__, "date": datetime.date.today().isoformat()}


def machine_line(m: dict) -> str:
    return (f"{m['device_kind']} x{m['devices']} ({m['cpu_cores']} CPU cores, {m['cpu']}), "
            f"jax {m['jax']}, Python {m['python']}, {m['date']}")


# -- models ----------------------------------------------------------------------------------

def given_drafters(args) -> dict[str, str]:
    """The baselines named on the command line (name -> directory or '')."""
    return {"dflash-b15": args.dflash_b15, "eagle3": args.eagle3}


def drafter_dirs(args, log) -> dict[str, str]:
    out = {}
    for name in args.models:
        source = MODELS[name][0]
        if source in bundled.DRAFTERS:
            out[name] = bundled.resolve_drafter(source)
        elif given_drafters(args).get(name):
            out[name] = given_drafters(args)[name]
        else:
            export = Path(args.work) / "drafters" / name
            if not (export / "model.safetensors").is_file():
                from train.demo_models import train_drafter

                print(f"== training the {name} baseline ({args.train_steps} steps; resumable)",
                      flush=True)
                t0 = time.perf_counter()
                train_drafter(source, Path(bundled.resolve_target("tiny")),
                              bundled.REGENERATED, Path(args.work) / "runs" / name, export,
                              args.train_steps, args.seed, "bfloat16")
                log.append({"stage": f"train {name}", "seconds": round(time.perf_counter() - t0, 1)})
            out[name] = str(export)
    return out


class Models:
    """The bundled target loaded once, each drafter loaded beside it on demand."""

    def __init__(self, args):
        from dspark_jax.formats.tokenizer import load_tokenizer

        self.args = args
        self.target = bundled.resolve_target("tiny")
        self.tokenizer = load_tokenizer(self.target)
        self.mesh = None

    def load(self, drafter: str, sts: str = "none"):
        ns = argparse.Namespace(target=self.target, drafter=drafter, sts=sts, dtype="auto",
                                verify_len=0)
        return cli.load_models(ns, self.mesh)

    def requests(self, engine, temperature: float) -> list:
        out = []
        for domain in DOMAINS:
            reqs, _, _ = cli.read_requests(Path(bundled.PROMPTS[domain]), self.tokenizer,
                                           engine.check_request,
                                           max_new_tokens=self.args.max_new_tokens,
                                           temperature=temperature, limit=self.args.limit)
            out += [dataclasses.replace(r, id=f"{domain}/{r.id}") for r in reqs]
        return out


# -- acceptance (Table 1, Fig. 2) ---------------------------------------------------------------

def acceptance(models: Models, drafters: dict[str, str], args) -> tuple[dict, dict]:
    """Per model and temperature: τ per domain and macro, conditional acceptance per position.
    Also returns the T = 1 results of the drafters with a confidence head (for calibration)."""
    from dspark_jax.decoding import metrics
    from dspark_jax.decoding.engine import Engine
    from dspark_jax.decoding.schedulers import SchedulerConfig

    table, kept = {}, {}
    for name, path in drafters.items():
        tcfg, tparams, dcfg, dparams, _, _ = models.load(path)
        engine = Engine(tcfg, tparams, dcfg, dparams, slots=args.slots, max_len=args.max_len,
                        scheduler=SchedulerConfig("fixed"), seed=args.seed)
        engine.warmup()
        for temp in (0.0, 1.0):
            results = []
            t0 = time.perf_counter()
            engine.generate(models.requests(engine, temp), results.append, keep_confidences=True)
            row = {"domains": {}}
            for domain in DOMAINS:
                mine = [r for r in results if r.id.startswith(domain + "/")]
                _, _, taus = metrics.acceptance_by_position(mine, dcfg.proposal_length)
                row["domains"][domain] = {"tau": float(np.mean(taus)), "prompts": len(mine),
                                          "rounds": len(taus)}
            reached, acc, taus = metrics.acceptance_by_position(results, dcfg.proposal_length)
            row.update(tau_macro=float(np.mean([d["tau"] for d in row["domains"].values()])),
                       tau_all=float(np.mean(taus)),
                       conditional_acceptance=(acc / np.maximum(reached, 1)).tolist(),
                       reached=reached.tolist(), seconds=round(time.perf_counter() - t0, 1))
            table[f"{name}@{temp:g}"] = row
            print(f"acceptance {name} T={temp:g}: tau {row['tau_macro']:.3f} macro "
                  + " ".join(f"{d} {v['tau']:.2f}" for d, v in row["domains"].items()), flush=True)
            if temp == 1.0 and getattr(dcfg, "enable_confidence_head", False):
                kept[name] = results
        del engine
    return table, kept


def plot_positions(table: dict, names: list[str], path: Path, temp: float = 1.0) -> None:
    fig, (ax,) = _figure(1)
    for i, name in enumerate(names):
        row = table.get(f"{name}@{temp:g}")
        if row is None:
            continue
        ca = row["conditional_acceptance"]
        ax.plot(range(1, len(ca) + 1), ca, marker="o", color=f"C{i}",
                linestyle={"DSpark": "-", "DFlash": "--"}.get(MODELS[name][1], ":"),
                label=f"{MODELS[name][1]} block {MODELS[name][2]}")
    ax.set(xlabel="draft position j", ylabel="P(draft j accepted | drafts before it accepted)",
           title=f"conditional acceptance by position, T = {temp:g}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# -- calibration (Fig. 6) -------------------------------------------------------------------------

def calibration_stage(kept: dict, figures: Path, args) -> dict:
    from dspark_jax.decoding import calibration

    out = {}
    for name, results in kept.items():
        fitted = calibration.fit_on_results(results, eval_fraction=0.3, seed=args.seed)
        rep = fitted.report
        calibration.reliability_diagram(*fitted.held_out, fitted.sts,
                                        figures / f"reliability-{name}.png",
                                        title=f"{name}: held-out rounds, T = 1")
        auc_shift = [abs(a - b) for a, b in zip(rep["auc"], rep["auc_before"])
                     if a is not None and b is not None]
        out[name] = {"method": calibration.METHODS[0], "form": fitted.sts.form,
                     "temperatures": list(fitted.sts.temperatures), "biases": list(fitted.sts.biases),
                     "prompts_fit": fitted.prompts_fit,
                     "prompts_eval": fitted.prompts_eval, "rounds_fit": fitted.fit_rounds,
                     "rounds_eval": int(len(fitted.held_out[0])),
                     "max_auc_shift": max(auc_shift) if auc_shift else None, **rep}
        print(f"calibration {name}: mean ECE {rep['mean_ece_before']:.4f} -> "
              f"{rep['mean_ece_after']:.4f}", flush=True)
    return out


# -- calibration on held-out benchmark prompts -----------------------------------------------------

def eval_calibration_stage(models: Models, drafter: str, figures: Path, args) -> dict:
    """The drafter's raw confidences on the held-out benchmark prompts of --eval-prompts, decoded
    at T = 1 with the whole block verified; each fit (EVAL_METHODS) on --eval-splits random 70/30
    splits of the prompts. {"skipped": why} when the directory is absent or holds no prompts."""
    from dspark_jax.decoding import calibration
    from dspark_jax.decoding.engine import Engine
    from dspark_jax.decoding.schedulers import SchedulerConfig
    from dspark_jax.formats.generation_config import SamplingSettings
    from train.calibrate import split_summary

    folder = Path(args.eval_prompts)
    files = sorted(folder.glob("*.jsonl")) if folder.is_dir() else []
    if not files:
        why = f"{folder}: {'no *.jsonl files' if folder.is_dir() else 'not found'}"
        print(f"calibration on held-out prompts skipped: {why}", flush=True)
        return {"skipped": why}
    # the drafter directory's sts.json is read, not applied: the rounds keep the raw confidences
    tcfg, tparams, dcfg, dparams, shipped, shipped_from = models.load(drafter, sts="")
    engine = Engine(tcfg, tparams, dcfg, dparams, slots=args.slots,
                    max_len=tcfg.max_position_embeddings, scheduler=SchedulerConfig("fixed"),
                    seed=args.seed)
    engine.warmup()
    settings = SamplingSettings(temperature=1.0, max_new_tokens=args.max_new_tokens)
    requests, counts = [], {}
    for path in files:  # the first --eval-limit prompts that fit the context (quietly skipping others)
        reqs, _, _ = cli.read_prompt_file(path, models.tokenizer, engine.check_request, settings,
                                          per_record=False, quiet=True, limit=args.eval_limit)
        counts[path.stem] = len(reqs)
        requests += [dataclasses.replace(r, id=f"{path.stem}/{r.id}") for r in reqs]
    results = []
    metrics = engine.generate(requests, results.append, keep_confidences=True)
    del engine
    out = {"dir": str(folder), "limit": args.eval_limit, "prompts": counts, "tau": metrics["tau"],
           "methods": {}}
    if shipped is not None:  # what a user of the drafter gets: its own calibration, fitted elsewhere
        rep = calibration.position_report(*calibration.stack_rounds(results), shipped)
        shifts = [abs(a - b) for a, b in zip(rep["auc"], rep["auc_before"])
                  if a is not None and b is not None]
        out["shipped"] = {"file": shipped_from, "rounds": rep["n"][0], "form": shipped.form,
                          **{f"mean_ece_{w}": rep[f"mean_ece_{w}"] for w in ("before", "after", "floor")},
                          **{f"mean_brier_{w}": float(np.mean([b for b in rep[key] if b is not None]))
                             for w, key in (("before", "brier_before"), ("after", "brier"))},
                          "max_auc_shift": max(shifts, default=0.0)}
    for method in EVAL_METHODS:
        fits = [calibration.fit_on_results(results, eval_fraction=0.3, seed=seed, method=method)
                for seed in range(args.seed, args.seed + args.eval_splits)]
        out["methods"][method] = [split_summary(seed, f) for seed, f in
                                  enumerate(fits, start=args.seed)]
        if method == EVAL_METHODS[0]:
            calibration.reliability_diagram(*fits[0].held_out, fits[0].sts,
                                            figures / "reliability-eval.png",
                                            title=f"{folder.name}: held-out prompts, T = 1")
        print(f"calibration on {folder} ({method}): mean ECE after "
              + ", ".join(f"{s['mean_ece_after']:.4f}" for s in out["methods"][method])
              + "; largest AUC shift " + ", ".join(f"{s['max_auc_shift']:.4f}"
                                                   for s in out["methods"][method]), flush=True)
    return out


# -- threshold sweep (Fig. 5) -----------------------------------------------------------------------

def threshold_stage(models: Models, drafter: str, args) -> list[dict]:
    from dspark_jax.decoding.engine import Engine
    from dspark_jax.decoding.schedulers import SchedulerConfig

    tcfg, tparams, dcfg, dparams, sts, sts_from = models.load(drafter, sts="")
    rows = []
    for t in args.thresholds:
        engine = Engine(tcfg, tparams, dcfg, dparams, slots=args.slots,
                        max_len=args.max_len,
                        scheduler=SchedulerConfig("threshold", threshold=t), seed=args.seed, sts=sts)
        engine.warmup()
        m = engine.generate(models.requests(engine, 1.0))
        rows.append({"threshold": t, "acceptance_rate": m["acceptance_rate"], "tau": m["tau"],
                     "mean_verified": m["mean_verified"], "calibration": sts_from or None})
        print(f"threshold {t:g}: acceptance {m['acceptance_rate']:.3f}, tau {m['tau']:.3f}, "
              f"verified {m['mean_verified']:.2f}", flush=True)
        del engine
    return rows


def plot_threshold(rows: list[dict], path: Path, name: str) -> None:
    fig, (ax,) = _figure(1)
    ts = [r["threshold"] for r in rows]
    ax.plot(ts, [r["acceptance_rate"] for r in rows], marker="o", color="C0", label="acceptance rate")
    ax.set(xlabel="confidence threshold", ylabel="acceptance rate (accepted / verified)",
           title=f"{name}: threshold sweep, T = 1")
    ax2 = ax.twinx()
    ax2.plot(ts, [r["tau"] for r in rows], marker="s", color="C1", label="τ (tokens / round)")
    ax2.plot(ts, [r["mean_verified"] for r in rows], marker="^", color="C2",
             label="drafts verified / round")
    ax2.set_ylabel("tokens per round")
    lines = ax.get_lines() + ax2.get_lines()
    ax.legend(lines, [ln.get_label() for ln in lines], fontsize="small", loc="center left")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _figure(panels: int):
    from serve.bench import _figure as figure

    return figure(panels)


# -- the report ---------------------------------------------------------------------------------------

def suffix_fall(row: dict) -> float:
    """Conditional acceptance at position 1 minus its mean over the second half of the block
    (weighted by how many rounds reached each position, so that rare late positions count less)."""
    ca, reached = np.asarray(row["conditional_acceptance"]), np.asarray(row["reached"], float)
    half = slice(len(ca) // 2, None)
    return float(ca[0] - np.average(ca[half], weights=np.maximum(reached[half], 1e-9)))


def criteria(res: dict) -> list[tuple[str, str, bool | None]]:
    """(what, measured, passed) for the findings the demo must show."""
    acc, out = res["acceptance"], []

    def tau(name, temp=1.0):
        row = acc.get(f"{name}@{temp:g}")
        return row["tau_macro"] if row else None

    ratios = {}
    for block in (7, 15):
        s, f = tau(f"dspark-b{block}"), tau(f"dflash-b{block}")
        ratios[block] = s / f if s and f else None
    if ratios[7] is not None:
        out.append(("τ(DSpark) / τ(DFlash), macro over domains, block 7, T = 1 (≥ 1.10)",
                    f"{ratios[7]:.3f}", ratios[7] >= 1.10))
    if ratios[15] is not None and ratios[7] is not None:
        out.append(("the same at block 15, larger than at block 7", f"{ratios[15]:.3f}",
                    ratios[15] > ratios[7]))
    s, e = tau("dspark-b7"), tau("eagle3")
    if s and e:
        out.append(("τ(DSpark) / τ(Eagle3), macro over domains, 7 drafts a round, T = 1 (> 1; the "
                    "paper: 1.27-1.31 on Qwen3 4B-14B)", f"{s / e:.3f}", s / e > 1))
    for block in (7, 15):
        rows = [acc.get(f"{n}-b{block}@1") for n in ("dspark", "dflash")]
        if all(rows):
            fall = [suffix_fall(r) for r in rows]
            out.append((f"conditional acceptance falls along the block (position 1 minus the "
                        f"second half's, T = 1), block {block}: more for DFlash than DSpark",
                        f"DSpark {fall[0]:.3f}, DFlash {fall[1]:.3f}", fall[1] > fall[0]))
    for name, cal in res.get("calibration", {}).items():
        floor = cal.get("mean_ece_floor")
        out.append((f"{name}: mean ECE after STS on held-out rounds (≤ 1.5 %)",
                    f"{100 * cal['mean_ece_before']:.2f} % → {100 * cal['mean_ece_after']:.2f} %"
                    + ("" if floor is None else f" (a perfectly calibrated head would show "
                       f"{100 * floor:.2f} % on as many rounds)"),
                    cal["mean_ece_after"] <= 0.015))
        if cal["max_auc_shift"] is not None:
            out.append((f"{name}: AUC per position unchanged by STS (within 0.005)",
                        f"largest shift {cal['max_auc_shift']:.4f}", cal["max_auc_shift"] <= 0.005))
    out += eval_calibration_criteria(res.get("calibration_eval"))
    for key, load in LOADS:
        if res.get(key):
            out += concurrency_criteria(res[key], load)
    return out


def span(values, fmt: str) -> str:
    """'a' or 'a-b': the lowest and highest of values."""
    lo, hi = format(min(values), fmt), format(max(values), fmt)
    return lo if lo == hi else f"{lo}-{hi}"


def eval_calibration_criteria(cal: dict | None) -> list[tuple[str, str, bool | None]]:
    """The scheduling issue's calibration criterion, judged on the held-out benchmark prompts
    over every split (the default fit; the other fits' figures beside it)."""
    if not cal:
        return []
    what = "dspark-b7 on held-out benchmark prompts"
    if "skipped" in cal:
        return [(f"{what}: mean ECE after STS (≤ 1.5 %), AUC unchanged (within 0.005)",
                 f"not measured ({cal['skipped']})", None)]
    default = next(m for m in EVAL_METHODS if m in cal["methods"])
    splits = cal["methods"][default]
    n = sum(cal["prompts"].values())
    before = [100 * s["mean_ece_before"] for s in splits]
    after = [100 * s["mean_ece_after"] for s in splits]
    floor = [100 * s["mean_ece_floor"] for s in splits]
    shift = [s["max_auc_shift"] for s in splits]
    where = f"{what} ({n} prompts of {cal['dir']}, 30 % held out, {len(splits)} random splits)"

    def others(key: str, fmt: str, scale: float = 1.0, unit: str = "") -> str:
        """The other fits' figures on the same splits, for the reader to weigh."""
        return "; ".join(f"{m}: {span([scale * s[key] for s in rows], fmt)}{unit}"
                         for m, rows in cal["methods"].items() if m != default and rows
                         and key in rows[0])

    brier = [s["mean_brier_after"] for s in splits if "mean_brier_after" in s]
    rows = [(f"{where}: mean ECE after STS, `{default}` (≤ 1.5 %)",
             f"{span(before, '.2f')} % → {span(after, '.2f')} % (a perfectly calibrated head would "
             f"show {span(floor, '.2f')} %; {others('mean_ece_after', '.2f', 100, ' %')})"
             + (f"; Brier {span(brier, '.4f')} ({others('mean_brier_after', '.4f')})" if brier else ""),
             max(after) <= 1.5),
            (f"{where}: AUC per position unchanged by STS, `{default}` (within 0.005)",
             f"largest shift {span(shift, '.4f')} ({others('max_auc_shift', '.4f')})",
             max(shift) <= 0.005)]
    shipped = cal.get("shipped")
    if shipped:
        rows.append((f"{what}: the drafter's shipped sts.json (fitted on the bundled prompts), all "
                     f"{shipped['rounds']} rounds", f"ECE {100 * shipped['mean_ece_before']:.2f} % → "
                     f"{100 * shipped['mean_ece_after']:.2f} %, largest AUC shift "
                     f"{shipped['max_auc_shift']:.4f}", None))
    return rows


def concurrency_criteria(conc: dict, load: str) -> list[tuple[str, str, bool | None]]:
    """The scheduling findings of one concurrency sweep; `load` names its prompts in each line
    ('' for the mixed load the paper's criteria are judged on)."""
    from serve import bench

    out = []
    tag = f"{load}: " if load else ""
    if conc:
        tps = {(r["level"], r["temperature"], r["scheduler"]): r for r in conc["rows"]}
        for temp in conc["temperatures"]:
            plain, spec = tps.get((1, temp, "plain")), [tps.get((1, temp, s)) for s in ("async", "fixed")]
            if plain and all(spec):
                best = max(spec, key=lambda r: r["full_load_tokens_per_s"])
                speed = best["full_load_tokens_per_s"] / plain["full_load_tokens_per_s"]
                same = best.get("same_as_plain")
                what = f"{tag}speculative ({best['scheduler']}) over plain decoding at batch 1, T = {temp:g}"
                if temp == 0:
                    out.append((what + " (≥ 2×, identical output)",
                                f"{speed:.2f}×, output {'identical' if same else 'DIFFERENT'}",
                                speed >= 2 and bool(same)))
                else:
                    out.append((what, f"{speed:.2f}×", None))
        if 16 in conc["levels"]:
            for temp in conc["temperatures"]:
                plain = tps.get((16, temp, "plain"))
                others = [s for s in conc["schedulers"] if s != "plain" and (16, temp, s) in tps]
                if not plain or not others:
                    continue
                rel = {s: tps[16, temp, s]["full_load_tokens_per_s"] / plain["full_load_tokens_per_s"]
                       for s in others}
                aware = [rel[s] for s in ("greedy", "async") if s in rel]
                out.append((f"{tag}the load-aware schedulers (greedy, async) not below plain decoding at "
                            f"16 requests, T = {temp:g} (fixed ones listed beside them)",
                            ", ".join(f"{s} {v:.2f}×" for s, v in rel.items()),
                            min(aware) >= 1.0 if aware else None))
        ratios_c = conc.get("ratios", [])
        if ratios_c and all(q["async_over_best"] is not None for q in ratios_c):
            worst = min(ratios_c, key=lambda q: q["async_over_best"])
            of_medians = worst.get("async_over_best_of_medians")
            out.append((f"{tag}async ≥ 0.97 × the best of plain, fixed(1), fixed(γ) at every level "
                        "(paired by repeat)",
                        f"lowest {worst['async_over_best']:.2f} (c = {worst['level']}, "
                        f"T = {worst['temperature']:g}"
                        + (f"; {of_medians:.2f} as a ratio of medians)" if of_medians else ")"),
                        worst["async_over_best"] >= 0.97))
        at32 = [q for q in ratios_c if q["level"] == 32]
        if at32:
            low = min(q["async_over_fixed"] for q in at32)
            out.append((f"{tag}async ≥ 1.15 × fixed(γ) at 32 requests", f"{low:.2f}", low >= 1.15))
        for temp in conc["temperatures"]:
            budgets = [bench.budget(tps[c, temp, "async"]) for c in conc["levels"]
                       if (c, temp, "async") in tps]
            if len(budgets) > 1:
                out.append((f"{tag}async's mean budget per request falls as concurrency rises, T = {temp:g}",
                            " → ".join(f"{b:.2f}" for b in budgets),
                            all(b2 <= b1 + 0.05 for b1, b2 in zip(budgets, budgets[1:]))
                            and budgets[-1] < budgets[0]))
    return out


def render(res: dict) -> str:
    m, cmd = res["machine"], res["command"]
    fig = res["figures_rel"]
    acc = res["acceptance"]
    lines = ["# Benchmarks", "",
             "Generated by `serve.bench reproduce`; every number and figure below comes out of it.",
             "", f"- command: `{cmd}`", f"- machine: {machine_line(m)}",
             "- models: the bundled target `tiny` (15.7M parameters) and drafters "
             + ", ".join(f"`{MODELS[n][0] if MODELS[n][0] in bundled.DRAFTERS else res['drafters'][n]}`"
                         for n in res["drafters"])
             + "; prompts: the bundled held-out prompts "
             + ", ".join(f"{d} {res['prompt_counts'][d]}" for d in DOMAINS),
             f"- at most {res['max_new_tokens']} new tokens per request, stopping at the stop "
             f"tokens; acceptance and threshold runs with {res['slots']} slots", ""]
    lines += ["## Findings", "", "| finding | measured | holds |", "|---|---|:-:|"]
    for what, value, ok in res["criteria"]:
        lines.append(f"| {what} | {value} | {'–' if ok is None else ('yes' if ok else '**no**')} |")
    lines += ["", "## τ per domain (Table 1 shape)", "",
              "Tokens committed per round (accepted drafts + 1) with the whole block verified "
              "(fixed(γ)), so every position is observed.", ""]
    for temp in (1.0, 0.0):
        lines += [f"T = {temp:g}:", "", "| drafter | block | " + " | ".join(DOMAINS) + " | macro |",
                  "|---|---:|" + "---:|" * (len(DOMAINS) + 1)]
        for name in res["drafters"]:
            row = acc.get(f"{name}@{temp:g}")
            if row:
                lines.append(f"| {MODELS[name][1]} | {MODELS[name][2]} | "
                             + " | ".join(f"{row['domains'][d]['tau']:.3f}" for d in DOMAINS)
                             + f" | {row['tau_macro']:.3f} |")
        lines.append("")
    lines += ["## Conditional acceptance by position (Fig. 2)", "",
              f"![conditional acceptance]({fig}/positions.png)", "",
              "| drafter | block | " + " | ".join(f"j={j}" for j in range(1, 16)) + " |",
              "|---|---:|" + "---:|" * 15]
    for name in res["drafters"]:
        row = acc.get(f"{name}@1")
        if row:
            ca = [f"{v:.3f}" for v in row["conditional_acceptance"]] + [""] * (15 - MODELS[name][2])
            lines.append(f"| {MODELS[name][1]} | {MODELS[name][2]} | " + " | ".join(ca) + " |")
    lines.append("")
    if res.get("threshold"):
        lines += [f"## Confidence-threshold sweep (Fig. 5), {res['threshold_model']}, T = 1", "",
                  f"![threshold sweep]({fig}/threshold.png)", "",
                  "| threshold | acceptance rate | τ | drafts verified / round |", "|---:|---:|---:|---:|"]
        for r in res["threshold"]:
            lines.append(f"| {r['threshold']:g} | {r['acceptance_rate']:.3f} | {r['tau']:.3f} | "
                         f"{r['mean_verified']:.2f} |")
        lines.append("")
    for name, cal in res.get("calibration", {}).items():
        lines += [f"## Calibration of {name} (Fig. 6)", "",
                  f"{FIT_WORDS[cal.get('method', 'sts-bias')]} fitted on the T = 1 rounds of "
                  f"{cal['prompts_fit']} prompts "
                  f"({cal['rounds_fit']} rounds), measured on the {cal['rounds_eval']} rounds of "
                  f"the other {cal['prompts_eval']}.", "", f"![reliability]({fig}/reliability-{name}.png)",
                  "", "ECE floor: the ECE a perfectly calibrated head would show on these rounds "
                  "(outcomes drawn from the calibrated survival itself, 200 draws): what so few "
                  "rounds per position can resolve.", "",
                  "| position | rounds | T | b | ECE before | ECE after | ECE floor | AUC before | AUC after |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for j, n in enumerate(cal["n"]):
            cells = [cal.get(k, [None] * len(cal["n"]))[j]
                     for k in ("ece_before", "ece_after", "ece_floor", "auc_before", "auc")]
            bias = cal.get("biases", [0.0] * len(cal["n"]))[j]
            lines.append(f"| {j + 1} | {n} | {cal['temperatures'][j]:.3f} | {bias:+.2f} | "
                         + " | ".join("–" if c is None else f"{c:.4f}" for c in cells) + " |")
        lines.append("")
    lines += render_eval_calibration(res.get("calibration_eval"), fig)
    conc = res.get("concurrency")
    if conc:
        from serve.bench import markdown

        lines += ["## Throughput against concurrency (Fig. 7, 8)", "",
                  f"![throughput]({fig}/throughput.png)", "", f"![per-user frontier]({fig}/pareto.png)",
                  "", markdown(conc), "## Speculative over plain decoding", "",
                  "Full-load output tokens/s over plain decoding's, from the table above; T = 0 "
                  "outputs compared with plain decoding's token for token.", "",
                  "| batch | T | " + " | ".join(s for s in conc["schedulers"] if s != "plain")
                  + " | T = 0 outputs equal plain |", "|---:|---:|" + "---:|" * len(conc["schedulers"])]
        tps = {(r["level"], r["temperature"], r["scheduler"]): r for r in conc["rows"]}
        for c in [lv for lv in (1, 16) if lv in conc["levels"]]:
            for t in conc["temperatures"]:
                plain = tps.get((c, t, "plain"))
                if not plain:
                    continue
                cells = [f"{tps[c, t, s]['full_load_tokens_per_s'] / plain['full_load_tokens_per_s']:.2f}×"
                         if (c, t, s) in tps else "–" for s in conc["schedulers"] if s != "plain"]
                same = [s for s in conc["schedulers"] if s != "plain"
                        and tps.get((c, t, s), {}).get("same_as_plain") is False]
                eq = ("–" if t != 0 else ("all" if not same else "not " + ", ".join(same)))
                lines.append(f"| {c} | {t:g} | " + " | ".join(cells) + f" | {eq} |")
        lines.append("")
    math = res.get("concurrency_math")
    if math:
        from serve.bench import markdown

        lines += ["## Throughput against concurrency, math prompts alone", "",
                  "The same sweep on the domain with the bundled drafters' highest τ (the table of τ "
                  "per domain): how each scheduler does where the drafts are longest, beside the "
                  "mixed load above.", "", f"![throughput, math prompts]({fig}/throughput-math.png)", "",
                  f"![per-user frontier, math prompts]({fig}/pareto-math.png)", "", markdown(math)]
    lines += ["## Stage times", "", "| stage | seconds |", "|---|---:|"]
    lines += [f"| {s['stage']} | {s['seconds']} |" for s in res["stages"]]
    return "\n".join(lines) + "\n"


def render_eval_calibration(cal: dict | None, fig: str) -> list[str]:
    if not cal:
        return []
    lines = ["## Calibration on held-out benchmark prompts", ""]
    if "skipped" in cal:
        return lines + [f"Not measured: {cal['skipped']}.", ""]
    lines += [f"The bundled DSpark (block 7) decodes the first {cal['limit']} prompts of each file of "
              f"`{cal['dir']}` that fit the context ("
              + ", ".join(f"{name} {n}" for name, n in cal["prompts"].items())
              + f") at T = 1 with the whole block verified (τ {cal['tau']:.3f}); STS is fitted on the "
              "rounds of 70 % of the prompts and measured on the rounds of the rest, on random "
              "splits of the prompts. `sts-rank` (the default): a temperature and a bias per "
              "position on the log prefix survival, a strictly increasing map of the raw survival, "
              "so each position's AUC is the raw one exactly; `sts-bias`: a temperature and a bias "
              "per position on each confidence factor; `sts`: the paper's temperatures alone on "
              "each factor. A product of differently scaled factors can reorder rounds, so under "
              "those two the AUC of a position's survival moves (up at some positions, down at "
              "others). Brier: the mean squared error of the survival, a proper score (ECE is not: "
              "a map that flattens every estimate towards its position's mean lowers the ECE and "
              f"raises the Brier score). The diagram: the first split, `{EVAL_METHODS[0]}`.", "",
              f"![reliability, held-out benchmark prompts]({fig}/reliability-eval.png)", "",
              "| fit | split seed | rounds fit | rounds held out | ECE before | ECE after | ECE floor "
              "| Brier before | Brier after | largest AUC shift |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    shipped = cal.get("shipped")
    if shipped:
        lines += [f"| shipped `{Path(shipped['file']).parent.name}/sts.json` (fitted on the bundled "
                  f"prompts) | – | – | {shipped['rounds']} (all) | "
                  f"{100 * shipped['mean_ece_before']:.2f} % | {100 * shipped['mean_ece_after']:.2f} % | "
                  f"{100 * shipped['mean_ece_floor']:.2f} % | {brier_cell(shipped, 'before')} | "
                  f"{brier_cell(shipped, 'after')} | {shipped['max_auc_shift']:.4f} |"]
    for method, splits in cal["methods"].items():
        for s in splits:
            lines.append(f"| {method} | {s['seed']} | {s['rounds_fit']} | {s['rounds_eval']} | "
                         f"{100 * s['mean_ece_before']:.2f} % | {100 * s['mean_ece_after']:.2f} % | "
                         f"{100 * s['mean_ece_floor']:.2f} % | {brier_cell(s, 'before')} | "
                         f"{brier_cell(s, 'after')} | {s['max_auc_shift']:.4f} |")
    return lines + [""]


def brier_cell(row: dict, when: str) -> str:
    value = row.get(f"mean_brier_{when}")
    return "–" if value is None else f"{value:.4f}"


def reusable(path: Path, cargs) -> dict | None:
    """A concurrency report already in WORK measured with these settings, models and code
    (`bench.fingerprint`) at (at least) these levels and recording every figure the report reads,
    cut to them; None when there is none (a long sweep that stopped keeps what it measured
    up to the level it reached, written after every level)."""
    from serve import bench

    if not path.is_file():
        return None
    saved = json.loads(path.read_text())
    wanted = {"max_new_tokens": cargs.max_new_tokens, "repeats": cargs.repeats,
              "requests_per_slot": cargs.requests_per_slot, "min_requests": cargs.min_requests,
              "temperatures": cargs.temperatures,
              "schedulers": cargs.schedulers, "max_len": cargs.max_len,
              "drafter": str(Path(cargs.drafter).resolve()), "ignore_eos": cargs.ignore_eos,
              "prompt_order": bench.PROMPT_ORDER, "prompt_files": cargs.prompts,
              "fingerprint": bench.fingerprint(cargs)}
    same = all(saved.get(key) == value for key, value in wanted.items())
    measured = {r["level"] for r in saved.get("rows", [])}
    # rows from before the full-load budget was recorded are measured again
    complete = all("full_load_mean_budget" in r for r in saved.get("rows", []))
    if not same or not complete or not set(cargs.levels) <= measured:
        return None
    saved["rows"] = [r for r in saved["rows"] if r["level"] in cargs.levels]
    saved["ratios"] = [q for q in saved["ratios"] if q["level"] in cargs.levels]
    saved["levels"] = list(cargs.levels)
    return saved


def concurrency_stage(stage, stages: list, drafter: str, out: Path, levels: str, prompts: list[str],
                      args) -> dict:
    """`serve.bench concurrency` with every scheduler at `levels`, T = 0 and 1, into `out`; a
    sweep already there with the same settings, models and code is reused unless --fresh (the
    stage times then list it as reused, with the seconds it took when measured)."""
    from serve import bench

    bargs = ["concurrency", "--drafter", drafter, "--out", str(out), *prompts,
             "--levels", levels, "--temperatures", "0,1", "--max-len", str(args.max_len),
             "--max-new-tokens", str(args.max_new_tokens), "--repeats", str(args.repeats),
             "--requests-per-slot", str(args.requests_per_slot),
             "--min-requests", str(args.min_requests), "--seed", str(args.seed)]
    if args.limit:
        bargs += ["--limit", str(args.limit)]
    if args.no_compile_cache:
        bargs.append("--no-compile-cache")
    cargs = bench.parse_args(bargs)
    saved = None if args.fresh else reusable(out / "concurrency.json", cargs)
    if saved:
        print(f"concurrency: reusing {out} (the same settings, models and code; --fresh to "
              "measure again)", flush=True)
        bench.write(saved, out)
        stages.append({"stage": f"{out.name} (reused: measured by an earlier run, same settings, "
                                "models and code)",
                       "seconds": saved.get("stage_seconds", "–")})
        return saved
    report = stage(out.name, bench.concurrency, cargs, shlex.join(["python", "-m", "serve.bench", *bargs]))
    report["stage_seconds"] = stages[-1]["seconds"]
    bench.write(report, out)
    return report


def main(args, argv: list[str]) -> int:
    command = shlex.join(["python", "-m", "serve.bench", *argv])
    problems = check_args(args)
    if problems:
        print("error: " + "; ".join(problems), file=sys.stderr)
        return 2
    if not args.no_compile_cache:
        from dspark_jax import compile_cache

        compile_cache.enable()
    work, figures = Path(args.work), Path(args.figures)
    try:
        for d in (work, figures):
            d.mkdir(parents=True, exist_ok=True)
        stages: list[dict] = []
        res = {"command": command, "machine": machine(), "max_new_tokens": args.max_new_tokens,
               "slots": args.slots, "stages": stages,
               "figures_rel": os.path.relpath(figures, Path(args.out).resolve().parent)}

        def stage(name, fn, *a):
            t0 = time.perf_counter()
            value = fn(*a)
            stages.append({"stage": name, "seconds": round(time.perf_counter() - t0, 1)})
            return value

        def keep(key, value):  # after every stage, so that a run that dies keeps what it measured
            res[key] = value
            (work / "reproduce.partial.json").write_text(json.dumps(res, indent=1, default=str) + "\n")
            return value

        drafters = drafter_dirs(args, stages)
        res["drafters"] = drafters
        models = Models(args)
        res["prompt_counts"] = {d: sum(1 for line in Path(bundled.PROMPTS[d]).read_text().splitlines()
                                       if line.strip()) for d in DOMAINS}
        if args.limit:
            res["prompt_counts"] = {d: min(n, args.limit) for d, n in res["prompt_counts"].items()}
        acc, kept = stage("acceptance", acceptance, models, drafters, args)
        keep("acceptance", acc)
        plot_positions(res["acceptance"], list(drafters), figures / "positions.png")
        keep("calibration", stage("calibration", calibration_stage, kept, figures, args))
        if "dspark-b7" in drafters and args.eval_prompts:
            keep("calibration_eval", stage("calibration-eval", eval_calibration_stage, models,
                                           drafters["dspark-b7"], figures, args))
        if "dspark-b7" in drafters:
            res["threshold_model"] = "DSpark block 7 (tiny-dspark, calibrated)"
            keep("threshold", stage("threshold", threshold_stage, models, drafters["dspark-b7"], args))
            plot_threshold(res["threshold"], figures / "threshold.png", "tiny-dspark")
        del models, kept
        if "dspark-b7" in drafters:
            sweeps = [("concurrency", "concurrency", args.levels, [], "")]
            if args.math_levels:
                sweeps.append(("concurrency_math", "concurrency-math", args.math_levels,
                               ["--prompts", "math"], "-math"))
            for key, sub, levels, prompts, suffix in sweeps:
                keep(key, concurrency_stage(stage, stages, drafters["dspark-b7"], work / sub, levels,
                                            prompts, args))
                for png in ("throughput.png", "pareto.png"):
                    shutil.copy2(work / sub / png, figures / png.replace(".png", f"{suffix}.png"))
    except DSparkError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    res["criteria"] = criteria(res)
    (work / "reproduce.json").write_text(json.dumps(res, indent=1) + "\n")
    text = render(res)
    Path(args.out).write_text(text)
    print(text)
    print(f"wrote {args.out}, {figures}/*.png, {work / 'reproduce.json'}")
    return 0
