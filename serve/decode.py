"""Decode a file of prompts with speculative decoding (or plain target decoding), batched and jitted.

    python -m serve.decode        # the bundled demo: target tiny, drafter tiny-dspark, sample prompts

    python -m serve.decode --target DIR --drafter DIR|none --prompts FILE [--out FILE] [--metrics FILE]
        [--temperature T] [--top-p P] [--top-k K] [--max-new-tokens N] [--stop STR ...]
        [--logprobs N] [--slots R] [--max-len S] [--scheduler async|greedy|fixed|threshold]
        [--verify-len L] [--threshold t] [--bucket-fill] [--sts FILE|none] [--sps FILE] [--seed S]
        [--enable-thinking] [--recompile-guard]
        [--distributed | --coordinator HOST:PORT --num-processes N --process-id I]

Prompt records (JSONL): {"prompt": "..."} (raw text, verbatim), {"turns": [...]} and
{"conversations": [...]} (chat template), with an optional "id". A record may carry its own
"temperature", "top_p", "top_k", "max_new_tokens", "stop" (a string or a list) and "seed" (its
random stream); the flags are the defaults, and where a sampling flag is not given, the target's
generation_config.json (temperature, top_p, top_k; "do_sample": false means greedy), else greedy.
Decoding stops at the target's stop ids (eos_token_id of generation_config.json, else config.json,
plus tokenizer_config.json's eos_token) and at stop strings (--stop, or the record's "stop"): the
completion ends just before the first one, which is not included, and token_ids are cut to the
tokens that produce it ("accepted"/"verified" still count the rounds as run). Each output line
carries the settings it was decoded with ("sampling"; its "seed" is the request's stream, which
reproduces the output under the same --seed); with --logprobs N, every output token's target
logprob (raw logits at T = 1, before temperature and filters) in "logprobs" and, for N > 0, its
top N as [[id, logprob], ...] in "top_logprobs".

A bad record is reported (file and line) and skipped; the others are still decoded and written,
and the command then exits with status 1 (also when there is nothing to decode). Output paths are
checked before anything loads. Results stream to OUT.partial as requests finish (whole lines,
flushed each), renamed to OUT at the end; an interrupted run (an error, Ctrl-C, SIGTERM) leaves
the .partial file with every result finished so far.

The default scheduler, async, needs the round times of this machine (an SPS profile): --sps names
one written by `python -m serve.profile`; without it a cached profile for this model, slot count,
context and device is used, else one is measured at start-up (seconds) and cached. The drafter's
confidences are calibrated with its directory's sts.json (`python -m train.calibrate`) when there
is one. With a fixed seed, a request's sampled output under plain decoding or fixed(ℓ) does not
depend on the slot count or its batch-mates; under the load-aware schedulers its distribution does
not, but which drafts get verified does, and so does the realisation.

On several hosts every process runs the same command (--distributed, or --coordinator with
--num-processes and --process-id, as train.drafter); --data-parallel x --tensor-parallel must then
cover every device of the job. Each process reads the prompts and the models itself and runs the
same host loop; the scheduler's host decisions are process 0's (`dspark_jax.distributed`), and
only process 0 prints and writes --out and --metrics.
"""

import argparse
import contextlib
import functools
import json
import os
import re
import signal
import sys
import textwrap
from pathlib import Path

from tqdm import tqdm

from dspark_jax.errors import DSparkError
from serve import cli

MAX_LOGPROBS = 20


