"""The checkpoint's tokenizer: ``tokenizer.json`` (via the ``tokenizers`` library), its stop tokens
and its chat template (:mod:`dspark_jax.formats.chat_template`), plus the tiny BPE trainer used by
the tests and the demo pair.

Text is encoded without added special tokens (Qwen adds none); a special-token string inside the
text becomes that token's id, as the ``tokenizers`` library does for added tokens. Prompt and
training records are read in :mod:`dspark_jax.formats.records`.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import tokenizers

from dspark_jax.errors import CheckpointError
from dspark_jax.formats import generation_config
from dspark_jax.formats.chat_template import (
    CONFIG_FILE,
    TINY_CHAT_TEMPLATE,
    ChatTemplate,
    builtin_chatml,
    load_chat_template,
)

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
END_OF_TEXT = "<|endoftext|>"


class Tokenizer:
    """A checkpoint's tokenizer plus its stop tokens."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        path: Path | str = "<memory>",
        eos_token_ids: Sequence[int] = (),
        chat_template: ChatTemplate | None = None,
    ) -> None:
        """Wrap ``backend``; stop ids are ``eos_token_ids`` (as :func:`load_tokenizer` reads them
        from the checkpoint), nothing more. Without a ``chat_template`` the built-in ChatML layout
        is used (with a warning, on first use)."""
        self.backend = backend
        self.path = Path(path)
        self._chat_template = chat_template
        self.stop_token_ids: tuple[int, ...] = tuple(sorted({int(i) for i in eos_token_ids}))

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added/special tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; no special tokens are added (Qwen adds none)."""
        return self.backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int] | np.ndarray, skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; special tokens are dropped unless asked for."""
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_id(self, token: str) -> int:
        """Id of a single vocabulary entry such as ``<|im_end|>``."""
        token_id = self.backend.token_to_id(token)
        if token_id is None:
            raise CheckpointError(f"{self.path}: token {token!r} is not in the tokenizer vocabulary")
        return token_id

    @property
    def chat_template(self) -> ChatTemplate:
        """The checkpoint's chat template, or the built-in ChatML when it has none (warned once)."""
        if self._chat_template is None:
            warnings.warn(
                f"{self.path}: the checkpoint has no chat template (no chat_template.jinja and no "
                f"'chat_template' in {CONFIG_FILE}); rendering chats with the built-in ChatML layout",
                stacklevel=2,
            )
            self._chat_template = builtin_chatml()
        return self._chat_template

    def __repr__(self) -> str:
        return (
            f"Tokenizer(path={str(self.path)!r}, vocab_size={self.vocab_size}, "
            f"stop_token_ids={self.stop_token_ids})"
        )


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    """Load ``model_dir/tokenizer.json``, the stop ids (:func:`generation_config.stop_token_ids`:
    the configs' ``eos_token_id`` and the tokenizer's ``eos_token``) and the chat template."""
    model_dir = Path(model_dir)
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise CheckpointError(f"{path}: tokenizer file not found")
    try:
        backend = tokenizers.Tokenizer.from_file(str(path))
    except Exception as err:  # tokenizers raises a bare Exception for bad files
        raise CheckpointError(f"{path}: cannot read tokenizer ({err})") from err
    eos = generation_config.stop_token_ids(model_dir, backend.token_to_id)
    return Tokenizer(backend, path=path, eos_token_ids=eos, chat_template=load_chat_template(model_dir))


CHAT_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>")  # ids 0..3


def train_bpe_tokenizer(texts: Sequence[str], vocab_size: int, out_dir: str | Path) -> Path:
    """Trains a small byte-level BPE `tokenizer.json` (ChatML special tokens first, ids 0..3) into
    out_dir, with a `tokenizer_config.json` carrying :data:`TINY_CHAT_TEMPLATE` (Qwen3's layout
    without think blocks: the vocabulary has no think tokens) and the special tokens.

    For the tiny test and demo models only; real models ship their own tokenizer.
    """
    from tokenizers import decoders, models, pre_tokenizers, trainers

    backend = tokenizers.Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(CHAT_SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    backend.train_from_iterator(list(texts) + ["user assistant system"], trainer=trainer)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    backend.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": END_OF_TEXT,
        "chat_template": TINY_CHAT_TEMPLATE,
    }
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return out


_MOVED_TO_RECORDS = frozenset({
    "PromptRecord", "encode_chat_prompt", "encode_conversation", "encode_prompt_record",
    "encode_training_record", "iter_jsonl", "load_prompts", "normalize_messages", "read_jsonl",
    "render_chat",
})


def __getattr__(name: str):
    # Record readers moved to formats.records; callers not yet updated still find them here.
    if name in _MOVED_TO_RECORDS:
        from dspark_jax.formats import records

        return getattr(records, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
