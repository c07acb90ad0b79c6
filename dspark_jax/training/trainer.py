"""The drafter training run: setup, orbax checkpoints with exact resume, and the step loop.

The library never prints: `run` reports through a `log` callback and checks a `should_stop` callback
between steps (the command line turns SIGTERM/SIGINT into that). Metrics of step N are read back
while step N+1 runs, so logging never stalls the device.
"""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np
import orbax.checkpoint as ocp

from dspark_jax.config import Config, from_dict, to_dict
from dspark_jax.distributed import any_process
from dspark_jax.errors import CheckpointError, ConfigError, DSparkError
from dspark_jax.formats import hf_checkpoint
from dspark_jax.formats.tokenizer import load_tokenizer
from dspark_jax.models.target import target_spec
from dspark_jax.params import abstract, count_params, init_params
from dspark_jax.sharding import describe_mesh, make_mesh
from dspark_jax.training.data import BatchIterator, make_global_batch
from dspark_jax.training.token_cache import TokenizedCache, open_training_data
from dspark_jax.training.train_step import (
    BATCH_AXES,
    TrainState,
    check_microbatches,
    describe_params,
    drafter_kind,
    drafter_params_spec,
    init_state,
    make_optimizer,
    make_train_step,
    state_shardings,
)

# Config sections that must not change between a checkpoint and its resume, and the keys in them
# that only choose how to compute (free to change).
MODEL_SECTIONS = ("target", "drafter")
COMPUTE_ONLY_KEYS = {("drafter", "attention_chunk")}


class TrainingError(DSparkError):
    """Training cannot go on (non-finite loss, ...); the last good checkpoint is intact."""


@dataclasses.dataclass
class Setup:
    cfg: Config
    mesh: Any
    target_params: Any
    iterator: BatchIterator
    total_steps: int
    optimizer: Any
    data_stats: dict
    data_errors: tuple[str, ...]  # why each skipped bad record was skipped
    data_source: str  # what the records were read from (for the log)


def load_target_for(cfg: Config, mesh):
    """The frozen target: a Hugging Face directory (architecture must match the config's target
    section), or random weights when `train.target_dir` is empty."""
    t = cfg.target
    if not cfg.train.target_dir:
        return cfg, init_params(target_spec(t), jax.random.key(cfg.train.seed + 1), mesh)
    tcfg, params = hf_checkpoint.load_target(
        cfg.train.target_dir, mesh=mesh, target_layer_ids=list(t.target_layer_ids),
        mask_token_id=t.mask_token_id, dtype=t.dtype)
    diff = [f"target.{f.name}: config {getattr(t, f.name)} != checkpoint {getattr(tcfg, f.name)}"
            for f in dataclasses.fields(t) if getattr(t, f.name) != getattr(tcfg, f.name)]
    if diff:
        raise ConfigError(f"{cfg.train.target_dir}/config.json does not match the config's target "
                          "section: " + "; ".join(diff))
    return cfg, params


def setup(cfg: Config) -> Setup:
    """Data first (a bad file or cache is refused before the target loads), then mesh and target.
    Touches nothing in the workdir."""
    tok_dir = cfg.train.tokenizer_dir or cfg.train.target_dir
    if not cfg.train.data_file:
        raise ConfigError("train.data_file: required (a JSONL file of conversations or a tokenized "
                          "cache directory)")
    if not tok_dir:
        raise ConfigError("train.tokenizer_dir: required when train.target_dir is empty")
    tokenizer = load_tokenizer(tok_dir)
    if tokenizer.vocab_size > cfg.target.vocab_size:
        raise ConfigError(f"{tok_dir}: tokenizer has {tokenizer.vocab_size} tokens, more than "
                          f"target.vocab_size {cfg.target.vocab_size}")
    records = open_training_data(cfg.train.data_file, tokenizer, max_length=cfg.train.max_length,
                                 min_length=cfg.drafter.proposal_length + 1,
                                 enable_thinking=cfg.train.enable_thinking,
                                 system_prompt=cfg.train.system_prompt,
                                 verify=cfg.train.verify_data_cache)
    iterator = BatchIterator(records, global_batch_size=cfg.train.global_batch_size,
                             num_anchors=drafter_kind(cfg).num_anchors(cfg.drafter),
                             block_size=cfg.drafter.proposal_length,
                             seed=cfg.train.seed, process_index=jax.process_index(),
                             process_count=jax.process_count(),
                             pad_to_multiple=cfg.train.pad_to_multiple,
                             workers=cfg.train.data_workers)
    kind = (f"tokenized cache, {records.num_shards} shards" if isinstance(records, TokenizedCache)
            else "JSONL")
    mesh = make_mesh(cfg.mesh)
    check_microbatches(cfg, math.prod(mesh.shape[a] for a in BATCH_AXES))
    cfg, target_params = load_target_for(cfg, mesh)
    total = cfg.train.max_steps or max(1, math.ceil(cfg.train.epochs * iterator.steps_per_epoch))
    return Setup(cfg=cfg, mesh=mesh, target_params=target_params, iterator=iterator,
                 total_steps=total, optimizer=make_optimizer(cfg, total),
                 data_stats=records.stats.as_dict(), data_errors=records.errors,
                 data_source=f"{records.path} ({kind}; {len(records)} records; "
                             f"{cfg.train.data_workers} batch workers)")


