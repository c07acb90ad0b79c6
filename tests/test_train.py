"""Drafter training end to end on the tiny preset: learning, exact resume, signals, SIGKILL during a
save, non-finite loss, changed config, bad input, export."""

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from dspark_jax.config import load_config, preset_path
from dspark_jax.errors import ConfigError, DataError
from dspark_jax.formats import deepspec
from dspark_jax.training import trainer

REPO = Path(__file__).resolve().parents[1]


def overrides(tiny_target, workdir, *extra):
    target, data = tiny_target
    return [f"train.target_dir={target}", f"train.data_file={data}", f"train.workdir={workdir}",
            "mesh.data=1", *extra]


def make_cfg(tiny_target, workdir, *extra, preset="dspark-tiny"):
    return load_config(preset_path(preset), overrides(tiny_target, workdir, *extra))


def train(cfg, stop_after=None):
    """Runs training; returns ({step: metrics}, summary)."""
    seen = {}
    calls = {"n": 0}

    def should_stop():
        calls["n"] += 1
        return stop_after is not None and calls["n"] > stop_after

    summary = trainer.run(cfg, on_step=lambda s: seen.__setitem__(s.step, s.metrics),
                          should_stop=should_stop)
    return seen, summary


@pytest.mark.parametrize("preset, keys", [("dspark-tiny", ("loss", "accept_rate")),
                                          ("eagle3-tiny", ("loss", "accuracy", "step_loss"))])
def test_padding_to_the_batch_longest_keeps_the_losses(tiny_target, tmp_path, preset, keys):
    """train.pad_to_multiple: batches cut to their longest record (rounded up to 16 of the 128
    positions) train to the same losses and accuracies as full-length ones."""
    cfgs = [make_cfg(tiny_target, tmp_path / f"run{m}", "train.max_steps=4", "train.log_every=1",
                     "train.max_length=128", f"train.pad_to_multiple={m}", preset=preset) for m in (0, 16)]
    cut = trainer.setup(cfgs[1]).iterator
    assert min(next(cut)["input_ids"].shape[1] for _ in range(4)) < cfgs[0].train.max_length
    runs = [train(cfg)[0] for cfg in cfgs]
    for step in range(1, 5):
        for key in keys:
            np.testing.assert_allclose(runs[1][step][key], runs[0][step][key], rtol=2e-5, atol=1e-6,
                                       err_msg=f"step {step} {key}")


def test_microbatches_train_to_the_same_losses(tiny_target, tmp_path):
    """train.microbatches=4 (micro-batches of 2 sequences run in turn, gradients summed as one
    batch's) trains to the losses of the one-batch run; a micro-batch count that does not divide
    the global batch is refused before anything is written."""
    runs = [train(make_cfg(tiny_target, tmp_path / f"run{m}", "train.max_steps=3", "train.log_every=1",
                           f"train.microbatches={m}"))[0] for m in (1, 4)]
    for step in range(1, 4):
        for key in ("loss", "loss_ce", "grad_norm"):
            np.testing.assert_allclose(runs[1][step][key], runs[0][step][key], rtol=2e-5, atol=1e-6,
                                       err_msg=f"step {step} {key}")
    with pytest.raises(ConfigError, match="train.microbatches 3: must divide train.global_batch_size 8"):
        trainer.run(make_cfg(tiny_target, tmp_path / "bad", "train.microbatches=3"))
    assert not (tmp_path / "bad").exists()


@pytest.mark.parametrize("preset", ["dspark-tiny", "dflash-tiny"])
def test_training_lowers_loss_and_raises_acceptance(tiny_target, tmp_path, preset):
    cfg = make_cfg(tiny_target, tmp_path / "run", "train.max_steps=40", "train.log_every=1",
                   preset=preset)
    seen, summary = train(cfg)
    assert summary["step"] == 40 and sorted(seen) == list(range(1, 41))
    loss = np.array([seen[s]["loss"] for s in sorted(seen)])
    acc0 = np.array([seen[s]["accept_rate"][0] for s in sorted(seen)])
    assert loss[-5:].mean() < 0.9 * loss[:5].mean(), loss
    assert acc0[-5:].mean() > acc0[:5].mean() + 0.05, acc0
    if preset == "dflash-tiny":
        assert "loss_confidence" not in seen[40]
    else:
        assert abs(seen[40]["confidence_bias"]) < 0.5


def check_resume_is_bit_exact(make, tmp_path, steps: int, every: int, stop: int) -> None:
    """A run stopped at `stop` and resumed logs the losses of an uninterrupted one, step for step;
    `make(workdir, *overrides)` builds the config."""
    extra = (f"train.max_steps={steps}", "train.log_every=1", f"train.checkpoint_every={every}")
    straight, _ = train(make(tmp_path / "a", *extra))
    cfg_b = make(tmp_path / "b", *extra)
    first, summary = train(cfg_b, stop_after=stop)
    assert summary["stopped"] == "signal" and summary["step"] == stop
    resumed, summary = train(cfg_b)
    assert summary["step"] == steps and sorted(resumed) == list(range(stop + 1, steps + 1))
    for step in range(1, steps + 1):
        got = first.get(step) or resumed[step]
        assert got["loss"] == straight[step]["loss"], step
        assert got["accept_rate"] == straight[step]["accept_rate"], step


