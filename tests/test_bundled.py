"""The bundled demo models: names on the command line, the no-argument `serve.decode`, and the
bundled drafters against their complete DeepSpec export."""

import json

import numpy as np
import pytest

from dspark_jax import bundled
from dspark_jax.formats.deepspec import SHARED_KEYS
from dspark_jax.formats.safetensors_io import CheckpointFiles
from serve import decode


def test_names_resolve_to_the_package_and_a_local_path_wins(tmp_path, monkeypatch):
    assert bundled.resolve_target("tiny") == str(bundled.ROOT / "target")
    assert bundled.resolve_drafter("tiny-dflash") == str(bundled.ROOT / "drafters" / "dflash")
    assert bundled.resolve_prompts("samples") == str(bundled.ROOT / "prompts" / "samples.jsonl")
    assert bundled.resolve_drafter("none") == "none"
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny").mkdir()
    assert bundled.resolve_target("tiny") == "tiny"


def test_the_bundle_is_lean_and_drafters_carry_no_target_copies():
    manifest = json.loads((bundled.ROOT / "MANIFEST.json").read_text())
    on_disk = sum(p.stat().st_size for p in bundled.ROOT.rglob("*") if p.is_file()
                  and p.name != "MANIFEST.json")
    assert on_disk == manifest["total_bytes"] <= 50 * 10**6
    for name, path in bundled.DRAFTERS.items():
        keys = CheckpointFiles(path).keys()
        assert not set(SHARED_KEYS) & set(keys), name
        config = json.loads((path / "config.json").read_text())
        assert (path / "sts.json").is_file() == bool(config["enable_confidence_head"])


def test_decode_needs_a_drafter_with_a_target_of_ones_own(tmp_path, capsys):
    with pytest.raises(SystemExit):
        decode.main(["--target", str(tmp_path), "--out", str(tmp_path / "o.jsonl")])
    assert f"--drafter is required with --target {tmp_path}" in capsys.readouterr().err


def test_export_restores_the_complete_deepspec_directory(tmp_path):
    from train import export

    assert export.main(["--drafter", "tiny-dspark", "--out", str(tmp_path / "full")]) == 0
    full, mine = CheckpointFiles(tmp_path / "full"), CheckpointFiles(bundled.DRAFTERS["tiny-dspark"])
    target = CheckpointFiles(bundled.TARGETS["tiny"])
    assert set(full.keys()) == set(mine.keys()) | set(SHARED_KEYS)
    for key in mine.keys():
        assert full.array(key).dtype == mine.array(key).dtype, key  # bfloat16 stays bfloat16
        np.testing.assert_array_equal(full.array(key), mine.array(key))
    np.testing.assert_array_equal(full.array("embed_tokens.weight"),
                                  target.array("model.embed_tokens.weight"))
    np.testing.assert_array_equal(full.array("lm_head.weight"), target.array("lm_head.weight"))
    assert (tmp_path / "full" / "sts.json").read_text() == \
        (bundled.DRAFTERS["tiny-dspark"] / "sts.json").read_text()


def test_decode_without_arguments_prints_completions_then_the_summary(capsys):
    args = decode.parse_args([])  # the README's main command: the bundled pair and samples
    assert (args.target, args.drafter, args.prompts, args.out) == (
        str(bundled.TARGETS["tiny"]), str(bundled.DRAFTERS["tiny-dspark"]),
        str(bundled.PROMPTS["samples"]), None)
    # Run with a smaller engine (and no start-up SPS profile) to keep the suite short.
    assert decode.main(["--max-new-tokens", "8", "--slots", "4", "--max-len", "256",
                        "--prefill-buckets", "256", "--scheduler", "fixed"]) == 0
    out = capsys.readouterr().out
    samples = [json.loads(x)["id"] for x in bundled.PROMPTS["samples"].read_text().splitlines()]
    assert all(f"── {rid} · " in out for rid in samples)
    assert out.index("── ") < out.index("tau (tokens / round)")
    assert "compilations after warm-up    0" in out
