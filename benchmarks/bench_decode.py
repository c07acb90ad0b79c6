"""Speculative versus plain decoding on a tiny trained pair: output tokens/s at several batch sizes
and temperatures, tau, and the time split of one round (propose, verify, host).

    python benchmarks/bench_decode.py [--pair runs/tiny-pair] [--batches 1,8,32] [--temperatures 0,1]

Without an existing --pair directory, one is built first with `python -m train.tiny_pair`. For each
(batch R, temperature) the same prompts are decoded by plain target decoding and by the drafter with
fixed(γ) through engines with R slots, stopping at the tokenizer's stop ids; throughput is measured
after compilation and one untimed pass. The round split times the
compiled round, the drafter's proposal and the flat verification separately on a full batch;
host+prefill is the wall time per round (prefill included) minus the compiled round's time.
"""

import argparse
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
from timing import median_time


def round_split(engine):
    """Seconds for (round, propose, verify) on the engine's current state (all slots active)."""
    from dspark_jax.models.drafter import propose
    from dspark_jax.models.target import forward_flat

    F = engine.verify_buckets[-1]
    W = engine.W
    rows = np.repeat(np.arange(engine.R), W)[:F].astype(np.int32)
    j = np.tile(np.arange(W), engine.R)[:F].astype(np.int32)
    verify = jax.jit(lambda st, tp: forward_flat(tp, engine.tcfg, st.target_cache, st.slots.anchor[rows],
                                                 rows, st.slots.length[rows] + j, np.ones(F, bool),
                                                 rows * W + j, W).logits)
    t_verify = median_time(lambda: verify(engine.state, engine.tparams), 20)
    t_propose = 0.0
    if engine.dcfg is not None:
        keys = jax.random.split(jax.random.key(0), engine.R)
        prop = jax.jit(lambda st, tp, dp: propose(dp, tp, engine.tcfg, engine.dcfg, st.draft_cache,
                                                  st.slots.anchor, st.slots.length, st.slots.temperature,
                                                  keys).tokens)
        t_propose = median_time(lambda: prop(engine.state, engine.tparams, engine.dparams), 20)
    def one_round():
        return engine.run_round(("scheduled", F))[0]

    t_round = median_time(one_round, 20)
    return t_round, t_propose, t_verify


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", default="runs/tiny-pair")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--max-len", type=int, default=128)
    args = ap.parse_args()
    pair = Path(args.pair)
    if not (pair / "drafter" / "config.json").is_file():
        subprocess.run([sys.executable, "-m", "train.tiny_pair", "--out", str(pair)], check=True)

    from dspark_jax.decoding.engine import Engine, Request
    from dspark_jax.decoding.schedulers import SchedulerConfig
    from dspark_jax.formats import deepspec
    from dspark_jax.formats.records import load_prompts
    from dspark_jax.formats.tokenizer import load_tokenizer
    tcfg, tparams, dcfg, dparams = deepspec.load_pair(pair / "target", pair / "drafter")
    tok = load_tokenizer(pair / "target")
    prompts = load_prompts(pair / "data/prompts.jsonl", tok)
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}; tiny pair {pair}: target "
          f"{tcfg.num_hidden_layers}x{tcfg.hidden_size}, drafter {dcfg.num_draft_layers} layers, block "
          f"{dcfg.block_size}; {args.max_new_tokens} new tokens per request")
    header = (f"{'R':>3} {'T':>4} | {'plain tok/s':>11} {'spec tok/s':>10} {'speedup':>7} | {'tau':>5} "
              f"{'acc':>5} | round ms: {'total':>6} {'propose':>7} {'verify':>6} {'host+prefill':>12}")
    print(header)
    for R in [int(b) for b in args.batches.split(",")]:
        kw = dict(slots=R, max_len=args.max_len, prefill_buckets=(32, args.max_len), max_prefill_batch=8)
        plain = Engine(tcfg, tparams, **kw)
        spec = Engine(tcfg, tparams, dcfg, dparams, scheduler=SchedulerConfig("fixed", 0), **kw)
        n = max(2 * R, 16)
        for engine in (plain, spec):  # compile, then one untimed pass (first-call allocations)
            engine.warmup()
            engine.generate([Request(id=str(i), prompt_ids=prompts[i % len(prompts)].token_ids,
                                     max_new_tokens=8) for i in range(n)])
        for T in [float(t) for t in args.temperatures.split(",")]:
            reqs = [Request(id=f"{i}", prompt_ids=prompts[i % len(prompts)].token_ids,
                            max_new_tokens=args.max_new_tokens, temperature=T,
                            stop_ids=tok.stop_token_ids) for i in range(n)]
            mp = plain.generate(reqs)
            ms = spec.generate(reqs)
            # Fill every slot for the split (prefill only: generate's requests have finished).
            spec.generate([Request(id=f"s{i}", prompt_ids=reqs[i % n].prompt_ids, max_new_tokens=2,
                                   temperature=T) for i in range(R)])
            spec.state = spec.state.replace(slots=spec.state.slots.replace(
                active=jax.numpy.ones(R, bool), max_new=jax.numpy.full(R, 10**6, jax.numpy.int32)))
            t_round, t_prop, t_ver = round_split(spec)
            wall = ms["elapsed_s"] / max(ms["rounds"], 1)  # prefill included
            print(f"{R:>3} {T:>4.1f} | {mp['output_tokens_per_s']:>11,.0f} {ms['output_tokens_per_s']:>10,.0f} "
                  f"{ms['output_tokens_per_s'] / mp['output_tokens_per_s']:>6.2f}x | {ms['tau']:>5.2f} "
                  f"{ms['acceptance_rate']:>5.2f} | {'':>9} {t_round * 1e3:>6.2f} {t_prop * 1e3:>7.2f} "
                  f"{t_ver * 1e3:>6.2f} {max(wall - t_round, 0) * 1e3:>12.2f}", flush=True)
    print("command: python " + " ".join(sys.argv))


if __name__ == "__main__":
    main()