class Terminated(BaseException):
    """SIGTERM, raised like Ctrl-C's KeyboardInterrupt so that the run winds down the same way."""


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cli.add_engine_flags(ap)
    cli.add_drafter_flag(ap)
    ap.add_argument("--prompts", default="samples",
                    help="JSONL prompt file, or a bundled prompt set (samples, math, code, chat; "
                         "default samples)")
    ap.add_argument("--out", help="output JSONL (written as OUT.partial, then renamed); without "
                                  "it, completions are printed as they finish")
    ap.add_argument("--metrics", help="write the summary metrics here as JSON")
    ap.add_argument("--temperature", type=float, default=None,
                    help="0 = greedy (default: generation_config.json's, else 0)")
    ap.add_argument("--top-p", type=float, default=None,
                    help="default: generation_config.json's, else 1")
    ap.add_argument("--top-k", type=int, default=None,
                    help="0 = off (default: generation_config.json's, else 0)")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--enable-thinking", action="store_true",
                    help="render chat prompts with thinking on (default off, as DeepSpec's evaluator: "
                         "Qwen3's generation prompt then ends with an empty think block, Gemma4's "
                         "with the empty thought channel)")
    ap.add_argument("--stop", action="append", default=[], metavar="STR",
                    help="stop string (repeatable); the output ends before it")
    ap.add_argument("--logprobs", type=int, default=None, metavar="N",
                    help=f"report each token's target logprob and its top N (0..{MAX_LOGPROBS})")
    cli.add_scheduler_flags(ap)
    ap.add_argument("--recompile-guard", action="store_true",
                    help="fail if anything compiles after warm-up")
    cli.add_distributed_flags(ap)
    args = ap.parse_args(argv)
    problems = []
    if args.temperature is not None and not args.temperature >= 0:
        problems.append(f"--temperature {args.temperature}: must be >= 0")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        problems.append(f"--top-p {args.top_p}: must be in (0, 1]")
    if args.top_k is not None and args.top_k < 0:
        problems.append(f"--top-k {args.top_k}: must be >= 0")
    if args.max_new_tokens < 1:
        problems.append(f"--max-new-tokens {args.max_new_tokens}: must be >= 1")
    if "" in args.stop:
        problems.append("--stop '': a stop string must not be empty")
    if args.logprobs is not None and not 0 <= args.logprobs <= MAX_LOGPROBS:
        problems.append(f"--logprobs {args.logprobs}: must be in [0, {MAX_LOGPROBS}]")
    problems += cli.engine_flag_problems(args)
    problems += cli.distributed_flag_problems(args)
    inputs = {"--prompts": args.prompts, "--sps": args.sps,
              "--sts": args.sts if args.sts.lower() != "none" else ""}
    problems += cli.output_problems({"--out": args.out, "--metrics": args.metrics}, inputs)
    if problems:
        ap.error("; ".join(problems))
    return args


def default_settings(args):
    """The settings of a record that names none of its own: the flags, else the target's
    generation_config.json, else greedy."""
    from dspark_jax.formats.generation_config import SamplingSettings, sampling_defaults

    given = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k}
    checkpoint = sampling_defaults(args.target)
    return SamplingSettings(**{k: checkpoint[k] if v is None else v for k, v in given.items()},
                            max_new_tokens=args.max_new_tokens, stop=tuple(args.stop))


def main(argv=None) -> int:
    args = parse_args(argv)
    cli.join_job(args)  # before anything touches a device
    import jax

    from dspark_jax import distributed
    from dspark_jax.decoding.engine import Engine
    from dspark_jax.formats.records import iter_jsonl
    from dspark_jax.formats.tokenizer import load_tokenizer

    if jax.process_count() > 1:  # jax.distributed's preemption notifier would swallow it
        signal.signal(signal.SIGTERM, _terminate)
    lead = distributed.is_lead()
    say = functools.partial(print, file=sys.stderr, flush=True) if lead else lambda *a, **k: None
    try:
        if not Path(args.prompts).is_file():
            raise DSparkError(f"{args.prompts}: prompt file not found")
        if next(iter_jsonl(args.prompts), None) is None:
            print(f"error: {args.prompts}: no prompt records (the file is empty); nothing to decode",
                  file=sys.stderr)
            return 1
        defaults = default_settings(args)
        tokenizer = load_tokenizer(args.target)
        cli.setup_jax(args)
        mesh = cli.make_mesh(args)
        tcfg, tparams, dcfg, dparams, sts, sts_from = cli.load_models(args, mesh)
        max_len = args.max_len or min(2048, tcfg.max_position_embeddings)
        scheduler = cli.scheduler_config(args)
        engine = Engine(tcfg, tparams, dcfg, dparams, slots=args.slots, max_len=max_len,
                        scheduler=scheduler, prefill_buckets=args.prefill_buckets, seed=args.seed,
                        mesh=mesh, sts=sts, sps=args.sps or None,
                        logprobs=0 if args.logprobs is None else max(args.logprobs, 1))
        requests, prompts, errors = cli.read_prompt_file(Path(args.prompts), tokenizer,
                                                         engine.check_request, defaults,
                                                         enable_thinking=args.enable_thinking,
                                                         quiet=not lead)
        if not requests:
            print(f"error: {args.prompts}: no record could be decoded ({len(errors)} bad)",
                  file=sys.stderr)
            return 1
        gamma = dcfg.proposal_length if dcfg else 0
        drafts = f"block {gamma}" if dcfg is None or dcfg.kind == "dspark" else f"Eagle3 chain {gamma}"
        mode = "plain target decoding" if dcfg is None else (
            f"speculative, {drafts}, {scheduler.describe(gamma)}"
            + (f", calibrated by {sts_from}" if sts_from else ""))
        if jax.process_count() > 1:
            say(f"{jax.process_count()} processes, mesh {dict(mesh.shape)} over "
                f"{jax.device_count()} {jax.devices()[0].platform} devices")
        say(f"{len(requests)} requests, {mode}, {args.slots} slots x {max_len} positions; "
            f"sampling by default: temperature {defaults.temperature:g}, top-p "
            f"{defaults.top_p:g}, top-k {defaults.top_k}; compiling ...")
        warm = engine.warmup()
        say(f"compiled {engine.compilations} programs in {warm:.1f} s"
            + (f"; SPS profile: {engine.profile_source}" if engine.profile else ""))
        engine.guard = args.recompile_guard
        metrics = decode(args, engine, tokenizer, requests, prompts, lead=lead)
    except DSparkError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, Terminated) as e:
        print(f"interrupted ({'SIGTERM' if isinstance(e, Terminated) else 'Ctrl-C'})",
              file=sys.stderr)
        return 143 if isinstance(e, Terminated) else 130
    metrics.update(requests=len(requests), errors=errors, warmup_s=warm,
                   compilations=engine.compilations, calibration=sts_from or None,
                   sps_profile=engine.profile_source or None,
                   sampling_defaults=defaults.to_json())
    if not lead:
        return 1 if errors else 0
    print_summary(metrics)
    if args.metrics:
        _write_atomically(Path(args.metrics), json.dumps(metrics, indent=2) + "\n")
    return 1 if errors else 0


