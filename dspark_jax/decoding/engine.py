"""The batched speculative decoding engine (DESIGN §4, §7).

A fixed number of request slots R, each with its target KV cache and drafter context cache
(capacity S positions). Requests join free slots between rounds (continuous batching) through a
bucketed prefill, and leave when they finish. One jitted round per verification bucket F:

    propose (drafter + Markov scan + confidence) -> schedule ℓ_r -> verify a flat batch of
    Σ_r (1 + ℓ_r) <= F tokens -> accept -> commit caches, context features and anchors.

Every per-request value (temperature, top-p, top-k, budget, stop ids) is an array in the state;
every program is compiled ahead of time at start-up, so nothing compiles while decoding. Without a
drafter the same engine runs plain target decoding (ℓ = 0: each round verifies only the anchor).
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from typing import Any, Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dspark_jax.decoding.acceptance import accept
from dspark_jax.config import DrafterConfig, TargetConfig
from dspark_jax.models.drafter import DraftCache, extend_context, propose
from dspark_jax.errors import DSparkError
from dspark_jax.decoding.sampling import sample, target_probs
from dspark_jax.decoding.schedulers import SchedulerConfig, schedule
from dspark_jax.sharding import logical_to_spec
from dspark_jax.models.target import KVCache, forward, forward_flat

RUNNING, STOP, LENGTH, CONTEXT = 0, 1, 2, 3
FINISH_REASONS = {STOP: "stop", LENGTH: "length", CONTEXT: "context"}
NO_STOP = -1  # padding of the stop-id table


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


@struct.dataclass
class Slots:
    """Per-slot decoding state; every field is [R] (stop_ids [R, NS])."""

    active: jax.Array  # bool
    length: jax.Array  # int32 n: positions 0..n-1 are in the caches; the anchor sits at n
    anchor: jax.Array  # int32 last committed token, not yet run through the target
    generated: jax.Array  # int32 output tokens so far
    max_new: jax.Array  # int32 budget
    temperature: jax.Array  # float32, 0 = greedy
    top_p: jax.Array  # float32
    top_k: jax.Array  # int32, 0 = off
    stop_ids: jax.Array  # int32 [R, NS], NO_STOP padded


@struct.dataclass
class EngineState:
    slots: Slots
    target_cache: KVCache
    draft_cache: DraftCache | None
    key: jax.Array


@struct.dataclass
class RoundOutput:
    tokens: jax.Array  # [R, W] committed tokens (first `count` valid)
    count: jax.Array  # [R] tokens committed this round (bonus included, after stop/budget cuts)
    verified: jax.Array  # [R] ℓ: drafts verified
    accepted: jax.Array  # [R] k: drafts accepted (before cuts)
    finish: jax.Array  # [R] RUNNING or a finish code
    was_active: jax.Array  # [R]


def _truncate(tokens, count, stop_ids, remaining):
    """Cuts a commit at the first stop token and at the budget; returns (count, finish code)."""
    W = tokens.shape[1]
    j = jnp.arange(W)
    is_stop = jnp.any(tokens[:, :, None] == stop_ids[:, None, :], -1) & (j < count[:, None])
    first_stop = jnp.where(jnp.any(is_stop, -1), jnp.argmax(is_stop, -1), W)
    stop_count = first_stop + 1
    finish = jnp.where(stop_count <= jnp.minimum(count, remaining), STOP,
                       jnp.where(count >= remaining, LENGTH, RUNNING))
    count = jnp.minimum(jnp.minimum(count, stop_count), remaining)
    return count, finish


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
        self.tcfg, self.tparams, self.dcfg, self.dparams = tcfg, target_params, dcfg, drafter_params
        self.R, self.S, self.scheduler = slots, max_len, scheduler
        self.acceptance = acceptance  # the rule; replaceable only to test that tests can fail
        self.NS = max_stop_ids
        self.gamma = dcfg.block_size if dcfg else 0
        self.max_verify = scheduler.max_len(self.gamma) if dcfg else 0
        self.W = self.gamma + 1
        if max_len < 2:
            raise DSparkError(f"max_len {max_len}: need at least 2 positions")
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
        self.state = self._init_state(seed)
        self._state_sharding = jax.tree.map(lambda x: x.sharding, self.state)
        self._compiled: dict[tuple, Any] = {}
        self._warm = False
        self.guard = False  # True: any compilation after warm-up is an error
        self.compilations = 0
        self.compilations_after_warmup = 0

    # ------------------------------------------------------------------ device programs

    def _init_state(self, seed: int) -> EngineState:
        R = self.R
        slots = Slots(active=np.zeros(R, bool), length=np.zeros(R, np.int32),
                      anchor=np.zeros(R, np.int32), generated=np.zeros(R, np.int32),
                      max_new=np.zeros(R, np.int32), temperature=np.zeros(R, np.float32),
                      top_p=np.ones(R, np.float32), top_k=np.zeros(R, np.int32),
                      stop_ids=np.full((R, self.NS), NO_STOP, np.int32))
        draft = DraftCache.create(self.tcfg, self.dcfg, R, self.S) if self.dcfg else None
        state = EngineState(slots=slots, target_cache=KVCache.create(self.tcfg, R, self.S),
                            draft_cache=draft, key=jax.random.key(seed))
        if self.mesh is None:
            return jax.tree.map(jnp.asarray, state)
        # Requests over (data, fsdp), KV heads over tensor; the small per-slot arrays replicated.
        cache = NamedSharding(self.mesh, logical_to_spec(
            ("layers", "batch", "cache_seq", "kv_heads", "head_dim")))
        replicated = NamedSharding(self.mesh, PartitionSpec())
        shard = jax.tree.map(lambda _: replicated, state)
        shard = shard.replace(target_cache=KVCache(k=cache, v=cache),
                              draft_cache=None if draft is None else DraftCache(k=cache, v=cache))
        return jax.device_put(state, shard)

    def _prefill(self, state: EngineState, tparams, dparams, slot_idx, tokens, lengths, max_new,
                 temperature, top_p, top_k, stop_ids):
        """Prompts [J, P] into slots `slot_idx` [J] (R = unused row); samples the first tokens."""
        tcfg, R = self.tcfg, self.R
        J, P = tokens.shape
        take = jnp.minimum(slot_idx, R - 1)
        positions = jnp.broadcast_to(jnp.arange(P), (J, P))
        valid = positions < lengths[:, None]
        sub = KVCache(k=state.target_cache.k[:, take], v=state.target_cache.v[:, take])
        out = forward(tparams, tcfg, tokens, positions, cache=sub, valid=valid,
                      logit_index=(lengths - 1)[:, None])
        tc = KVCache(k=state.target_cache.k.at[:, slot_idx].set(out.cache.k, mode="drop"),
                     v=state.target_cache.v.at[:, slot_idx].set(out.cache.v, mode="drop"))
        dc = state.draft_cache
        if dc is not None:
            sub_d = DraftCache(k=dc.k[:, take], v=dc.v[:, take])
            sub_d = extend_context(dparams, tcfg, self.dcfg, sub_d, out.taps, positions, valid)
            dc = DraftCache(k=dc.k.at[:, slot_idx].set(sub_d.k, mode="drop"),
                            v=dc.v.at[:, slot_idx].set(sub_d.v, mode="drop"))
        key, k_sample = jax.random.split(state.key)
        probs = target_probs(out.logits[:, 0], temperature, top_p, top_k)
        first = sample(k_sample, probs)
        count, finish = _truncate(first[:, None], jnp.ones((J,), jnp.int32), stop_ids, max_new)
        finish = jnp.where((finish == RUNNING) & (lengths >= self.S), CONTEXT, finish)
        s = state.slots
        upd = lambda field, value: field.at[slot_idx].set(value, mode="drop")
        slots = Slots(active=upd(s.active, finish == RUNNING), length=upd(s.length, lengths),
                      anchor=upd(s.anchor, first), generated=upd(s.generated, count),
                      max_new=upd(s.max_new, max_new), temperature=upd(s.temperature, temperature),
                      top_p=upd(s.top_p, top_p), top_k=upd(s.top_k, top_k),
                      stop_ids=upd(s.stop_ids, stop_ids))
        return EngineState(slots=slots, target_cache=tc, draft_cache=dc, key=key), (first, finish)

    def _round(self, state: EngineState, tparams, dparams, bucket: int):
        """One decoding round for every active slot, verifying at most `bucket` tokens."""
        tcfg, R, S, W, gamma = self.tcfg, self.R, self.S, self.W, self.gamma
        s = state.slots
        key, k_prop, k_acc = jax.random.split(state.key, 3)
        if self.dcfg is not None:
            prop = propose(dparams, tparams, tcfg, self.dcfg, state.draft_cache, s.anchor, s.length,
                           s.temperature, k_prop)
            ell = schedule(self.scheduler, jax.nn.sigmoid(prop.conf_logits))
            drafts = prop.tokens
        else:
            ell = jnp.zeros((R,), jnp.int32)
            drafts = jnp.zeros((R, 0), jnp.int32)
        remaining = s.max_new - s.generated
        # Verify positions n..n+ℓ < S, and no more drafts than the budget can still use.
        ell = jnp.clip(ell, 0, jnp.minimum(self.max_verify, S - 1 - s.length))
        ell = jnp.where(s.active, jnp.minimum(ell, jnp.maximum(remaining - 1, 0)), 0)
        counts = jnp.where(s.active, 1 + ell, 0)
        ends = jnp.cumsum(counts)
        i = jnp.arange(bucket)
        row = jnp.minimum(jnp.searchsorted(ends, i, side="right"), R - 1).astype(jnp.int32)
        j = i - (ends - counts)[row]
        valid = i < ends[-1]
        prev = jnp.concatenate([s.anchor[:, None], drafts], axis=1)  # [R, W]
        tok = prev[row, jnp.clip(j, 0, W - 1)]
        out = forward_flat(tparams, tcfg, state.target_cache, tok, row, s.length[row] + j, valid,
                           row * W + j, W)
        grid = jnp.where(valid, row * W + j, R * W)
        logits = jnp.zeros((R * W, tcfg.vocab_size), jnp.float32).at[grid].set(
            out.logits, mode="drop").reshape(R, W, -1)
        p = target_probs(logits, s.temperature[:, None], s.top_p[:, None], s.top_k[:, None])
        if self.dcfg is not None:
            acc = self.acceptance(k_acc, drafts, prop.probs, p, ell)
            k, nxt = acc.num_accepted, acc.next_token
        else:
            k, nxt = jnp.zeros((R,), jnp.int32), sample(k_acc, p[:, 0])
        jw = jnp.arange(W)
        padded = jnp.concatenate([drafts, jnp.zeros((R, 1), jnp.int32)], axis=1)
        tokens = jnp.where(jw < k[:, None], padded, nxt[:, None])
        count, finish = _truncate(tokens, k + 1, s.stop_ids, remaining)
        new_length = s.length + k + 1
        finish = jnp.where((finish == RUNNING) & (new_length >= S), CONTEXT, finish)
        finish = jnp.where(s.active, finish, RUNNING)
        count = jnp.where(s.active, count, 0)
        dc = state.draft_cache
        if dc is not None:  # the drafter's context gains the anchor and the accepted drafts
            taps = jnp.zeros((R * W, out.taps.shape[-1]), out.taps.dtype).at[grid].set(
                out.taps, mode="drop").reshape(R, W, -1)
            dc = extend_context(dparams, tcfg, self.dcfg, dc, taps, s.length[:, None] + jw,
                                (jw <= k[:, None]) & s.active[:, None])
        slots = s.replace(active=s.active & (finish == RUNNING),
                          length=jnp.where(s.active, new_length, s.length),
                          anchor=jnp.where(s.active, nxt, s.anchor),
                          generated=s.generated + count)
        new_state = EngineState(slots=slots, target_cache=out.cache, draft_cache=dc, key=key)
        return new_state, RoundOutput(tokens=tokens, count=count, verified=ell, accepted=k,
                                      finish=finish, was_active=s.active)

    # ------------------------------------------------------------------ compilation

    def _check_guard(self, since: int) -> None:
        """Counts what compiled since `since` (this engine's own work) and enforces the guard."""
        new = _CompileCounter.count - since
        if new and self._warm:
            self.compilations += new
            self.compilations_after_warmup += new
            if self.guard:
                raise RecompileError(f"{new} program(s) compiled after warm-up (recompile guard on)")

    def _program(self, kind: str, *static):
        key = (kind, *static)
        if key not in self._compiled:
            if self._warm and self.guard:
                raise RecompileError(f"no compiled program for {key} (recompile guard on)")
            # The state keeps its shardings round after round (a compiled program accepts only
            # the shardings it was compiled for); the small outputs come back replicated.
            out = None if self.mesh is None else (
                self._state_sharding, NamedSharding(self.mesh, PartitionSpec()))
            if kind == "round":
                fn = jax.jit(lambda st, tp, dp: self._round(st, tp, dp, static[0]), donate_argnums=0,
                             out_shardings=out)
                args = (self.state, self.tparams, self.dparams)
            else:
                J, P = static
                fn = jax.jit(self._prefill, donate_argnums=0, out_shardings=out)
                args = (self.state, self.tparams, self.dparams, *self._prefill_args(J, P))
            self._compiled[key] = fn.lower(*args).compile()
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
        gamma = self.gamma
        pos_verified = np.zeros(max(gamma, 1), np.int64)
        pos_accepted = np.zeros(max(gamma, 1), np.int64)
        tally = {"rounds": 0, "out_tokens": 0, "tau": [], "verified": [], "accepted": [], "rates": []}
        t_start = time.perf_counter()

        def finish(slot: int, reason: str):
            res = live.pop(slot)
            res.finish_reason = reason
            took = time.perf_counter() - started.pop(slot)
            if len(res.token_ids) > 1 and took > 0:
                tally["rates"].append((len(res.token_ids) - 1) / took)
            free.append(slot)
            on_result(res)

        def read(event):
            kind, payload = event
            if kind == "prefill":
                chunk, (first, codes) = payload
                first, codes = jax.device_get((first, codes))
                for i, (slot, _) in enumerate(chunk):
                    live[slot].token_ids.append(int(first[i]))
                    tally["out_tokens"] += 1
                    if codes[i] != RUNNING:
                        finish(slot, FINISH_REASONS[int(codes[i])])
                return
            out = jax.device_get(payload)
            if out.was_active.any():
                tally["rounds"] += 1
            for slot in np.flatnonzero(out.was_active):
                res = live[slot]
                c, ell, k = int(out.count[slot]), int(out.verified[slot]), int(out.accepted[slot])
                res.token_ids += out.tokens[slot, :c].tolist()
                res.accepted.append(c)
                res.verified.append(ell)
                tally["out_tokens"] += c
                tally["tau"].append(k + 1)
                tally["verified"].append(ell)
                tally["accepted"].append(k)
                pos_verified[:ell] += 1
                pos_accepted[:min(k, ell)] += 1
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
                F = _bucket(len(live) * (1 + self.max_verify), self.verify_buckets)
                self.state, out = self._program("round", F)(self.state, self.tparams, self.dparams)
                events.append(("round", out))
                in_flight = 1
            self._check_guard(mark)
            mark = _CompileCounter.count
            while len(events) > in_flight:
                read(events.popleft())
        elapsed = time.perf_counter() - t_start
        verified = np.asarray(tally["verified"], float)
        accepted = np.asarray(tally["accepted"], float)
        return {
            # τ: tokens a round commits (accepted drafts + the bonus), before stop/budget cuts.
            "tau": float(np.mean(tally["tau"])) if tally["tau"] else 0.0,
            "acceptance_rate": float(accepted.sum() / verified.sum()) if verified.sum() else 0.0,
            "conditional_acceptance": [float(a / v) if v else 0.0
                                       for a, v in zip(pos_accepted, pos_verified)][:gamma],
            "mean_verified": float(verified.mean()) if len(verified) else 0.0,
            "output_tokens": tally["out_tokens"],
            "output_tokens_per_s": tally["out_tokens"] / elapsed if elapsed else 0.0,
            # Decoding speed one user sees: tokens after the first over the time since admission.
            "tokens_per_s_per_request": float(np.mean(tally["rates"])) if tally["rates"] else 0.0,
            "elapsed_s": elapsed,
            "rounds": tally["rounds"],
            "compilations": self.compilations,
            "compilations_after_warmup": self.compilations_after_warmup,
        }


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

