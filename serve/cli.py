"""What the decoding commands share: engine flags and their checks (output paths among them),
loading the pair with its calibration, reading a prompt file into requests line by line."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from dspark_jax import bundled
from dspark_jax.bundled import DEFAULT_DRAFTER, DEFAULT_TARGET
from dspark_jax.errors import DSparkError

SCHEDULERS = ("async", "greedy", "fixed", "threshold")


def add_engine_flags(ap: argparse.ArgumentParser, *, slots: int = 8) -> None:
    """Model, engine-shape and scheduler flags, shared by serve.decode, serve.profile, serve.bench
    and train.calibrate."""
    ap.add_argument("--target", default=DEFAULT_TARGET,
                    help=f"Hugging Face Qwen3 directory, or a bundled target's name (default "
                         f"{DEFAULT_TARGET})")
    ap.add_argument("--slots", type=int, default=slots, help="concurrent requests (R)")
    ap.add_argument("--max-len", type=int, default=0,
                    help="context positions per slot (default: min(2048, the target's maximum))")
    ap.add_argument("--prefill-buckets", default="", help="comma-separated prompt-length buckets")
    ap.add_argument("--data-parallel", type=int, default=1, help="mesh axis for requests")
    ap.add_argument("--tensor-parallel", type=int, default=1, help="mesh axis for weights/KV heads")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "checkpoint"), default="auto",
                    help="compute dtype of both models: auto = float32 on CPU (XLA's bfloat16 "
                         "matmuls there are ~6x slower), the checkpoint's own on accelerators; "
                         "checkpoint = as stored")
    ap.add_argument("--no-compile-cache", action="store_true",
                    help="do not use JAX's persistent compilation cache (user cache directory)")


def add_scheduler_flags(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--scheduler", choices=SCHEDULERS, default="async",
                    help="async (default): bucket from earlier rounds' confidences and the SPS "
                         "profile, filled on the device; greedy: Algorithm 1, synchronous; "
                         "fixed(--verify-len); threshold(--threshold)")
    ap.add_argument("--verify-len", type=int, default=0, help="fixed(ℓ); 0 = the block size")
    ap.add_argument("--threshold", type=float, default=0.5, help="threshold(t) on confidences")
    ap.add_argument("--bucket-fill", action="store_true",
                    help="fixed, threshold, greedy: the verification bucket's padding takes the "
                         "next drafts in survival order instead of idling")
    ap.add_argument("--sts", default="",
                    help="calibration temperatures (sts.json); default: the drafter directory's "
                         "sts.json when present; 'none': raw confidences")
    ap.add_argument("--sps", default="",
                    help="SPS profile (serve.profile); default: a cached start-up profile")


def add_distributed_flags(ap: argparse.ArgumentParser) -> None:
    """The multi-process flags of train.drafter: every process runs the same command, joined by
    jax.distributed into one job whose mesh spans them all."""
    dist = ap.add_argument_group("multi-process jobs (the same command on every process; one mesh "
                                 "over all their devices)")
    dist.add_argument("--distributed", action="store_true",
                      help="join a jax.distributed job detected from the environment (TPU pods, "
                           "SLURM...)")
    dist.add_argument("--coordinator", metavar="HOST:PORT",
                      help="address of process 0 (explicit alternative to detection)")
    dist.add_argument("--num-processes", type=int, help="with --coordinator: processes in the job")
    dist.add_argument("--process-id", type=int, help="with --coordinator: this process, in [0, N)")


def distributed_flag_problems(args) -> list[str]:
    problems = []
    if args.coordinator:
        n, i = args.num_processes, args.process_id
        if n is None or i is None:
            problems.append("--coordinator needs --num-processes and --process-id")
        elif n < 1 or not 0 <= i < n:
            problems.append(f"--process-id {i} --num-processes {n}: need N >= 1 and 0 <= I < N")
    elif args.num_processes is not None or args.process_id is not None:
        problems.append("--num-processes and --process-id go with --coordinator HOST:PORT")
    return problems


def join_job(args) -> None:
    """Joins the jax.distributed job the flags name, if any; before anything touches a device."""
    if args.distributed or args.coordinator:
        from dspark_jax import distributed

        distributed.initialize(args.coordinator, args.num_processes, args.process_id)


def add_drafter_flag(ap: argparse.ArgumentParser, *, none: bool = True) -> None:
    """--drafter: a DeepSpec directory or a bundled name (default: the bundled drafter when the
    target is the bundled one; otherwise it must be given)."""
    ap.add_argument("--drafter", default=None,
                    help="DeepSpec-format drafter directory (DSpark/DFlash, or Eagle3: "
                         "architectures Qwen3Eagle3Model)" + (", 'none' (plain decoding)" if none
                                                                else "")
                    + f", or a bundled drafter's name ({', '.join(bundled.DRAFTERS)}); default "
                      f"{DEFAULT_DRAFTER} with the bundled target")


def resolve_bundled(args) -> list[str]:
    """Bundled names in --target, --drafter and --prompts replaced by their paths (an existing path
    of the same name wins); the drafter's default filled in. Returns the problems."""
    problems = []
    try:
        if getattr(args, "drafter", "") is None:
            if args.target != DEFAULT_TARGET:
                problems.append(f"--drafter is required with --target {args.target} (a DeepSpec "
                                "drafter directory, or 'none')")
                args.drafter = "none"
            else:
                args.drafter = DEFAULT_DRAFTER
        args.target = bundled.resolve_target(args.target)
        if getattr(args, "drafter", None):
            args.drafter = bundled.resolve_drafter(args.drafter)
        prompts = getattr(args, "prompts", None)
        if isinstance(prompts, str):
            args.prompts = bundled.resolve_prompts(prompts)
        elif isinstance(prompts, list):
            args.prompts = [bundled.resolve_prompts(p) for p in prompts]
    except DSparkError as e:
        problems.append(str(e))
    return problems


