"""How the host loop runs one round for each scheduler: which programs it compiles, which one it
dispatches with which verification bucket, and what it learns from the rounds it reads back.

A policy never touches device state itself; it asks the engine to run a compiled program by key:
("plain", F), ("scheduled", F), ("topk", F), ("greedy_plan",), ("greedy_verify", F). Adding a
scheduler means adding a policy (and, if it needs one, a program in `rounds.py`), not a branch in
the host loop.
"""

from __future__ import annotations

import collections
import time

import jax
import numpy as np

from dspark_jax import distributed
from dspark_jax.decoding.schedulers import BucketTable

# async: while plain rounds win, one round with a proposal (a probe, in the smallest bucket holding
# the anchors) after PROBE_EVERY plain ones, so that the survival estimates stay current; each probe that changes nothing doubles the wait,
# up to PROBE_MAX (a bounded cost that vanishes on a steady load: one round in PROBE_MAX).
PROBE_EVERY = 64
PROBE_MAX = 1024
# async: a probe also when at least UNSEEN_SHARE of the live requests joined since the last
# proposal. Their estimates are only the prior (what earlier requests' drafts were worth), and on a
# mixed load the next request may draft far better or worse than the last one did: at one request
# a math answer that speculation doubles can follow a chat answer it cannot help. But only when
# the joiners could change the decision: when, with their mean worth JOINER_Z standard errors above
# the prior (the spread of the requests' survival over the square root of their number), a
# proposal would pay. Many joiners average out, so at high load the prior is a good enough mean and
# the probe (two to three plain rounds' cost on 2 CPU cores at 32 requests) is not paid.
UNSEEN_SHARE = 0.5
JOINER_Z = 2.0
# async: a decision stands for REDECIDE_EVERY rounds unless the number of live requests changes
# (the survival estimates move slowly; searching every round costs the host more than it gains on
# small rounds); each search that repeats the decision doubles that, up to REDECIDE_MAX. A switch
# from plain rounds to proposals stands SWITCH_HOLD rounds only: it was priced on the slots' last
# read proposals, which after a run of plain rounds are many rounds old, and its first round
# refreshes them; the host reads that round after dispatching the next one, so the third round is
# the first decided with it. A stale switch then costs two rounds with a proposal, not four.
REDECIDE_EVERY = 4
REDECIDE_MAX = 32
SWITCH_HOLD = 2
KINDS = ("plain", "spec")  # round kinds as the decision broadcast encodes them


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

    def dispatch(self, live: list[int], rooms):
        """Runs one round for the live slots; `rooms()` gives the most drafts each can still
        verify, as far as the host knows. Returns (output, kind, bucket)."""
        F = bucket_for(len(live), self.engine.plain_buckets)
        return self.engine.run_round(("plain", F)), "plain", F

    def warm(self) -> None:
        """Compiles what the policy itself runs besides the engine's programs (at warm-up)."""

    def starting(self) -> None:
        """A `generate` call begins (the time since the last one was idle)."""

    def admitted(self, slot: int) -> None:
        """A new request took `slot`."""

    def observe(self, out, live: list[int]) -> None:
        """A round's host output, read back (an earlier round than the one last dispatched)."""


class PerRequestPolicy(Policy):
    """fixed / threshold: the scheduler sets ℓ on the device; the bucket holds every live slot's
    anchor and the scheduler's most drafts."""

    def programs(self):
        return [("scheduled", F) for F in self.engine.verify_buckets]

    def dispatch(self, live, rooms):
        e = self.engine
        F = bucket_for(len(live) * (1 + e.max_verify), e.verify_buckets)
        return e.run_round(("scheduled", F)), "spec", F


class GreedyPolicy(Policy):
    """Algorithm 1, synchronous: propose and plan, read B, verify in the bucket B pads up to."""

    def programs(self):
        return [("greedy_plan",)] + [("greedy_verify", F) for F in self.engine.spec_buckets]

    def dispatch(self, live, rooms):
        e = self.engine
        plan = e.run_program(("greedy_plan",), e.sps_array)
        B = int(plan.tokens)  # the one small device-to-host read of this scheduler
        F = bucket_for(max(B, 1), e.spec_buckets)
        return e.run_round(("greedy_verify", F), plan), "spec", F


