"""Drafter train-step throughput and memory for the tiny preset and a medium one, with the share of
step time spent in the frozen target forward.

    python benchmarks/bench_train.py [--only tiny|medium] [--steps 3] [--attention-chunk 0,64]

medium: target hidden 1024, 8 layers, 16 heads (8 KV), vocabulary 32k, sequence 2048; drafter 2
layers, block 7, Markov rank 256, 512 anchors, batch 1. Tokens/s counts sequence tokens (batch x
length) per second of a steady-state step. Peak memory is XLA's compiled estimate for the step
(arguments + outputs + temporaries) and the process's peak RSS.
"""

import argparse
import resource
import sys

import jax
import jax.numpy as jnp
import numpy as np
from timing import median_time

from dspark_jax.config import Config, DrafterConfig, LossConfig, MeshConfig, TargetConfig, TrainConfig
from dspark_jax.models.target import forward, lm_head, target_spec
from dspark_jax.params import count_params, init_params
from dspark_jax.sharding import make_mesh
from dspark_jax.training.data import sample_anchors
from dspark_jax.training.train_step import init_state, make_optimizer, make_train_step, state_shardings

PRESETS = {
    "tiny": dict(target=dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                             target_layer_ids=(0, 2), mask_token_id=3),
                 drafter=dict(num_draft_layers=2, block_size=4, markov_rank=16, num_anchors=8),
                 batch=8, length=64),
    "medium": dict(target=dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816,
                               num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=8,
                               head_dim=64, target_layer_ids=(1, 3, 5), mask_token_id=3),
                   drafter=dict(num_draft_layers=2, block_size=7, markov_rank=256, num_anchors=512),
                   batch=1, length=2048),
}


def make_batch(cfg: Config, rows: int, length: int, rng):
    ids = rng.integers(4, cfg.target.vocab_size, size=(rows, length)).astype(np.int32)
    mask = np.zeros((rows, length), bool)
    mask[:, length // 8:] = True
    anchors, keep = zip(*(sample_anchors(m, cfg.drafter.num_anchors, rng) for m in mask))
    return {"input_ids": jnp.asarray(ids), "loss_mask": jnp.asarray(mask),
            "anchors": jnp.asarray(np.stack(anchors)), "anchor_keep": jnp.asarray(np.stack(keep))}


def bench(name: str, steps: int, chunk: int):
    p = PRESETS[name]
    cfg = Config(target=TargetConfig(**p["target"]),
                 drafter=DrafterConfig(**p["drafter"], attention_chunk=chunk),
                 mesh=MeshConfig(data=1), train=TrainConfig(max_length=p["length"], loss=LossConfig()))
    mesh = make_mesh(cfg.mesh)
    target = init_params(target_spec(cfg.target), jax.random.key(1), mesh)
    opt = make_optimizer(cfg, total_steps=100)
    state = init_state(cfg, opt, jax.random.key(0), mesh)
    step = make_train_step(cfg, opt, state_shardings(state))
    batch = make_batch(cfg, p["batch"], p["length"], np.random.default_rng(0))
    mem = step.lower(state, target, batch).compile().memory_analysis()
    holder = {"state": state}

    def run_step():
        holder["state"], metrics = step(holder["state"], target, batch)
        return metrics

    t_step = median_time(run_step, steps)

    @jax.jit
    def target_only(tp, batch):
        ids = batch["input_ids"]
        B, L = ids.shape
        out = forward(tp, cfg.target, ids, jnp.broadcast_to(jnp.arange(L), (B, L)), compute_logits=False)
        idx = jnp.minimum(batch["anchors"][..., None] + jnp.arange(cfg.drafter.block_size), L - 1)
        sel = jnp.take_along_axis(out.hidden, idx.reshape(B, -1)[..., None], 1)
        return out.taps.sum(), lm_head(tp, cfg.target, sel).sum()

    t_target = median_time(lambda: target_only(target, batch), steps)
    tokens = p["batch"] * p["length"]
    est = (mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes) if mem else 0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"{name:7s} target {count_params(target) / 1e6:7.1f}M  drafter {count_params(state.params) / 1e6:6.1f}M  "
          f"batch {p['batch']} x {p['length']}  anchors {cfg.drafter.num_anchors}  chunk {chunk}  | step {t_step * 1e3:9.1f} ms  "
          f"{tokens / t_step:10,.0f} tok/s  | target forward {100 * t_target / t_step:4.1f} % of step  | "
          f"XLA peak estimate {est / 2**30:.2f} GiB, process peak RSS {rss:.2f} GiB")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=sorted(PRESETS))
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--attention-chunk", default="0",
                    help="comma-separated drafter.attention_chunk values to compare (0 = unchunked)")
    args = ap.parse_args()
    print(f"jax {jax.__version__} on {jax.devices()[0].platform} ({jax.device_count()} devices)")
    for name in [args.only] if args.only else ["tiny", "medium"]:
        for chunk in (int(c) for c in args.attention_chunk.split(",")):
            bench(name, args.steps, chunk)
    print("command: python " + " ".join(sys.argv))


if __name__ == "__main__":
    main()
