"""Decode-cache bytes of a Gemma4 target: sliding layers in a ring of window - 1 + max_step slots
against keeping every position on them too. Abstract shapes only (`jax.eval_shape`): nothing is
allocated, so the 12B preset is measured on any machine.

    python benchmarks/gemma4_cache_memory.py [--preset gemma4-12b] [--slots 64] [--context 8192]
                                             [--max-step 8]

Prints the command, then the bytes of each cache array and the totals.
"""

import argparse
import math
import shlex
import sys


def cache_bytes(tree) -> dict[str, int]:
    """{field: bytes} of a cache of ShapeDtypeStructs."""
    import dataclasses

    return {f.name: math.prod(getattr(tree, f.name).shape) * getattr(tree, f.name).dtype.itemsize
            for f in dataclasses.fields(tree)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="gemma4-12b", help="a preset name or YAML file with a gemma4 target")
    ap.add_argument("--slots", type=int, default=64, help="request slots (cache rows)")
    ap.add_argument("--context", type=int, default=8192, help="positions per slot")
    ap.add_argument("--max-step", type=int, default=8, help="most tokens a slot adds per round (1 + drafts)")
    args = ap.parse_args()
    import jax

    from dspark_jax.config import load_config, preset_path
    from dspark_jax.models.target import new_cache

    cfg = load_config(preset_path(args.preset)).target
    if cfg.family != "gemma4":
        sys.exit(f"{args.preset}: family {cfg.family!r}, expected gemma4")
    print("$ python " + " ".join(shlex.quote(a) for a in sys.argv))
    print(f"{args.preset}: {len(cfg.sliding_layers)} sliding layers (window {cfg.sliding_window}, "
          f"{cfg.num_key_value_heads} KV heads x {cfg.head_dim}), {len(cfg.full_layers)} full layers "
          f"({cfg.full_kv_heads} KV head x {cfg.full_head_dim}), {cfg.dtype}; {args.slots} slots x "
          f"{args.context} positions, max_step {args.max_step}")
    GiB = 2 ** 30
    layouts = {"ring": args.max_step, "every position": args.context}  # max_step >= context: W = context
    totals = {}
    for name, max_step in layouts.items():
        shapes = jax.eval_shape(lambda m=max_step: new_cache(cfg, args.slots, args.context, m))
        sizes = cache_bytes(shapes)
        totals[name] = sum(sizes.values())
        W = shapes.ring_pos.shape[1]
        print(f"\n{name} (sliding layers keep {W} slots per row):")
        for field, n in sizes.items():
            print(f"  {field:9s} {str(getattr(shapes, field).shape):28s} {n:>16,d} B  {n / GiB:8.2f} GiB")
        print(f"  {'total':9s} {'':28s} {totals[name]:>16,d} B  {totals[name] / GiB:8.2f} GiB")
    ring, every = totals["ring"], totals["every position"]
    print(f"\nring / every position: {ring / every:.3f} ({(every - ring) / GiB:.2f} GiB saved)")


if __name__ == "__main__":
    main()
