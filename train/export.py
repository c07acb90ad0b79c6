"""Export a drafter (DSpark/DFlash, or Eagle3 from a training checkpoint) to a complete DeepSpec-format
directory.

    python -m train.export --checkpoint runs/dspark-8b [--step N] --out exported/dspark-8b [--dtype bfloat16]
    python -m train.export --drafter tiny-dspark [--target tiny] --out exported/tiny-dspark

From an orbax training checkpoint (`--checkpoint`), or from a drafter directory or bundled drafter
(`--drafter`; bundled drafters leave out the target's embedding and lm_head copies, which this puts
back). The output directory (config.json + model.safetensors with the target's embedding and lm_head
copied in, and the drafter's sts.json when it has one) loads in DeepSpec-format torch stacks and back
here with `dspark_jax.formats.deepspec.load_drafter` (an Eagle3 run's: `Qwen3Eagle3Model`, loaded by
`dspark_jax.formats.eagle3.load_eagle3`).
"""

import argparse
import shutil
import sys
from pathlib import Path

from dspark_jax.errors import DSparkError


def stored_dtype(drafter: str) -> str:
    """The dtype of a drafter directory's floating-point tensors (a bundled bfloat16 drafter exports
    as bfloat16, not as the float32 it computes in on CPU)."""
    from dspark_jax.formats.safetensors_io import CheckpointFiles

    files = CheckpointFiles(drafter)
    dtypes = {str(files.array(k).dtype) for k in files.keys()} & {"float32", "bfloat16"}
    return "bfloat16" if dtypes == {"bfloat16"} else "float32"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", help="training workdir (holds checkpoints/)")
    src.add_argument("--drafter", help="drafter directory or bundled drafter name")
    ap.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                    help="tensor dtype to write (default: with --checkpoint the drafter's compute "
                         "dtype, with --drafter the dtype its tensors are stored in)")
    ap.add_argument("--target", default=None,
                    help="Hugging Face target directory for the embedding/lm_head copies "
                         "(default: the run's train.target_dir; with --drafter: the bundled tiny)")
    args = ap.parse_args(argv)

    from dspark_jax import bundled
    from dspark_jax.formats import deepspec
    from dspark_jax.training import trainer

    try:
        if args.drafter:
            drafter = bundled.resolve_drafter(args.drafter)
            target = bundled.resolve_target(args.target or bundled.DEFAULT_TARGET)
            if Path(args.out).resolve() == Path(drafter).resolve():
                raise DSparkError(f"--out {args.out}: is the drafter directory itself")
            tcfg, tparams, dcfg, params = deepspec.load_pair(target, drafter)
            dtype = args.dtype or stored_dtype(drafter)
            out = deepspec.save_any(params, tcfg, dcfg, tparams, args.out, dtype=dtype)
            if (Path(drafter) / "sts.json").is_file():
                shutil.copy2(Path(drafter) / "sts.json", out / "sts.json")
            what = drafter
        else:
            cfg, params, step = trainer.load_drafter_params(args.checkpoint, args.step)
            if args.target:
                import dataclasses
                cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train,
                                                                         target_dir=args.target))
            _, target_params = trainer.load_target_for(cfg, mesh=None)
            out = deepspec.save_any(params, cfg.target, cfg.drafter, target_params, args.out,
                                    dtype=args.dtype)
            what = f"step {step} of {args.checkpoint}"
    except DSparkError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"exported {what} to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