# ----------------------------------------------------------------------------- checkpoints


def checkpoint_manager(cfg: Config) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(
        max_to_keep=cfg.train.keep_checkpoints, save_interval_steps=cfg.train.checkpoint_every,
        enable_async_checkpointing=cfg.train.async_checkpointing, create=True)
    return ocp.CheckpointManager(Path(cfg.train.workdir).absolute() / "checkpoints",
                                 options=options, item_names=("state", "data", "config"))


def save_checkpoint(mngr: ocp.CheckpointManager, state: TrainState, iterator_state: dict,
                    cfg: Config, total_steps: int) -> bool:
    """Saves (asynchronously) the train state, the data position and the resolved config."""
    step = int(jax.device_get(state.step))
    data = {"iterator": iterator_state, "total_steps": total_steps}
    return mngr.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data),
        config=ocp.args.JsonSave(to_dict(cfg))), force=True)


def check_resumable(saved: dict, cfg: Config, where: str) -> None:
    """A resumed run must have the model it was saved with."""
    try:  # keys added since the checkpoint was written take their defaults (`drafter.kind`: dspark)
        saved = to_dict(from_dict(Config, saved))
    except ConfigError:
        pass  # compared as written: the differences below name the keys
    was = saved.get("drafter", {}).get("kind", "dspark")
    if was != cfg.drafter.kind:
        raise ConfigError(f"{where}: cannot resume: the checkpoint's drafter.kind is {was!r}, the "
                          f"config's {cfg.drafter.kind!r}")
    now = to_dict(cfg)
    diff = []
    for section in MODEL_SECTIONS:
        for key in sorted(set(saved.get(section, {})) | set(now[section])):
            if (section, key) in COMPUTE_ONLY_KEYS:
                continue
            a, b = saved.get(section, {}).get(key), now[section].get(key)
            if a != b:
                diff.append(f"{section}.{key}: checkpoint {a!r}, now {b!r}")
    if diff:
        raise ConfigError(f"{where}: cannot resume with a changed model config: " + "; ".join(diff))


def restore_checkpoint(mngr: ocp.CheckpointManager, template: TrainState, cfg: Config,
                       step: int | None = None):
    """(state, {"iterator": data position, "total_steps": n}, step) of `step` (default: the
    latest complete one), or None."""
    step = mngr.latest_step() if step is None else step
    if step is None:
        return None
    where = f"{mngr.directory}/{step}"
    saved_cfg = mngr.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore())).config
    check_resumable(saved_cfg, cfg, where)
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                          template)
    restored = mngr.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(target), data=ocp.args.JsonRestore()))
    return restored.state, restored.data, step


def load_drafter_params(workdir: str | Path, step: int | None = None):
    """(Config, drafter params, step) from a training workdir's orbax checkpoint (`cfg.drafter` says
    the drafter's kind)."""
    directory = Path(workdir).absolute() / "checkpoints"
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: no checkpoints (is {workdir} a training workdir?)")
    mngr = ocp.CheckpointManager(directory, item_names=("state", "data", "config"))
    steps = mngr.all_steps()
    step = steps[-1] if step is None and steps else step
    if step is None or step not in steps:
        raise CheckpointError(f"{directory}: step {step} not found; available steps {list(steps)}")
    cfg = from_dict(Config, mngr.restore(step, args=ocp.args.Composite(
        config=ocp.args.JsonRestore())).config)
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
                          abstract(drafter_params_spec(cfg)))
    restored = mngr.restore(step, args=ocp.args.Composite(
        state=ocp.args.PyTreeRestore(
            partial_restore=True, item={"params": params},
            restore_args=ocp.checkpoint_utils.construct_restore_args({"params": params}))))
    mngr.close()
    return cfg, restored.state["params"], step


# ----------------------------------------------------------------------------- the loop


@dataclasses.dataclass
class StepLog:
    step: int
    metrics: dict[str, Any]  # floats, or lists for per-position metrics
    tokens_per_s: float
    eta_s: float
    input_wait_s: float = 0.0  # mean time per step blocked on the next batch, since the last report


def _host_metrics(metrics) -> dict[str, Any]:
    host = jax.device_get(metrics)
    return {k: (v.tolist() if np.ndim(v) else float(v)) for k, v in host.items()}


