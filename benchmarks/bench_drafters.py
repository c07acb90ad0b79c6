"""Drafters compared on one target in one run: τ and output tokens/s of each drafter with its whole
proposal verified (fixed(γ)) beside plain decoding, at batch 1 and 16, T = 0 and 1.

    python benchmarks/bench_drafters.py --drafters dspark=tiny-dspark,dflash=tiny-dflash,eagle3=DIR
        [--target tiny] [--batches 1,16] [--temperatures 0,1] [--schedulers plain,fixed]
        [--max-new-tokens 96] [--repeats 3] [--requests-per-slot 3] [--limit 0] [--out runs/bench-drafters]

Each drafter is measured by `serve.bench concurrency` (one engine per batch size and scheduler,
warmed up, timed runs interleaved and repeated, the median kept; its docstring says what is
measured) on the bundled held-out prompts of the three domains, in this one process; plain decoding
is measured beside every drafter, so each speed-up is a ratio within one sweep. At T = 0 every
drafter's output is compared with plain decoding's token for token. Writes OUT/NAME/ (each sweep's
JSON, tables and plots) and OUT/drafters.md, and prints the table with this command.
"""

import argparse
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from serve import bench  # noqa: E402


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafters", required=True, help="NAME=DIR or NAME=bundled name, comma-separated")
    ap.add_argument("--target", default="tiny")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--schedulers", default="plain,fixed", help="as serve.bench concurrency's")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--requests-per-slot", type=int, default=3)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--limit", type=int, default=0, help="at most this many prompts per domain")
    ap.add_argument("--out", default="runs/bench-drafters")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    pairs = [p.split("=", 1) for p in args.drafters.split(",") if p]
    if not pairs or any(len(p) != 2 or not all(p) for p in pairs):
        ap.error(f"--drafters {args.drafters!r}: expected NAME=DIR,NAME=DIR")
    args.drafters = dict(pairs)
    # Every flag the sweeps share, checked by serve.bench's own parser before anything runs.
    args.sweeps = {name: bench.parse_args([
        "concurrency", "--target", args.target, "--drafter", path, "--out", str(Path(args.out) / name),
        "--levels", args.batches, "--temperatures", args.temperatures, "--schedulers", args.schedulers,
        "--max-new-tokens", str(args.max_new_tokens), "--repeats", str(args.repeats),
        "--requests-per-slot", str(args.requests_per_slot), "--max-len", str(args.max_len),
        "--limit", str(args.limit), "--seed", str(args.seed)]) for name, path in args.drafters.items()}
    return args


def table(reports: dict) -> str:
    lines = ["| drafter | batch | T | τ | tokens/s | plain tokens/s | over plain | T = 0 output equals plain |",
             "|---|---:|---:|---:|---:|---:|---:|---|"]
    for name, report in reports.items():
        cell = {(r["level"], r["temperature"], r["scheduler"]): r for r in report["rows"]}
        for level in report["levels"]:
            for temp in report["temperatures"]:
                plain = cell.get((level, temp, "plain"))
                for sched in (s for s in report["schedulers"] if s != "plain"):
                    r = cell[level, temp, sched]
                    label = name if sched == "fixed" else f"{name} ({sched})"
                    base = plain["full_load_tokens_per_s"] if plain else None
                    same = "–" if r["same_as_plain"] is None else ("yes" if r["same_as_plain"] else "**no**")
                    lines.append(f"| {label} | {level} | {temp:g} | {r['tau']:.3f} | "
                                 f"{r['full_load_tokens_per_s']:,.1f} | "
                                 + (f"{base:,.1f} | {r['full_load_tokens_per_s'] / base:.2f}× | "
                                    if base else "– | – | ") + f"{same} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    command = shlex.join(["python", "benchmarks/bench_drafters.py", *argv])
    reports = {}
    for name, sweep in args.sweeps.items():
        print(f"== {name}: {sweep.drafter}", file=sys.stderr, flush=True)
        reports[name] = report = bench.concurrency(sweep, command)
        bench.write(report, Path(sweep.out))
    first = next(iter(reports.values()))
    device = first["device"]
    text = "\n".join([
        f"`{command}`", "",
        f"{device['kind']} x{device['count']}, jax {first['jax_version']}; target {first['target']}; "
        f"at most {args.max_new_tokens} new tokens per request, stopping at stop tokens; "
        f"{args.requests_per_slot} requests per slot, median of {args.repeats} runs; τ = tokens "
        "committed per round", "", table(reports), ""])
    (Path(args.out) / "drafters.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
