"""The scheduling benchmark for an accelerator: SPS profiles and the concurrency sweep of
`serve.bench concurrency` on a bfloat16 target of about 1B parameters with a matching DSpark drafter,
in one run sized for a few minutes of device time.

    python benchmarks/accelerator_sweep.py --out DIR [--preset 1b|tiny] [--acceptance 0.8]
        [--levels 1,4,16,32,64] [--schedulers plain,fixed1,fixed,async] [--temperatures 1]
        [--max-new-tokens 128] [--prompt-len 64] [--requests-per-slot 2] [--min-requests 16]
        [--repeats 1] [--budget-s 420] [--seed 0]

No checkpoint is read: the pair is built in memory (`dspark_jax.models.counting`), with random
decoder layers and a known acceptance rate. The target (preset `1b`: 16 layers, width 2048, FFN
6144, 16 query and 8 key/value heads of 128, a 32768-token vocabulary, untied output head; 0.94B
parameters) is a counter that continues a sequence with x + 1 with probability --acceptance at
T = 1; the drafter (one layer, block 7, vanilla Markov head of rank 256, confidence head) drafts
the same bigram from its Markov head alone, and its confidence head states the per-draft
acceptance the pair really has, so the survival the schedulers rank is calibrated. Every matrix
has its real shape and a round's cost does not depend on the values: the SPS profile is the
accelerator's own. What the construction fixes is the acceptance: τ for the whole block is
(1 - a^8) / (1 - a), the same for every request (at T = 0 every draft is accepted). Decoding stays
lossless; requests run to --max-new-tokens (no stop tokens).

For each level c (the engine's slot count) and scheduler one engine is built, warmed up (its SPS
profile measured at start-up, as `serve.decode` does without --sps), and timed exactly as
`serve.bench concurrency` times it (`serve.bench.warm_level`, `time_level`); the prompts are random
token ids. Before a level the run estimates its time from the previous level's and stops when it
would pass --budget-s, so a limited device lease ends with every finished level written. Writes
into --out the files `serve.bench concurrency` writes (concurrency.json, concurrency.md,
throughput.png, pareto.png) plus sps.md, the SPS profile of each level (round seconds per bucket).
"""

import argparse
import math
import shlex
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

