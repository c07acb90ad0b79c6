"""Synthetic chat data the tiny targets and drafters learn from (tests, the tiny demo pair):
counting, repeating and cycling words, with answers that follow from the questions."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from dspark_jax.errors import ConfigError

DEFAULT_WORDS = (
    "apple", "river", "stone", "cloud", "green", "tiger", "lamp", "paper",
    "music", "orange", "silver", "window", "garden", "rocket", "pencil", "forest",
)  # fmt: skip


def _synthetic_exchange(rng: np.random.Generator, words: Sequence[str]) -> tuple[str, str]:
    """One (user, assistant) pair whose answer follows from the question."""
    kind = rng.integers(3)
    if kind == 0:
        start, count = int(rng.integers(0, 50)), int(rng.integers(6, 16))
        numbers = [str(i) for i in range(start, start + count)]
        return f"Count from {numbers[0]} to {numbers[-1]}.", " ".join(numbers)
    phrase = [str(w) for w in rng.choice(words, size=int(rng.integers(2, 5)), replace=False)]
    if kind == 1:
        times = int(rng.integers(3, 6))
        return f"Repeat '{' '.join(phrase)}' {times} times.", " ".join(phrase * times)
    total = int(rng.integers(len(phrase) + 4, 3 * len(phrase) + 8))
    cycle = [phrase[i % len(phrase)] for i in range(total)]
    return f"Continue the pattern: {' '.join(phrase)}", " ".join(cycle)


def write_synthetic_conversations(
    path: str | Path, n: int, *, seed: int, vocab_words: Sequence[str] = DEFAULT_WORDS
) -> Path:
    """Write ``n`` learnable chat records (counting, repeating, cycling words) as JSONL; deterministic in ``seed``.

    Some records have a system message or a second exchange, so masks cover several assistant turns.
    The others get the template family's default system prompt when loaded, unless the loader is
    told otherwise (the tiny presets set ``train.system_prompt: ""``: Qwen's default would fill half
    of a 64-token row in the tiny vocabulary).
    """
    if len(vocab_words) < 4:
        raise ConfigError(f"data: synthetic data needs at least 4 vocab_words, got {len(vocab_words)}")
    rng = np.random.default_rng(seed)
    path = Path(path)
    lines = []
    for i in range(n):
        messages = []
        if rng.random() < 0.2:
            messages.append({"role": "system", "content": "Answer exactly."})
        for _ in range(2 if rng.random() < 0.25 else 1):
            user, assistant = _synthetic_exchange(rng, vocab_words)
            messages += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
        lines.append(json.dumps({"id": i, "conversations": messages}))
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path
