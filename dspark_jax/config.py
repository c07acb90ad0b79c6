"""Typed, frozen configs; YAML presets; command-line overrides.

A config is a tree of frozen dataclasses. `load_config(path, overrides)` reads a YAML preset (which may
name a `base:` preset to start from, relative to its own folder), applies `section.key=value`
overrides (values parsed as YAML scalars/lists), and checks every key, type and consistency rule.
Every error a user can cause is one `ConfigError` that names the key.

The `drafter` section is one of several kinds, told apart by its `kind` key (`dspark`, the default,
or `eagle3`): a union of config classes that each carry a `kind` class variable is read as the
member its mapping's `kind` names, and `to_dict` writes the key back. A class variable, not a field:
DSpark configs, and everything derived from their fields, stay as they were before kinds existed.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, ClassVar, Literal, Mapping, Sequence

import yaml

from dspark_jax.errors import ConfigError

DTYPES = ("float32", "bfloat16")
LAYER_TYPES = ("sliding_attention", "full_attention")


def _require(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {message}")


@dataclasses.dataclass(frozen=True)
class TargetConfig:
    """The target (Hugging Face config.json names) and the drafter-side facts about it."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 40960
    # Weights and activations; norms and softmax are always float32.
    dtype: Literal["float32", "bfloat16"] = "float32"
    # Layer ids whose outputs the drafter reads (-1: embedding output; the last layer is not allowed).
    target_layer_ids: tuple[int, ...] = ()
    mask_token_id: int = 0
    # The Gemma4 text family (DESIGN §2b); every default is Qwen3's. Gemma4 mixes sliding-window
    # and full layers: `rope_theta`, `head_dim` and `num_key_value_heads` describe the sliding ones,
    # the `global_*` fields and `partial_rotary_factor` the full ones ("proportional" RoPE).
    family: Literal["qwen3", "gemma4"] = "qwen3"
    layer_types: tuple[str, ...] = ()  # per layer "sliding_attention" | "full_attention"; () = all full
    sliding_window: int = 0  # keys a sliding layer sees, the query itself included
    global_rope_theta: float = 0.0  # full layers' RoPE theta (0: rope_theta)
    global_head_dim: int = 0  # full layers' head dim (0: head_dim)
    num_global_key_value_heads: int = 0  # full layers' KV heads (0: num_key_value_heads)
    attention_k_eq_v: bool = False  # full layers take the raw key projection as the value
    partial_rotary_factor: float = 1.0  # fraction of a full layer's head dim that is rotated
    final_logit_softcapping: float = 0.0  # cap * tanh(logits / cap); 0 = none

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim",
                     "max_position_embeddings"):
            _require(getattr(self, name) > 0, name, f"must be positive, got {getattr(self, name)}")
        _require(self.num_attention_heads % self.num_key_value_heads == 0, "num_attention_heads",
                 f"{self.num_attention_heads} is not a multiple of num_key_value_heads "
                 f"{self.num_key_value_heads}")
        _require(self.head_dim % 2 == 0, "head_dim", f"must be even for RoPE, got {self.head_dim}")
        _require(self.rms_norm_eps > 0, "rms_norm_eps", f"must be positive, got {self.rms_norm_eps}")
        _require(self.rope_theta > 0, "rope_theta", f"must be positive, got {self.rope_theta}")
        ids = self.target_layer_ids
        last = self.num_hidden_layers - 1
        _require(all(a < b for a, b in zip(ids, ids[1:])), "target_layer_ids",
                 f"must be strictly increasing, got {list(ids)}")
        bad = [i for i in ids if not -1 <= i < last]
        _require(not bad, "target_layer_ids",
                 f"{bad} out of range: ids must lie in [-1, {last - 1}] for {self.num_hidden_layers} "
                 f"layers (-1 is the embedding output; the last layer {last} is not allowed)")
        _require(0 <= self.mask_token_id < self.vocab_size, "mask_token_id",
                 f"{self.mask_token_id} is outside the vocabulary [0, {self.vocab_size})")
        types_ = self.layer_types
        _require(not types_ or len(types_) == self.num_hidden_layers, "layer_types",
                 f"has {len(types_)} entries for {self.num_hidden_layers} layers")
        bad = sorted(set(types_) - set(LAYER_TYPES))
        _require(not bad, "layer_types", f"unknown types {bad}; expected {list(LAYER_TYPES)}")
        _require(not types_ or types_[-1] == "full_attention", "layer_types",
                 "the last layer must be full_attention")
        _require(self.sliding_window >= 0, "sliding_window", f"must be >= 0, got {self.sliding_window}")
        _require("sliding_attention" not in types_ or self.sliding_window > 0, "sliding_window",
                 "must be positive when layer_types has sliding_attention layers")
        _require(0.0 < self.partial_rotary_factor <= 1.0, "partial_rotary_factor",
                 f"must lie in (0, 1], got {self.partial_rotary_factor}")
        _require(self.final_logit_softcapping >= 0, "final_logit_softcapping",
                 f"must be >= 0, got {self.final_logit_softcapping}")
        _require(self.full_head_dim % 2 == 0, "global_head_dim",
                 f"must be even for RoPE, got {self.full_head_dim}")
        _require(self.num_attention_heads % self.full_kv_heads == 0, "num_global_key_value_heads",
                 f"{self.num_attention_heads} heads are not a multiple of {self.full_kv_heads}")
        if self.family == "qwen3":
            gemma_only = {"sliding layers": "sliding_attention" in types_,
                          "attention_k_eq_v": self.attention_k_eq_v,
                          "global_head_dim": self.global_head_dim not in (0, self.head_dim),
                          "num_global_key_value_heads":
                              self.num_global_key_value_heads not in (0, self.num_key_value_heads),
                          "partial_rotary_factor": self.partial_rotary_factor != 1.0,
                          "final_logit_softcapping": self.final_logit_softcapping != 0.0}
            bad = [k for k, on in gemma_only.items() if on]
            _require(not bad, "family", f"qwen3 has no {', '.join(bad)} (family gemma4 has)")

    @property
    def num_taps(self) -> int:
        return len(self.target_layer_ids)

    @property
    def q_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    def is_sliding(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == "sliding_attention"

    @property
    def sliding_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_hidden_layers) if self.is_sliding(i))

    @property
    def full_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_hidden_layers) if not self.is_sliding(i))

    @property
    def full_head_dim(self) -> int:
        return self.global_head_dim or self.head_dim

    @property
    def full_kv_heads(self) -> int:
        return self.num_global_key_value_heads or self.num_key_value_heads

    @property
    def full_rope_theta(self) -> float:
        return self.global_rope_theta or self.rope_theta


