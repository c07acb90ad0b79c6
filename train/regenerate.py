"""Regenerate a training set's assistant turns with the target itself (self-distillation data).

    python -m train.regenerate --target DIR --drafter DIR|none --data FILE --out FILE
        [--temperature 0.7] [--top-p 0.8] [--top-k 20] [--max-new-tokens 4096] [--limit N]
        [--num-processes N --process-id I] [--slots R] [--max-len S] [--scheduler ...] [--seed S]

Reads JSONL records ({"conversations": [...]} with role/content or ShareGPT from/value,
{"turns": [...]} whose turns are all user turns, {"prompt": "..."}; optional "id", else the
record's 0-based index among the file's records) and writes one training conversation per record,
{"id": ..., "conversations": [{"role", "content"}, ...]}: each user turn followed by the target's
own answer given the conversation so far (system messages kept, the dataset's answers dropped),
rendered with the target's chat template, thinking off. `python -m train.drafter` trains on the
output directly (train.data_file=OUT). The drafter only makes it faster: speculative decoding is
lossless. The sampling defaults are the released recipe's.

Resumable: each finished record is appended to OUT as one flushed line; rerun the same command
after an interruption and the records already in OUT are skipped (a partial last line is cut off).
Throughput and tau are printed at the end and written to OUT's stem + .stats.json.

Several accelerators: run one independent process per accelerator (the recipe's way; no
jax.distributed), e.g. with two GPUs

    CUDA_VISIBLE_DEVICES=0 python -m train.regenerate ... --out out.jsonl --num-processes 2 --process-id 0 &
    CUDA_VISIBLE_DEVICES=1 python -m train.regenerate ... --out out.jsonl --num-processes 2 --process-id 1

Process I takes the records whose index % N == I and writes out.I-of-N.jsonl (and
out.I-of-N.stats.json); join them with `cat out.*-of-2.jsonl > out.jsonl`.

The context (--max-len) defaults to min(8192, the target's maximum) here: a turn whose prompt
does not fit is reported and its record skipped (tried again on a rerun; the exit status stays 0).
A bad record is reported with its file and line and skipped; the command then exits with status 1.
With a fixed --seed a request's random stream depends only on its record id and turn, so under
plain decoding or --scheduler fixed a resumed run samples what an uninterrupted one would.
"""

import argparse
import json
import sys
from pathlib import Path

from tqdm import tqdm

from dspark_jax.errors import DSparkError
from serve import cli

DEFAULT_CONTEXT = 8192


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cli.add_engine_flags(ap)
    for action in ap._actions:
        if action.dest == "max_len":
            action.help = f"context positions per slot (default: min({DEFAULT_CONTEXT}, the target's maximum))"
    ap.add_argument("--drafter", required=True, help="DeepSpec-format drafter directory, or 'none'")
    ap.add_argument("--data", required=True, help="JSONL prompts or conversations")
    ap.add_argument("--out", required=True, help="output JSONL (appended to: resumable)")
    ap.add_argument("--temperature", type=float, default=0.7, help="0 = greedy")
    ap.add_argument("--top-p", type=float, default=0.8)
    ap.add_argument("--top-k", type=int, default=20, help="0 = off")
    ap.add_argument("--max-new-tokens", type=int, default=4096, help="per turn")
    ap.add_argument("--limit", type=int, help="only the first N records of the file")
    ap.add_argument("--num-processes", type=int, default=1, help="independent processes sharing the file")
    ap.add_argument("--process-id", type=int, default=0, help="this process, in [0, N)")
    cli.add_scheduler_flags(ap)
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
    if args.limit is not None and args.limit < 1:
        problems.append(f"--limit {args.limit}: must be >= 1")
    if args.num_processes < 1:
        problems.append(f"--num-processes {args.num_processes}: must be >= 1")
    elif not 0 <= args.process_id < args.num_processes:
        problems.append(f"--process-id {args.process_id}: must be in [0, {args.num_processes})")
    problems += cli.engine_flag_problems(args)
    if problems:
        ap.error("; ".join(problems))
    return args


