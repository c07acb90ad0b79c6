"""What a speculative round costs against a plain one, for random demo-sized targets of one parameter
budget and several depths, each with the demo's one-layer DSpark drafter (block 7).

    python benchmarks/target_shapes.py [--shapes 8x384,16x256,24x192] [--slots 1,8] [--trials 5]
        [--max-len 512]

Weights are random: a round's time does not depend on them. Each shape is LAYERSxHIDDEN with
head_dim 64 (48 where the hidden size is not a multiple of 64 x 2), two key/value heads, an FFN of
about 2.7 x the hidden size and the demo's 4096-token vocabulary; the drafter taps three target
layers and shares the target's embedding and output head, as the demo drafters do. For every shape
and slot count the real engine is built and `serve.profile`'s measurement times its rounds (two
untimed rounds, then back-to-back rounds for 60 ms, the median of --trials), computing in float32
as `--dtype auto` does on CPU.

Prints, per shape and slot count, the plain round (anchors only), the round verifying the whole
block beside every anchor, their ratio, and the τ (tokens committed per speculative round) at which
speculation breaks even and doubles the plain throughput: break-even τ = ratio, 2x needs 2 x ratio.
"""

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def parse_shape(text: str) -> tuple[int, int]:
    layers, hidden = (int(v) for v in text.lower().split("x"))
    if layers < 6 or hidden < 64 or hidden % 32:
        raise ValueError(f"--shapes {text}: expected LAYERSxHIDDEN with >= 6 layers (three taps) and a hidden "
                         "size that is a multiple of 32 and >= 64")
    return layers, hidden


def target_config(base, layers: int, hidden: int):
    head_dim = 64 if hidden % 128 == 0 else 48 if hidden % 96 == 0 else 32
    ffn = int(round(hidden * 8 / 3 / 64)) * 64
    return dataclasses.replace(
        base, num_hidden_layers=layers, hidden_size=hidden, intermediate_size=ffn, head_dim=head_dim,
        num_attention_heads=hidden // head_dim, num_key_value_heads=2,
        target_layer_ids=(1, layers // 2 - 1, layers - 3))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="8x384,16x256,24x192")
    ap.add_argument("--slots", default="1,8")
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--max-len", type=int, default=512)
    args = ap.parse_args(argv)
    try:
        shapes = [parse_shape(s) for s in args.shapes.split(",")]
        slot_counts = [int(s) for s in args.slots.split(",")]
    except ValueError as e:
        ap.error(str(e))
    if any(s < 1 for s in slot_counts):
        ap.error(f"--slots {args.slots}: expected positive integers, e.g. 1,8")

    import jax

    from dspark_jax.config import load_config, preset_path
    from dspark_jax.decoding import profile
    from dspark_jax.decoding.engine import Engine
    from dspark_jax.decoding.schedulers import SchedulerConfig
    from dspark_jax.models.drafter import drafter_spec
    from dspark_jax.models.target import target_spec
    from dspark_jax.params import count_params, init_params

    cfg = load_config(preset_path("dspark-demo"))
    dcfg = cfg.drafter
    rows = []
    for layers, hidden in shapes:
        tcfg = target_config(cfg.target, layers, hidden)
        tparams = init_params(target_spec(tcfg), jax.random.key(0))
        dparams = init_params(drafter_spec(tcfg, dcfg), jax.random.key(1))
        sizes = (count_params(tparams) / 1e6, count_params(dparams) / 1e6)
        for slots in slot_counts:
            engine = Engine(tcfg, tparams, dcfg, dparams, slots=slots, max_len=args.max_len,
                            scheduler=SchedulerConfig("async"), cache_profile=False)
            prof = profile.measure(engine, trials=args.trials).round_seconds()
            plain = prof.plain[max(prof.plain)]
            spec = prof.spec[min(F for F in prof.spec if F >= slots * (1 + dcfg.block_size))]
            rows.append((f"{layers}x{hidden}", *sizes, slots, plain * 1e3, spec * 1e3, spec / plain))
            print(f"{rows[-1][0]} slots {slots}: plain {plain * 1e3:.2f} ms, spec {spec * 1e3:.2f} ms",
                  file=sys.stderr, flush=True)
            del engine
    print("| target | target params | drafter params | slots | plain round | whole-block round | "
          "ratio = break-even τ | τ for 2x |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, tp, dp, slots, plain, spec, ratio in rows:
        print(f"| {name} | {tp:.1f}M | {dp:.1f}M | {slots} | {plain:.2f} ms | {spec:.2f} ms | "
              f"{ratio:.2f} | {2 * ratio:.2f} |")
    device = jax.devices()[0]
    print(f"\nmachine: {device.platform} x{jax.device_count()}, jax {jax.__version__}")
    print("command: python " + " ".join(["benchmarks/target_shapes.py", *sys.argv[1:]]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