@dataclasses.dataclass(frozen=True)
class DrafterConfig:
    """The DSpark drafter (§3). Layer shapes are the target's; only their number differs.

    `markov_rank = 0` removes the sequential head; with the confidence head off and a CE-only loss
    that is DFlash.
    """

    kind: ClassVar[str] = "dspark"  # `drafter.kind`; the default when a config names none
    num_draft_layers: int = 5
    block_size: int = 7
    markov_rank: int = 256
    markov_head_type: Literal["vanilla", "gated", "rnn"] = "vanilla"
    enable_confidence_head: bool = True
    confidence_head_with_markov: bool = True
    num_anchors: int = 512  # anchored blocks per training sequence
    dtype: Literal["float32", "bfloat16"] = "float32"  # compute dtype; master weights are float32
    # Training attention over this many anchored blocks at a time (0 = all at once): bounds the
    # [blocks, heads, block, context] scores; recomputed in the backward pass.
    attention_chunk: int = 0

    def __post_init__(self):
        _require(self.attention_chunk >= 0, "attention_chunk",
                 f"must be >= 0, got {self.attention_chunk}")
        _require(self.num_draft_layers >= 1, "num_draft_layers", f"must be >= 1, got {self.num_draft_layers}")
        _require(self.block_size >= 2, "block_size", f"must be >= 2, got {self.block_size}")
        _require(self.markov_rank >= 0, "markov_rank", f"must be >= 0, got {self.markov_rank}")
        _require(self.num_anchors >= 1, "num_anchors", f"must be >= 1, got {self.num_anchors}")
        _require(not (self.confidence_head_with_markov and self.enable_confidence_head
                      and self.markov_rank == 0), "confidence_head_with_markov",
                 "needs a Markov embedding (markov_rank > 0)")

    @property
    def proposal_length(self) -> int:
        """Drafts per round (γ)."""
        return self.block_size

    @property
    def has_markov(self) -> bool:
        return self.markov_rank > 0

    @property
    def conf_uses_markov(self) -> bool:
        return self.enable_confidence_head and self.confidence_head_with_markov and self.has_markov


