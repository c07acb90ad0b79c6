"""The models that ship with the package, addressable by name on every command line.

    --target tiny                                 the demo target (Qwen3 architecture, 15.7M
                                                  parameters, Hugging Face layout)
    --drafter tiny-dspark | tiny-dflash | tiny-dspark-b15
                                                  drafters for it (DeepSpec layout), calibrated

They live under `tiny/` beside this file: `target/`, `drafters/NAME/`, `prompts/` (held-out
prompts per domain and `samples.jsonl`, which `serve.decode` decodes when given no prompts) and
`regenerated.jsonl` (the target's own answers the drafters were trained on). `tiny/MANIFEST.json`
records the command that made each of them. A bundled drafter directory holds only the drafter's
own tensors: the target's embedding and lm_head, which DeepSpec checkpoints carry as copies, are
taken from the target (`python -m train.export --drafter NAME --out DIR` writes the complete
DeepSpec directory).
"""

from __future__ import annotations

from pathlib import Path

from dspark_jax.errors import DSparkError

ROOT = Path(__file__).resolve().parent / "tiny"
TARGETS = {"tiny": ROOT / "target"}
DRAFTERS = {"tiny-dspark": ROOT / "drafters" / "dspark",
            "tiny-dflash": ROOT / "drafters" / "dflash",
            "tiny-dspark-b15": ROOT / "drafters" / "dspark-b15"}
PROMPTS = {"samples": ROOT / "prompts" / "samples.jsonl",
           **{domain: ROOT / "prompts" / f"{domain}.jsonl" for domain in ("math", "code", "chat")}}
REGENERATED = ROOT / "regenerated.jsonl"
DEFAULT_TARGET, DEFAULT_DRAFTER = "tiny", "tiny-dspark"


def _resolve(value: str, names: dict[str, Path], what: str) -> str:
    """`value` itself when it names an existing path or is not a bundled name; else the bundled
    path, which must be there (an install without package data would not have it)."""
    if value in names and not Path(value).exists():
        path = names[value]
        if not path.exists():
            raise DSparkError(f"bundled {what} {value!r}: {path} is missing from this installation "
                              "(reinstall the package with its data, or pass a directory)")
        return str(path)
    return value


def resolve_target(value: str) -> str:
    """A target directory, or a bundled target's name (`tiny`), as a path."""
    return _resolve(value, TARGETS, "target")


def resolve_drafter(value: str) -> str:
    """A drafter directory, 'none', or a bundled drafter's name (`tiny-dspark`, ...), as a path."""
    return _resolve(value, DRAFTERS, "drafter")


def resolve_prompts(value: str) -> str:
    """A prompt file, or a bundled prompt set's name (`samples`, `math`, `code`, `chat`)."""
    return _resolve(value, PROMPTS, "prompt set")


def names() -> str:
    """One line listing what is bundled, for help texts."""
    return (f"bundled: --target {', '.join(TARGETS)}; --drafter {', '.join(DRAFTERS)}; "
            f"--prompts {', '.join(PROMPTS)}")
