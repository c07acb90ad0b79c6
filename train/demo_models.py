"""Rebuild the demo models end to end: the target on the built-in corpus, its own answers to the
corpus's questions, drafters trained on those answers with identical data and budget, each
exported in DeepSpec format and calibrated.

    python -m train.demo_models --out runs/demo [--target-steps 420] [--drafter-steps 800]
        [--drafters dspark=dspark-demo,dflash=dflash-demo,dspark-b15=dspark-demo-b15]
        [--target-preset demo] [--drafter-set KEY=VALUE ...] [--regenerate-limit N] [--seed 0]

Stages, each skipped when its output is already there (rerun the command to resume):
  1. OUT/target, OUT/data      python -m train.target (corpus, tokenizer, pretraining)
  2. OUT/data/regenerated.jsonl  python -m train.regenerate with the target alone (the recipe's
                               sampling: T 0.7, top-p 0.8, top-k 20), resumable by record
  3. OUT/drafters/NAME         for each drafter: train.drafter on the regenerated data for
                               --drafter-steps steps (OUT/runs/NAME, orbax, resumable), exported in
                               bfloat16 DeepSpec format
  4. OUT/drafters/NAME/sts.json  train.calibrate on the held-out prompts of every domain, T = 1,
                               --calibrate-samples samples of each (drafters with a confidence head)
Every stage prints what it runs; OUT/demo_models.json records the commands, times and step
counts.
"""

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

from dspark_jax.errors import DSparkError

