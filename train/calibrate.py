"""Calibrate a drafter's confidence head with Sequential Temperature Scaling (DESIGN §6).

    python -m train.calibrate --target DIR --drafter DIR --prompts FILE [FILE ...] [--out DIR]
        [--eval-fraction 0.3] [--temperature T] [--max-new-tokens N] [--limit N] [--slots R]
        [--method sts-rank|sts-bias|sts] [--splits K] [--samples K]

Decodes the prompts with the whole block verified (fixed(γ): every position observed) at the
serving temperature, recording each round's raw confidence logits and how many drafts survived.
The prompts are split at random (--seed): STS is fitted on the rounds of 1 - eval-fraction of them
and measured on the rounds of the rest. `--method sts-rank` (the default) fits a temperature and
a bias per position to the log prefix survival, which keeps every position's ranking (AUC)
exactly; `sts-bias` fits them to each confidence factor, `sts` the paper's temperatures alone to
each factor (see dspark_jax/decoding/calibration.py for when each one wins). Writes into --out (default: the drafter's directory):
  sts.json          temperatures and biases, which serve.decode applies from the drafter directory
  calibration.json  per position on the held-out rounds: ece_before, ece_after, auc, brier (and
                    their before-STS values), with mean_ece_after; ece_floor, the ECE a perfectly
                    calibrated head would show on as many rounds
  reliability.png   reliability diagrams before and after, per position

--samples K (K > 1, at a temperature above 0) decodes every prompt K times, each sample its own
random stream: K times the rounds from the same prompts, so that the held-out figures resolve
finer (the ECE floor falls as 1/sqrt(rounds)). A prompt's samples stay together on one side of
the split: the held-out prompts are still prompts the fit has not seen.

--splits K (K > 1) fits and measures again on K - 1 more random splits of the same decoded rounds
(seeds --seed + 1 ...) and prints a line per split: how much the held-out figures (mean ECE, the
largest AUC shift) owe to which prompts were held out. sts.json and the report stay the first
split's; calibration.json lists every split under "splits".
"""

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import numpy as np

from dspark_jax.decoding.calibration import METHODS
from dspark_jax.errors import DSparkError
from serve import cli


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cli.add_engine_flags(ap, slots=16)
    cli.add_drafter_flag(ap, none=False)
    ap.add_argument("--prompts", nargs="+", default=["math", "code", "chat"],
                    help="JSONL prompt file(s) or bundled prompt sets (default: math code chat)")
    ap.add_argument("--out", default="", help="output directory (default: the drafter's)")
    ap.add_argument("--eval-fraction", type=float, default=0.3,
                    help="share of the prompts held out to measure the calibration")
    ap.add_argument("--temperature", type=float, default=0.0, help="serving temperature (0 = greedy)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--limit", type=int, default=0, help="at most this many prompts per file")
    ap.add_argument("--bins", type=int, default=10, help="equal-width ECE bins")
    ap.add_argument("--splits", type=int, default=1,
                    help="random fit/held-out splits of the decoded rounds to measure (the first "
                         "one's calibration is written)")
    ap.add_argument("--samples", type=int, default=1,
                    help="decode every prompt this many times (needs --temperature > 0)")
    ap.add_argument("--method", choices=METHODS, default=METHODS[0],
                    help="sts-rank: a temperature and a bias per position on the log prefix "
                         "survival, ranking kept exactly (default); sts-bias: the same on each "
                         "confidence factor; sts: the paper's temperatures alone")
    args = ap.parse_args(argv)
    problems = cli.engine_flag_problems(args)
    if not 0 < args.eval_fraction < 1:
        problems.append(f"--eval-fraction {args.eval_fraction}: must be in (0, 1)")
    if args.temperature < 0:
        problems.append(f"--temperature {args.temperature}: must be >= 0")
    if args.max_new_tokens < 2:
        problems.append(f"--max-new-tokens {args.max_new_tokens}: must be >= 2")
    if args.limit < 0 or args.bins < 2:
        problems.append("--limit must be >= 0 and --bins >= 2")
    if args.splits < 1:
        problems.append(f"--splits {args.splits}: must be >= 1")
    if args.samples < 1:
        problems.append(f"--samples {args.samples}: must be >= 1")
    elif args.samples > 1 and args.temperature == 0:
        problems.append(f"--samples {args.samples}: greedy decoding (--temperature 0) gives every "
                        "sample the same rounds; sample at a temperature above 0")
    if problems:
        ap.error("; ".join(problems))
    return args


