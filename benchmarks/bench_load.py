"""Times loading a random ~100M-parameter Qwen3 checkpoint with `load_target` against reading the same
safetensors files raw with numpy (the floor: every byte read once into host memory).

    python benchmarks/bench_load.py [--dtype float32|bfloat16] [--devices N] [--repeats 3]

Prints both times (best of --repeats, warm page cache) and their ratio.
"""

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--devices", type=int, default=1, help="fake CPU devices; >1 loads onto a (data, tensor) mesh")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--shard-mb", type=int, default=200, help="safetensors shard size")
    args = ap.parse_args()
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.devices}"
    import jax
    import numpy as np

    from dspark_jax.config import MeshConfig, TargetConfig
    from dspark_jax.formats import hf_checkpoint
    from dspark_jax.formats.safetensors_io import CheckpointFiles
    from dspark_jax.models.target import target_spec
    from dspark_jax.params import count_params, init_params
    from dspark_jax.sharding import make_mesh

    cfg = TargetConfig(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                       num_attention_heads=12, num_key_value_heads=4, head_dim=64, dtype=args.dtype,
                       target_layer_ids=(1, 5, 9))
    mesh = make_mesh(MeshConfig(data=-1, tensor=2)) if args.devices > 1 else None
    with tempfile.TemporaryDirectory() as tmp:
        params = init_params(target_spec(cfg), jax.random.key(0))
        n = count_params(params)
        hf_checkpoint.save_target(params, cfg, tmp, max_shard_bytes=args.shard_mb << 20)
        del params
        files = sorted(Path(tmp).glob("*.safetensors"))
        size = sum(f.stat().st_size for f in files)

        def raw():
            ckpt = CheckpointFiles(tmp)
            return [np.array(ckpt.array(k)) for k in ckpt.keys()]  # one copy of every tensor

        def ours():
            _, p = hf_checkpoint.load_target(tmp, mesh=mesh, target_layer_ids=cfg.target_layer_ids)
            jax.block_until_ready(p)
            return p

        def best(fn):
            times = []
            for _ in range(args.repeats):
                t = time.perf_counter()
                out = fn()
                times.append(time.perf_counter() - t)
                del out
            return min(times)

        raw()  # warm the page cache
        t_raw, t_ours = best(raw), best(ours)
    print(f"checkpoint: {n / 1e6:.1f}M params, {args.dtype}, {len(files)} files, {size / 2**20:.0f} MiB; "
          f"devices {jax.device_count()}" + (f", mesh {dict(mesh.shape)}" if mesh else ""))
    print(f"raw numpy read : {t_raw:.3f} s ({size / 2**30 / t_raw:.2f} GiB/s)")
    print(f"load_target    : {t_ours:.3f} s ({size / 2**30 / t_ours:.2f} GiB/s)")
    print(f"ratio load_target / raw = {t_ours / t_raw:.2f}")
    print("command: python " + " ".join(sys.argv))


if __name__ == "__main__":
    main()
