"""Build the smallest real setup end to end: a tiny Qwen3 target fitted on synthetic chat data and a
DSpark drafter trained against it, both written in their interchange formats.

    python -m train.tiny_pair --out runs/tiny-pair [--preset dspark-tiny] [--target-steps 1500] \
        [--drafter-steps 600] [--records 1024]

Writes OUT/data/train.jsonl, OUT/data/prompts.jsonl (held-out prompts), OUT/target (Hugging Face
Qwen3 directory with tokenizer), OUT/drafter-run (orbax training workdir) and OUT/drafter (DeepSpec
format). Then decode with:

    python -m serve.decode --target OUT/target --drafter OUT/drafter --prompts OUT/data/prompts.jsonl \
        --out OUT/completions.jsonl
"""

import argparse
import json
import sys
from pathlib import Path

from dspark_jax.errors import DSparkError


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--preset", default="dspark-tiny", help="drafter/target preset (configs/)")
    ap.add_argument("--target-steps", type=int, default=1500)
    ap.add_argument("--drafter-steps", type=int, default=600)
    ap.add_argument("--records", type=int, default=1024, help="synthetic training conversations")
    ap.add_argument("--prompts", type=int, default=64, help="held-out prompts to write")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    from dspark_jax.config import load_config, preset_path
    from dspark_jax.training.pretrain import make_tiny_target
    from dspark_jax.training.synthetic import write_synthetic_conversations
    from train.demo_models import train_drafter

    out = Path(args.out)
    try:
        (out / "data").mkdir(parents=True, exist_ok=True)
        data = write_synthetic_conversations(out / "data/train.jsonl", args.records, seed=args.seed)
        held = write_synthetic_conversations(out / "data/held_out.jsonl", args.prompts, seed=args.seed + 1)
        with open(out / "data/prompts.jsonl", "w") as f:
            for line in held.read_text().splitlines():
                rec = json.loads(line)
                first_user = next(m for m in rec["conversations"] if m["role"] == "user")
                f.write(json.dumps({"id": rec["id"], "turns": [first_user["content"]]}) + "\n")
        cfg = load_config(preset_path(args.preset))
        print(f"fitting the tiny target ({args.target_steps} steps) ...", flush=True)
        make_tiny_target(out / "target", data, cfg.target, steps=args.target_steps, seed=args.seed)
        print(f"training the drafter ({args.drafter_steps} steps) ...", flush=True)
        summary = train_drafter(args.preset, out / "target", data, out / "drafter-run",
                                out / "drafter", args.drafter_steps, args.seed)
        step = summary["step"]
    except DSparkError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"done: target {out / 'target'}, drafter {out / 'drafter'} (step {step}), "
          f"prompts {out / 'data/prompts.jsonl'}; last metrics {summary['last_metrics'].get('tau_prob')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