def check_paths(args) -> Path:
    """This process's output file, once the inputs exist and the output can be written."""
    from dspark_jax.decoding.regenerate import shard_path

    target, data = Path(args.target), Path(args.data)
    out = shard_path(args.out, args.process_id, args.num_processes)
    if not (target / "config.json").is_file():
        raise DSparkError(f"--target {target}: no config.json there (expected a Hugging Face Qwen3 or Gemma4 directory)")
    if args.drafter.lower() != "none" and not (Path(args.drafter) / "config.json").is_file():
        raise DSparkError(f"--drafter {args.drafter}: no config.json there (expected a DeepSpec "
                          "drafter directory, or 'none')")
    if not data.is_file():
        raise DSparkError(f"--data {data}: file not found")
    if out.resolve() == data.resolve():
        raise DSparkError(f"--out {out} is the input file --data {data}: choose another output")
    if not out.parent.is_dir():
        raise DSparkError(f"--out {out}: directory {out.parent} does not exist")
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        out = check_paths(args)
    except DSparkError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from dspark_jax.decoding.engine import Engine
    from dspark_jax.decoding.regenerate import Sampling, regenerate_file, stats_path
    from dspark_jax.formats.tokenizer import load_tokenizer

    bar = None
    try:
        tokenizer = load_tokenizer(args.target)
        cli.setup_jax(args)
        mesh = cli.make_mesh(args)
        tcfg, tparams, dcfg, dparams, sts, sts_from = cli.load_models(args, mesh)
        max_len = args.max_len or min(DEFAULT_CONTEXT, tcfg.max_position_embeddings)
        scheduler = cli.scheduler_config(args)
        engine = Engine(tcfg, tparams, dcfg, dparams, slots=args.slots, max_len=max_len,
                        scheduler=scheduler, prefill_buckets=args.prefill_buckets, seed=args.seed,
                        mesh=mesh, sts=sts, sps=args.sps or None)
        mode = "plain target decoding" if dcfg is None else (
            f"speculative, block {dcfg.proposal_length}, {scheduler.describe(dcfg.proposal_length)}"
            + (f", calibrated by {sts_from}" if sts_from else ""))
        print(f"{mode}, {args.slots} slots x {max_len} positions; compiling ...", file=sys.stderr,
              flush=True)
        warm = engine.warmup()
        print(f"compiled {engine.compilations} programs in {warm:.1f} s"
              + (f"; SPS profile: {engine.profile_source}" if engine.profile else ""),
              file=sys.stderr, flush=True)
        sampling = Sampling(args.temperature, args.top_p, args.top_k, args.max_new_tokens)
        tokens = [0]

        def start(report):
            nonlocal bar
            print(f"{report.records} records for process {args.process_id} of {args.num_processes}"
                  f", {report.resumed} already in {out}; writing to {out}", file=sys.stderr, flush=True)
            bar = tqdm(total=report.records - report.resumed, unit="rec", file=sys.stderr,
                       mininterval=0.5)

        def progress(r):
            tokens[0] += sum(r.tokens)
            bar.set_postfix_str(f"{tokens[0]:,} tok, "
                                f"{tokens[0] / max(bar.format_dict['elapsed'], 1e-9):,.0f} tok/s",
                                refresh=False)
            bar.update(1)

        report = regenerate_file(engine, tokenizer, args.data, out, sampling=sampling,
                                 process_id=args.process_id, num_processes=args.num_processes,
                                 limit=args.limit, on_start=start, on_record=progress,
                                 on_error=lambda message: (bar.write if bar else print)(
                                     f"error: {message}", file=sys.stderr))
    except DSparkError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        if bar is not None:
            bar.close()
    stats = {**report.summary(), "warmup_s": warm, "out": str(out), "data": str(args.data),
             "process_id": args.process_id, "num_processes": args.num_processes}
    stats_path(out).write_text(json.dumps(stats, indent=2) + "\n")
    print_summary(stats)
    return 1 if report.errors else 0


def print_summary(s: dict) -> None:
    rows = [("records", s["records"]), ("written now", s["done"]),
            ("already written (resumed)", s["resumed"]),
            ("skipped: prompt too long", s["skipped_too_long"]), ("bad records", s["bad_records"]),
            ("turns", s["turns"]), ("turns cut by budget/context", s["truncated_turns"]),
            ("output tokens", s["output_tokens"]), ("output tokens / s", s["output_tokens_per_s"]),
            ("tau (tokens / round)", s["tau"]), ("warm-up (compile) s", s["warmup_s"])]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value:,.3f}" if isinstance(value, float) else f"{name:<{width}}  {value}")


if __name__ == "__main__":
    sys.exit(main())