@dataclasses.dataclass(frozen=True)
class Eagle3Config:
    """The Eagle3 baseline drafter (DESIGN §3b), as DeepSpec trains it.

    `ttt_length` is both the number of unrolled test-time-training steps and the proposal length;
    step k's loss is weighted by `step_loss_decay`**k. Selected by `drafter.kind: eagle3`.
    """

    kind: ClassVar[str] = "eagle3"
    ttt_length: int = 7
    step_loss_decay: float = 0.8
    # One decoder layer whose q/k/v read [embedding; hidden]: DeepSpec's Eagle3 has no other shape.
    num_draft_layers: int = 1
    dtype: Literal["float32", "bfloat16"] = "float32"  # compute dtype; master weights are float32

    def __post_init__(self):
        _require(self.ttt_length >= 1, "ttt_length", f"must be >= 1, got {self.ttt_length}")
        _require(0 < self.step_loss_decay <= 1, "step_loss_decay",
                 f"must be in (0, 1], got {self.step_loss_decay}")
        _require(self.num_draft_layers == 1, "num_draft_layers",
                 f"Eagle3 has exactly one draft layer, got {self.num_draft_layers}")

    @property
    def proposal_length(self) -> int:
        """Drafts per round (γ)."""
        return self.ttt_length


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """L = ce·CE + tv·‖p_d − p_t‖₁ + confidence·BCE, position weights exp(−k / decay_gamma)."""

    ce_weight: float = 0.1
    tv_weight: float = 0.9
    confidence_weight: float = 1.0
    loss_decay_gamma: float = 4.0

    def __post_init__(self):
        for name in ("ce_weight", "tv_weight", "confidence_weight"):
            _require(getattr(self, name) >= 0, name, f"must be >= 0, got {getattr(self, name)}")
        _require(self.ce_weight + self.tv_weight > 0, "ce_weight", "ce_weight + tv_weight must be > 0")
        _require(self.loss_decay_gamma > 0, "loss_decay_gamma",
                 f"must be positive, got {self.loss_decay_gamma}")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Device mesh axis sizes; -1 on one axis takes all remaining devices."""

    data: int = -1
    fsdp: int = 1
    tensor: int = 1

    def __post_init__(self):
        sizes = dataclasses.asdict(self)
        for name, size in sizes.items():
            _require(size == -1 or size >= 1, name, f"must be >= 1 or -1, got {size}")
        _require(list(sizes.values()).count(-1) <= 1, "mesh", "at most one axis may be -1")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Drafter training (defaults: the released DeepSpec runs, DESIGN §10)."""

    target_dir: str = ""  # Hugging Face Qwen3/Gemma4 directory; "" = random target (smoke runs, benchmarks)
    # JSONL conversations, or a tokenized cache directory of them (`python -m train.tokenize`).
    data_file: str = ""
    # Worker processes building batches ahead of the step (grain); 0: built in the loop.
    data_workers: int = 0
    # Check every shard of a tokenized cache against its sha256 at start (reads the whole cache);
    # false: sizes and record counts only (a damaged record is still refused when read).
    verify_data_cache: bool = True
    tokenizer_dir: str = ""  # "" = target_dir
    workdir: str = "runs/drafter"
    max_length: int = 4096
    # > 0: pad each batch only to its longest record rounded up to this multiple (at most
    # max_length), not to max_length: the same losses at a cost that follows the data's lengths,
    # one compiled step per distinct length (BatchIterator). 0: every batch max_length long.
    pad_to_multiple: int = 0
    # Handed to the chat template when rendering training conversations; None = not passed (DeepSpec).
    enable_thinking: bool | None = None
    # Prepended to training conversations without their own system message; None = the template
    # family's default (DeepSpec: Qwen's "You are a helpful assistant."), "" = none.
    system_prompt: str | None = None
    global_batch_size: int = 512
    # > 1: each step runs the global batch as this many micro-batches in turn and sums their
    # gradients (weighed as one batch: the same update), holding one micro-batch's activations.
    microbatches: int = 1
    epochs: float = 10.0
    max_steps: int = 0  # > 0 overrides epochs
    learning_rate: float = 6e-4
    warmup_ratio: float = 0.04
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    adam_b1: float = 0.9
    adam_b2: float = 0.95
    seed: int = 0
    loss: LossConfig = LossConfig()  # DSpark/DFlash; Eagle3's loss is set by drafter.step_loss_decay
    log_every: int = 10
    checkpoint_every: int = 500
    keep_checkpoints: int = 3
    async_checkpointing: bool = True

    def __post_init__(self):
        for name in ("max_length", "global_batch_size", "microbatches", "log_every", "checkpoint_every",
                     "keep_checkpoints"):
            _require(getattr(self, name) >= 1, name, f"must be >= 1, got {getattr(self, name)}")
        _require(self.max_steps >= 0, "max_steps", f"must be >= 0, got {self.max_steps}")
        _require(self.pad_to_multiple >= 0, "pad_to_multiple", f"must be >= 0, got {self.pad_to_multiple}")
        _require(self.data_workers >= 0, "data_workers", f"must be >= 0, got {self.data_workers}")
        _require(self.epochs > 0 or self.max_steps > 0, "epochs", "set epochs > 0 or max_steps > 0")
        _require(self.learning_rate > 0, "learning_rate", f"must be positive, got {self.learning_rate}")
        _require(0 <= self.warmup_ratio < 1, "warmup_ratio", f"must be in [0, 1), got {self.warmup_ratio}")
        _require(self.grad_clip > 0, "grad_clip", f"must be positive, got {self.grad_clip}")


