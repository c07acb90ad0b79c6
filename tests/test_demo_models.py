"""`python -m train.demo_models` end to end on the tiny presets: target, regenerated answers, a
DSpark and a DFlash drafter with the same data and budget, DeepSpec export, calibration; a rerun
finds everything done."""

import json

from train import demo_models


def test_demo_models_builds_and_resumes(tmp_path, capsys):
    out = tmp_path / "demo"
    argv = ["--out", str(out), "--target-preset", "tiny", "--target-steps", "3",
            "--target-max-length", "64", "--math-items", "30",
            "--drafters", "dspark=dspark-tiny,dflash=dflash-tiny", "--drafter-steps", "2",
            "--drafter-set", "train.global_batch_size=2", "--regenerate-limit", "12",
            "--regenerate-max-new-tokens", "12", "--regenerate-slots", "4",
            "--regenerate-max-len", "256", "--calibrate-max-new-tokens", "8",
            "--calibrate-slots", "4", "--calibrate-max-len", "256",
            "--calibrate-prefill-buckets", "256", "--calibrate-samples", "2"]
    assert demo_models.main(argv) == 0
    regenerated = [json.loads(x) for x in (out / "data/regenerated.jsonl").read_text().splitlines()]
    assert len(regenerated) == 12 and all(r["conversations"][-1]["role"] == "assistant"
                                          for r in regenerated)
    for name in ("dspark", "dflash"):
        config = json.loads((out / "drafters" / name / "config.json").read_text())
        assert (out / "drafters" / name / "model.safetensors").stat().st_size > 0
        assert config["block_size"] == 4
    sts = json.loads((out / "drafters/dspark/sts.json").read_text())  # the drafter with a confidence head
    assert sts["method"] == "sts-rank" and sts["samples"] == 2
    assert not (out / "drafters/dflash/sts.json").exists()
    stages = json.loads((out / "demo_models.json").read_text())["runs"][0]["stages"]
    assert [s["stage"] for s in stages] == ["target", "regenerate", "drafter dspark",
                                            "calibrate dspark", "drafter dflash"]
    capsys.readouterr()
    assert demo_models.main(argv) == 0
    assert "nothing left to do" in capsys.readouterr().out
    assert len(json.loads((out / "demo_models.json").read_text())["runs"]) == 2

    # train.bundle: the same models, the drafters without the target's copies, loading as before
    import jax
    import numpy as np

    from dspark_jax.formats.deepspec import SHARED_KEYS, load_pair
    from dspark_jax.formats.safetensors_io import CheckpointFiles
    from train import bundle

    into = tmp_path / "bundle"
    assert bundle.main(["--from", str(out), "--into", str(into), "--drafters", "dspark,dflash",
                        "--samples", "2,1,1"]) == 0
    manifest = json.loads((into / "MANIFEST.json").read_text())
    assert manifest["drafters"] == {"tiny-dspark": "drafters/dspark", "tiny-dflash": "drafters/dflash"}
    assert manifest["demo_models"][0]["command"].startswith("python -m train.demo_models")
    assert len((into / "prompts/samples.jsonl").read_text().splitlines()) == 4
    assert (into / "drafters/dspark/sts.json").exists()
    for name in ("dspark", "dflash"):
        assert not set(SHARED_KEYS) & set(CheckpointFiles(into / "drafters" / name).keys())
        *_, params = load_pair(into / "target", into / "drafters" / name)
        *_, reference = load_pair(out / "target", out / "drafters" / name)
        assert jax.tree.structure(params) == jax.tree.structure(reference)
        for mine, ref in zip(jax.tree.leaves(params), jax.tree.leaves(reference)):
            np.testing.assert_array_equal(np.asarray(mine), np.asarray(ref))
    assert not (tmp_path / "bundle.partial").exists()
    assert bundle.main(["--from", str(tmp_path / "nowhere"), "--into", str(into)]) == 2
    assert "missing (run train.demo_models first)" in capsys.readouterr().err
    assert (into / "MANIFEST.json").exists()  # a failed bundle leaves the old one
