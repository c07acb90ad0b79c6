"""One process of a (possibly multi-process) training run, for tests/test_multiprocess.py.

    python tests/multiprocess_worker.py --process-id I --num-processes N --port P --out FILE
        [--preset dspark-tiny] [--stop-after K] [OVERRIDE ...]

With N > 1 the process joins a `jax.distributed` job (coordinator 127.0.0.1:P, gloo CPU
collectives) before anything touches a device; with N == 1 it runs alone. It then runs
`trainer.run` on the preset with the overrides and writes a JSON file: its process index/count,
device counts, every step's metrics (from `on_step`), the `log` lines and the run's summary.
`--stop-after K` makes `should_stop` answer True from its (K+1)-th call, i.e. after K steps; the
trainer makes the processes agree, so with different K they all stop after the smallest.

The device count per process comes from XLA_FLAGS (--xla_force_host_platform_device_count), which
the caller sets in the environment: it must be set before jax is imported.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--process-id", type=int, required=True)
    p.add_argument("--num-processes", type=int, required=True)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--out", required=True)
    p.add_argument("--preset", default="dspark-tiny")
    p.add_argument("--stop-after", type=int, default=None)
    p.add_argument("--init-timeout", type=int, default=120)
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    t_start = time.perf_counter()

    import jax

    if args.num_processes > 1:
        from dspark_jax import distributed

        distributed.initialize(f"127.0.0.1:{args.port}", args.num_processes, args.process_id,
                               timeout_s=args.init_timeout)

    from dspark_jax.config import load_config, preset_path
    from dspark_jax.training import trainer

    tag = f"[p{jax.process_index()}/{jax.process_count()}]"
    logs: list[str] = []
    steps: dict[int, dict] = {}

    def log(line: str) -> None:
        logs.append(line)
        print(tag, f"{time.perf_counter() - t_start:6.1f}s", line, flush=True)

    def on_step(s) -> None:
        steps[s.step] = s.metrics
        print(tag, f"{time.perf_counter() - t_start:6.1f}s",
              f"step {s.step} | loss {s.metrics['loss']!r}", flush=True)

    calls = {"n": 0}

    def should_stop() -> bool:
        calls["n"] += 1
        return args.stop_after is not None and calls["n"] > args.stop_after

    cfg = load_config(preset_path(args.preset), args.overrides)
    t0 = time.perf_counter()
    summary = trainer.run(cfg, log=log, on_step=on_step, should_stop=should_stop)
    result = {
        "process_index": jax.process_index(),
        "process_count": jax.process_count(),
        "local_device_count": jax.local_device_count(),
        "device_count": jax.device_count(),
        "steps": {str(k): v for k, v in sorted(steps.items())},
        "logs": logs,
        "summary": summary,
        "run_s": time.perf_counter() - t0,
    }
    tmp = args.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=1)
    os.replace(tmp, args.out)
    print(tag, f"done in {result['run_s']:.1f}s: {summary}", flush=True)
    if args.num_processes > 1:
        jax.distributed.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