class AsyncPolicy(Policy):
    """§5.2: the bucket for round t from survival estimates of rounds already read (t-2 and
    earlier), searched over every profiled bucket; a plain round when that pays more.

    Each live request's estimate is the survival its last read proposal predicted, rescaled per
    block position by how often such predictions came true lately (observed / predicted prefix
    survival over the verified drafts, decayed by DECAY a round, PRIOR pseudo-drafts at the head's
    word). The budget then follows the
    tokens rounds really commit even when the confidence head is miscalibrated; the ranking
    inside a round still uses the round's own (calibrated) survival. Everything here comes from
    rounds already committed, so it cannot bias the output.

    The profile times rounds alone; a running engine also pays its host loop between rounds. That
    overhead is measured as it runs, per kind of round (with and without a proposal). With one
    round in flight the host dispatches round t+1, then waits for round t to finish before it
    dispatches t+2: the time between those two dispatches is round t's wall time (not t+1's:
    attributing it to the round just dispatched charges a proposal's cost to the plain round after
    it, and the other way round, which makes sparse proposals look free). That time minus round t's
    profiled time, clipped to [-OVERHEAD_FLOOR, OVERHEAD_CAP] x that time (an idle gap is not a
    cost of the round), is averaged with weight OVERHEAD_DECAY per round (of either kind: a figure not
    refreshed for long counts for little against a new sample), bias-corrected (the weights' sum
    divides, so the first measurement counts whole: an average started at 0 would take the rare
    proposals of a plain-heavy load for free for dozens of rounds); the search adds
    it to that kind's buckets. A kind not yet run borrows the other kind's figure, and before
    either has run the profile's word stands.

    The figure may also be negative, down to -OVERHEAD_FLOOR x the profiled time: rounds that run
    faster than their profile says. A profile is measured once and cached, and one measured while
    the machine was busy overstates every round it times, unevenly: on 2 CPU cores, one measured
    beside a benchmark priced the plain round at 16 slots 23.4 ms where the engine's rounds then
    took 15-16 ms, while its proposal rounds were off by less, so the search proposed in rounds
    that lost (async at 0.87-0.95x plain decoding). Clipped at 0, nothing corrected it.

    An interval that also waited for a prefill (the requests admitted with round t+1 are prefilled
    on the device between rounds t and t+1) is not a sample. The prefills are the workload's, the
    same work whichever rounds decode it, so they do not belong in the price of a round; and
    counted in, they made the figures follow the joins (on the bundled pair at 4 requests a prefill
    costs 16-22 ms, three plain rounds). A kind's figure only changes while that kind runs, so one
    unlucky figure could shut it out for good: plain rounds priced at a stale 2 ms too many kept
    async proposing in every round at 4 requests (0.7x plain decoding) until the call ended, since
    nothing re-measured them. So a figure not refreshed for STALE_ROUNDS rounds falls to the other
    kind's when that is lower: the worst a stale figure can then cost is one round of its kind,
    which measures it again.

    The estimates are a slot's last read proposal, up to a few rounds old, and the search
    speculates when they are high: on a load whose drafts vary from one round to the next (T = 1,
    mixed domains) the rounds it chooses then deliver less than their estimates promised (at 16
    requests on the bundled pair, 10.4 accepted drafts a round where the corrected estimates said
    15.4). So the search also scales every bucket's estimated drafts by what such prices have
    delivered: the accepted drafts of each round with a proposal over the sum of estimates the
    search priced it with, decayed by DECAY a round, PRICE_PRIOR drafts at face value. Probes
    are left out: the search did not choose them for their estimates, and a call's first probe is
    priced on none (every estimate is 0 until a proposal is read), which would have tripled the
    scale after it.

    A proposal must promise MARGIN more tokens per second than the plain round to be chosen.
    The search takes the best of a dozen buckets priced with estimated survival, and the largest
    of several noisy estimates is biased upwards (the winner's curse), while the plain round's
    tokens are certain: near the break-even point, where speculating gains little when right, the
    margin keeps the scheduler from paying for noise (on 2 CPU cores, spec and plain rounds of the
    bundled pair tie within a few per cent at low load).

    In a job of several processes each measures its own clock, so every decision is process 0's,
    broadcast to the others (one small collective per decision, not per round); everything else
    the policy reads (the rounds' outputs, the live slots) is the same in every process.
    """

    DECAY = 0.98
    PRIOR = 8.0
    OVERHEAD_DECAY = 0.9
    OVERHEAD_CAP = 2.0
    OVERHEAD_FLOOR = 0.5
    STALE_ROUNDS = 64
    MARGIN = 0.05
    PRICE_PRIOR = 16.0

    def __init__(self, engine):
        super().__init__(engine)
        self.plain_run = 0  # rounds without a proposal since the held-back features were projected
        self.table = None  # (profile, BucketTable of the compiled buckets)
        self.clock = time.perf_counter
        # measured seconds per round beyond the profile, per kind (see the docstring), and the
        # sum of the weights behind each (0: not measured yet)
        self.overhead = {"spec": 0.0, "plain": 0.0}
        self.overhead_weight = {"spec": 0.0, "plain": 0.0}
        self.dispatched = []  # (clock, profiled seconds, kind) of the last two dispatches
        self.timed = 0  # rounds dispatched with the clock running (every kind)
        self.sampled_at = {"spec": 0, "plain": 0}  # `timed` when each kind's figure last moved
        # Joins since the last dispatch, and whether the interval the next dispatch closes holds
        # a prefill (the one admitted with the last dispatch).
        self.joins, self.prefilled = 0, False
        self.prices = collections.deque()  # per round dispatched and not read: its price or None
        self._forget()

    def _forget(self) -> None:
        """What the policy learns about the drafts and decides from them, back to its start.
        Each `generate` call starts here: its requests are not the last call's, and the engine's
        drafter may have changed in between (the overheads describe the machine and stay)."""
        gamma, R = self.engine.gamma, self.engine.R
        # Per slot, and a new request's (the last read round's mean). Before any round is read
        # they are 0: the joiners' probe (the spread is unknown) proposes first, and the decision
        # made while it is in flight waits for its read rather than propose on no information.
        self.estimates = np.zeros((R, gamma))
        self.prior = np.zeros(gamma)
        self.predicted = np.zeros(gamma)  # decayed Σ a_j over verified drafts j
        self.observed = np.zeros(gamma)  # decayed Σ 1[draft j survived] over the same
        self.since_spec = 0  # rounds since the last proposal
        self.last = None  # (kind, bucket, live count) of the last decision
        self.age = 0  # rounds it has been used for
        self.hold = REDECIDE_EVERY  # rounds the current decision stands
        self.probe_every = PROBE_EVERY  # plain rounds before the next probe
        # Decisions still to make one round apart after a probe (2, 1, 0): the host reads round
        # t after dispatching t+1, so the decision for t+1 has not seen the probe yet; the one for
        # t+2 has, and judges it.
        self.after_probe = 0
        self.timed_probe = False  # that probe came from the PROBE_EVERY clock (not from joiners)
        self.unseen = np.zeros(R, bool)  # joined since the last proposal
        self.joined = False  # a request joined since the last decision
        self.spread = None  # [γ] std across requests of the last read proposal's survival
        self.pending = []  # round outputs read since the last decision
        # the estimated drafts the search priced the current decision's bucket at (None: a probe)
        self.price = None
        self.priced = 0.0  # decayed Σ price over the rounds with a proposal read
        self.delivered = 0.0  # decayed Σ accepted drafts of the same rounds

    def programs(self):
        return super().programs() + [("topk", F) for F in self.engine.spec_buckets] + [("flush",)]

    def correction(self) -> np.ndarray:
        """[γ] observed / predicted prefix survival, pulled towards 1 (the head's own word) by
        PRIOR drafts' worth of pseudo-observations, so that a few unlucky rounds cannot zero it."""
        return (self.observed + self.PRIOR) / (self.predicted + self.PRIOR)

    def dispatch(self, live, rooms):
        e = self.engine
        if self.plain_run >= e.shape.pending:  # the held-back features would overflow their buffer
            e.flush()
            self.plain_run = 0
        n = len(live)
        if self.last is None or self.last[2] != n or self.age >= self.hold or self.after_probe or \
                self.since_spec >= self.probe_every or (self.joined and self._unseen(live)):
            self._decide(live, rooms)
        self.age += 1
        kind, F, _ = self.last
        self._time_round(*((e.profile.plain[F], "plain") if kind == "plain" else (e.profile.spec[F], "spec")))
        if kind == "plain":
            self.since_spec += 1
            self.plain_run += 1
            self.prices.append(None)
            return e.run_round(("plain", F)), "plain", F
        self.since_spec = self.plain_run = 0
        self.prices.append(self.price)
        self.unseen[live] = False  # every live request gets a proposal, whatever the bucket
        return e.run_round(("topk", F)), "spec", F

    def warm(self):
        if jax.process_count() > 1:
            distributed.from_lead([0, 0, 0])  # compiles the broadcast `_decide` uses

    def starting(self):
        self.dispatched = []
        self.joins, self.prefilled = 0, False
        self.prices.clear()
        self._forget()

    def scale(self) -> float:
        """Accepted drafts per estimated draft over the rounds the search chose to propose in,
        pulled towards 1 by PRICE_PRIOR drafts at face value."""
        return (self.delivered + self.PRICE_PRIOR) / (self.priced + self.PRICE_PRIOR)

    def _time_round(self, profiled: float, kind: str) -> None:
        """Folds the wall time since the last dispatch into the overhead of the round dispatched
        before that one (the round the host waited for in between; see the docstring), unless the
        host also waited for a prefill then."""
        now = self.clock()
        if len(self.dispatched) == 2 and not self.prefilled:
            (_, expected, waited), (then, _, _) = self.dispatched
            extra = min(max(now - then - expected, -self.OVERHEAD_FLOOR * expected),
                        self.OVERHEAD_CAP * expected)
            # decayed by every round since the kind's last sample, not by its own rounds only:
            # a figure not refreshed for long counts for little against the new one
            kept = self.OVERHEAD_DECAY ** (self.timed - self.sampled_at[waited]) * \
                self.overhead_weight[waited]
            self.overhead_weight[waited] = kept + (1 - self.OVERHEAD_DECAY)
            self.overhead[waited] = ((kept * self.overhead[waited] + (1 - self.OVERHEAD_DECAY) * extra)
                                     / self.overhead_weight[waited])
            self.sampled_at[waited] = self.timed
        self.prefilled, self.joins = self.joins > 0, 0
        self.timed += 1
        self.dispatched = [*self.dispatched[-1:], (now, profiled, kind)]

    def _unseen(self, live) -> bool:
        """At least UNSEEN_SHARE of the live requests have had no proposal yet."""
        return bool(self.unseen[live].sum() >= UNSEEN_SHARE * len(live))

    def _joiners_matter(self, live, rooms) -> bool:
        """Whether a proposal would pay were the unseen joiners' mean worth JOINER_Z standard
        errors above the prior (always, before the spread across requests is known)."""
        self._absorb()
        if self.spread is None:
            return True
        unseen = self.unseen[live]
        est = self.estimates[live].copy()
        est[unseen] = self.prior + JOINER_Z * self.spread / np.sqrt(unseen.sum())
        return self._search(est, len(live), rooms)[0] == "spec"

    def _decide(self, live, rooms) -> None:
        rooms = rooms()
        timed = self.since_spec >= self.probe_every
        kind, F = self.choose(live, rooms)
        # A probe only where the search chose a plain round, and in the cheapest round with a
        # proposal: the smallest bucket holding the anchors (no drafts once the live count fills
        # a bucket). What it is for is the proposal, which refreshes every live request's
        # estimate; a larger bucket verifies drafts the search has just priced out. Probes in the
        # bucket the estimates liked best (up to 8 drafts a request at 32 requests) set a floor
        # under async's budget at high load that plain rounds could never lower.
        probe = kind == "plain" and (timed or (self._unseen(live) and self._joiners_matter(live, rooms)))
        self.joined = False
        if probe:
            kind, F = "spec", bucket_for(len(live), self.engine.spec_buckets)
        if jax.process_count() > 1:
            # The clock-based overhead differs between processes, and so may whether the joiners
            # were worth a probe: the probe flag decides when the next decision comes (after_probe,
            # hold), and every process must enter that decision's broadcast in the same round.
            code, F, probe = (int(v) for v in distributed.from_lead([KINDS.index(kind), F, probe]))
            kind, probe = KINDS[code], bool(probe)
        if probe:  # not chosen for its estimates: the scale corrects the search's choices only
            self.price = None
        decision = (kind, F, len(live))
        judging = self.after_probe == 1  # the first decision that has read the probe's round
        if judging and self.timed_probe:  # did the probe change the decision?
            self.probe_every = min(2 * self.probe_every, PROBE_MAX) if kind == "plain" else PROBE_EVERY
        elif kind == "spec" and not probe and self.last is not None and self.last[0] == "plain":
            self.probe_every = PROBE_EVERY  # the load or the drafts changed: probe often again
        if decision == self.last:
            self.hold = min(2 * self.hold, REDECIDE_MAX)
        elif kind == "spec" and not probe and self.last is not None and self.last[0] == "plain":
            self.hold = SWITCH_HOLD
        else:
            self.hold = REDECIDE_EVERY
        if probe and kind == "spec":
            self.after_probe, self.timed_probe = 2, timed
        else:
            self.after_probe = max(self.after_probe - 1, 0)
        self.last, self.age = decision, 0

    def choose(self, live, rooms) -> tuple[str, int]:
        self._absorb()
        kind, F, est = self._search(self.estimates[live], len(live), rooms)
        if kind == "spec":  # the estimates of the F - n best candidates, before the scale
            self.price = float(np.sort(est, axis=None)[::-1][:F - len(live)].sum())
        return kind, F

    def _search(self, estimates, n: int, rooms) -> tuple[str, int, np.ndarray]:
        """The bucket for n live requests with these [n, γ] survival estimates; also returns
        them corrected as the search priced them."""
        e = self.engine
        if self.table is None or self.table[0] is not e.profile:
            self.table = (e.profile, BucketTable({F: e.profile.spec[F] for F in e.spec_buckets},
                                                 {F: e.profile.plain[F] for F in e.plain_buckets}))
        est = estimates * self.correction()
        est = np.minimum.accumulate(np.clip(est, 0.0, 1.0), axis=1)  # survival never rises along j
        est[np.arange(est.shape[1]) >= np.asarray(rooms)[:, None]] = 0.0
        kind, F = self.table[1].choose(est, n, overhead=self.overheads(),
                                       margin=self.MARGIN, scale=self.scale())
        return kind, F, est

    def overheads(self) -> dict[str, float]:
        """The overhead the search adds per kind: the measured one, else the other kind's; a
        figure older than STALE_ROUNDS rounds at most the other kind's."""
        out = dict(self.overhead)
        for kind, other in (("spec", "plain"), ("plain", "spec")):
            if not self.overhead_weight[kind]:
                out[kind] = self.overhead[other]
            elif self.overhead_weight[other] and self.timed - self.sampled_at[kind] > self.STALE_ROUNDS:
                out[kind] = min(self.overhead[kind], self.overhead[other])
        return out

    def admitted(self, slot):
        self.joins += 1  # prefilled before the next round: see `_time_round`
        self._absorb()  # rounds read so far may still describe the slot's previous request
        self.estimates[slot] = self.prior
        self.unseen[slot] = self.joined = True
        # The decision stands: a joiner that keeps the live count only refreshes one slot's
        # estimate at the prior (a changed count is a new decision anyway).

    def observe(self, out, live):
        price = self.prices.popleft() if self.prices else None
        if price is not None and out.was_active.any():
            self.priced = self.DECAY * self.priced + price
            self.delivered = self.DECAY * self.delivered + float(out.accepted[out.was_active].sum())
        # Kept until the next decision: the estimates are read only then, and absorbing a few
        # rounds at once costs the host about what one costs.
        if out.survival.shape[1] and out.was_active.any():
            self.pending.append(out)

    def _absorb(self) -> None:
        """Folds the rounds read since the last decision into the estimates, as if one by one."""
        if not self.pending:
            return
        outs, self.pending = self.pending, []
        a = np.stack([o.survival for o in outs]).astype(np.float64)  # [m, R, γ]
        active = np.stack([o.was_active for o in outs])  # [m, R]
        j = np.arange(a.shape[2])
        verified = (j < np.stack([o.verified for o in outs])[..., None]) & active[..., None]
        survived = (j < np.stack([o.accepted for o in outs])[..., None]) & active[..., None]
        m = len(outs)
        weight = self.DECAY ** np.arange(m - 1, -1, -1.0)  # round t is decayed m-1-t times
        self.predicted = self.DECAY ** m * self.predicted + np.einsum(
            "m,mrj->j", weight, np.where(verified, a, 0.0))
        self.observed = self.DECAY ** m * self.observed + np.einsum("m,mrj->j", weight, survived)
        seen = active.any(0)
        latest = m - 1 - np.argmax(active[::-1], axis=0)  # each slot's last active round
        self.estimates[seen] = a[latest[seen], np.flatnonzero(seen)]
        rows = a[-1][active[-1]]
        self.prior = rows.mean(0)
        if len(rows) > 1:
            self.spread = rows.std(0, ddof=1)


def make_policy(engine) -> Policy:
    if engine.dcfg is None:
        return Policy(engine)
    kind = engine.scheduler.kind
    if kind in ("fixed", "threshold"):
        return PerRequestPolicy(engine)
    return GreedyPolicy(engine) if kind == "greedy" else AsyncPolicy(engine)