def test_resume_is_bit_exact(tiny_target, tmp_path):
    check_resume_is_bit_exact(lambda work, *extra: make_cfg(tiny_target, work, *extra), tmp_path,
                              steps=12, every=4, stop=6)


def test_cache_trains_as_jsonl_and_resumes_across_sources(tiny_target, tiny_cache, tmp_path):
    """The losses of a run on the tokenized cache are those of the JSONL file, bit for bit; a run
    started on the cache resumes on the JSONL file (tests/test_multiprocess.py: the other way)."""
    extra = ("train.max_steps=8", "train.log_every=1", "train.checkpoint_every=4")
    straight, _ = train(make_cfg(tiny_target, tmp_path / "a", *extra))
    first, summary = train(make_cfg(tiny_target, tmp_path / "b", *extra, f"train.data_file={tiny_cache}"),
                           stop_after=5)
    assert summary["stopped"] == "signal" and summary["step"] == 5
    assert summary["input_wait_s_per_step"] > 0
    resumed, summary = train(make_cfg(tiny_target, tmp_path / "b", *extra))
    assert summary["step"] == 8 and sorted(resumed) == [6, 7, 8]
    for step in range(1, 9):
        got = first.get(step) or resumed[step]
        assert got["loss"] == straight[step]["loss"], step
        assert got["accept_rate"] == straight[step]["accept_rate"], step


def tree_hashes(directory: Path) -> dict[str, str]:
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def test_bad_cache_is_refused_before_checkpoints_are_touched(tiny_target, tiny_cache, tmp_path):
    """A stale, unfinished, incomplete or damaged cache: one error each, raised before the
    workdir's checkpoints are opened; the good cache then resumes them."""
    work = tmp_path / "run"
    train(make_cfg(tiny_target, work, "train.max_steps=4", "train.checkpoint_every=2"))
    before = tree_hashes(work)
    assert any(name.startswith("checkpoints/4/") for name in before), before

    def broken(name, damage):
        copy = tmp_path / name
        shutil.copytree(tiny_cache, copy)
        damage(copy)
        return copy

    def flip(path):
        data = bytearray(path.read_bytes())
        data[100] ^= 0xFF
        path.write_bytes(bytes(data))

    cases = [
        (tiny_cache, ["train.max_length=48"], r"cache: stale: made with max_length 64 \(the run's: 48\)"),
        (broken("unfinished", lambda c: (c / "manifest.json").unlink()), [],
         r"unfinished: an unfinished tokenized cache"),
        (broken("missing", lambda c: (c / "shard-00001.arrayrecord").unlink()), [],
         r"shard-00001.arrayrecord: missing shard \(2 of the 3"),
        (broken("damaged", lambda c: flip(c / "shard-00002.arrayrecord")), [],
         r"shard-00002.arrayrecord: corrupt shard: its sha256"),
    ]
    for cache, extra, pattern in cases:
        cfg = make_cfg(tiny_target, work, "train.max_steps=6", "train.checkpoint_every=2",
                       f"train.data_file={cache}", *extra)
        with pytest.raises(DataError, match=pattern):
            trainer.run(cfg)
        assert tree_hashes(work) == before, pattern
    logs = []
    cfg = make_cfg(tiny_target, work, "train.max_steps=6", "train.checkpoint_every=2",
                   f"train.data_file={tiny_cache}")
    assert trainer.run(cfg, log=logs.append)["step"] == 6
    assert any(line.startswith("resumed from") and line.endswith("/4") for line in logs), logs


def test_changed_model_config_refuses_to_resume(tiny_target, tmp_path):
    train(make_cfg(tiny_target, tmp_path / "run", "train.max_steps=2", "train.checkpoint_every=2"))
    cfg = make_cfg(tiny_target, tmp_path / "run", "train.max_steps=4", "drafter.markov_rank=8")
    with pytest.raises(ConfigError, match=r"cannot resume with a changed model config: "
                                          r"drafter.markov_rank: checkpoint 16, now 8"):
        trainer.run(cfg)


def test_non_finite_loss_stops_and_keeps_last_good_checkpoint(tiny_target, tmp_path):
    cfg = make_cfg(tiny_target, tmp_path / "run", "train.max_steps=30", "train.checkpoint_every=1",
                   "train.learning_rate=1e30", "train.warmup_ratio=0")
    with pytest.raises(trainer.TrainingError, match=r"non-finite loss .* at step (\d+).*Last good "
                                                    r"checkpoint: step (\d+)") as e:
        trainer.run(cfg)
    bad, good = map(int, __import__("re").search(r"at step (\d+).*step (\d+)", str(e.value)).groups())
    assert good == bad - 1
    _, params, step = trainer.load_drafter_params(tmp_path / "run")
    assert step == good
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(params))


