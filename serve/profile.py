"""Profile the engine's round time for every verification bucket (SPS, DESIGN §5).

    python -m serve.profile --target DIR --drafter DIR --out FILE [--slots R] [--max-len S]
        [--context N] [--trials 5] [--min-ms 60]

Fills every slot with a prompt of --context tokens (default: a quarter of the context), then times the
real engine's round with a proposal (propose, fill the bucket, verify, commit) for every
verification bucket it compiles and the round without one for every anchor bucket: two untimed
rounds, then back-to-back rounds for at least --min-ms (or until the context is full), the median
over --trials of the mean round time; a table that contradicts itself (a smaller bucket slower
than a larger one, a plain round slower than a proposal round) was disturbed, and gets up to two
more passes of --trials, the medians taken over all. Writes a JSON table keyed by
what it was measured on (model shapes, slots, context, device); serve.decode --sps FILE uses it.
"""

import argparse
import sys
from pathlib import Path

from dspark_jax.errors import DSparkError
from serve import cli


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cli.add_engine_flags(ap)
    cli.add_drafter_flag(ap, none=False)
    ap.add_argument("--out", required=True, help="profile JSON to write")
    ap.add_argument("--context", type=int, default=0,
                    help="cached positions per slot (0: a quarter of the context)")
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--min-ms", type=float, default=60.0, help="timed milliseconds per trial")
    args = ap.parse_args(argv)
    problems = cli.engine_flag_problems(args)
    if args.context < 0 or args.min_ms < 0 or args.trials < 1:
        problems.append("--context and --min-ms must be >= 0, --trials >= 1")
    if Path(args.out).is_dir():
        problems.append(f"--out {args.out}: is a directory; expected a file name")
    if problems:
        ap.error("; ".join(problems))
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    from dspark_jax.decoding import profile
    from dspark_jax.decoding.engine import Engine
    from dspark_jax.decoding.schedulers import SchedulerConfig

    try:
        cli.setup_jax(args)
        mesh = cli.make_mesh(args)
        args.sts = "none"  # round times do not depend on the calibration
        tcfg, tparams, dcfg, dparams, _, _ = cli.load_models(args, mesh)
        if dcfg is None:
            raise DSparkError("--drafter none: profiles time rounds with and without a proposal; "
                              "name a drafter")
        max_len = args.max_len or min(2048, tcfg.max_position_embeddings)
        engine = Engine(tcfg, tparams, dcfg, dparams, slots=args.slots, max_len=max_len,
                        scheduler=SchedulerConfig("async"), prefill_buckets=args.prefill_buckets,
                        seed=args.seed, mesh=mesh, cache_profile=False)
        print(f"profiling {len(engine.spec_buckets)} verification and {len(engine.plain_buckets)} "
              f"anchor buckets, {args.slots} slots x {max_len} positions (compiles first) ...",
              file=sys.stderr, flush=True)
        prof = profile.measure(engine, trials=args.trials, min_seconds=args.min_ms / 1e3,
                               context=args.context or None)
    except DSparkError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    profile.save(prof, args.out)
    print(f"{'round':>6} {'bucket':>6} {'ms':>8} {'rounds/s':>9}")
    for kind, table in (("spec", prof.spec), ("plain", prof.plain)):
        for F, seconds in sorted(table.items()):
            print(f"{kind:>6} {F:>6} {seconds * 1e3:>8.3f} {1 / seconds:>9.1f}")
    m = prof.measured_on
    print(f"measured on {m['device_kind']} x{m['devices']}, {m['slots']} slots, context {m['context']} "
          f"of {m['max_len']}; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
