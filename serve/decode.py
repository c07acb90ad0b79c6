"""Decode a file of prompts with speculative decoding (or plain target decoding), batched and jitted.

    python -m serve.decode --target DIR --drafter DIR|none --prompts FILE --out FILE [--metrics FILE]
        [--temperature T] [--top-p P] [--top-k K] [--max-new-tokens N] [--slots R] [--max-len S]
        [--scheduler fixed|threshold] [--verify-len L] [--threshold t] [--seed S] [--recompile-guard]

Prompt records (JSONL): {"prompt": "..."} (raw text, verbatim), {"turns": [...]} and
{"conversations": [...]} (chat template), with an optional "id". Results stream to --out as requests
finish. A bad record is reported (file and line) and skipped; the others are still decoded and
written, and the command then exits with status 1.
"""

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

from dspark_jax.errors import DSparkError


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True, help="Hugging Face Qwen3 directory")
    ap.add_argument("--drafter", required=True, help="DeepSpec-format drafter directory, or 'none'")
    ap.add_argument("--prompts", required=True, help="JSONL prompt file")
    ap.add_argument("--out", required=True, help="output JSONL")
    ap.add_argument("--metrics", help="write the summary metrics here as JSON")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0, help="0 = off")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--slots", type=int, default=8, help="concurrent requests (R)")
    ap.add_argument("--max-len", type=int, default=0,
                    help="context positions per slot (default: min(2048, the target's maximum))")
    ap.add_argument("--scheduler", choices=["fixed", "threshold"], default="fixed")
    ap.add_argument("--verify-len", type=int, default=0, help="fixed(ℓ); 0 = the block size")
    ap.add_argument("--threshold", type=float, default=0.5, help="threshold(t) on confidences")
    ap.add_argument("--prefill-buckets", default="", help="comma-separated prompt-length buckets")
    ap.add_argument("--data-parallel", type=int, default=1, help="mesh axis for requests")
    ap.add_argument("--tensor-parallel", type=int, default=1, help="mesh axis for weights/KV heads")
    ap.add_argument("--seed", type=int, default=0)
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
    if args.slots < 1:
        problems.append(f"--slots {args.slots}: must be >= 1")
    if not 0 <= args.threshold <= 1:
        problems.append(f"--threshold {args.threshold}: must be in [0, 1]")
    if args.verify_len < 0:
        problems.append(f"--verify-len {args.verify_len}: must be >= 0")
    if args.data_parallel < 1 or args.tensor_parallel < 1:
        problems.append("--data-parallel and --tensor-parallel must be >= 1")
    if args.max_len < 0:
        problems.append(f"--max-len {args.max_len}: must be >= 1 (or 0 for the default)")
    try:
        args.prefill_buckets = tuple(int(b) for b in args.prefill_buckets.split(",") if b.strip())
        if any(b < 1 for b in args.prefill_buckets):
            raise ValueError
    except ValueError:
        problems.append(f"--prefill-buckets {args.prefill_buckets!r}: expected positive integers "
                        "separated by commas, e.g. 64,256,1024")
    if problems:
        ap.error("; ".join(problems))
    return args


def load_models(args, mesh):
    """(tcfg, target params, dcfg | None, drafter params | None), placed on `mesh`; the drafter
    says which target layers it reads and its mask token."""
    from dspark_jax.formats import deepspec, hf_checkpoint

    if args.drafter.lower() == "none":
        tcfg, tparams = hf_checkpoint.load_target(args.target, mesh=mesh)
        return tcfg, tparams, None, None
    where = Path(args.drafter) / "config.json"
    drafter_cfg = hf_checkpoint.read_json(where)
    taps = drafter_cfg.get("target_layer_ids")
    mask = drafter_cfg.get("mask_token_id")
    if not isinstance(taps, list) or not isinstance(mask, int):
        raise DSparkError(f"{where}: needs target_layer_ids (list) and mask_token_id (int)")
    base = hf_checkpoint.load_target_config(args.target)
    try:  # the drafter's view of the target must fit the target before anything is loaded
        dataclasses.replace(base, target_layer_ids=tuple(taps), mask_token_id=mask)
    except DSparkError as e:
        raise DSparkError(f"{where}: does not fit the target {args.target}: {e}") from None
    tcfg, tparams = hf_checkpoint.load_target(args.target, mesh=mesh, target_layer_ids=taps,
                                              mask_token_id=mask)
    dcfg, dparams = deepspec.load_drafter(args.drafter, tcfg, tparams, mesh=mesh)
    if args.verify_len > dcfg.block_size:
        raise DSparkError(f"--verify-len {args.verify_len} exceeds the drafter's block size "
                          f"{dcfg.block_size}")
    return tcfg, tparams, dcfg, dparams


