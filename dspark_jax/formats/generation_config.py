"""What a checkpoint says about generating: sampling defaults and stop token ids, and the sampling
settings of one request (checkpoint defaults, overridden by flags, overridden by its record).

Defaults (as vLLM takes them): `temperature`, `top_p` and `top_k` of `generation_config.json`; a file
with `do_sample: false` means greedy (as in transformers). Without a file or key: greedy (T = 0),
top-p 1, top-k 0 (off).

Stop ids (as transformers and vLLM take them): the `eos_token_id` of `generation_config.json` (else
of `config.json`), plus the tokenizer's own eos token (`eos_token` of `tokenizer_config.json`, a
string or an AddedToken object); nothing more.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from dspark_jax.errors import CheckpointError, DataError

GENERATION_CONFIG = "generation_config.json"
GREEDY = {"temperature": 0.0, "top_p": 1.0, "top_k": 0}
RECORD_KEYS = ("temperature", "top_p", "top_k", "max_new_tokens", "stop", "seed")


def read_json_object(path: Path) -> dict | None:
    """The JSON object in `path`, None when there is no such file."""
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{path}: cannot read JSON ({err})") from err
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# ------------------------------------------------------------------ checkpoint defaults


def sampling_defaults(model_dir: str | Path) -> dict[str, float | int]:
    """{"temperature", "top_p", "top_k"} from `model_dir/generation_config.json` (greedy when it
    says `do_sample: false`), the greedy defaults where it is silent."""
    path = Path(model_dir) / GENERATION_CONFIG
    data = read_json_object(path) or {}
    if data.get("do_sample", True) is False:
        return dict(GREEDY)
    out = dict(GREEDY)
    for key, value in data.items():
        if key in GREEDY and value is not None:
            problem = _sampling_problem(key, value)
            if problem:
                raise CheckpointError(f"{path}: {problem}")
            out[key] = float(value) if key != "top_k" else int(value)
    return out


def _sampling_problem(key: str, value: Any) -> str | None:
    """What is wrong with a sampling value (None: nothing)."""
    if key == "temperature" and not (_is_number(value) and value >= 0):
        return f"'temperature' must be a finite number >= 0 (0 = greedy), got {value!r}"
    if key == "top_p" and not (_is_number(value) and 0 < value <= 1):
        return f"'top_p' must be a number in (0, 1], got {value!r}"
    if key == "top_k" and not (_is_int(value) and value >= 0):
        return f"'top_k' must be an integer >= 0 (0 = off), got {value!r}"
    if key == "max_new_tokens" and not (_is_int(value) and value >= 1):
        return f"'max_new_tokens' must be an integer >= 1, got {value!r}"
    if key == "seed" and not (_is_int(value) and 0 <= value < 2 ** 32):
        return f"'seed' must be an integer in [0, 2^32), got {value!r}"
    if key == "stop":
        strings = [value] if isinstance(value, str) else value
        if not (isinstance(strings, list) and all(isinstance(s, str) and s for s in strings)):
            return f"'stop' must be a non-empty string or a list of them, got {value!r}"
    return None


# ------------------------------------------------------------------ stop ids


def _eos_ids(path: Path) -> list[int] | None:
    """`eos_token_id` (int or list of ints) of a JSON config; None if the file or key is absent
    (or null)."""
    data = read_json_object(path)
    value = None if data is None else data.get("eos_token_id")
    if value is None:
        return None
    values = value if isinstance(value, list) else [value]
    if not all(_is_int(v) and v >= 0 for v in values):  # true/false here is a typo, not an id
        raise CheckpointError(
            f"{path}: 'eos_token_id' must be a non-negative int or a list of them, got {value!r}")
    return list(values)


def tokenizer_eos_token(model_dir: str | Path) -> str | None:
    """`eos_token` of `model_dir/tokenizer_config.json` (a string or an AddedToken object with a
    "content"), None when absent."""
    path = Path(model_dir) / "tokenizer_config.json"
    data = read_json_object(path)
    value = None if data is None else data.get("eos_token")
    if isinstance(value, Mapping):
        value = value.get("content")
    if value is None or (isinstance(value, str) and value):
        return value
    raise CheckpointError(f"{path}: 'eos_token' must be a token string or an object with a "
                          f"'content' string, got {data.get('eos_token')!r}")


def stop_token_ids(model_dir: str | Path, token_to_id: Callable[[str], int | None]
                   ) -> tuple[int, ...]:
    """Sorted stop ids of a checkpoint (see the module docstring); `token_to_id` maps a vocabulary
    entry to its id (None when absent)."""
    model_dir = Path(model_dir)
    ids = _eos_ids(model_dir / GENERATION_CONFIG)
    if ids is None:
        ids = _eos_ids(model_dir / "config.json") or []
    token = tokenizer_eos_token(model_dir)
    if token is not None:
        token_id = token_to_id(token)
        if token_id is None:
            raise CheckpointError(f"{model_dir / 'tokenizer_config.json'}: 'eos_token' {token!r} "
                                  "is not in the tokenizer vocabulary")
        ids.append(token_id)
    return tuple(sorted(set(ids)))


# ------------------------------------------------------------------ one request's settings


@dataclasses.dataclass(frozen=True)
class SamplingSettings:
    """How one request is decoded. `stop`: strings that end the output (excluded from it); `seed`:
    the request's random stream, None to derive it from the request's id."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 256
    stop: tuple[str, ...] = ()
    seed: int | None = None

    def __post_init__(self):
        for key in RECORD_KEYS:
            value = getattr(self, key)
            if key == "stop":
                value = list(value)
                if not value:
                    continue
            if key == "seed" and value is None:
                continue
            problem = _sampling_problem(key, value)
            if problem:
                raise ValueError(problem)

    def with_record(self, record: Mapping[str, Any], where: str = "") -> SamplingSettings:
        """These settings overridden by a prompt record's own keys (RECORD_KEYS); a bad value
        raises DataError naming `where` (file:line), the key and what was expected."""
        given = {}
        for key in RECORD_KEYS:
            if key not in record:
                continue
            value = record[key]
            problem = _sampling_problem(key, value)
            if problem:
                raise DataError(f"{where}: {problem}" if where else problem)
            if key == "stop":
                value = (value,) if isinstance(value, str) else tuple(value)
            elif key in ("temperature", "top_p"):
                value = float(value)
            given[key] = value
        return dataclasses.replace(self, **given)

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "stop": list(self.stop)}