def decode(args, engine, tokenizer, requests, prompts, *, lead: bool = True) -> dict:
    """Runs the engine, streaming one line per result to OUT.partial, renamed to OUT when every
    request is done (without --out: each completion printed as it finishes); returns the metrics.
    On an interruption the .partial file stays. Not `lead` (a job's other processes): the same
    run, nothing written or shown."""
    from dspark_jax.decoding.stop_strings import cut_at_stop, find_stop

    by_id = {req.id: req for req in requests}
    partial = Path(f"{args.out}.partial") if args.out and lead else None
    written = [0, 0]  # results, tokens
    signal.signal(signal.SIGTERM, _terminate)

    def should_stop(res):
        stops = prompts[res.id][1].stop
        return bool(stops) and find_stop(tokenizer.decode(res.token_ids), stops) is not None

    try:
        with (open(partial, "w", encoding="utf-8") if partial else contextlib.nullcontext()) as out, \
                tqdm(total=len(requests), unit="req", file=sys.stderr, mininterval=0.5,
                     disable=not lead) as bar:

            def write(res):
                if not lead:
                    return
                text, settings = prompts[res.id]
                ids, completion, stopped = cut_at_stop(res.token_ids, tokenizer.decode,
                                                       settings.stop)
                line = {"id": res.id, "prompt": text, "completion": completion, "token_ids": ids,
                        "finish_reason": "stop" if stopped else res.finish_reason,
                        "accepted": res.accepted, "verified": res.verified,
                        "sampling": {**settings.to_json(), "seed": by_id[res.id].stream}}
                if args.logprobs is not None:
                    line["logprobs"] = res.logprobs[:len(ids)]
                    if args.logprobs:
                        line["top_logprobs"] = [[list(pair) for pair in top[:args.logprobs]]
                                                for top in res.top_logprobs[:len(ids)]]
                if out is None:
                    bar.write(shown(line), file=sys.stdout)
                else:
                    out.write(json.dumps(line, ensure_ascii=False) + "\n")
                    out.flush()
                written[0] += 1
                written[1] += len(ids)
                bar.set_postfix_str(f"{written[1] / max(bar.format_dict['elapsed'], 1e-9):,.0f} "
                                    "tok/s", refresh=False)
                bar.update(1)

            metrics = engine.generate(requests, write, should_stop=should_stop)
    except BaseException:
        if partial:
            print(f"{written[0]} of {len(requests)} results were written to {partial}; {args.out} "
                  "was not written", file=sys.stderr)
        raise
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if partial:
        os.replace(partial, args.out)
    return metrics


def shown(line: dict) -> str:
    """A finished completion as the terminal shows it: a header, the prompt without the chat
    template's markup, the completion."""
    prompt = re.sub(r"<\|[^|<>]*\|>", "", line["prompt"]).strip()
    rounds = len(line["verified"])
    head = (f"── {line['id']} · {len(line['token_ids'])} tokens in {rounds} rounds · "
            f"{line['finish_reason']} ")
    return (f"{head:─<100}\n" + textwrap.indent(prompt, "  > ") + "\n"
            + textwrap.indent(line["completion"].strip() or "(empty)", "  ") + "\n")


def _terminate(signum, frame):
    raise Terminated()


def _write_atomically(path: Path, text: str) -> None:
    tmp = Path(f"{path}.partial")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


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
