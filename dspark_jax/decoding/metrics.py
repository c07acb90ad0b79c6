"""The engine's run metrics: a per-round tally on the host and the summary dictionary.

τ counts the tokens a round commits (accepted drafts + the bonus) before stop and budget cuts.
`conditional_acceptance[j]` is P(draft j+1 accepted | drafts 1..j accepted), over the slot-rounds
that verified draft j+1 and accepted the j before it. `mean_budget` is the verification paid per
request and round beyond its anchor, (bucket - active) / active, padding included (0 for a round
without a proposal); `full_load_mean_budget` the same over the rounds read while the queue still
held requests (every slot busy: the load `full_load_tokens_per_s` is measured at, without the
drain, where fewer live requests make proposals cheaper); `buckets` counts the rounds per (kind,
bucket).
"""

from __future__ import annotations

import time

import numpy as np


class Tally:
    """Accumulates what the host reads back, round by round."""

    def __init__(self, gamma: int):
        self.gamma = gamma
        self.rounds = 0
        self.out_tokens = 0
        self.tau: list[int] = []
        self.verified: list[int] = []
        self.accepted: list[int] = []
        self.rates: list[float] = []  # per finished request: tokens after the first / seconds
        self.pos_reached = np.zeros(max(gamma, 1), np.int64)  # verified, and the ones before accepted
        self.pos_accepted = np.zeros(max(gamma, 1), np.int64)
        self.budgets: list[float] = []
        self.buckets: dict[str, int] = {}
        self.t_start = time.perf_counter()
        self.full: tuple[int, float] | None = None  # (tokens, seconds) when the queue ran dry
        self.full_rounds: int | None = None  # rounds read by then

    def prefill_token(self) -> None:
        self.out_tokens += 1

    def round(self, kind: str, bucket: int, num_active: int) -> None:
        """A round of `kind` ("spec" or "plain") verifying `bucket` tokens for `num_active` slots."""
        if not num_active:
            return
        self.rounds += 1
        self.budgets.append((bucket - num_active) / num_active if kind == "spec" else 0.0)
        name = f"{kind}:{bucket}"
        self.buckets[name] = self.buckets.get(name, 0) + 1

    def slot(self, committed: int, verified: int, accepted: int) -> None:
        """One active slot's round: `committed` tokens kept, ℓ verified, k accepted."""
        self.out_tokens += committed
        self.tau.append(accepted + 1)
        self.verified.append(verified)
        self.accepted.append(accepted)
        self.pos_reached[:min(accepted + 1, verified)] += 1
        self.pos_accepted[:min(accepted, verified)] += 1

    def queue_empty(self) -> None:
        """The last request was admitted: until now every slot was kept busy."""
        if self.full is None:
            self.full = (self.out_tokens, time.perf_counter() - self.t_start)
            self.full_rounds = len(self.budgets)

    def finished(self, num_tokens: int, seconds: float) -> None:
        if num_tokens > 1 and seconds > 0:
            self.rates.append((num_tokens - 1) / seconds)

    def summary(self) -> dict:
        elapsed = time.perf_counter() - self.t_start
        verified = np.asarray(self.verified, float)
        accepted = np.asarray(self.accepted, float)
        return {
            "tau": float(np.mean(self.tau)) if self.tau else 0.0,
            "acceptance_rate": float(accepted.sum() / verified.sum()) if verified.sum() else 0.0,
            "conditional_acceptance": [float(a / v) if v else 0.0 for a, v in
                                       zip(self.pos_accepted, self.pos_reached)][:self.gamma],
            "mean_verified": float(verified.mean()) if len(verified) else 0.0,
            "mean_budget": float(np.mean(self.budgets)) if self.budgets else 0.0,
            "full_load_mean_budget": (float(np.mean(self.budgets[:self.full_rounds]))
                                      if self.full_rounds else None),
            "buckets": dict(sorted(self.buckets.items(), key=lambda kv: (kv[0].split(":")[0],
                                                                          int(kv[0].split(":")[1])))),
            "output_tokens": self.out_tokens,
            "output_tokens_per_s": self.out_tokens / elapsed if elapsed else 0.0,
            # Read back while the queue still held requests (every slot busy; the drain excluded).
            "full_load_tokens_per_s": (self.full[0] / self.full[1]
                                       if self.full and self.full[0] > 0 else None),
            # Decoding speed one user sees: tokens after the first over the time since admission.
            "tokens_per_s_per_request": float(np.mean(self.rates)) if self.rates else 0.0,
            "elapsed_s": elapsed,
            "rounds": self.rounds,
        }


def acceptance_by_position(results, gamma: int) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """From results decoded with `keep_confidences` (k per round): (rounds that verified draft j+1
    with drafts 1..j accepted [γ], those that accepted it too [γ], k + 1 per round with a proposal);
    their ratio is `conditional_acceptance`, the mean of the last τ, as the Tally counts them."""
    reached, accepted, taus = np.zeros(gamma, np.int64), np.zeros(gamma, np.int64), []
    for res in results:
        for ell, k in zip(res.verified, res.drafts_accepted):
            if ell:
                reached[:min(k + 1, ell)] += 1
                accepted[:min(k, ell)] += 1
                taus.append(k + 1)
    return reached, accepted, taus