def test_bad_inputs(tiny_target, tmp_path):
    with pytest.raises(DataError, match="missing.jsonl"):
        trainer.run(make_cfg(tiny_target, tmp_path / "r", f"train.data_file={tmp_path}/missing.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"conversations": []}\n{not json\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2"):
        trainer.run(make_cfg(tiny_target, tmp_path / "r", f"train.data_file={bad}"))
    with pytest.raises(ConfigError, match=r"does not match the config's target section: "
                                          r"target.intermediate_size: config 96 != checkpoint 128"):
        trainer.run(make_cfg(tiny_target, tmp_path / "r", "target.intermediate_size=96"))
    with pytest.raises(ConfigError, match=r"target_layer_ids: \[5\] out of range"):
        make_cfg(tiny_target, tmp_path / "r", "target.target_layer_ids=[0, 5]")
    with pytest.raises(ConfigError, match=r"train.max_length: 4 must exceed drafter.block_size 4"):
        make_cfg(tiny_target, tmp_path / "r", "train.max_length=4")


def test_short_sequences_are_skipped_and_counted(tiny_target, tmp_path):
    data = tmp_path / "mixed.jsonl"
    lines = tiny_target[1].read_text().splitlines()[:40]
    # Too short: the cut to max_length (64) leaves no supervised token.
    lines += [json.dumps({"conversations": [{"role": "user", "content": "apple " * 80},
                                            {"role": "assistant", "content": "river"}]})] * 3
    lines += [json.dumps({"conversations": [{"role": "user", "content": "no answer"}]})] * 2
    lines += ["{not json"]
    data.write_text("\n".join(lines) + "\n")
    logs = []
    cfg = make_cfg(tiny_target, tmp_path / "r", f"train.data_file={data}", "train.max_steps=1")
    trainer.run(cfg, log=logs.append)
    stats = next(line for line in logs if line.startswith("data:"))
    assert "'skipped_no_assistant': 2" in stats and "'skipped_too_short': 3" in stats
    assert "'skipped_bad': 1" in stats
    assert any(line.startswith(f"skipped a bad record: {data}:{len(lines)}: invalid JSON") for line in logs)


def cli(*args, **kwargs):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, *args], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, **kwargs)


def wait_for_line(proc, pattern, timeout=300):
    lines, deadline = [], time.time() + timeout
    while time.time() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if pattern in line:
            return lines
    proc.kill()
    raise AssertionError(f"never saw {pattern!r}:\n{''.join(lines)}")


def test_cli_sigterm_saves_and_exits_cleanly(tiny_target, tmp_path):
    work = tmp_path / "run"
    proc = cli("-m", "train.drafter", "--config", "dspark-tiny",
               *overrides(tiny_target, work, "train.max_steps=100000", "train.log_every=1",
                          "train.checkpoint_every=1000"))
    wait_for_line(proc, "step 3 |")
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 0, out
    assert "SIGTERM: saving a checkpoint and exiting" in out
    final = int(out.split("finished at step ")[1].split()[0])
    _, _, step = trainer.load_drafter_params(work)
    assert step == final >= 3
    assert list((work / "tb").glob("events.out.tfevents.*"))


def test_cli_sigkill_during_save_resumes_from_last_complete(tiny_target, tmp_path):
    work = tmp_path / "run"
    args = overrides(tiny_target, work, "train.max_steps=100000", "train.log_every=1",
                     "train.checkpoint_every=1", "train.keep_checkpoints=3")
    proc = cli("-m", "train.drafter", "--config", "dspark-tiny", *args)
    wait_for_line(proc, "step 6 |")
    proc.send_signal(signal.SIGKILL)  # saves run every step: very likely mid-save
    proc.communicate(timeout=60)
    ckpts = work / "checkpoints"
    complete = sorted(int(p.name) for p in ckpts.iterdir() if p.name.isdigit())
    assert complete, list(ckpts.iterdir())
    logs = []
    cfg = load_config(preset_path("dspark-tiny"), args[:-4] + ["train.max_steps=" + str(complete[-1] + 2)])
    summary = trainer.run(cfg, log=logs.append)
    resumed = [line for line in logs if line.startswith("resumed from")]
    assert resumed and resumed[0].endswith(f"/{complete[-1]}"), (logs, complete)
    assert summary["step"] == complete[-1] + 2


def test_export_cli_round_trip(tiny_target, tmp_path):
    work = tmp_path / "run"
    train(make_cfg(tiny_target, work, "train.max_steps=3"))
    out = tmp_path / "exported"
    proc = cli("-m", "train.export", "--checkpoint", str(work), "--out", str(out))
    text = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, text
    cfg, params, _ = trainer.load_drafter_params(work)
    _, target_params = trainer.load_target_for(cfg, None)
    dcfg, imported = deepspec.load_drafter(out, cfg.target, target_params)
    assert dcfg == cfg.drafter
    jax.tree.map(np.testing.assert_array_equal, params, imported)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen3DSparkModel"] and config["block_size"] == 4
    proc = cli("-m", "train.export", "--checkpoint", str(tmp_path / "nope"), "--out", str(out))
    text = proc.communicate(timeout=300)[0]
    assert proc.returncode == 2 and "no checkpoints" in text
