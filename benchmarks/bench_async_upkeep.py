"""What async's plain rounds cost beyond plain decoding's: the bundled pair's concurrency benchmark
with async's decisions replaced by a plain round every round (no proposal, no probe), paired with
plain decoding. Both commit exactly one token per request and round; the difference is the
drafter engine's upkeep (the committed tokens' target features held back and projected into the
drafter's context at least every 64 rounds, the larger programs' dispatch, the policy's host work).

    python benchmarks/bench_async_upkeep.py [--levels 8,16] [--repeats 5] [--out DIR]

Prints the tokens/s of both per level (median of --repeats, run back to back), the paired ratio
(median over repeats of forced-plain async over plain, lowest and highest repeat) and the command.
"""

import argparse
import sys


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--levels", default="8,16")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--out", default="runs/async-upkeep")
    args = ap.parse_args()

    from dspark_jax.decoding import policies
    from serve import bench

    def plain_every_round(self, live, rooms):  # stands until the live count changes
        F = policies.bucket_for(len(live), self.engine.plain_buckets)
        self.last, self.age, self.hold = ("plain", F, len(live)), 0, sys.maxsize

    policies.AsyncPolicy._decide = plain_every_round
    command = "python " + " ".join(sys.argv)
    report = bench.concurrency(bench.parse_args([
        "concurrency", "--out", args.out, "--levels", args.levels, "--temperatures", "0",
        "--schedulers", "plain,async", "--max-len", "512", "--max-new-tokens", str(args.max_new_tokens),
        "--repeats", str(args.repeats), "--requests-per-slot", "3", "--min-requests", "96"]), command)
    rows = {(r["level"], r["scheduler"]): r for r in report["rows"]}
    print(f"\n{command}\nasync forced to plain rounds against plain decoding, T = 0 (tokens/s at full load)")
    print("| c | plain | async, plain rounds | paired ratio (lowest-highest) | ratio of medians | budget |")
    print("|---:|---:|---:|---:|---:|---:|")
    for q in report["ratios"]:
        c = q["level"]
        plain, upkeep = rows[c, "plain"], rows[c, "async"]
        runs = q["async_over_best_runs"]
        print(f"| {c} | {plain['full_load_tokens_per_s']:.1f} | {upkeep['full_load_tokens_per_s']:.1f} "
              f"| {q['async_over_best']:.3f} ({min(runs):.3f}-{max(runs):.3f}) "
              f"| {q['async_over_best_of_medians']:.3f} | {upkeep['full_load_mean_budget']:.2f} |")


if __name__ == "__main__":
    main()