def sps_markdown(profiles: dict) -> str:
    """Round milliseconds per bucket for each level's measured profile."""
    lines = ["# SPS profiles (round milliseconds per verification bucket, host loop included)", ""]
    for c, prof in profiles.items():
        lines += [f"c = {c}", "", "| kind | " + " | ".join(map(str, sorted(prof.plain))) + " |",
                  "|---|" + "---:|" * len(prof.plain),
                  "| plain | " + " | ".join(f"{1e3 * prof.plain[F]:.2f}" for F in sorted(prof.plain)) + " |",
                  "", "| kind | " + " | ".join(map(str, sorted(prof.spec))) + " |",
                  "|---|" + "---:|" * len(prof.spec),
                  "| spec | " + " | ".join(f"{1e3 * prof.spec[F]:.2f}" for F in sorted(prof.spec)) + " |", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--preset", choices=("1b", "tiny"), default="1b")
    ap.add_argument("--acceptance", type=float, default=0.8,
                    help="the target's and the drafter's mass on the successor at T = 1")
    ap.add_argument("--levels", default="1,4,16,32,64")
    ap.add_argument("--schedulers", default="plain,fixed1,fixed,async")
    ap.add_argument("--temperatures", default="1")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--requests-per-slot", type=int, default=2)
    ap.add_argument("--min-requests", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--budget-s", type=float, default=420.0,
                    help="stop before a level that would end past this many seconds")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    from serve import bench

    try:
        args.levels = [int(v) for v in args.levels.split(",")]
        args.temperatures = [float(v) for v in args.temperatures.split(",")]
        args.schedulers = args.schedulers.split(",")
    except ValueError as e:
        ap.error(f"--levels/--temperatures: {e}")
    bad = [s for s in args.schedulers if s not in bench.SCHEDULERS]
    if bad:
        ap.error(f"--schedulers: unknown {bad}; choose from {sorted(bench.SCHEDULERS)}")
    if not 0.0 < args.acceptance < 1.0:
        ap.error(f"--acceptance {args.acceptance}: must lie in (0, 1)")
    if min(args.levels) < 1 or args.prompt_len < 1 or args.max_new_tokens < 2:
        ap.error("--levels, --prompt-len must be >= 1 and --max-new-tokens >= 2")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()

    import gc

    import jax
    import numpy as np

    from dspark_jax.decoding.engine import Engine
    from dspark_jax.decoding.requests import Request
    from dspark_jax.decoding.schedulers import SchedulerConfig

    # The context: the prompt, the answer, a block of drafts, and room for the start-up profile
    # (a quarter of the context cached, then rounds of a block each).
    max_len = 1 << math.ceil(math.log2(4 * (args.prompt_len + args.max_new_tokens + 8)))
    from dspark_jax.models.counting import counting_pair

    tcfg, tparams, dcfg, dparams, facts = counting_pair(args.preset, args.acceptance, max_len, args.seed)
    device = jax.devices()[0]
    print(f"{device.device_kind}: target {facts['target_params'] / 1e9:.3f}B, drafter "
          f"{facts['drafter_params'] / 1e6:.1f}M parameters; per-draft acceptance "
          f"{facts['acceptance_per_draft']:.3f} (whole-block tau {facts['tau_whole_block']:.2f}); "
          f"built in {time.perf_counter() - t_start:.1f} s", file=sys.stderr, flush=True)
    rng = np.random.default_rng(args.seed)
    prompts = [tuple(rng.integers(0, tcfg.vocab_size - 1, args.prompt_len).tolist()) for _ in range(64)]

    def batch(n: int, temperature: float, new_tokens: int, tag: str) -> list:
        return [Request(id=f"{tag}-{i}", prompt_ids=prompts[i % len(prompts)], max_new_tokens=new_tokens,
                        temperature=temperature, stop_ids=()) for i in range(n)]

    def engine_for(name: str, slots: int) -> Engine:
        shape = dict(slots=slots, max_len=max_len, prefill_buckets=(args.prompt_len,),
                     max_prefill_batch=8, seed=args.seed)
        if bench.SCHEDULERS[name] is None:
            return Engine(tcfg, tparams, **shape)
        return Engine(tcfg, tparams, dcfg, dparams, scheduler=SchedulerConfig(*bench.SCHEDULERS[name]),
                      cache_profile=False, **shape)

    command = shlex.join(["python", "benchmarks/accelerator_sweep.py", *(argv or sys.argv[1:])])
    report = {"command": command, "jax_version": jax.__version__,
              "device": {"platform": device.platform, "kind": device.device_kind,
                         "count": jax.device_count()},
              "target": f"counting pair, preset {args.preset}", "pair": facts, "calibration": None,
              "drafter": "counting pair", "block_size": dcfg.block_size, "max_len": max_len,
              "max_new_tokens": args.max_new_tokens, "requests_per_slot": args.requests_per_slot,
              "min_requests": args.min_requests, "repeats": args.repeats, "ignore_eos": True,
              "levels": [], "temperatures": args.temperatures, "schedulers": args.schedulers,
              "rows": []}
    profiles, last_level_s = {}, 0.0
    for c in args.levels:
        spent = time.perf_counter() - t_start
        if report["levels"] and spent + 1.5 * last_level_s * c ** 0.5 > args.budget_s:
            print(f"c={c}: skipped, it would end past --budget-s {args.budget_s:.0f} "
                  f"({spent:.0f} s spent)", file=sys.stderr, flush=True)
            break
        t_level = time.perf_counter()
        engines = bench.warm_level(c, args.schedulers, engine_for, batch, args.temperatures[0])
        bench.time_level(c, engines, batch, args, report)
        profiles[c] = next((e.profile for e in engines.values() if e.profile is not None), None)
        del engines
        gc.collect()
        jax.clear_caches()
        last_level_s = (time.perf_counter() - t_level) / c ** 0.5
        report["levels"].append(c)
        report["ratios"] = bench.ratios(report["rows"])
        bench.write(report, out)
        if any(profiles.values()):
            (out / "sps.md").write_text(sps_markdown({k: v for k, v in profiles.items() if v}))
        print(f"c={c}: {time.perf_counter() - t_level:.0f} s", file=sys.stderr, flush=True)
    if not report["rows"]:
        print("no level finished within --budget-s", file=sys.stderr)
        return 1
    print(bench.markdown(report))
    if any(profiles.values()):
        print(sps_markdown({k: v for k, v in profiles.items() if v}))
    print(f"total {time.perf_counter() - t_start:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