def split_summary(seed: int, fitted) -> dict:
    """One split's held-out figures: mean ECE before, after and its floor, mean Brier score before
    and after, and the largest AUC shift over the positions where AUC is defined."""
    report = fitted.report
    shifts = [abs(a - b) for a, b in zip(report["auc"], report["auc_before"])
              if a is not None and b is not None]
    brier = {w: float(np.mean([b for b in report[key] if b is not None]))
             for w, key in (("before", "brier_before"), ("after", "brier"))}
    return {"seed": seed, "rounds_fit": fitted.fit_rounds, "rounds_eval": len(fitted.held_out[0]),
            **{f"mean_ece_{w}": report[f"mean_ece_{w}"] for w in ("before", "after", "floor")},
            "mean_brier_before": brier["before"], "mean_brier_after": brier["after"],
            "max_auc_shift": max(shifts, default=0.0), "form": fitted.sts.form,
            "temperatures": list(fitted.sts.temperatures), "biases": list(fitted.sts.biases)}


def main(argv=None) -> int:
    args = parse_args(argv)
    from dspark_jax.decoding import calibration
    from dspark_jax.decoding.engine import Engine
    from dspark_jax.decoding.schedulers import SchedulerConfig
    from dspark_jax.formats.tokenizer import load_tokenizer

    out_dir = Path(args.out or args.drafter)
    try:
        if out_dir.exists() and not out_dir.is_dir():
            raise DSparkError(f"--out {out_dir}: exists and is not a directory")
        for p in args.prompts:
            if not Path(p).is_file():
                raise DSparkError(f"{p}: prompt file not found")
        args.sts = "none"  # the raw confidences are what gets fitted
        tokenizer = load_tokenizer(args.target)
        cli.setup_jax(args)
        mesh = cli.make_mesh(args)
        tcfg, tparams, dcfg, dparams, _, _ = cli.load_models(args, mesh)
        if dcfg is None:
            raise DSparkError("--drafter none: there is no confidence head to calibrate")
        max_len = args.max_len or min(2048, tcfg.max_position_embeddings)
        engine = Engine(tcfg, tparams, dcfg, dparams, slots=args.slots, max_len=max_len,
                        scheduler=SchedulerConfig("fixed"), prefill_buckets=args.prefill_buckets,
                        seed=args.seed, mesh=mesh)
        requests = []
        for path in args.prompts:
            reqs, _, _ = cli.read_requests(Path(path), tokenizer, engine.check_request,
                                           max_new_tokens=args.max_new_tokens,
                                           temperature=args.temperature, limit=args.limit)
            for k in range(args.samples):  # a sample's stream: its record's seed, else its id
                requests += [dataclasses.replace(
                    r, id=f"{Path(path).stem}/{r.id}" + (f"#{k}" if args.samples > 1 else ""),
                    seed=r.seed if k == 0 else None) for r in reqs]
        if len(requests) < 2:
            raise DSparkError(f"{len(requests)} usable prompts; calibration needs at least 2")
        print(f"decoding {len(requests)} {'samples' if args.samples > 1 else 'prompts'} with fixed({dcfg.proposal_length}) at temperature "
              f"{args.temperature} ...", file=sys.stderr, flush=True)
        results = []
        metrics = engine.generate(requests, results.append, keep_confidences=True)
    except DSparkError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        prompt_of = (lambda r: r.id.rsplit("#", 1)[0]) if args.samples > 1 else None
        fits = [calibration.fit_on_results(results, eval_fraction=args.eval_fraction, seed=seed,
                                           bins=args.bins, method=args.method, prompt_of=prompt_of)
                for seed in range(args.seed, args.seed + args.splits)]
    except DSparkError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    fitted = fits[0]
    splits = [split_summary(seed, f) for seed, f in enumerate(fits, start=args.seed)]
    sts, report = fitted.sts, fitted.report
    temps, biases = sts.temperatures, sts.biases
    z_eval, ell_eval, k_eval = fitted.held_out
    held, fit, z_fit = fitted.prompts_eval, fitted.prompts_fit, fitted.fit_rounds
    info = {"drafter": str(args.drafter), "prompts": [str(p) for p in args.prompts],
            "serving_temperature": args.temperature, "prompts_fit": fit, "prompts_eval": held,
            "rounds_fit": int(z_fit), "rounds_eval": int(len(z_eval)), "bins": args.bins,
            "tau": metrics["tau"], "seed": args.seed, "method": args.method,
            "samples": args.samples}
    out_dir.mkdir(parents=True, exist_ok=True)
    calibration.save_sts(out_dir / "sts.json", sts, mean_ece_after=report["mean_ece_after"], **info)
    (out_dir / "calibration.json").write_text(json.dumps(
        {**info, "form": sts.form, "temperatures": list(temps), "biases": list(biases), **report,
         **({"splits": splits} if args.splits > 1 else {})}, indent=2) + "\n")
    calibration.reliability_diagram(z_eval, ell_eval, k_eval, sts, out_dir / "reliability.png",
                                    bins=args.bins, title=f"{args.drafter}: held-out rounds")
    print(f"{'j':>2} {'n':>7} {'T':>6} {'b':>6} {'accept':>6} {'ece before':>10} {'ece after':>9} "
          f"{'ece floor':>9} {'auc before':>10} {'auc after':>9} {'brier':>6}")
    for j in range(len(temps)):
        cells = [report[key][j] for key in ("accept_rate", "ece_before", "ece_after", "ece_floor",
                                            "auc_before", "auc", "brier")]
        text = " ".join("     -" if c is None else f"{c:>{w}.4f}"
                        for c, w in zip(cells, (6, 10, 9, 9, 10, 9, 6)))
        print(f"{j + 1:>2} {report['n'][j]:>7} {temps[j]:>6.3f} {biases[j]:>+6.2f} {text}")
    print(f"{args.method}: T and b scale "
          + ("the log prefix survival" if sts.form == "survival" else "each confidence logit"))
    print(f"mean ECE before {report['mean_ece_before']:.4f}, after {report['mean_ece_after']:.4f}, "
          f"floor {report['mean_ece_floor']:.4f} (a perfectly calibrated head on as many rounds) "
          f"({len(z_eval)} held-out rounds from {held} prompts; fitted on {z_fit} rounds"
          + (f"; {args.samples} samples a prompt)" if args.samples > 1 else ")"))
    if args.splits > 1:
        print(f"{args.splits} random splits of the same rounds:")
        print(f"{'seed':>5} {'rounds fit':>10} {'held out':>8} {'ece before':>10} {'ece after':>9} "
              f"{'ece floor':>9} {'brier before':>12} {'brier after':>11} {'largest |auc shift|':>19}")
        for s in splits:
            print(f"{s['seed']:>5} {s['rounds_fit']:>10} {s['rounds_eval']:>8} "
                  f"{s['mean_ece_before']:>10.4f} {s['mean_ece_after']:>9.4f} "
                  f"{s['mean_ece_floor']:>9.4f} {s['mean_brier_before']:>12.5f} "
                  f"{s['mean_brier_after']:>11.5f} {s['max_auc_shift']:>19.4f}")
    print(f"wrote {out_dir / 'sts.json'}, {out_dir / 'calibration.json'}, {out_dir / 'reliability.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
