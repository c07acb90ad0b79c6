"""Tokenizing throughput of `python -m train.tokenize` with 1 and 2 workers, and the trainer's input
wait per step reading JSONL in memory or the tokenized cache with 0 and 2 grain workers.

    python benchmarks/tokenize_throughput.py [--out DIR] [--steps 20 (0: tokenizing only)] [--shard-lines 1000]

Corpus: the built-in three-domain corpus (`dspark_jax.training.corpus`, 3.4k conversations) and
the bundled demo's regenerated conversations (4k), in one JSONL file; the bundled demo target's
tokenizer (vocabulary 4096); the dspark-demo preset's settings (max_length 512, block 7). Records/s
counts records read (lines tokenized) per second of `tokenize_corpus`, as the command prints it,
and per second of the whole command (interpreter and worker start-up included).

Input wait: the dspark-demo drafter on a random target (`train.target_dir=`), `--steps` steps of
global batch 8; the time per step blocked in `next()` on the batch iterator (the trainer's own
figure), the first two steps (worker start-up) apart, next to the step time. Then the batch
iterator alone, with a sleep for the step: what workers buy when the step leaves the host's CPUs
idle (an accelerator), which a CPU-only trainer does not.
"""

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BUNDLED = REPO / "dspark_jax" / "bundled" / "tiny"


def build_corpus(out: Path) -> Path:
    from dspark_jax.training.corpus import write_corpus

    write_corpus(out / "builtin")
    corpus = out / "corpus.jsonl"
    with open(corpus, "wb") as f:
        for part in (out / "builtin" / "train.jsonl", BUNDLED / "regenerated.jsonl"):
            f.write(part.read_bytes())
    return corpus


def tokenize(corpus: Path, out: Path, workers: int, shard_lines: int) -> dict:
    cmd = [sys.executable, "-m", "train.tokenize", "--tokenizer", str(BUNDLED / "target"),
           "--data", str(corpus), "--out", str(out), "--config", "dspark-demo",
           "--workers", str(workers), "--shard-lines", str(shard_lines)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout}{proc.stderr}")
    last = proc.stdout.strip().splitlines()[-1]
    rate = float(last.split(" records/s")[0].rsplit(" ", 1)[1].replace(",", ""))
    records = json.loads((out / "manifest.json").read_text())["stats"]["records_read"]
    return {"workers": workers, "records": records, "records_per_s": rate,
            "records_per_s_wall": records / wall, "wall_s": wall, "command": " ".join(cmd[1:])}


def input_wait(data: str, workers: int, steps: int, workdir: Path) -> dict:
    from dspark_jax.config import load_config, preset_path
    from dspark_jax.training import trainer

    cfg = load_config(preset_path("dspark-demo"), [
        "train.target_dir=", f"train.tokenizer_dir={BUNDLED / 'target'}", f"train.data_file={data}",
        f"train.workdir={workdir}", f"train.max_steps={steps}", "train.log_every=1",
        "train.checkpoint_every=100000", f"train.data_workers={workers}", "mesh.data=1"])
    logs = []
    t0 = time.perf_counter()
    summary = trainer.run(cfg, on_step=logs.append)
    wall = time.perf_counter() - t0
    steady = logs[1:]  # the first report folds steps 1 and 2 (compilation, worker start-up)
    return {"data": "cache" if Path(data).is_dir() else "JSONL", "workers": workers,
            "first_two_steps_ms": logs[0].input_wait_s * 1e3,
            "wait_ms_per_step": 1e3 * sum(s.input_wait_s for s in steady) / len(steady),
            "step_ms": 1e3 * 8 * 512 / steady[-1].tokens_per_s, "run_s": wall,
            "mean_all_steps_ms": summary["input_wait_s_per_step"] * 1e3}


def iterator_wait(data: str, workers: int, batch: int, steps: int, step_s: float) -> float:
    """Mean ms blocked in next() when each step takes `step_s` of sleep (an accelerator step, which
    leaves the host's CPUs to the workers), after the first two batches."""
    from dspark_jax.formats.tokenizer import load_tokenizer
    from dspark_jax.training.data import BatchIterator
    from dspark_jax.training.token_cache import open_training_data

    records = open_training_data(data, load_tokenizer(BUNDLED / "target"), max_length=512, min_length=8,
                                 system_prompt="")
    it = BatchIterator(records, global_batch_size=batch, num_anchors=16, block_size=7, seed=0,
                       workers=workers)
    waits = []
    try:
        for _ in range(steps):
            t = time.perf_counter()
            next(it)
            waits.append(time.perf_counter() - t)
            time.sleep(step_s)
    finally:
        it.close()
    return 1e3 * sum(waits[2:]) / len(waits[2:])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="working directory (default: a temporary one)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--shard-lines", type=int, default=1000)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(args.out or tmp)
        out.mkdir(parents=True, exist_ok=True)
        corpus = build_corpus(out)
        print(f"corpus: {corpus} ({sum(1 for _ in open(corpus))} conversations)", flush=True)
        rows = [tokenize(corpus, out / f"cache-w{w}", w, args.shard_lines) for w in (1, 2)]
        same = all((out / "cache-w1" / p.name).read_bytes() == p.read_bytes()
                   for p in (out / "cache-w2").iterdir())
        print("\ntokenizing (python -m train.tokenize):")
        for r in rows:
            print(f"  --workers {r['workers']}: {r['records_per_s']:,.0f} records/s tokenizing, "
                  f"{r['records_per_s_wall']:,.0f} records/s of the whole command ({r['wall_s']:.1f} s "
                  f"for {r['records']} records)")
        print(f"  caches byte-identical: {same}; command: python {rows[-1]['command']}")
        if args.steps:
            print(f"\ntrainer input wait (dspark-demo, random target, {args.steps} steps, batch 8 x 512):")
        for data, workers in ((str(corpus), 0), (str(out / "cache-w1"), 0), (str(out / "cache-w1"), 2)):
            if not args.steps:
                break
            r = input_wait(data, workers, args.steps, out / f"run-{Path(data).name}-{workers}")
            print(f"  {r['data']:5s} data_workers={workers}: {r['wait_ms_per_step']:.2f} ms/step waiting "
                  f"for input (steps 1-2: {r['first_two_steps_ms']:.0f} ms/step; step {r['step_ms']:.0f} ms; "
                  f"run {r['run_s']:.0f} s incl. setup)", flush=True)
        print("\nthe batch iterator alone, the step a 100 ms sleep (host CPUs left to the workers), "
              "batch 64 x 512, 30 steps:")
        for data, workers in ((str(corpus), 0), (str(out / "cache-w1"), 0), (str(out / "cache-w1"), 2)):
            wait = iterator_wait(data, workers, 64, 30, 0.1)
            kind = "cache" if Path(data).is_dir() else "JSONL"
            print(f"  {kind:5s} workers={workers}: {wait:.2f} ms/step waiting for input", flush=True)
        print(f"\nmade by: python benchmarks/tokenize_throughput.py --steps {args.steps} "
              f"--shard-lines {args.shard_lines}")


if __name__ == "__main__":
    main()
