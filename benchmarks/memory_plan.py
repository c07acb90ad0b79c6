"""Per-device memory plans from abstract shapes: the DSpark train step and the engine's decode
rounds, compiled for a mesh of fake CPU devices from jax.ShapeDtypeStruct trees with shardings (no
weight, cache or batch is allocated), read from XLA's `memory_analysis()`.

    python benchmarks/memory_plan.py [--config dspark-qwen3-8b] [--train-devices 8,16,64]
        [--train-layout "OVERRIDES" ...] [--decode-devices 1,8] [--decode-layout D,T ...]
        [--slots 64] [--max-len 8192] [--hbm H100=80,H200=141,TPUv5p=95] [--json FILE]

Train step: `make_train_step` of the config (its sequence length, anchors, block, global batch),
state from `train_step.abstract_state`, target and drafter weights from `params.abstract`, the batch
as the trainer makes it (rows over data x fsdp). Each --train-layout is a comma-separated list of
config overrides applied at every device count ("" = the preset's mesh, data=-1; `{n}` stands for
the device count, `{per}` for the preset's global batch over it), e.g.
"mesh.data=1,mesh.fsdp=-1,train.microbatches={per}".

Decode: the engine's programs (`engine.program`) for the config's target and drafter with SLOTS x
MAX_LEN, state from `state.abstract_state`: the largest verification round of the default scheduler
(async: topk over all slots' blocks, SLOTS x (block + 1) tokens), the plain round over all slots,
and the largest prefill (8 prompts x MAX_LEN), the heaviest program the engine compiles at warm-up.
Each --decode-layout is D,T (data-parallel x tensor-parallel, as serve.decode's flags); a layout
whose size differs from the device count is skipped.

Every device count runs in its own subprocess (the fake device count is read when jax starts). The
numbers are XLA:CPU's buffer assignment of the same SPMD-partitioned program: arguments and outputs
follow from shapes and shardings exactly; temporaries are the CPU compiler's (fusion and scheduling
on GPU and TPU differ, and XLA:CPU may widen bfloat16 matmul operands). total = arguments + outputs
- aliased (donated buffers reused) + temporaries + generated code.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

GIB = 1024 ** 3
DEFAULT_HBM = "H100=80,H200=141,TPUv5p=95"
# the preset's mesh (data over every device) and ZeRO-3 over every device, each with the recipe's
# global batch in one piece and in micro-batches of one sequence per device ({per}: the global
# batch / the device count); the recipe's 512 at once do not fit: see the docs' table
DEFAULT_TRAIN_LAYOUTS = ("", "train.microbatches={per}", "mesh.data=1,mesh.fsdp=-1",
                         "mesh.data=1,mesh.fsdp=-1,train.microbatches={per}")
DEFAULT_DECODE_LAYOUTS = ("1,1", "1,8", "8,1")
PREFILL_BATCH = 8  # the engine's default largest prefill batch (Engine max_prefill_batch)


# ----------------------------------------------------------------------------- abstract path


def memory(compiled) -> dict:
    """Per-device bytes of a compiled program (XLA's memory analysis)."""
    m = compiled.memory_analysis()
    out = {"arguments": int(m.argument_size_in_bytes), "outputs": int(m.output_size_in_bytes),
           "aliased": int(m.alias_size_in_bytes), "temporaries": int(m.temp_size_in_bytes),
           "code": int(m.generated_code_size_in_bytes)}
    out["total"] = (out["arguments"] + out["outputs"] - out["aliased"] + out["temporaries"]
                    + out["code"])
    return out


def train_plan(cfg, mesh) -> dict:
    """Memory of one DSpark train step of `cfg` on `mesh`, compiled from abstract shapes."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    from dspark_jax.models.target import target_spec
    from dspark_jax.params import abstract
    from dspark_jax.training.train_step import (
        abstract_state,
        drafter_kind,
        make_optimizer,
        make_train_step,
    )

    optimizer = make_optimizer(cfg, total_steps=1000)
    state = abstract_state(cfg, optimizer, mesh)
    target = abstract(target_spec(cfg.target), mesh)
    B, L = cfg.train.global_batch_size, cfg.train.max_length
    N = drafter_kind(cfg).num_anchors(cfg.drafter)
    rows = NamedSharding(mesh, PartitionSpec(("data", "fsdp")))
    batch = {name: jax.ShapeDtypeStruct(shape, dtype, sharding=rows) for name, shape, dtype in (
        ("input_ids", (B, L), "int32"), ("loss_mask", (B, L), "bool"),
        ("attention_mask", (B, L), "bool"), ("anchors", (B, N), "int32"),
        ("anchor_keep", (B, N), "bool"))}
    step = make_train_step(cfg, optimizer, jax.tree.map(lambda x: x.sharding, state))
    t = time.perf_counter()
    compiled = step.lower(state, target, batch).compile()
    per_device = B // (mesh.shape["data"] * mesh.shape["fsdp"] * cfg.train.microbatches)
    return {**memory(compiled), "compile_s": time.perf_counter() - t,
            "sequences_per_device": per_device, "microbatches": cfg.train.microbatches}


def decode_plan(tcfg, dcfg, slots: int, max_len: int, mesh, programs=None) -> dict[str, dict]:
    """Memory of the engine's programs ({name: bytes}) for `slots` x `max_len` on `mesh` (None:
    one device), compiled from abstract shapes. `programs`: {name: engine program key}; default
    the largest async round, the plain round over all slots and the largest prefill."""
    import jax

    from dspark_jax.decoding.engine import program
    from dspark_jax.decoding.schedulers import SchedulerConfig
    from dspark_jax.decoding.state import EngineShape, abstract_state
    from dspark_jax.models.drafter import drafter_spec
    from dspark_jax.models.target import target_spec
    from dspark_jax.params import abstract

    shape = EngineShape(tcfg=tcfg, dcfg=dcfg, slots=slots, max_len=max_len, max_stop_ids=8,
                        scheduler=SchedulerConfig())
    if programs is None:
        programs = {f"verify (topk {slots * shape.width} tokens)": ("topk", slots * shape.width),
                    f"plain ({slots} tokens)": ("plain", slots),
                    f"prefill ({min(slots, PREFILL_BATCH)} x {max_len})":
                        ("prefill", min(slots, PREFILL_BATCH), max_len)}
    state = abstract_state(shape, mesh)
    tparams, dparams = abstract(target_spec(tcfg), mesh), abstract(drafter_spec(tcfg, dcfg), mesh)
    plans = {}
    for name, key in programs.items():
        fn, args, donate, out = program(shape, key, state, tparams, dparams, mesh)
        t = time.perf_counter()
        compiled = jax.jit(fn, donate_argnums=donate, out_shardings=out).lower(*args).compile()
        plans[name] = {**memory(compiled), "compile_s": time.perf_counter() - t}
    return plans


def decode_models(cfg):
    """(target config, drafter config) of a training config, as a GPU run would decode them
    (`--dtype auto`: the checkpoint's dtype; the drafter computes in the target's)."""
    import dataclasses

    return cfg.target, dataclasses.replace(cfg.drafter, dtype=cfg.target.dtype)


# ----------------------------------------------------------------------------- advice


def advice(row: dict, hbm_bytes: float) -> str:
    """Which config field (or flag) brings a row that does not fit under `hbm_bytes`, from what
    dominates it; "" when it fits."""
    if row["total"] <= hbm_bytes:
        return ""
    resident = row["arguments"] + row["outputs"] - row["aliased"]
    if row["kind"] == "train":
        n = row.get("sequences_per_device", 0)
        if resident > row["temporaries"] or n <= 1:  # nothing left to split by micro-batches
            return "mesh.fsdp, mesh.tensor (weights, Adam state, gradients); drafter.num_anchors, train.max_length"
        return (f"train.microbatches ({n} seq/device at a time), drafter.num_anchors, "
                "train.max_length")
    if row["program"].startswith("prefill"):
        return "--prefill-buckets, --max-len (prompt bucket); --tensor-parallel"
    return "--tensor-parallel (weights, KV heads); --data-parallel, --slots, --max-len (cache)"


# ----------------------------------------------------------------------------- worker and table


def worker(args) -> None:
    """One device count, in this process: prints one JSON line per configuration."""
    import jax

    from dspark_jax.config import MeshConfig, load_config, preset_path
    from dspark_jax.errors import DSparkError
    from dspark_jax.sharding import make_mesh

    n = jax.device_count()
    for layout in args.layouts:
        base = {"devices": n, "kind": args.worker, "layout": layout}
        try:
            if args.worker == "train":
                overrides = [substitute(o, n, args.config) for o in layout.split(",") if o]
                cfg = load_config(preset_path(args.config), overrides)
                mesh = make_mesh(cfg.mesh)
                rows = [{**base, "program": "train step", "mesh": dict(mesh.shape),
                         **train_plan(cfg, mesh)}]
            else:
                D, T = (int(v) for v in layout.split(","))
                if D * T != n:
                    continue
                tcfg, dcfg = decode_models(load_config(preset_path(args.config)))
                mesh = None if n == 1 else make_mesh(MeshConfig(data=D, fsdp=1, tensor=T))
                plans = decode_plan(tcfg, dcfg, args.slots, args.max_len, mesh)
                rows = [{**base, "program": name, "mesh": {"data": D, "fsdp": 1, "tensor": T},
                         **plan} for name, plan in plans.items()]
        except (DSparkError, ValueError) as e:
            rows = [{**base, "error": str(e)}]
        for row in rows:
            print(json.dumps(row), flush=True)


def substitute(override: str, devices: int, config: str) -> str:
    """`{n}`: the device count; `{per}`: the config's global batch over it (at least 1)."""
    from dspark_jax.config import load_config, preset_path

    if "{per}" in override:
        batch = load_config(preset_path(config)).train.global_batch_size
        override = override.replace("{per}", str(max(batch // devices, 1)))
    return override.replace("{n}", str(devices))


def run_worker(kind: str, devices: int, layouts, args) -> list[dict]:
    """A worker subprocess on `devices` fake CPU devices; its rows (peak RSS and wall time added)."""
    repo = Path(__file__).resolve().parents[1]
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
               PYTHONPATH=os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, __file__, "--worker", kind, "--config", args.config,
           "--slots", str(args.slots), "--max-len", str(args.max_len), "--layouts", *layouts]
    time_v = Path("/usr/bin/time")
    if time_v.exists():  # GNU time: the worker's peak RSS
        cmd = [str(time_v), "-f", "MAXRSS_KB %M", *cmd]
    t = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t
    rss = [int(line.split()[1]) for line in proc.stderr.splitlines() if line.startswith("MAXRSS_KB")]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 and not rows:
        rows = [{"devices": devices, "kind": kind, "layout": " ".join(layouts),
                 "error": f"worker exit {proc.returncode}: {proc.stderr.strip()[-400:]}"}]
    for row in rows:
        row.update(worker_wall_s=wall, worker_peak_rss_gib=rss[0] / 2 ** 20 if rss else None)
    return rows


def parse_hbm(text: str) -> list[tuple[str, float]]:
    out = []
    for item in text.split(","):
        name, _, gib = item.partition("=")
        out.append((name.strip(), float(gib)))
    return out


def table(rows: list[dict], hbm: list[tuple[str, float]]) -> str:
    """A markdown table: per-device GiB of each configuration, whether it fits each HBM size,
    and for what does not fit the first one, the field that fixes it."""
    name0, gib0 = hbm[0]
    head = (["what", "devices", "mesh (data, fsdp, tensor)", "arguments", "outputs", "aliased",
             "temporaries", "code", "total"] + [f"fits {n} {g:g} GiB" for n, g in hbm]
            + [f"if not on {name0}: what fixes it", "compile s"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        mesh = r.get("mesh")
        where = "-" if not mesh else f"{mesh['data']}, {mesh['fsdp']}, {mesh['tensor']}"
        what = r.get("program", r["kind"])
        if r["kind"] == "train":
            layout = r["layout"].replace("{n}", str(r["devices"])).replace(
                "{per}", str(r.get("microbatches", "{per}"))) or "preset mesh"
            what = f"train step ({layout}; {r.get('sequences_per_device', '?')} seq/device at a time)"
        if "error" in r:
            lines.append(f"| {what} | {r['devices']} | {where} | " + " | ".join(["-"] * 6)
                         + " | " + " | ".join(["-"] * len(hbm)) + f" | {r['error']} | - |")
            continue
        gib = [f"{r[k] / GIB:.2f}" for k in ("arguments", "outputs", "aliased", "temporaries",
                                              "code", "total")]
        fits = ["yes" if r["total"] <= g * GIB else "no" for _, g in hbm]
        lines.append(f"| {what} | {r['devices']} | {where} | " + " | ".join(gib) + " | "
                     + " | ".join(fits) + f" | {advice(r, gib0 * GIB) or '-'} | "
                     f"{r.get('compile_s', 0):.0f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="dspark-qwen3-8b", help="training preset (name or YAML path)")
    ap.add_argument("--train-devices", default="8,16,64", help="device counts ('' = none)")
    ap.add_argument("--train-layout", action="append", default=None, metavar="OVERRIDES",
                    help="comma-separated config overrides per row (repeatable); default: "
                         + " and ".join(repr(x) for x in DEFAULT_TRAIN_LAYOUTS))
    ap.add_argument("--decode-devices", default="1,8", help="device counts ('' = none)")
    ap.add_argument("--decode-layout", action="append", default=None, metavar="D,T",
                    help="data-parallel,tensor-parallel per row (repeatable); default: "
                         + " ".join(DEFAULT_DECODE_LAYOUTS))
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=8192)
    ap.add_argument("--hbm", default=DEFAULT_HBM,
                    help="per-device memory to compare against, NAME=GiB,...; the first decides "
                         f"the advice (default {DEFAULT_HBM})")
    ap.add_argument("--json", help="also write the rows here")
    ap.add_argument("--table-from", metavar="FILE", help="print the table of rows saved by --json "
                                                          "(nothing is compiled)")
    ap.add_argument("--worker", choices=("train", "decode"), help=argparse.SUPPRESS)
    ap.add_argument("--layouts", nargs="*", default=(), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    hbm = parse_hbm(args.hbm)
    if args.table_from:
        print(table(json.loads(Path(args.table_from).read_text()), hbm))
        return 0
    train_layouts = args.train_layout if args.train_layout is not None else DEFAULT_TRAIN_LAYOUTS
    decode_layouts = args.decode_layout or DEFAULT_DECODE_LAYOUTS
    rows = []
    for kind, counts, layouts in (("train", args.train_devices, train_layouts),
                                  ("decode", args.decode_devices, decode_layouts)):
        for n in (int(c) for c in counts.split(",") if c.strip()):
            got = run_worker(kind, n, layouts, args)
            rows += got
            rss = got[0].get("worker_peak_rss_gib") if got else None
            print(f"{kind} on {n} devices: {len(got)} rows in {got[0]['worker_wall_s']:.0f} s, peak "
                  f"RSS {rss if rss is None else f'{rss:.1f} GiB'}", file=sys.stderr, flush=True)
    print("    " + " ".join(shlex.quote(a) for a in ["python", "benchmarks/memory_plan.py",
                                                    *(sys.argv[1:] if argv is None else argv)]))
    print()
    print(table(rows, hbm))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
