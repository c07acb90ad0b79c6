"""Pretrain the bundled demo target: a Qwen3-architecture model on the built-in corpus (math word
problems with worked solutions, standard-library code, docstring prose; `training/corpus.py`,
conversations rendered with the chat template and packed end to end into rows), saved as a Hugging Face Qwen3 directory with its BPE tokenizer and a Qwen-style chat template.

    python -m train.target --out runs/demo [--preset demo] [--steps 1500] [--batch-size 16]
        [--max-length 384] [--learning-rate 2e-3] [--math-items 3000] [--seed 0]

Writes OUT/data/ (train.jsonl; held-out math.jsonl, code.jsonl, chat.jsonl with reference
answers; prompts/{math,code,chat}.jsonl) and OUT/target/ (config.json, model.safetensors in
bfloat16, tokenizer.json, tokenizer_config.json with the chat template, generation_config.json,
training.json: the command, the loss curve and the time it took). Then, for instance:

    python -m serve.decode --target OUT/target --drafter none --prompts OUT/data/prompts/math.jsonl \\
        --out OUT/plain.jsonl
"""

import argparse
import dataclasses
import json
import shlex
import sys
import time
from pathlib import Path

from dspark_jax.errors import DSparkError


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="python -m train.target", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output directory (data/ and target/ go in it)")
    ap.add_argument("--preset", default="demo", help="target preset (configs/) or YAML file")
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--max-length", type=int, default=384, help="tokens per training row")
    ap.add_argument("--learning-rate", type=float, default=2e-3)
    ap.add_argument("--warmup-steps", type=int, default=100)
    ap.add_argument("--math-items", type=int, default=3000, help="generated math problems")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    problems = []
    for name in ("steps", "batch_size", "max_length", "math_items"):
        if getattr(args, name) < 1:
            problems.append(f"--{name.replace('_', '-')} {getattr(args, name)}: must be >= 1")
    if not args.learning_rate > 0:
        problems.append(f"--learning-rate {args.learning_rate}: must be > 0")
    if args.warmup_steps < 0:
        problems.append(f"--warmup-steps {args.warmup_steps}: must be >= 0")
    out = Path(args.out)
    if (out / "target" / "model.safetensors").exists():
        problems.append(f"--out {out}: {out / 'target'} already holds a model; choose a new directory")
    if out.exists() and not out.is_dir():
        problems.append(f"--out {out}: is a file; expected a directory")
    if problems:
        ap.error("; ".join(problems))
    return args


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    import jax
    from tqdm import tqdm

    from dspark_jax.config import load_config, preset_path
    from dspark_jax.training import corpus
    from dspark_jax.training.pretrain import fit_target, prepare_target_dir

    out = Path(args.out)
    try:
        cfg = load_config(preset_path(args.preset)).target
        if args.max_length > cfg.max_position_embeddings:
            raise DSparkError(f"--max-length {args.max_length} exceeds the preset's "
                              f"max_position_embeddings {cfg.max_position_embeddings}")
        t0 = time.perf_counter()
        counts = corpus.write_corpus(out / "data", seed=args.seed, math_items=args.math_items)
        print("corpus: " + ", ".join(f"{d} {c['train']} training / {c['held_out']} held out"
                                     for d, c in counts.items()), flush=True)
        params, batches, tokenizer, ds = prepare_target_dir(
            out / "target", out / "data" / "train.jsonl", cfg, seed=args.seed,
            max_length=args.max_length, batch_size=args.batch_size, init_std=0.02, packed=True)
        tokens = sum(len(ids) + 1 for ids in ds.input_ids)
        print(f"tokenizer: {cfg.vocab_size} tokens; {len(ds)} conversations, {tokens} tokens "
              f"packed in rows of {args.max_length} ({tokens / (args.max_length * args.batch_size):.0f} "
              f"steps an epoch)", flush=True)
        bar = tqdm(total=args.steps, desc="pretraining", unit="step", mininterval=2.0)
        curve = []

        def on_step(step, loss):
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.3f}", refresh=False)
            if step % 50 == 0 or step == args.steps:
                curve.append({"step": step, "loss": loss,
                              "seconds": round(time.perf_counter() - t0, 1)})

        t1 = time.perf_counter()
        params, losses = fit_target(params, cfg, batches, args.steps, args.learning_rate,
                                    warmup_steps=min(args.warmup_steps, args.steps - 1),
                                    cosine=True, weight_decay=0.01, clip_norm=1.0, on_step=on_step)
        bar.close()
        train_seconds = time.perf_counter() - t1
        from dspark_jax.training.pretrain import save_target_dir

        save_target_dir(params, dataclasses.replace(cfg, dtype="bfloat16"), out / "target", tokenizer)
        report = {"command": "python -m train.target " + shlex.join(argv),
                  "device": f"{jax.devices()[0].platform} x{jax.device_count()}",
                  "preset": args.preset, "steps": args.steps, "batch_size": args.batch_size,
                  "max_length": args.max_length, "corpus": counts, "tokens": tokens,
                  "epochs": round(args.steps * args.batch_size * args.max_length / tokens, 2),
                  "final_loss": sum(losses[-20:]) / len(losses[-20:]),
                  "train_seconds": round(train_seconds, 1),
                  "total_seconds": round(time.perf_counter() - t0, 1), "curve": curve}
        (out / "target" / "training.json").write_text(json.dumps(report, indent=1) + "\n")
    except DSparkError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"done: {out / 'target'} (loss {report['final_loss']:.3f} after {args.steps} steps, "
          f"{train_seconds / 60:.1f} min of training)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