@dataclasses.dataclass(frozen=True)
class Config:
    """A whole run: target, drafter (DSpark/DFlash or Eagle3, by `drafter.kind`), device mesh (and
    training, when training)."""

    target: TargetConfig
    drafter: DrafterConfig | Eagle3Config = DrafterConfig()
    mesh: MeshConfig = MeshConfig()
    train: TrainConfig = TrainConfig()

    def __post_init__(self):
        d = self.drafter
        length_key = "block_size" if isinstance(d, DrafterConfig) else "ttt_length"
        _require(self.train.max_length > d.proposal_length, "train.max_length",
                 f"{self.train.max_length} must exceed drafter.{length_key} {d.proposal_length}")
        if isinstance(d, Eagle3Config):
            _require(self.target.num_taps > 0, "target.target_layer_ids",
                     "an Eagle3 drafter fuses tapped target layers: name at least one")
            _require(self.target.family == "qwen3", "drafter.kind",
                     f"eagle3 drafters run on qwen3 targets only, not on target.family "
                     f"{self.target.family} (use kind dspark)")


# ----------------------------------------------------------------------------- generic machinery


def _type_name(tp) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _kind(cls) -> str | None:
    """The `kind` class variable of a config class that has one (see the module docstring)."""
    if not dataclasses.is_dataclass(cls) or "kind" in {f.name for f in dataclasses.fields(cls)}:
        return None
    kind = getattr(cls, "kind", None)
    return kind if isinstance(kind, str) else None


def _kinds(args) -> dict[str, type]:
    """{kind: class} of a union whose members all carry a kind (the first is the default), else {}."""
    members = [a for a in args if a is not type(None)]
    kinds = {_kind(a): a for a in members}
    return kinds if None not in kinds and len(kinds) == len(members) else {}


