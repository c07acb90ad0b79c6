"""Decode a file of prompts with speculative decoding (or plain target decoding), batched and jitted.

    python -m serve.decode --target DIR --drafter DIR|none --prompts FILE --out FILE [--metrics FILE]
        [--temperature T] [--top-p P] [--top-k K] [--max-new-tokens N] [--slots R] [--max-len S]
        [--scheduler async|greedy|fixed|threshold] [--verify-len L] [--threshold t]
        [--bucket-fill] [--sts FILE|none] [--sps FILE] [--seed S] [--recompile-guard]

Prompt records (JSONL): {"prompt": "..."} (raw text, verbatim), {"turns": [...]} and
{"conversations": [...]} (chat template), with an optional "id". Results stream to --out as requests
finish. A bad record is reported (file and line) and skipped; the others are still decoded and
written, and the command then exits with status 1.

The default scheduler, async, needs the round times of this machine (an SPS profile): --sps names
one written by `python -m serve.profile`; without it a cached profile for this model, slot count,
context and device is used, else one is measured at start-up (seconds) and cached. The drafter's
confidences are calibrated with its directory's sts.json (`python -m train.calibrate`) when there
is one. With a fixed seed, a request's sampled output under plain decoding or fixed(ℓ) does not
depend on the slot count or its batch-mates; under the load-aware schedulers its distribution does
not, but which drafts get verified does, and so does the realisation.
"""

import argparse
import json
import sys
from pathlib import Path

from tqdm import tqdm

from dspark_jax.errors import DSparkError
from serve import cli


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cli.add_engine_flags(ap)
    ap.add_argument("--drafter", required=True, help="DeepSpec-format drafter directory, or 'none'")
    ap.add_argument("--prompts", required=True, help="JSONL prompt file")
    ap.add_argument("--out", required=True, help="output JSONL")
    ap.add_argument("--metrics", help="write the summary metrics here as JSON")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0, help="0 = off")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    cli.add_scheduler_flags(ap)
    ap.add_argument("--recompile-guard", action="store_true",
                    help="fail if anything compiles after warm-up")
    args = ap.parse_args(argv)
    problems = []
    if args.temperature < 0:
        problems.append(f"--temperature {args.temperature}: must be >= 0")
    if not 0 < args.top_p <= 1:
        problems.append(f"--top-p {args.top_p}: must be in (0, 1]")
    if args.top_k < 0:
        problems.append(f"--top-k {args.top_k}: must be >= 0")
    if args.max_new_tokens < 1:
        problems.append(f"--max-new-tokens {args.max_new_tokens}: must be >= 1")
    problems += cli.engine_flag_problems(args)
    if problems:
        ap.error("; ".join(problems))
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    from dspark_jax.decoding.engine import Engine
    from dspark_jax.formats.tokenizer import load_tokenizer

    try:
        if not Path(args.prompts).is_file():
            raise DSparkError(f"{args.prompts}: prompt file not found")
        tokenizer = load_tokenizer(args.target)
        cli.setup_jax(args)
        mesh = cli.make_mesh(args)
        tcfg, tparams, dcfg, dparams, sts, sts_from = cli.load_models(args, mesh)
        max_len = args.max_len or min(2048, tcfg.max_position_embeddings)
        scheduler = cli.scheduler_config(args)
        engine = Engine(tcfg, tparams, dcfg, dparams, slots=args.slots, max_len=max_len,
                        scheduler=scheduler, prefill_buckets=args.prefill_buckets, seed=args.seed,
                        mesh=mesh, sts=sts, sps=args.sps or None)
        requests, texts, errors = cli.read_requests(
            Path(args.prompts), tokenizer, engine.check_request, max_new_tokens=args.max_new_tokens,
            temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
        mode = "plain target decoding" if dcfg is None else (
            f"speculative, block {dcfg.block_size}, {scheduler.describe(dcfg.block_size)}"
            + (f", calibrated by {sts_from}" if sts_from else ""))
        print(f"{len(requests)} requests, {mode}, {args.slots} slots x {max_len} positions; "
              "compiling ...", file=sys.stderr, flush=True)
        warm = engine.warmup()
        print(f"compiled {engine.compilations} programs in {warm:.1f} s"
              + (f"; SPS profile: {engine.profile_source}" if engine.profile else ""),
              file=sys.stderr, flush=True)
        engine.guard = args.recompile_guard
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        with open(args.out, "w", encoding="utf-8") as out, \
                tqdm(total=len(requests), unit="req", file=sys.stderr, mininterval=0.5) as bar:
            tokens = [0]

            def write(res):
                out.write(json.dumps({
                    "id": res.id, "prompt": texts[res.id],
                    "completion": tokenizer.decode(res.token_ids), "token_ids": res.token_ids,
                    "finish_reason": res.finish_reason, "accepted": res.accepted,
                    "verified": res.verified}, ensure_ascii=False) + "\n")
                out.flush()
                tokens[0] += len(res.token_ids)
                bar.set_postfix_str(f"{tokens[0] / max(bar.format_dict['elapsed'], 1e-9):,.0f} tok/s",
                                    refresh=False)
                bar.update(1)

            metrics = engine.generate(requests, write) if requests else {}
    except DSparkError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    metrics.update(requests=len(requests), errors=errors, warmup_s=warm,
                   compilations=engine.compilations, calibration=sts_from or None,
                   sps_profile=engine.profile_source or None)
    print_summary(metrics)
    if args.metrics:
        Path(args.metrics).write_text(json.dumps(metrics, indent=2) + "\n")
    return 1 if errors else 0


def print_summary(m: dict) -> None:
    rows = [("requests", m.get("requests")), ("bad records", len(m.get("errors", []))),
            ("scheduler", m.get("scheduler")),
            ("rounds", m.get("rounds")), ("tau (tokens / round)", m.get("tau")),
            ("acceptance rate", m.get("acceptance_rate")),
            ("conditional acceptance", m.get("conditional_acceptance")),
            ("mean verified drafts / round", m.get("mean_verified")),
            ("mean budget / request", m.get("mean_budget")),
            ("output tokens", m.get("output_tokens")),
            ("output tokens / s", m.get("output_tokens_per_s")),
            ("tokens / s per request", m.get("tokens_per_s_per_request")),
            ("warm-up (compile) s", m.get("warmup_s")), ("compilations", m.get("compilations")),
            ("compilations after warm-up", m.get("compilations_after_warmup"))]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        if isinstance(value, float):
            value = f"{value:,.3f}"
        elif isinstance(value, list):
            value = " ".join(f"{v:.3f}" for v in value)
        print(f"{name:<{width}}  {value}")


if __name__ == "__main__":
    sys.exit(main())
