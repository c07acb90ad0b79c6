"""benchmarks/memory_plan.py's abstract path on the tiny preset over 2 fake devices: the train step
and the engine's rounds compile from jax.ShapeDtypeStruct trees (nothing allocated), the abstract
states are the ones `init_state` makes, and the argument bytes XLA reports per device are the
per-device shards of those trees."""

import importlib.util
import math
from pathlib import Path

import jax
import pytest

from dspark_jax.config import MeshConfig, load_config, preset_path
from dspark_jax.sharding import make_mesh

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "memory_plan.py"


@pytest.fixture(scope="module")
def memory_plan():
    spec = importlib.util.spec_from_file_location("memory_plan", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def shard_bytes(tree) -> int:
    """Bytes of one device's shards of every leaf (the shards are even: the mesh divides)."""
    total = 0
    for x in jax.tree.leaves(tree):
        shape = x.shape if x.sharding is None else x.sharding.shard_shape(x.shape)
        total += math.prod(shape) * x.dtype.itemsize  # key<fry> too: 8 bytes
    return total


def same_layout(abstract, concrete) -> None:
    a, c = jax.tree.leaves_with_path(abstract), jax.tree.leaves(concrete)
    assert len(a) == len(c)
    for (path, x), y in zip(a, c):
        name = jax.tree_util.keystr(path)
        assert (x.shape, x.dtype) == (y.shape, y.dtype), name
        assert x.sharding.is_equivalent_to(y.sharding, len(x.shape)), (name, x.sharding, y.sharding)


def test_train_step_plan_on_two_devices(memory_plan):
    from dspark_jax.models.target import target_spec
    from dspark_jax.params import abstract
    from dspark_jax.training.train_step import abstract_state, init_state, make_optimizer

    cfg = load_config(preset_path("dspark-tiny"), ["mesh.data=1", "mesh.fsdp=2"])
    mesh = make_mesh(cfg.mesh)
    opt = make_optimizer(cfg, total_steps=1000)
    state = abstract_state(cfg, opt, mesh)
    same_layout(state, init_state(cfg, opt, jax.random.key(0), mesh))

    plan = memory_plan.train_plan(cfg, mesh)
    B, L, N = cfg.train.global_batch_size, cfg.train.max_length, cfg.drafter.num_anchors
    # ids, loss mask, anchors, keep (jit drops attention_mask: the DSpark loss does not read it)
    batch = (B // 2) * (L * (4 + 1) + N * (4 + 1))
    assert plan["arguments"] == shard_bytes(state) + shard_bytes(
        abstract(target_spec(cfg.target), mesh)) + batch
    assert plan["sequences_per_device"] == B // 2
    assert plan["temporaries"] > 0
    assert plan["total"] == (plan["arguments"] + plan["outputs"] - plan["aliased"]
                             + plan["temporaries"] + plan["code"])


def test_decode_plan_on_two_devices(memory_plan):
    from dspark_jax.decoding.schedulers import SchedulerConfig
    from dspark_jax.decoding.state import EngineShape, abstract_state, init_state
    from dspark_jax.models.drafter import drafter_spec
    from dspark_jax.models.target import target_spec
    from dspark_jax.params import abstract

    tcfg, dcfg = memory_plan.decode_models(load_config(preset_path("dspark-tiny")))
    mesh = make_mesh(MeshConfig(data=1, fsdp=1, tensor=2))
    slots, max_len = 2, 64
    shape = EngineShape(tcfg=tcfg, dcfg=dcfg, slots=slots, max_len=max_len, max_stop_ids=8,
                        scheduler=SchedulerConfig())
    state = abstract_state(shape, mesh)
    same_layout(state, init_state(shape, 0, mesh))

    on_two = memory_plan.decode_plan(tcfg, dcfg, slots, max_len, mesh)
    verify = f"verify (topk {slots * (dcfg.block_size + 1)} tokens)"
    assert list(on_two) == [verify, f"plain ({slots} tokens)", f"prefill ({slots} x {max_len})"]
    resident = shard_bytes(state) + shard_bytes(abstract(target_spec(tcfg), mesh)) + shard_bytes(
        abstract(drafter_spec(tcfg, dcfg), mesh))
    assert on_two[verify]["arguments"] == resident
    assert on_two[verify]["aliased"] > 0  # the donated state is updated in place
    # the caches and weights split over tensor: less per device than on one
    on_one = memory_plan.decode_plan(tcfg, dcfg, slots, max_len, None,
                                     {verify: ("topk", slots * (dcfg.block_size + 1))})
    assert on_two[verify]["arguments"] < on_one[verify]["arguments"]


def test_table_says_what_does_not_fit_and_what_fixes_it(memory_plan):
    gib = memory_plan.GIB
    rows = [{"kind": "train", "layout": "", "devices": 8, "mesh": {"data": 8, "fsdp": 1, "tensor": 1},
             "program": "train step", "arguments": 30 * gib, "outputs": 20 * gib, "aliased": 20 * gib,
             "temporaries": 200 * gib, "code": 0, "total": 230 * gib, "sequences_per_device": 64},
            {"kind": "decode", "layout": "1,1", "devices": 1, "mesh": {"data": 1, "fsdp": 1, "tensor": 1},
             "program": "verify (topk 512 tokens)", "arguments": 90 * gib, "outputs": 80 * gib,
             "aliased": 80 * gib, "temporaries": gib, "code": 0, "total": 91 * gib},
            {"kind": "decode", "layout": "1,8", "devices": 8, "mesh": {"data": 1, "fsdp": 1, "tensor": 8},
             "program": "plain (64 tokens)", "arguments": 12 * gib, "outputs": 10 * gib,
             "aliased": 10 * gib, "temporaries": gib, "code": 0, "total": 13 * gib}]
    text = memory_plan.table(rows, memory_plan.parse_hbm("H100=80,H200=141"))
    lines = text.splitlines()
    assert lines[0].startswith("| what | devices |") and "fits H100 80 GiB" in lines[0]
    assert "train.microbatches (64 seq/device at a time)" in lines[2]
    assert "| no | no |" in lines[2]
    # at one sequence per device at a time, micro-batches cannot help: the replicated state must go
    one = dict(rows[0], sequences_per_device=1, layout="train.microbatches={per}", microbatches=64)
    line = memory_plan.table([one], memory_plan.parse_hbm("H100=80")).splitlines()[2]
    assert line.startswith("| train step (train.microbatches=64; 1 seq/device at a time) |"), line
    assert "mesh.fsdp, mesh.tensor" in line and "train.microbatches (" not in line, line
    assert "--tensor-parallel" in lines[3] and "| no | yes |" in lines[3]
    assert lines[4].endswith("| yes | yes | - | 0 |")