def _coerce(value: Any, tp, key: str) -> Any:
    """Checks `value` against the annotation `tp` and converts lists to tuples, ints to floats."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        kinds = _kinds(args)
        if kinds and isinstance(value, Mapping):
            kind = value.get("kind", next(iter(kinds)))
            _require(kind in kinds, f"{key}.kind", f"expected one of {list(kinds)}, got {kind!r}")
            return from_dict(kinds[kind], value, prefix=key)
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{key}: {value!r} fits none of {tp}")
    if origin is Literal:
        _require(value in args, key, f"expected one of {list(args)}, got {value!r}")
        return value
    if origin is tuple:
        _require(isinstance(value, (list, tuple)), key,
                 f"expected a list, got {type(value).__name__} {value!r}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_coerce(v, args[0], f"{key}[{i}]") for i, v in enumerate(value))
        _require(len(value) == len(args), key, f"expected {len(args)} items, got {len(value)}")
        return tuple(_coerce(v, a, f"{key}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        _require(isinstance(value, Mapping), key, f"expected a mapping, got {value!r}")
        return from_dict(tp, value, prefix=key)
    if tp is bool:
        _require(isinstance(value, bool), key, f"expected true or false, got {value!r}")
        return value
    if tp is int:
        _require(isinstance(value, int) and not isinstance(value, bool), key,
                 f"expected an integer, got {type(value).__name__} {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads "5e5" (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        _require(isinstance(value, (int, float)) and not isinstance(value, bool), key,
                 f"expected a number, got {type(value).__name__} {value!r}")
        return float(value)
    if tp is str:
        _require(isinstance(value, str), key, f"expected a string, got {value!r}")
        return value
    raise TypeError(f"unsupported config annotation {tp} for {key}")


def from_dict(cls, data: Mapping[str, Any], prefix: str = ""):
    """Builds dataclass `cls` from a mapping; unknown, missing or mistyped keys raise ConfigError."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    dotted = (lambda name: f"{prefix}.{name}") if prefix else (lambda name: name)
    kind = _kind(cls)
    if kind is not None and "kind" in data:
        _require(data["kind"] == kind, dotted("kind"), f"expected {kind!r}, got {data['kind']!r}")
        data = {k: v for k, v in data.items() if k != "kind"}
    known = set(fields) | ({"kind"} if kind is not None else set())
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(f"unknown config key {dotted(unknown[0])!r}"
                          + (f" (and {unknown[1:]})" if len(unknown) > 1 else "")
                          + f"; known keys{' under ' + repr(prefix) if prefix else ''}: "
                          + ", ".join(sorted(known)))
    kwargs = {}
    for name, field in fields.items():
        if name in data:
            kwargs[name] = _coerce(data[name], hints[name], dotted(name))
        elif (field.default is dataclasses.MISSING
              and field.default_factory is dataclasses.MISSING):
            raise ConfigError(f"missing config key {dotted(name)!r} ({_type_name(hints[name])})")
    try:
        return cls(**kwargs)
    except ConfigError as e:
        raise ConfigError(f"{prefix}.{e}" if prefix else str(e)) from None


def to_dict(cfg) -> dict[str, Any]:
    """The inverse of from_dict: plain YAML/JSON-friendly values (tuples become lists; a section
    with a kind starts with its `kind` key)."""

    def plain(v):
        if dataclasses.is_dataclass(v):
            kind = {} if _kind(type(v)) is None else {"kind": _kind(type(v))}
            return kind | {f.name: plain(getattr(v, f.name)) for f in dataclasses.fields(v)}
        if isinstance(v, (tuple, list)):
            return [plain(x) for x in v]
        return v

    return plain(cfg)


def _read_yaml(path: Path, seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    path = path.resolve()
    if path in seen:
        raise ConfigError(f"{path}: circular 'base:' chain through {[str(p) for p in seen]}")
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: invalid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    base = data.pop("base", None)
    if base is None:
        return data
    if not isinstance(base, str):
        raise ConfigError(f"{path}: 'base' must be a file name, got {base!r}")
    return merge(_read_yaml(path.parent / base, seen + (path,)), data)


def merge(base: Mapping[str, Any], update: Mapping[str, Any]) -> dict[str, Any]:
    """Recursive dict merge: mappings merge key by key, anything else replaces."""
    out = dict(base)
    for k, v in update.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = merge(out[k], v)
        else:
            out[k] = v
    return out


def parse_overrides(overrides: Sequence[str]) -> dict[str, Any]:
    """`["target.dtype=bfloat16", "mesh.data=4"]` -> nested dict; values parsed as YAML."""
    out: dict[str, Any] = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip().lstrip("-")
        if not sep or not key:
            raise ConfigError(f"override {item!r}: expected KEY=VALUE, e.g. target.dtype=bfloat16")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError as e:
            raise ConfigError(f"override {item!r}: cannot parse value: {e}") from None
        node = out
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {part!r} was already given a value")
        node[parts[-1]] = value
    return out


def load_config(path: str | Path, overrides: Sequence[str] = (), cls=Config):
    """Reads a YAML preset, applies overrides, returns a validated `cls` instance."""
    data = merge(_read_yaml(Path(path)), parse_overrides(overrides))
    try:
        return from_dict(cls, data)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None


PRESETS_DIR = Path(__file__).resolve().parent.parent / "configs"


def preset_path(name: str) -> Path:
    """A bundled preset by name (`qwen3-8b`) or a path to a YAML file."""
    p = Path(name)
    if p.suffix in (".yaml", ".yml") or p.exists():
        return p
    return PRESETS_DIR / f"{name}.yaml"


