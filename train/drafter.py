"""Train a DSpark (or DFlash, or Eagle3) drafter against a frozen target.

    python -m train.drafter --config configs/dspark-qwen3-8b.yaml train.target_dir=/ckpt/Qwen3-8B \
        train.data_file=data.jsonl train.workdir=runs/dspark-8b [more key=value overrides]

`train.data_file` may also be a tokenized cache directory (`python -m train.tokenize`), read by
`train.data_workers` worker processes.

The preset's `drafter.kind` (dspark, the default, or eagle3: `--config eagle3-qwen3-8b`) says which.

Prints a progress line every `train.log_every` steps, writes TensorBoard scalars to WORKDIR/tb and
orbax checkpoints to WORKDIR/checkpoints; rerunning the same command resumes exactly. SIGTERM or
SIGINT saves a checkpoint and exits cleanly; a non-finite loss stops with an error and leaves the
last good checkpoint intact.
"""

import argparse
import math
import signal
import sys

from dspark_jax.config import load_config, preset_path
from dspark_jax.errors import DSparkError


def format_dspark_metrics(m: dict) -> str:
    parts = [f"loss {m['loss']:.4f}", f"ce {m['loss_ce']:.4f}", f"tv {m['loss_tv']:.4f}"]
    if "loss_confidence" in m:
        parts.append(f"conf {m['loss_confidence']:.4f}")
    acc = m["accept_rate"]
    parts.append(f"acc@0 {acc[0]:.3f} acc@{len(acc) - 1} {acc[-1]:.3f} tau {m['tau_prob']:.2f}")
    return " | ".join(parts)


def format_eagle3_metrics(m: dict) -> str:
    top1, acc = m["accuracy"], m["accept_rate"]
    last = len(acc) - 1
    return " | ".join([f"loss {m['loss']:.4f}", f"step0 {m['step_loss'][0]:.4f}",
                       f"top1@0 {top1[0]:.3f} top1@{last} {top1[-1]:.3f}",
                       f"acc@0 {acc[0]:.3f} acc@{last} {acc[-1]:.3f} tau {m['tau_probabilistic']:.2f} "
                       f"(greedy {m['tau_greedy']:.2f})"])


FORMATS = {"dspark": format_dspark_metrics, "eagle3": format_eagle3_metrics}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="YAML preset (a path or a name in configs/)")
    ap.add_argument("overrides", nargs="*", help="section.key=value")
    dist = ap.add_argument_group("multi-process jobs (one command per process)")
    dist.add_argument("--distributed", action="store_true",
                      help="join a jax.distributed job detected from the environment (TPU pods, SLURM...)")
    dist.add_argument("--coordinator", help="host:port of process 0 (explicit alternative to detection)")
    dist.add_argument("--num-processes", type=int)
    dist.add_argument("--process-id", type=int)
    args = ap.parse_args(argv)

    import jax
    from tensorboardX import SummaryWriter

    from dspark_jax import distributed
    from dspark_jax.training import trainer

    if args.distributed or args.coordinator:
        # Before anything touches a device; and before our signal handlers, which must win.
        distributed.initialize(args.coordinator, args.num_processes, args.process_id)

    stop = {"requested": False}

    def request_stop(signum, frame):
        if stop["requested"]:  # a second signal: give up at once
            raise KeyboardInterrupt
        stop["requested"] = True
        print(f"\n{signal.Signals(signum).name}: saving a checkpoint and exiting", flush=True)

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    try:
        cfg = load_config(preset_path(args.config), args.overrides)
        lead = jax.process_index() == 0
        format_metrics = FORMATS[cfg.drafter.kind]
        writer = SummaryWriter(f"{cfg.train.workdir}/tb") if lead else None

        def on_step(s):
            eta = "?" if math.isnan(s.eta_s) else f"{s.eta_s / 60:.1f} min"
            print(f"step {s.step} | {format_metrics(s.metrics)} | {s.tokens_per_s:,.0f} tok/s | "
                  f"input {s.input_wait_s * 1e3:.1f} ms/step | eta {eta}", flush=True)
            if writer:
                for k, v in s.metrics.items():
                    if isinstance(v, list):
                        for i, x in enumerate(v):
                            writer.add_scalar(f"{k}/{i}", x, s.step)
                    else:
                        writer.add_scalar(k, v, s.step)
                writer.add_scalar("tokens_per_s", s.tokens_per_s, s.step)
                writer.add_scalar("input_wait_s", s.input_wait_s, s.step)
                writer.flush()

        summary = trainer.run(cfg, log=lambda line: print(line, flush=True) if lead else None,
                              on_step=on_step, should_stop=lambda: stop["requested"])
        if writer:
            writer.close()
        print(f"finished at step {summary['step']} ({summary['stopped']}); "
              f"checkpoints in {summary['workdir']}/checkpoints; waited "
              f"{summary['input_wait_s_per_step'] * 1e3:.1f} ms/step for input", flush=True)
        return 0
    except DSparkError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