DEFAULT_DRAFTERS = "dspark=dspark-demo,dflash=dflash-demo,dspark-b15=dspark-demo-b15"


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="python -m train.demo_models", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--target-preset", default="demo")
    ap.add_argument("--target-steps", type=int, default=420)
    ap.add_argument("--target-max-length", type=int, default=384)
    ap.add_argument("--math-items", type=int, default=3000)
    ap.add_argument("--drafters", default=DEFAULT_DRAFTERS, help="NAME=PRESET,... (configs/)")
    ap.add_argument("--drafter-steps", type=int, default=800)
    ap.add_argument("--drafter-set", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override for every drafter (repeatable), e.g. "
                         "train.global_batch_size=16")
    ap.add_argument("--regenerate-limit", type=int, default=0, help="only the first N records")
    ap.add_argument("--regenerate-max-new-tokens", type=int, default=384)
    ap.add_argument("--regenerate-slots", type=int, default=32)
    ap.add_argument("--regenerate-max-len", type=int, default=1024)
    ap.add_argument("--calibrate-max-new-tokens", type=int, default=128)
    ap.add_argument("--calibrate-slots", type=int, default=16)
    ap.add_argument("--calibrate-samples", type=int, default=4,
                    help="samples per prompt (train.calibrate --samples): the held-out prompts "
                         "are few, and 4 samples each give the fit 4x the rounds")
    ap.add_argument("--calibrate-max-len", type=int, default=0,
                    help="the calibration engine's context (0: the target's, at most 2048)")
    ap.add_argument("--calibrate-prefill-buckets", default="",
                    help="its prompt-length buckets (default: powers of two up to the context)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    problems = []
    try:
        args.drafters = dict(item.split("=", 1) for item in args.drafters.split(",") if item)
    except ValueError:
        problems.append(f"--drafters {args.drafters!r}: expected NAME=PRESET,...")
        args.drafters = {}
    if not args.drafters and not problems:
        problems.append("--drafters: name at least one NAME=PRESET")
    for name in ("target_steps", "drafter_steps", "math_items", "target_max_length", "calibrate_samples"):
        if getattr(args, name) < 1:
            problems.append(f"--{name.replace('_', '-')} {getattr(args, name)}: must be >= 1")
    if problems:
        ap.error("; ".join(problems))
    return args


def _stage(log: list, what: str, fn, *args) -> None:
    print(f"== {what}", flush=True)
    t = time.perf_counter()
    fn(*args)
    log.append({"stage": what, "seconds": round(time.perf_counter() - t, 1)})


def _run_cli(module, argv: list[str]) -> None:
    print("   python -m " + module.__name__ + " " + shlex.join(argv), flush=True)
    rc = module.main(argv)
    if rc not in (0, None):
        raise DSparkError(f"python -m {module.__name__} exited with status {rc}")


def train_drafter(preset: str, target: Path, data: Path, workdir: Path, export: Path, steps: int,
                  seed: int, dtype: str | None = None, overrides: tuple[str, ...] = ()) -> dict:
    """train.drafter with `preset` on `data` for `steps` steps (orbax checkpoints in `workdir`, so a
    rerun resumes), then the last checkpoint exported to `export` in DeepSpec format (`dtype`:
    the export's, default the preset's). Returns the training summary."""
    from dspark_jax.config import load_config, preset_path
    from dspark_jax.formats import deepspec
    from dspark_jax.training import trainer
    from train.drafter import FORMATS

    cfg = load_config(preset_path(preset), [
        f"train.target_dir={target}", f"train.data_file={data}", f"train.workdir={workdir}",
        f"train.max_steps={steps}", "train.checkpoint_every=100000", f"train.seed={seed}",
        "mesh.data=1", *overrides])
    print(f"   train.drafter --config {preset} (workdir {workdir}, {steps} steps)", flush=True)
    every = max(cfg.train.log_every, steps // 10)
    fmt = FORMATS[cfg.drafter.kind]
    summary = trainer.run(cfg, on_step=lambda s: print(f"   step {s.step} {fmt(s.metrics)}", flush=True)
                          if s.step % every < cfg.train.log_every else None)
    cfg, params, step = trainer.load_drafter_params(workdir)
    _, target_params = trainer.load_target_for(cfg, None)
    deepspec.save_any(params, cfg.target, cfg.drafter, target_params, export, dtype=dtype)
    print(f"   exported step {step} to {export}; last {fmt(summary['last_metrics'])}", flush=True)
    return {**summary, "step": step}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    from train import calibrate, regenerate
    from train import target as train_target

    out = Path(args.out)
    target, data = out / "target", out / "data"
    regenerated = data / "regenerated.jsonl"
    log: list[dict] = []
    try:
        if not (target / "model.safetensors").exists():
            _stage(log, "target", _run_cli, train_target, [
                "--out", str(out), "--preset", args.target_preset, "--steps", str(args.target_steps),
                "--max-length", str(args.target_max_length), "--math-items", str(args.math_items),
                "--seed", str(args.seed)])
        regen = ["--target", str(target), "--drafter", "none", "--data", str(data / "train.jsonl"),
                 "--out", str(regenerated), "--max-new-tokens", str(args.regenerate_max_new_tokens),
                 "--slots", str(args.regenerate_slots), "--max-len", str(args.regenerate_max_len),
                 "--seed", str(args.seed)]
        if args.regenerate_limit:
            regen += ["--limit", str(args.regenerate_limit)]
        if not regenerated.with_suffix(".stats.json").exists():  # written when a run completes
            _stage(log, "regenerate", _run_cli, regenerate, regen)
        prompts = sorted(str(p) for p in (data / "prompts").glob("*.jsonl"))
        for name, preset in args.drafters.items():
            drafter = out / "drafters" / name
            if not (drafter / "model.safetensors").exists():
                _stage(log, f"drafter {name}", train_drafter, preset, target, regenerated,
                       out / "runs" / name, drafter, args.drafter_steps, args.seed, "bfloat16",
                       tuple(args.drafter_set))
            config = json.loads((drafter / "config.json").read_text())
            if config.get("enable_confidence_head") and not (drafter / "sts.json").exists():
                _stage(log, f"calibrate {name}", _run_cli, calibrate, [
                    "--target", str(target), "--drafter", str(drafter), "--prompts", *prompts,
                    "--temperature", "1", "--max-new-tokens", str(args.calibrate_max_new_tokens),
                    "--slots", str(args.calibrate_slots), "--max-len", str(args.calibrate_max_len),
                    "--prefill-buckets", args.calibrate_prefill_buckets,
                    "--samples", str(args.calibrate_samples),
                    "--seed", str(args.seed)])
    except DSparkError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    record = out / "demo_models.json"
    previous = json.loads(record.read_text()) if record.exists() else {"runs": []}
    previous["runs"].append({"command": "python -m train.demo_models " + shlex.join(argv),
                             "stages": log})
    record.write_text(json.dumps(previous, indent=1) + "\n")
    print(f"done: {out} ({', '.join(s['stage'] for s in log) or 'nothing left to do'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
