"""Drafter-recipe ablation on the bundled demo pair: drafters trained with identical data, steps and
seed but different presets or overrides, then τ measured exactly as `serve.bench reproduce` measures
it (every held-out prompt, whole block verified, T = 0 and T = 1), each against DFlash.

    python benchmarks/drafter_recipe.py [--work runs/recipe] [--seeds 0] [--steps 800]
        [--variant NAME=PRESET[:KEY=VALUE,...] ...] [--baseline dflash] [--json FILE]

Default variants: `release` (dspark-demo with the released recipe's loss 0.1 CE + 0.9 L1 and Markov
rank 256, DESIGN.md §3, §10), `demo` (dspark-demo as configured: the bundled drafters' recipe) and
`dflash` (dflash-demo, the baseline). Every variant is trained once per seed with
`train.demo_models.train_drafter` on the bundled regenerated data (WORK/runs/NAME@sSEED, resumable;
the export in WORK/drafters/NAME@sSEED is reused by a rerun), about 17 minutes each on 2 cores.
Prints per variant the macro τ averaged over seeds (each seed's in brackets), its ratio to the
baseline's seed-mean, τ per domain at T = 1 and the fall of conditional acceptance along the block.
"""

import argparse
import json
import shlex
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DEFAULT_VARIANTS = ["release=dspark-demo:train.loss.ce_weight=0.1,train.loss.tv_weight=0.9,"
                    "drafter.markov_rank=256",
                    "demo=dspark-demo",
                    "dflash=dflash-demo"]


def parse_variant(text: str) -> tuple[str, str, tuple[str, ...]]:
    name, _, rest = text.partition("=")
    preset, _, sets = rest.partition(":")
    if not name or not preset:
        raise SystemExit(f"--variant {text!r}: expected NAME=PRESET[:KEY=VALUE,...]")
    return name, preset, tuple(s for s in sets.split(",") if s)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default="runs/recipe")
    ap.add_argument("--seeds", default="0", help="training seeds, comma-separated")
    ap.add_argument("--steps", type=int, default=800)
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=PRESET[:KEY=VALUE,...]")
    ap.add_argument("--baseline", default="dflash", help="the variant ratios are taken against")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--limit", type=int, default=0, help="only the first N prompts per domain")
    ap.add_argument("--json", default="", help="also write the table here")
    args = ap.parse_args(argv)
    variants = [parse_variant(v) for v in (args.variant or DEFAULT_VARIANTS)]
    seeds = [int(s) for s in args.seeds.split(",") if s]
    if args.baseline not in {v[0] for v in variants}:
        raise SystemExit(f"--baseline {args.baseline!r}: not among the variants "
                         f"({', '.join(v[0] for v in variants)})")

    from dspark_jax import bundled
    from serve import reproduce
    from train.demo_models import train_drafter

    work = Path(args.work)
    exports = {}
    for name, preset, sets in variants:
        for seed in seeds:
            tag = f"{name}@s{seed}"
            export = work / "drafters" / tag
            if not (export / "model.safetensors").is_file():
                print(f"== training {tag}: {preset} {' '.join(sets)}", flush=True)
                train_drafter(preset, Path(bundled.resolve_target("tiny")), bundled.REGENERATED,
                              work / "runs" / tag, export, args.steps, seed, "bfloat16", sets)
            exports[tag] = str(export)
    ns = argparse.Namespace(max_new_tokens=args.max_new_tokens, max_len=args.max_len,
                            slots=args.slots, seed=0, limit=args.limit)
    table, _ = reproduce.acceptance(reproduce.Models(ns), exports, ns)

    def mean(name, temp, key=lambda row: row["tau_macro"]):
        return float(np.mean([key(table[f"{name}@s{s}@{temp:g}"]) for s in seeds]))

    rows = []
    for name, preset, sets in variants:
        row = {"variant": name, "preset": preset, "overrides": list(sets), "seeds": seeds}
        for temp in (0.0, 1.0):
            row[f"tau_T{temp:g}"] = mean(name, temp)
            row[f"tau_T{temp:g}_per_seed"] = [table[f"{name}@s{s}@{temp:g}"]["tau_macro"] for s in seeds]
            row[f"ratio_T{temp:g}"] = row[f"tau_T{temp:g}"] / mean(args.baseline, temp)
        row["domains_T1"] = {d: mean(name, 1.0, lambda r, d=d: r["domains"][d]["tau"])
                             for d in reproduce.DOMAINS}
        row["suffix_fall_T1"] = mean(name, 1.0, reproduce.suffix_fall)
        rows.append(row)

    command = "python benchmarks/drafter_recipe.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    print(f"\n{command}\n{reproduce.machine_line(reproduce.machine())}\n")
    print(f"| variant | overrides | τ T = 0 | / {args.baseline} | τ T = 1 | / {args.baseline} "
          "| math / code / chat, T = 1 | suffix fall, T = 1 |")
    print("|---|---|---:|---:|---:|---:|---|---:|")
    for r in rows:
        per = lambda t: " (" + ", ".join(f"{x:.3f}" for x in r[f"tau_T{t}_per_seed"]) + ")" if len(seeds) > 1 else ""
        print(f"| {r['variant']} | {r['preset']} {' '.join(r['overrides'])} | {r['tau_T0']:.3f}{per(0)} "
              f"| {r['ratio_T0']:.3f} | {r['tau_T1']:.3f}{per(1)} | {r['ratio_T1']:.3f} | "
              + " / ".join(f"{v:.2f}" for v in r["domains_T1"].values())
              + f" | {r['suffix_fall_T1']:+.3f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"command": command, "rows": rows, "acceptance": table},
                                              indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
