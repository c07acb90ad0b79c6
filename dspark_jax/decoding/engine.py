"""The batched speculative decoding engine's host loop (DESIGN §4, §7).

A fixed number of request slots R, each with its target KV cache and drafter context cache
(capacity S positions). Requests join free slots between rounds (continuous batching) through a
bucketed prefill, and leave when they finish. The device programs are the pure functions of
`rounds.py`; this module owns what the host decides: admission, the verification bucket of each
round, the table of compiled programs and the recompile guard. `metrics.py` keeps the tally.

Every per-request value (temperature, top-p, top-k, budget, stop ids) is an array in the state;
every program is compiled ahead of time at start-up, so nothing compiles while decoding. Without a
drafter the same engine runs plain target decoding (ℓ = 0: each round verifies only the anchor).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections import deque
from typing import Any, Callable, Iterable

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dspark_jax.config import DrafterConfig, TargetConfig
from dspark_jax.decoding import rounds
from dspark_jax.decoding.acceptance import accept
from dspark_jax.decoding.metrics import Tally
from dspark_jax.decoding.rounds import FINISH_REASONS, NO_STOP, RUNNING, EngineShape
from dspark_jax.decoding.schedulers import SchedulerConfig
from dspark_jax.errors import DSparkError


class RecompileError(DSparkError):
    """A program compiled after warm-up while the recompile guard was on."""


class _CompileCounter:
    """Counts XLA lowerings in this process (jit cache hits lower nothing)."""

    count = 0

    @classmethod
    def on_event(cls, event: str, duration: float, **kwargs) -> None:
        if event == "/jax/core/compile/jaxpr_to_mlir_module_duration":
            cls.count += 1


jax.monitoring.register_event_duration_secs_listener(_CompileCounter.on_event)


@dataclasses.dataclass(frozen=True)
class Request:
    id: str
    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    stop_ids: tuple[int, ...] = ()


@dataclasses.dataclass
class Result:
    id: str
    token_ids: list[int]
    finish_reason: str
    accepted: list[int]  # tokens committed in each round (the first comes from prefill)
    verified: list[int]  # drafts verified in each round


class Engine:
    """Owns the compiled programs and the device state; `generate` runs the host loop."""

    def __init__(self, tcfg: TargetConfig, target_params, dcfg: DrafterConfig | None = None,
                 drafter_params=None, *, slots: int = 8, max_len: int = 512,
                 scheduler: SchedulerConfig = SchedulerConfig(), prefill_buckets: Iterable[int] = (),
                 max_prefill_batch: int = 8, max_stop_ids: int = 8, seed: int = 0,
                 acceptance: Callable = accept, mesh: Mesh | None = None):
        if (dcfg is None) != (drafter_params is None):
            raise ValueError("give both the drafter config and its params, or neither")
        if max_len > tcfg.max_position_embeddings:
            raise DSparkError(f"max_len {max_len} exceeds the target's max_position_embeddings "
                              f"{tcfg.max_position_embeddings}")
        if max_len < 2:
            raise DSparkError(f"max_len {max_len}: need at least 2 positions")
        self.shape = EngineShape(tcfg=tcfg, dcfg=dcfg, slots=slots, max_len=max_len,
                                 max_stop_ids=max_stop_ids, scheduler=scheduler,
                                 acceptance=acceptance)
        self.tcfg, self.tparams, self.dcfg, self.dparams = tcfg, target_params, dcfg, drafter_params
        self.R, self.S, self.scheduler, self.NS = slots, max_len, scheduler, max_stop_ids
        self.gamma, self.W, self.max_verify = self.shape.gamma, self.shape.width, self.shape.max_verify
        # Prompt-length buckets up to the context; the context itself is always the last one.
        given = set(prefill_buckets) or set(_powers_of_two(16, max_len))
        self.prefill_buckets = sorted(b for b in given if b < max_len) + [max_len]
        self.batch_buckets = _powers_of_two(1, min(slots, max_prefill_batch))
        # Verification buckets: multiples of the per-request width up to all slots full.
        per = 1 + self.max_verify
        self.verify_buckets = sorted({min(b, slots) * per for b in _powers_of_two(1, slots)})
        self.mesh = mesh
        if mesh is not None and slots % (mesh.shape["data"] * mesh.shape["fsdp"]):
            raise DSparkError(f"slots {slots} must be a multiple of the mesh's data x fsdp size "
                              f"{mesh.shape['data'] * mesh.shape['fsdp']}")
        self.state = rounds.init_state(self.shape, seed, mesh)
        self._state_sharding = jax.tree.map(lambda x: x.sharding, self.state)
        self._compiled: dict[tuple, Any] = {}
        self._warm = False
        self.guard = False  # True: any compilation after warm-up is an error
        self.compilations = 0
        self.compilations_after_warmup = 0

    # ------------------------------------------------------------------ compiled programs

    def _check_guard(self, since: int) -> None:
        """Counts what compiled since `since` (this engine's own work) and enforces the guard."""
        new = _CompileCounter.count - since
        if new and self._warm:
            self.compilations += new
            self.compilations_after_warmup += new
            if self.guard:
                raise RecompileError(f"{new} program(s) compiled after warm-up (recompile guard on)")

    def _program(self, kind: str, *static):
        """The compiled program for ("round", bucket) or ("prefill", batch, length)."""
        key = (kind, *static)
        if key not in self._compiled:
            if self._warm and self.guard:
                raise RecompileError(f"no compiled program for {key} (recompile guard on)")
            # The state keeps its shardings round after round (a compiled program accepts only
            # the shardings it was compiled for); the small outputs come back replicated.
            out = None if self.mesh is None else (
                self._state_sharding, NamedSharding(self.mesh, PartitionSpec()))
            if kind == "round":
                fn = functools.partial(rounds.scheduled_round, self.shape, static[0])
                args = (self.state, self.tparams, self.dparams)
            else:
                fn = functools.partial(rounds.prefill, self.shape)
                args = (self.state, self.tparams, self.dparams, *self._prefill_args(*static))
            self._compiled[key] = jax.jit(fn, donate_argnums=0, out_shardings=out).lower(
                *args).compile()
        return self._compiled[key]

    def _prefill_args(self, J, P, batch=None):
        """Host arrays for one prefill call (zeros/unused rows when `batch` is None)."""
        slot_idx = np.full(J, self.R, np.int32)
        tokens = np.zeros((J, P), np.int32)
        lengths = np.ones(J, np.int32)
        max_new = np.ones(J, np.int32)
        temperature = np.zeros(J, np.float32)
        top_p = np.ones(J, np.float32)
        top_k = np.zeros(J, np.int32)
        stop_ids = np.full((J, self.NS), NO_STOP, np.int32)
        for i, (slot, req) in enumerate(batch or []):
            slot_idx[i] = slot
            tokens[i, :len(req.prompt_ids)] = req.prompt_ids
            lengths[i] = len(req.prompt_ids)
            max_new[i] = req.max_new_tokens
            temperature[i], top_p[i], top_k[i] = req.temperature, req.top_p, req.top_k
            stop_ids[i, :len(req.stop_ids)] = req.stop_ids
        return slot_idx, tokens, lengths, max_new, temperature, top_p, top_k, stop_ids

    def warmup(self) -> float:
        """Compiles every prefill (batch x length bucket) and round (verification bucket)."""
        t = time.perf_counter()
        before = _CompileCounter.count
        for J in self.batch_buckets:
            for P in self.prefill_buckets:
                self._program("prefill", J, P)
        for F in self.verify_buckets:
            self._program("round", F)
        self._warm = True
        self.compilations += _CompileCounter.count - before
        return time.perf_counter() - t

    # ------------------------------------------------------------------ host loop

    def check_request(self, req: Request) -> None:
        """Raises DSparkError for a request the engine cannot serve."""
        n = len(req.prompt_ids)
        if n == 0:
            raise DSparkError(f"request {req.id}: empty prompt")
        if n > self.S:
            raise DSparkError(f"request {req.id}: prompt of {n} tokens is longer than the context "
                              f"({self.S} positions)")
        if req.max_new_tokens < 1:
            raise DSparkError(f"request {req.id}: max_new_tokens must be >= 1")
        if len(req.stop_ids) > self.NS:
            raise DSparkError(f"request {req.id}: {len(req.stop_ids)} stop ids, at most {self.NS}")
        if max(req.prompt_ids) >= self.tcfg.vocab_size or min(req.prompt_ids) < 0:
            raise DSparkError(f"request {req.id}: token id outside the vocabulary")

    def _dispatch_round(self, num_live: int):
        """Runs one round for the live slots and returns its (not yet read) output. The bucket
        holds every live slot's anchor and the scheduler's most drafts."""
        F = _bucket(num_live * (1 + self.max_verify), self.verify_buckets)
        self.state, out = self._program("round", F)(self.state, self.tparams, self.dparams)
        return out

    def generate(self, requests: Iterable[Request], on_result: Callable[[Result], None] = lambda r: None
                 ) -> dict:
        """Decodes all requests with continuous batching; calls `on_result` as each finishes.
        Returns the run's metrics.

        The host keeps one round in flight: it dispatches round t+1 before reading round t's
        tokens, so reading results, streaming them and admitting requests overlap device work. A
        slot that finished in round t is already inactive on the device in round t+1; it is freed
        and refilled on the host one round later.
        """
        if not self._warm:
            self.warmup()
        queue = deque(requests)
        for req in queue:
            self.check_request(req)
        free = list(range(self.R))[::-1]
        live: dict[int, Result] = {}  # slots the host has not seen finish (a superset of active)
        started: dict[int, float] = {}
        events: deque = deque()  # device outputs not yet read, in dispatch order
        tally = Tally(self.gamma)

        def finish(slot: int, reason: str):
            res = live.pop(slot)
            res.finish_reason = reason
            tally.finished(len(res.token_ids), time.perf_counter() - started.pop(slot))
            free.append(slot)
            on_result(res)

        def read(event):
            kind, payload = event
            if kind == "prefill":
                chunk, (first, codes) = payload
                first, codes = jax.device_get((first, codes))
                for i, (slot, _) in enumerate(chunk):
                    live[slot].token_ids.append(int(first[i]))
                    tally.prefill_token()
                    if codes[i] != RUNNING:
                        finish(slot, FINISH_REASONS[int(codes[i])])
                return
            out = jax.device_get(payload)
            tally.round(out.was_active.any())
            for slot in np.flatnonzero(out.was_active):
                res = live[slot]
                c, ell, k = int(out.count[slot]), int(out.verified[slot]), int(out.accepted[slot])
                res.token_ids += out.tokens[slot, :c].tolist()
                res.accepted.append(c)
                res.verified.append(ell)
                tally.slot(c, ell, k)
                if out.finish[slot] != RUNNING:
                    finish(slot, FINISH_REASONS[int(out.finish[slot])])

        mark = _CompileCounter.count
        while queue or live or events:
            # Admit into free slots: group joiners by prompt bucket, up to the largest batch bucket.
            joiners = []
            while queue and free:
                slot, req = free.pop(), queue.popleft()
                joiners.append((slot, req))
                live[slot] = Result(id=req.id, token_ids=[], finish_reason="", accepted=[], verified=[])
                started[slot] = time.perf_counter()
            for P, group in _group_by(joiners, lambda sr: _bucket(len(sr[1].prompt_ids),
                                                                  self.prefill_buckets)):
                for chunk in _chunks(group, self.batch_buckets[-1]):
                    J = _bucket(len(chunk), self.batch_buckets)
                    self.state, out = self._program("prefill", J, P)(
                        self.state, self.tparams, self.dparams, *self._prefill_args(J, P, chunk))
                    events.append(("prefill", (chunk, out)))
            in_flight = 0
            if live:
                events.append(("round", self._dispatch_round(len(live))))
                in_flight = 1
            self._check_guard(mark)
            mark = _CompileCounter.count
            while len(events) > in_flight:
                read(events.popleft())
        return {**tally.summary(), "compilations": self.compilations,
                "compilations_after_warmup": self.compilations_after_warmup}


def _powers_of_two(lo: int, hi: int) -> list[int]:
    out, b = [], lo
    while b < hi:
        out.append(b)
        b *= 2
    return out + [hi]


def _bucket(n: int, buckets: list[int]) -> int:
    for b in buckets:
        if b >= n:
            return b
    raise AssertionError(f"{n} exceeds the largest bucket {buckets[-1]}")


def _group_by(items, key):
    groups: dict[Any, list] = {}
    for it in items:
        groups.setdefault(key(it), []).append(it)
    return sorted(groups.items())


def _chunks(items, size):
    return [items[i:i + size] for i in range(0, len(items), size)]
