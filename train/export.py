"""Export a trained drafter from an orbax training checkpoint to the DeepSpec format.

    python -m train.export --checkpoint runs/dspark-8b [--step N] --out exported/dspark-8b [--dtype bfloat16]

The output directory (config.json + model.safetensors, the target's embedding and lm_head copied in)
loads in DeepSpec-format torch stacks and back here with `dspark_jax.formats.deepspec.load_drafter`.
"""

import argparse
import sys

from dspark_jax.errors import DSparkError


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", required=True, help="training workdir (holds checkpoints/)")
    ap.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                    help="tensor dtype to write (default: the drafter's compute dtype)")
    ap.add_argument("--target", default=None,
                    help="Hugging Face target directory for the embedding/lm_head copies "
                         "(default: the run's train.target_dir)")
    args = ap.parse_args(argv)

    from dspark_jax.formats import deepspec
    from dspark_jax.training import trainer

    try:
        cfg, params, step = trainer.load_drafter_params(args.checkpoint, args.step)
        if args.target:
            import dataclasses
            cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, target_dir=args.target))
        _, target_params = trainer.load_target_for(cfg, mesh=None)
        out = deepspec.save_drafter(params, cfg.target, cfg.drafter, target_params, args.out,
                                    dtype=args.dtype)
    except DSparkError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"exported step {step} of {args.checkpoint} to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
