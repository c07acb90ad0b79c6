"""Copy the demo models `train.demo_models` built into the package (dspark_jax/bundled/tiny), where
`--target tiny` and `--drafter tiny-dspark|tiny-dflash|tiny-dspark-b15` find them.

    python -m train.bundle --from runs/demo [--drafters dspark,dflash,dspark-b15] [--samples 8,4,4]

Copies the target (bfloat16 Hugging Face directory with tokenizer and training.json), each drafter's
config.json, sts.json and calibration.json and its own tensors (the target's embedding and lm_head
copies that DeepSpec directories carry are left out: 6.3 MB each, and the loader takes the target's),
the held-out prompts per domain, `samples.jsonl` (the first few of each domain, evenly spaced; what
`serve.decode` decodes with no arguments) and the regenerated training data. Writes MANIFEST.json:
every file's size and the commands that made the models (from OUT/demo_models.json and the target's
training.json). Refuses to bundle more than 50 MB.
"""

import argparse
import json
import shutil
import sys
from pathlib import Path

from dspark_jax import bundled
from dspark_jax.errors import DSparkError

LIMIT_BYTES = 50 * 10**6
TARGET_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                "tokenizer_config.json", "training.json")
DRAFTER_FILES = ("config.json", "sts.json", "calibration.json")
DOMAINS = ("math", "code", "chat")


def strip_shared_copies(src: Path, dst: Path) -> None:
    """dst/model.safetensors: src's tensors without the shared embedding/lm_head copies."""
    from dspark_jax.formats.deepspec import SHARED_KEYS
    from dspark_jax.formats.safetensors_io import CheckpointFiles, save_dir

    files = CheckpointFiles(src)
    keys = [k for k in files.keys() if k not in SHARED_KEYS]
    save_dir(dst, ((k, files.array(k)) for k in keys), metadata={"format": "pt"})


def samples(prompts: Path, counts: dict[str, int]) -> list[dict]:
    out = []
    for domain, n in counts.items():
        records = [json.loads(line) for line in (prompts / f"{domain}.jsonl").read_text().splitlines()
                   if line.strip()]
        out += records[::max(1, len(records) // n)][:n]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m train.bundle", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--from", dest="src", required=True, help="train.demo_models --out directory")
    ap.add_argument("--drafters", default="dspark,dflash,dspark-b15")
    ap.add_argument("--samples", default="8,4,4", help="sample prompts per domain (math,code,chat)")
    ap.add_argument("--into", default=str(bundled.ROOT), help="bundle directory (default: the package's)")
    args = ap.parse_args(argv)
    src, dst = Path(args.src), Path(args.into)
    drafters = [d for d in args.drafters.split(",") if d]
    try:
        counts = dict(zip(DOMAINS, (int(n) for n in args.samples.split(","))))
        missing = [str(p) for p in [*(src / "target" / f for f in TARGET_FILES),
                                    *(src / "drafters" / d / f for d in drafters
                                      for f in ("config.json", "model.safetensors")),
                                    *(src / "data" / "prompts" / f"{d}.jsonl" for d in DOMAINS),
                                    src / "data" / "regenerated.jsonl"] if not p.is_file()]
        if missing:
            raise DSparkError("missing (run train.demo_models first): " + ", ".join(missing))
        staging = dst.with_name(dst.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        (staging / "target").mkdir(parents=True)
        for f in TARGET_FILES:
            shutil.copy2(src / "target" / f, staging / "target" / f)
        for d in drafters:
            out = staging / "drafters" / d
            out.mkdir(parents=True)
            for f in DRAFTER_FILES:
                if (src / "drafters" / d / f).is_file():
                    shutil.copy2(src / "drafters" / d / f, out / f)
            strip_shared_copies(src / "drafters" / d, out)
        (staging / "prompts").mkdir()
        for d in DOMAINS:
            shutil.copy2(src / "data" / "prompts" / f"{d}.jsonl", staging / "prompts" / f"{d}.jsonl")
        (staging / "prompts" / "samples.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in samples(src / "data" / "prompts", counts)))
        shutil.copy2(src / "data" / "regenerated.jsonl", staging / "regenerated.jsonl")
        files = {str(p.relative_to(staging)): p.stat().st_size
                 for p in sorted(staging.rglob("*")) if p.is_file()}
        total = sum(files.values())
        if total > LIMIT_BYTES:
            shutil.rmtree(staging)
            raise DSparkError(f"the bundle would hold {total / 1e6:.1f} MB, over the "
                              f"{LIMIT_BYTES / 1e6:.0f} MB limit; bundle fewer drafters")
        record = src / "demo_models.json"
        manifest = {
            "built_by": "python -m train.bundle " + " ".join(argv or sys.argv[1:]),
            "target": json.loads((src / "target" / "training.json").read_text())["command"],
            "demo_models": json.loads(record.read_text())["runs"] if record.exists() else [],
            "drafters": {f"tiny-{d}": f"drafters/{d}" for d in drafters},
            "total_bytes": total, "files": files}
        (staging / "MANIFEST.json").write_text(json.dumps(manifest, indent=1) + "\n")
        shutil.rmtree(dst, ignore_errors=True)
        staging.rename(dst)
    except DSparkError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"bundled {len(files)} files, {total / 1e6:.1f} MB, into {dst}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