def run(cfg: Config, *, log: Callable[[str], None] = lambda s: None,
        on_step: Callable[[StepLog], None] = lambda s: None,
        should_stop: Callable[[], bool] = lambda: False) -> dict:
    """Trains until the step budget, a stop request or an error; returns a summary dict."""
    s = setup(cfg)
    cfg = s.cfg
    log(f"{describe_mesh(s.mesh)}; jax {jax.__version__}; {jax.process_count()} processes")
    log(f"data: {s.data_source}: {s.data_stats}; {s.iterator.steps_per_epoch} steps/epoch; "
        f"{s.total_steps} steps")
    for error in s.data_errors[:5]:
        log(f"skipped a bad record: {error}")
    if len(s.data_errors) > 5:
        log(f"... and {len(s.data_errors) - 5} more bad records")
    state = init_state(cfg, s.optimizer, jax.random.key(cfg.train.seed), s.mesh)
    log(f"drafter ({cfg.drafter.kind}): {count_params(state.params) / 1e6:.2f}M params; target: "
        f"{count_params(s.target_params) / 1e6:.2f}M params (frozen)")
    for line in describe_params(drafter_params_spec(cfg), s.mesh):
        log("  " + line)
    shard = state_shardings(state)
    mngr = checkpoint_manager(cfg)
    resumed = restore_checkpoint(mngr, state, cfg)
    if resumed is not None:
        state, data, step = resumed
        # Resharding onto another mesh runs programs of its own; let them finish before the first
        # step, so that no two programs' collectives are in flight on the same devices at once.
        state = jax.block_until_ready(state)
        s.iterator.restore(data["iterator"])
        log(f"resumed from {mngr.directory}/{step}")
        saved_total = data["total_steps"]
        if saved_total != s.total_steps:
            log(f"warning: the run now has {s.total_steps} steps, the checkpoint's run had "
                f"{saved_total}: the learning-rate schedule changes from here on")
    step_fn = make_train_step(cfg, s.optimizer, shard)
    start_step = int(jax.device_get(state.step))
    tokens_per_step = cfg.train.global_batch_size * cfg.train.max_length
    pending: list[tuple[int, Any]] = []  # (step, device metrics) not yet checked on the host
    last_good = mngr.latest_step()
    t0, timed_steps, last, last_step = None, 0, {}, start_step
    last_reported = start_step
    waits = {"total": 0.0, "steps": 0, "since_report": 0.0, "steps_since_report": 0}

    def check(items):
        """Reads metrics back; a non-finite loss stops the run before anything is saved."""
        nonlocal last, last_step
        for step_no, m in items:
            host = _host_metrics(m)
            if not np.isfinite(host["loss"]):
                raise TrainingError(f"non-finite loss {host['loss']} at step {step_no}; stopping. "
                                    f"Last good checkpoint: step {last_good} in {mngr.directory}")
            last, last_step = host, step_no

    def drain():
        check(pending)
        pending.clear()

    def report(step):
        nonlocal last_reported
        if last_step <= last_reported:
            return
        last_reported = last_step
        rate = timed_steps / max(time.perf_counter() - t0, 1e-9) if t0 else 0.0
        wait = waits["since_report"] / max(waits["steps_since_report"], 1)
        waits["since_report"], waits["steps_since_report"] = 0.0, 0
        on_step(StepLog(step=last_step, metrics=last, tokens_per_s=rate * tokens_per_step,
                        eta_s=(s.total_steps - step - 1) / rate if rate else float("nan"),
                        input_wait_s=wait))

    stopped = "done"
    try:
        for step in range(start_step, s.total_steps):
            # A signal reaches the processes of a job at different times: stop together, or the
            # ones that go on would wait forever in the next step's collectives.
            if any_process(should_stop()):
                stopped = "signal"
                break
            t_wait = time.perf_counter()
            local = next(s.iterator)
            t_wait = time.perf_counter() - t_wait
            waits["total"] += t_wait
            waits["since_report"] += t_wait
            waits["steps"] += 1
            waits["steps_since_report"] += 1
            batch = make_global_batch(local, s.mesh)
            state, metrics = step_fn(state, s.target_params, batch)
            pending.append((step + 1, metrics))
            if step == start_step:  # the first step includes compilation
                jax.block_until_ready(metrics)
                t0 = time.perf_counter()
            else:
                timed_steps += 1
            if (step + 1) % cfg.train.log_every == 0:
                # Report the previous step's metrics (ready by now) while this one runs.
                check(pending[:-1])
                del pending[:-1]
                report(step)
            if (step + 1) % cfg.train.checkpoint_every == 0 or step + 1 == s.total_steps:
                drain()  # never save a state whose loss went non-finite
                save_checkpoint(mngr, state, s.iterator.state(), cfg, s.total_steps)
                last_good = step + 1
        drain()
        report(s.total_steps - 1)
        if stopped == "signal" and int(jax.device_get(state.step)) != (mngr.latest_step() or 0):
            save_checkpoint(mngr, state, s.iterator.state(), cfg, s.total_steps)
            log(f"stop requested: saved step {int(jax.device_get(state.step))}")
    finally:
        s.iterator.close()
        mngr.wait_until_finished()
        mngr.close()
    return {"step": int(jax.device_get(state.step)), "stopped": stopped, "last_metrics": last,
            "workdir": str(Path(cfg.train.workdir).absolute()),
            "input_wait_s_per_step": waits["total"] / max(waits["steps"], 1)}