def read_requests(args, tokenizer, engine):
    """(requests, prompt texts by id, errors): every line is handled on its own."""
    from dspark_jax.decoding.engine import Request
    from dspark_jax.formats.tokenizer import encode_prompt_record, iter_jsonl

    requests, texts, errors, seen = [], {}, [], set()
    path = Path(args.prompts)
    for line_no, obj in iter_jsonl(path):
        where = f"{path}:{line_no}"
        try:
            if isinstance(obj, DSparkError):
                raise obj
            rec = encode_prompt_record(tokenizer, obj, where=where, index=len(requests) + len(errors))
            if rec.id in seen:
                raise DSparkError(f"{where}: duplicate id {rec.id!r}")
            req = Request(id=rec.id, prompt_ids=rec.token_ids, max_new_tokens=args.max_new_tokens,
                          temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                          stop_ids=tuple(tokenizer.stop_token_ids))
            try:
                engine.check_request(req)
            except DSparkError as e:
                raise DSparkError(f"{where}: {e}") from None
        except DSparkError as e:
            errors.append(str(e))
            print(f"error: {e}", file=sys.stderr)
            continue
        seen.add(rec.id)
        texts[rec.id] = rec.prompt_text
        requests.append(req)
    return requests, texts, errors


class Progress:
    """A one-line progress bar on stderr."""

    def __init__(self, total: int):
        self.total, self.done, self.tokens, self.t0 = total, 0, 0, time.perf_counter()

    def update(self, tokens: int):
        self.done += 1
        self.tokens += tokens
        width = 30
        filled = int(width * self.done / max(self.total, 1))
        rate = self.tokens / max(time.perf_counter() - self.t0, 1e-9)
        print(f"\r[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} requests, "
              f"{rate:,.0f} tok/s", end="", file=sys.stderr, flush=True)
        if self.done == self.total:
            print(file=sys.stderr)


def main(argv=None) -> int:
    args = parse_args(argv)
    from dspark_jax.config import MeshConfig
    from dspark_jax.decoding.engine import Engine
    from dspark_jax.decoding.schedulers import SchedulerConfig
    from dspark_jax.formats.tokenizer import load_tokenizer
    from dspark_jax.sharding import make_mesh

    try:
        if not Path(args.prompts).is_file():
            raise DSparkError(f"{args.prompts}: prompt file not found")
        tokenizer = load_tokenizer(args.target)
        mesh = make_mesh(MeshConfig(data=args.data_parallel, fsdp=1, tensor=args.tensor_parallel))
        tcfg, tparams, dcfg, dparams = load_models(args, mesh)
        max_len = args.max_len or min(2048, tcfg.max_position_embeddings)
        engine = Engine(tcfg, tparams, dcfg, dparams, slots=args.slots, max_len=max_len,
                        scheduler=SchedulerConfig(args.scheduler, args.verify_len, args.threshold),
                        prefill_buckets=args.prefill_buckets, seed=args.seed, mesh=mesh)
        requests, texts, errors = read_requests(args, tokenizer, engine)
        mode = "plain target decoding" if dcfg is None else (
            f"speculative, block {dcfg.block_size}, {args.scheduler}"
            + (f"({args.verify_len or dcfg.block_size})" if args.scheduler == "fixed" else f"({args.threshold})"))
        print(f"{len(requests)} requests, {mode}, {args.slots} slots x {max_len} positions; "
              "compiling ...", file=sys.stderr, flush=True)
        warm = engine.warmup()
        print(f"compiled {engine.compilations} programs in {warm:.1f} s", file=sys.stderr, flush=True)
        engine.guard = args.recompile_guard
        progress = Progress(len(requests))
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        with open(args.out, "w", encoding="utf-8") as out:
            def write(res):
                out.write(json.dumps({
                    "id": res.id, "prompt": texts[res.id],
                    "completion": tokenizer.decode(res.token_ids), "token_ids": res.token_ids,
                    "finish_reason": res.finish_reason, "accepted": res.accepted,
                    "verified": res.verified}, ensure_ascii=False) + "\n")
                out.flush()
                progress.update(len(res.token_ids))

            metrics = engine.generate(requests, write) if requests else {}
    except DSparkError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    metrics.update(requests=len(requests), errors=errors, warmup_s=warm,
                   compilations=engine.compilations)
    print_summary(metrics)
    if args.metrics:
        Path(args.metrics).write_text(json.dumps(metrics, indent=2) + "\n")
    return 1 if errors else 0


def print_summary(m: dict) -> None:
    rows = [("requests", m.get("requests")), ("bad records", len(m.get("errors", []))),
            ("rounds", m.get("rounds")), ("tau (tokens / round)", m.get("tau")),
            ("acceptance rate", m.get("acceptance_rate")),
            ("conditional acceptance", m.get("conditional_acceptance")),
            ("mean verified drafts / round", m.get("mean_verified")),
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