def engine_flag_problems(args) -> list[str]:
    """Flag errors (one line each), found before anything is loaded; bundled names resolved."""
    problems = resolve_bundled(args)
    if args.slots < 1:
        problems.append(f"--slots {args.slots}: must be >= 1")
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
    if hasattr(args, "threshold") and not 0 <= args.threshold <= 1:
        problems.append(f"--threshold {args.threshold}: must be in [0, 1]")
    if getattr(args, "verify_len", 0) < 0:
        problems.append(f"--verify-len {args.verify_len}: must be >= 0")
    if getattr(args, "bucket_fill", False) and args.scheduler == "async":
        problems.append("--bucket-fill: async fills its bucket already; it applies to fixed, "
                        "threshold and greedy")
    return problems


def setup_jax(args) -> None:
    """The persistent compilation cache, unless --no-compile-cache."""
    if not args.no_compile_cache:
        from dspark_jax import compile_cache

        compile_cache.enable()


def make_mesh(args):
    """The (data, 1, tensor) mesh of the flags; in a multi-process job it must take every device
    of every process (each process runs every program)."""
    import jax

    from dspark_jax.config import MeshConfig
    from dspark_jax.sharding import make_mesh as build

    D, T = args.data_parallel, args.tensor_parallel
    if jax.process_count() > 1 and D * T != jax.device_count():
        raise DSparkError(f"--data-parallel {D} x --tensor-parallel {T} = {D * T} devices, but the "
                          f"job has {jax.device_count()} over {jax.process_count()} processes: a mesh "
                          "spanning processes must use every device")
    return build(MeshConfig(data=D, fsdp=1, tensor=T))


def load_models(args, mesh):
    """(tcfg, target params, dcfg | None, drafter params | None, calibration temperatures | None,
    where the calibration came from). The drafter is DSpark/DFlash or Eagle3, as its config.json
    says (`deepspec.load_pair`)."""
    from dspark_jax.decoding.calibration import load_sts
    from dspark_jax.formats.deepspec import load_pair

    drafter = None if args.drafter.lower() == "none" else args.drafter
    tcfg, tparams, dcfg, dparams = load_pair(args.target, drafter, mesh)
    tcfg, tparams, dcfg, dparams = cast_models(compute_dtype(getattr(args, "dtype", "checkpoint"),
                                                             tcfg.dtype), tcfg, tparams, dcfg, dparams)
    if dcfg is None:
        return tcfg, tparams, None, None, None, ""
    gamma = dcfg.proposal_length  # DSpark: the block size; Eagle3: the chain's ttt_length
    if getattr(args, "verify_len", 0) > gamma:
        raise DSparkError(f"--verify-len {args.verify_len} exceeds the drafter's "
                          f"{'block size' if dcfg.kind == 'dspark' else 'chain length'} {gamma}")
    sts_arg = getattr(args, "sts", "none")
    if sts_arg.lower() == "none":
        return tcfg, tparams, dcfg, dparams, None, ""
    path = Path(sts_arg) if sts_arg else Path(drafter) / "sts.json"
    if not sts_arg and not path.is_file():
        return tcfg, tparams, dcfg, dparams, None, ""
    return tcfg, tparams, dcfg, dparams, load_sts(path, gamma), str(path)


def compute_dtype(flag: str, stored: str) -> str:
    """The dtype `--dtype` asks for, given the checkpoint's."""
    import jax

    if flag == "checkpoint":
        return stored
    if flag == "auto":
        return "float32" if jax.default_backend() == "cpu" else stored
    return flag


