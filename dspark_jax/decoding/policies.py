"""How the host loop runs one round for each scheduler: which programs it compiles, which one it
dispatches with which verification bucket, and what it learns from the rounds it reads back.

A policy never touches device state itself; it asks the engine to run a compiled program by key:
("plain", F), ("scheduled", F), ("topk", F), ("greedy_plan",), ("greedy_verify", F). Adding a
scheduler means adding a policy (and, if it needs one, a program in `rounds.py`), not a branch in
the host loop.
"""

from __future__ import annotations

import numpy as np

from dspark_jax.decoding.schedulers import choose_bucket

# async: a round with a proposal at least this often, so that survival estimates stay current even
# when plain rounds win (a bounded cost: one round in PROBE_EVERY).
PROBE_EVERY = 64


def bucket_for(n: int, buckets: list[int]) -> int:
    """The smallest bucket holding n tokens."""
    for b in buckets:
        if b >= n:
            return b
    raise AssertionError(f"{n} exceeds the largest bucket {buckets[-1]}")


class Policy:
    """Plain target decoding (also the base class): every round verifies the live anchors."""

    def __init__(self, engine):
        self.engine = engine

    def programs(self) -> list[tuple]:
        return [("plain", F) for F in self.engine.plain_buckets]

    def dispatch(self, live: list[int]):
        """Runs one round for the live slots; returns (output, kind, bucket)."""
        F = bucket_for(len(live), self.engine.plain_buckets)
        return self.engine.run_round(("plain", F)), "plain", F

    def admitted(self, slot: int) -> None:
        """A new request took `slot`."""

    def observe(self, out, live: list[int]) -> None:
        """A round's host output, read back (an earlier round than the one last dispatched)."""


class PerRequestPolicy(Policy):
    """fixed / threshold: the scheduler sets ℓ on the device; the bucket holds every live slot's
    anchor and the scheduler's most drafts."""

    def programs(self):
        return [("scheduled", F) for F in self.engine.verify_buckets]

    def dispatch(self, live):
        e = self.engine
        F = bucket_for(len(live) * (1 + e.max_verify), e.verify_buckets)
        return e.run_round(("scheduled", F)), "spec", F


class GreedyPolicy(Policy):
    """Algorithm 1, synchronous: propose and plan, read B, verify in the bucket B pads up to."""

    def programs(self):
        return [("greedy_plan",)] + [("greedy_verify", F) for F in self.engine.spec_buckets]

    def dispatch(self, live):
        e = self.engine
        plan = e.run_program(("greedy_plan",), e.sps_array)
        B = int(plan.tokens)  # the one small device-to-host read of this scheduler
        F = bucket_for(max(B, 1), e.spec_buckets)
        return e.run_round(("greedy_verify", F), plan), "spec", F


class AsyncPolicy(Policy):
    """§5.2: the bucket for round t from survival estimates of rounds already read (t-2 and
    earlier), searched over every profiled bucket; a plain round when that pays more."""

    def __init__(self, engine):
        super().__init__(engine)
        gamma = engine.gamma
        self.estimates: dict[int, np.ndarray] = {}
        self.prior = np.ones(gamma)  # optimistic until the first proposal is read: explore
        self.seen = False
        self.since_spec = 0
        self.seconds = None  # (profile, spec seconds, plain seconds) of the compiled buckets

    def programs(self):
        return super().programs() + [("topk", F) for F in self.engine.spec_buckets]

    def dispatch(self, live):
        e = self.engine
        if self.seconds is None or self.seconds[0] is not e.profile:
            self.seconds = (e.profile, {F: e.profile.spec[F] for F in e.spec_buckets},
                            {F: e.profile.plain[F] for F in e.plain_buckets})
        _, spec, plain = self.seconds
        est = np.stack([self.estimates.get(slot, self.prior) for slot in live])
        if self.since_spec >= PROBE_EVERY:
            plain = {}  # force a proposal, so that the estimates stay current
        kind, F = choose_bucket(est, len(live), spec, plain)
        if kind == "plain":
            self.since_spec += 1
            return e.run_round(("plain", F)), "plain", F
        self.since_spec = 0
        return e.run_round(("topk", F)), "spec", F

    def admitted(self, slot):
        self.estimates.pop(slot, None)

    def observe(self, out, live):
        active = np.flatnonzero(out.was_active)
        if out.survival.shape[1] == 0 or not len(active):
            return
        for slot in active:
            self.estimates[int(slot)] = out.survival[slot].astype(np.float64)
        mean = out.survival[active].mean(0).astype(np.float64)
        self.prior = mean if not self.seen else 0.9 * self.prior + 0.1 * mean
        self.seen = True


def make_policy(engine) -> Policy:
    if engine.dcfg is None:
        return Policy(engine)
    kind = engine.scheduler.kind
    if kind in ("fixed", "threshold"):
        return PerRequestPolicy(engine)
    return GreedyPolicy(engine) if kind == "greedy" else AsyncPolicy(engine)
