"""What the engine is asked for and what it gives back: a `Request` (prompt ids, budget, sampling
settings, stop ids, random stream) and its `Result` (tokens, finish reason, per-round counts)."""

from __future__ import annotations

import dataclasses
import math
import zlib

from dspark_jax.errors import DSparkError


@dataclasses.dataclass(frozen=True)
class Request:
    id: str
    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    stop_ids: tuple[int, ...] = ()
    seed: int | None = None  # the request's random stream; None: derived from its id

    def __post_init__(self):
        problems = []
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
                and self.temperature >= 0):
            problems.append(f"temperature {self.temperature!r} must be a finite number >= 0")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            problems.append(f"top_p {self.top_p!r} must be in (0, 1]")
        if not (isinstance(self.top_k, int) and self.top_k >= 0):
            problems.append(f"top_k {self.top_k!r} must be an integer >= 0 (0 = off)")
        if self.seed is not None and not (isinstance(self.seed, int) and 0 <= self.seed < 2 ** 32):
            problems.append(f"seed {self.seed!r} must be an integer in [0, 2^32)")
        if problems:
            raise DSparkError(f"request {self.id}: " + "; ".join(problems))

    @property
    def stream(self) -> int:
        """uint32 seed of this request's random stream: its own, else a stable hash of its id."""
        return self.seed if self.seed is not None else zlib.crc32(str(self.id).encode())


@dataclasses.dataclass
class Result:
    id: str
    token_ids: list[int]
    finish_reason: str
    accepted: list[int]  # tokens committed in each round (the first comes from prefill)
    verified: list[int]  # drafts verified in each round
    # With generate(..., keep_confidences=True), per round: the raw confidence logits [γ] of the
    # block (empty for a round without a proposal) and k, the drafts accepted before any cut.
    conf_logits: list[list[float]] = dataclasses.field(default_factory=list)
    drafts_accepted: list[int] = dataclasses.field(default_factory=list)
    # With an engine built with logprobs=N > 0, per output token: the target's raw logprob of it
    # (log-softmax at T = 1, unfiltered) and its N most likely (id, logprob) pairs.
    logprobs: list[float] = dataclasses.field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = dataclasses.field(default_factory=list)

    def take_logprobs(self, logprob, top_ids, top_logprobs) -> None:
        """Appends tokens' logprobs [c] and their top (id, logprob) pairs [c, N]."""
        self.logprobs += logprob.tolist()
        self.top_logprobs += [list(zip(i, v)) for i, v in zip(top_ids.tolist(),
                                                              top_logprobs.tolist())]