def cast_models(dtype: str, tcfg, tparams, dcfg, dparams):
    """Both models' floating-point weights and compute dtype in `dtype` (a no-op when they are)."""
    import dataclasses

    import jax
    import jax.numpy as jnp

    def cast(tree):  # norms stay float32, as the loaders read them
        return jax.tree_util.tree_map_with_path(
            lambda p, x: x if "norm" in jax.tree_util.keystr(p)
            or not jnp.issubdtype(x.dtype, jnp.floating) else x.astype(dtype), tree)

    if tcfg.dtype != dtype:
        tcfg, tparams = dataclasses.replace(tcfg, dtype=dtype), cast(tparams)
    if dcfg is not None and dcfg.dtype != dtype:
        dcfg, dparams = dataclasses.replace(dcfg, dtype=dtype), cast(dparams)
    return tcfg, tparams, dcfg, dparams


def scheduler_config(args):
    from dspark_jax.decoding.schedulers import SchedulerConfig

    return SchedulerConfig(args.scheduler, args.verify_len, args.threshold, args.bucket_fill)


def read_requests(path: Path, tokenizer, check, *, max_new_tokens: int, temperature: float = 0.0,
                  top_p: float = 1.0, top_k: int = 0, enable_thinking: bool = False, limit: int = 0):
    """(requests, prompt texts by id, errors) at these settings for every record (a record's own
    sampling keys are not read): `read_prompt_file` without per-record settings."""
    from dspark_jax.formats.generation_config import SamplingSettings

    settings = SamplingSettings(temperature=temperature, top_p=top_p, top_k=top_k,
                                max_new_tokens=max_new_tokens)
    requests, prompts, errors = read_prompt_file(path, tokenizer, check, settings, per_record=False,
                                                 enable_thinking=enable_thinking, limit=limit)
    return requests, {rid: text for rid, (text, _) in prompts.items()}, errors


def read_prompt_file(path: Path, tokenizer, check, defaults, *, per_record: bool = True,
                     enable_thinking: bool = False, quiet: bool = False, limit: int = 0):
    """(requests, {id: (prompt text, SamplingSettings)}, errors): every line is handled on its own;
    a bad one is reported on stderr with its file and line and skipped. `defaults`: the
    SamplingSettings of a record that names none of its own (with `per_record`, a record's
    temperature, top_p, top_k, max_new_tokens, stop and seed override them). `check(request)`
    raises for a request the engine cannot serve. Stop ids: the tokenizer's. `enable_thinking` goes
    to the chat template (off by default, as DeepSpec's evaluator). `quiet`: bad records are only
    returned, not printed (the processes of a job other than the first). `limit` > 0: reading stops
    at that many requests (the records after them are not read, so not reported either)."""
    from dspark_jax.decoding.engine import Request
    from dspark_jax.formats.records import encode_prompt_record, iter_jsonl

    requests, prompts, errors = [], {}, []
    path = Path(path)
    for line_no, obj in iter_jsonl(path):
        if limit and len(requests) >= limit:
            break
        where = f"{path}:{line_no}"
        try:
            if isinstance(obj, DSparkError):
                raise obj
            rec = encode_prompt_record(tokenizer, obj, where=where, index=len(requests) + len(errors),
                                       enable_thinking=enable_thinking)
            if rec.id in prompts:
                raise DSparkError(f"{where}: duplicate id {rec.id!r}")
            settings = defaults.with_record(obj, where) if per_record else defaults
            req = Request(id=rec.id, prompt_ids=rec.token_ids,
                          max_new_tokens=settings.max_new_tokens,
                          temperature=settings.temperature, top_p=settings.top_p,
                          top_k=settings.top_k, stop_ids=tuple(tokenizer.stop_token_ids),
                          seed=settings.seed)
            try:
                check(req)
            except DSparkError as e:
                raise DSparkError(f"{where}: {e}") from None
        except DSparkError as e:
            errors.append(str(e))
            if not quiet:
                print(f"error: {e}", file=sys.stderr)
            continue
        prompts[rec.id] = (rec.prompt_text, settings)
        requests.append(req)
    return requests, prompts, errors


def output_problems(outputs: dict[str, str | None], inputs: dict[str, str | None]) -> list[str]:
    """Flag errors of output paths ({flag: path}), found before anything loads: each must name a
    file (not a directory) in an existing writable directory, and none may be an input file or
    another output."""
    problems, seen = [], {}
    for flag, value in outputs.items():
        if not value:
            continue
        path = Path(value)
        parent = path.parent
        if path.is_dir():
            problems.append(f"{flag} {value}: is a directory; expected a file to write")
        elif not parent.is_dir():
            problems.append(f"{flag} {value}: directory {parent} does not exist")
        elif not os.access(parent, os.W_OK | os.X_OK):
            problems.append(f"{flag} {value}: directory {parent} is not writable")
        for other, named in [*inputs.items(), *seen.items()]:
            if named and _same_file(path, Path(named)):
                what = "the input" if other in inputs else "the output"
                problems.append(f"{flag} {value}: is {what} {other} {named}; refusing to "
                                "overwrite it")
        seen[flag] = value
    return problems


def _same_file(a: Path, b: Path) -> bool:
    if a.exists() and b.exists():
        return os.path.samefile(a, b)
    return a.resolve() == b.resolve()
