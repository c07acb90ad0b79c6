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
import os
import time
import weakref
from collections import deque
from typing import Any, Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dspark_jax import distributed
from dspark_jax.config import DrafterConfig, Eagle3Config, TargetConfig
from dspark_jax.decoding import profile as sps_profile
from dspark_jax.decoding import rounds
from dspark_jax.decoding.acceptance import accept
from dspark_jax.decoding.calibration import Sts, check_form
from dspark_jax.decoding.metrics import Tally
from dspark_jax.decoding.policies import bucket_for, make_policy
from dspark_jax.decoding.requests import Request, Result
from dspark_jax.decoding.schedulers import SchedulerConfig
from dspark_jax.decoding.state import (
    FINISH_REASONS,
    PENDING,
    RUNNING,
    EngineShape,
    RoundOutput,
    init_state,
    prefill_arrays,
)
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

# Compiled programs are shared by every engine of one shape, mesh and argument layout in the
# process while one of them holds it; these kinds compute the same whatever the scheduler (static
# in the shape, but never read: a plain round verifies anchors only), so they are shared across
# schedulers too. Engines side by side (a benchmark's schedulers at one concurrency) then compile
# and map them once: at 32 slots five engines' own copies outgrew the kernel's 65530 memory maps
# per process.
SHARED_KINDS = ("prefill", "plain", "end", "flush")
_shared_programs: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def _layout(tree) -> tuple:
    """What a compiled program is specialised to in `tree`: structure, shapes, dtypes, shardings."""
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple((x.shape, str(x.dtype), getattr(x, "sharding", None)) for x in leaves)


class Engine:
    """Owns the compiled programs and the device state; `generate` runs the host loop.

    The drafter is a DSpark/DFlash one (`DrafterConfig`) or an Eagle3 chain (`Eagle3Config`); the
    programs are the same, with the kind's stages plugged in (`rounds.DrafterStages`).

    `scheduler` picks the round policy (`policies.py`). The load-aware ones (greedy, async) need an
    SPS profile: `sps` (a profile or a path), else a cached start-up profile for this model, slot
    count, context and device, else one measured at warm-up and cached. `sts`: the calibration of
    the confidence head (Eagle3: of its stand-in), a `calibration.Sts` (either form) or
    temperatures alone, one per draft position.
    `pending_context` (DSpark): how many rounds without a proposal a slot may hold its committed
    tokens' features back from the drafter's context before a flush projects them (PendingContext;
    a bigger buffer flushes less often, at R x pending x m·d target-dtype values).
    """

    def __init__(self, tcfg: TargetConfig, target_params,
                 dcfg: DrafterConfig | Eagle3Config | None = None, drafter_params=None, *,
                 slots: int = 8, max_len: int = 512,
                 scheduler: SchedulerConfig = SchedulerConfig(), prefill_buckets: Iterable[int] = (),
                 max_prefill_batch: int = 8, max_stop_ids: int = 8, seed: int = 0,
                 acceptance: Callable = accept, mesh: Mesh | None = None,
                 sts: Sts | tuple[float, ...] | None = None,
                 sps: sps_profile.SpsProfile | str | os.PathLike | None = None,
                 cache_profile: bool = True, logprobs: int = 0, pending_context: int = PENDING):
        if (dcfg is None) != (drafter_params is None):
            raise ValueError("give both the drafter config and its params, or neither")
        if not 0 <= logprobs <= tcfg.vocab_size:
            raise DSparkError(f"logprobs {logprobs}: must be in [0, {tcfg.vocab_size}] (0 = off)")
        if isinstance(dcfg, Eagle3Config) and tcfg.family != "qwen3":
            raise DSparkError(f"an Eagle3 drafter runs on qwen3 targets only; the target is "
                              f"{tcfg.family}")
        if max_len > tcfg.max_position_embeddings:
            raise DSparkError(f"max_len {max_len} exceeds the target's max_position_embeddings "
                              f"{tcfg.max_position_embeddings}")
        if max_len < 2:
            raise DSparkError(f"max_len {max_len}: need at least 2 positions")
        if pending_context < 1:
            raise DSparkError(f"pending_context {pending_context}: must be >= 1")
        sts = None if sts is None else Sts.of(sts)
        if sts is not None and (dcfg is None or len(sts) != dcfg.proposal_length):
            raise DSparkError(f"{len(sts)} calibration temperatures for a drafter with block size "
                              f"{dcfg.proposal_length if dcfg else 0}")
        if sts is not None:
            check_form("the engine's calibration (sts)", sts.form, sts.temperatures, sts.biases)
        self.shape = EngineShape(tcfg=tcfg, dcfg=dcfg, slots=slots, max_len=max_len,
                                 max_stop_ids=max_stop_ids, scheduler=scheduler,
                                 sts=sts,
                                 acceptance=acceptance, logprobs=logprobs, pending=pending_context,
                                 one_device=mesh is None)
        self.tcfg, self.tparams, self.dcfg, self.dparams = tcfg, target_params, dcfg, drafter_params
        self.R, self.S, self.scheduler, self.NS = slots, max_len, scheduler, max_stop_ids
        self.gamma, self.W, self.max_verify = self.shape.gamma, self.shape.width, self.shape.max_verify
        # Prompt-length buckets up to the context; the context itself is always the last one.
        given = set(prefill_buckets) or set(_powers_of_two(16, max_len))
        self.prefill_buckets = sorted(b for b in given if b < max_len) + [max_len]
        self.batch_buckets = _powers_of_two(1, min(slots, max_prefill_batch))
        # Verification buckets (tokens): fixed/threshold hold every slot's anchor plus its most
        # drafts; the load-aware schedulers pick any size up to all slots' whole blocks; rounds
        # without a proposal hold the anchors.
        per = 1 + self.max_verify
        self.verify_buckets = sorted({min(b, slots) * per for b in _powers_of_two(1, slots)})
        self.spec_buckets = _powers_of_two(2, slots * self.W) if dcfg else []
        self.plain_buckets = _powers_of_two(1, slots)
        self.mesh = mesh
        if mesh is not None and slots % (mesh.shape["data"] * mesh.shape["fsdp"]):
            raise DSparkError(f"slots {slots} must be a multiple of the mesh's data x fsdp size "
                              f"{mesh.shape['data'] * mesh.shape['fsdp']}")
        self.seed = seed
        self.state = init_state(self.shape, seed, mesh)
        self._compiled: dict[tuple, Any] = {}
        self._warm = False
        self.guard = False  # True: any compilation after warm-up is an error
        self.compilations = 0
        self.compilations_after_warmup = 0
        self.policy = make_policy(self)
        self.profile: sps_profile.SpsProfile | None = None
        self.profile_source = ""  # where the profile came from: a file, the cache, measured
        self.sps_array = None
        self._sps_arg, self._cache_profile = sps, cache_profile

    # ------------------------------------------------------------------ compiled programs

    def _check_guard(self, since: int) -> None:
        """Counts what compiled since `since` (this engine's own work) and enforces the guard."""
        new = _CompileCounter.count - since
        if new and self._warm:
            self.compilations += new
            self.compilations_after_warmup += new
            if self.guard:
                raise RecompileError(f"{new} program(s) compiled after warm-up (recompile guard on)")

    def _program(self, key: tuple):
        """The compiled program for `key`: ("prefill", J, P), ("plain" | "scheduled" | "topk" |
        "greedy_verify", F) or ("greedy_plan",)."""
        if key not in self._compiled:
            if self._warm and self.guard:
                raise RecompileError(f"no compiled program for {key} (recompile guard on)")
            kind = key[0]
            fn, args, donate, out = program(self.shape, key, self.state, self.tparams,
                                            self.dparams, self.mesh)
            # A program depends on the engine's shape and its arguments' layout only, so engines
            # alive side by side compile each once; the kinds no scheduler reads ignore it.
            shape = self.shape
            if kind in SHARED_KINDS:
                shape = dataclasses.replace(shape, scheduler=SchedulerConfig())
            shared = (key, shape, _layout(args), donate, out)
            self._compiled[key] = _shared_programs.get(shared)
            if self._compiled[key] is None:
                self._compiled[key] = jax.jit(fn, donate_argnums=donate, out_shardings=out).lower(
                    *args).compile()
                _shared_programs[shared] = self._compiled[key]
        return self._compiled[key]

    def run_round(self, key: tuple, *extra):
        """Dispatches a state-updating program; returns its (not yet read) output."""
        self.state, out = self._program(key)(self.state, self.tparams, self.dparams, *extra)
        return out

    def flush(self) -> None:
        """Projects the features held back by rounds without a proposal (PendingContext)."""
        self.state = self._program(("flush",))(self.state, self.tparams, self.dparams)

    def run_program(self, key: tuple, *extra):
        """Dispatches a program that reads the state without changing it."""
        return self._program(key)(self.state, self.tparams, self.dparams, *extra)

    def prefill_chunks(self, joiners: list[tuple[int, Request]]) -> list[list]:
        """(slot, request) pairs grouped by prompt bucket, in chunks of the largest batch bucket."""
        groups = _group_by(joiners, lambda sr: bucket_for(len(sr[1].prompt_ids), self.prefill_buckets))
        return [chunk for _, group in groups for chunk in _chunks(group, self.batch_buckets[-1])]

    def prefill(self, chunk: list[tuple[int, Request]]):
        """Dispatches the prefill of one chunk (one prompt bucket); returns (first tokens, codes)."""
        P = bucket_for(max(len(req.prompt_ids) for _, req in chunk), self.prefill_buckets)
        J = bucket_for(len(chunk), self.batch_buckets)
        self.state, out = self._program(("prefill", J, P))(
            self.state, self.tparams, self.dparams, *prefill_arrays(self.R, self.NS, J, P, chunk))
        return out

    def reset(self) -> None:
        """Empties every slot (new state; the compiled programs stay)."""
        self.state = init_state(self.shape, self.seed, self.mesh)

    def warmup(self) -> float:
        """Compiles every prefill (batch x length bucket) and every round the scheduler uses;
        loads, or measures, the SPS profile of a load-aware scheduler."""
        t = time.perf_counter()
        before = _CompileCounter.count
        if self._sps_arg is not None and self.scheduler.load_aware and self.dcfg is not None \
                and self.profile is None and jax.process_count() == 1:
            self._load_profile()  # a given profile is checked before minutes of compiling
        for J in self.batch_buckets:
            for P in self.prefill_buckets:
                self._program(("prefill", J, P))
        for key in self.policy.programs() + [("end",)]:
            self._program(key)
        distributed.wait_for_all("engine warm-up")  # before the first collective
        self.policy.warm()
        self._warm = True
        if self.scheduler.load_aware and self.dcfg is not None and self.profile is None:
            self._load_profile()  # may measure: through `generate` too, so after warm-up
        self.compilations += _CompileCounter.count - before
        return time.perf_counter() - t

    # ------------------------------------------------------------------ SPS profile

    def _load_profile(self) -> None:
        self.use_profile(*sps_profile.resolve(self, self._sps_arg, self._cache_profile))

    def use_profile(self, prof: sps_profile.SpsProfile, source: str) -> None:
        """Schedules by `prof` (as whole round costs: `SpsProfile.round_seconds`)."""
        self.profile, self.profile_source = prof.round_seconds(), source
        # A host array: on a mesh over several processes each passes its own (equal) copy.
        self.sps_array = np.asarray(self.profile.sps_table(self.R * self.W), np.float32)

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

    def _room(self, req: Request, generated: int) -> int:
        """The most drafts a request can still verify, as far as the host has read (rounds in
        flight may have used some)."""
        return max(0, min(self.max_verify, req.max_new_tokens - max(generated, 1) - 1,
                          self.S - len(req.prompt_ids) - max(generated, 1)))

    def generate(self, requests: Iterable[Request], on_result: Callable[[Result], None] = lambda r: None,
                 *, keep_confidences: bool = False,
                 should_stop: Callable[[Result], bool] | None = None) -> dict:
        """Decodes all requests with continuous batching; calls `on_result` as each finishes.
        Returns the run's metrics.

        A collection of requests is checked whole before anything runs. An iterator (a generator)
        is pulled lazily, as slots free, each request checked when pulled; it may yield None for
        "nothing ready yet" (say a conversation's next turn waits for its previous turn's
        `on_result`) and is asked again after the next round.

        The host keeps one round in flight: it dispatches round t+1 before reading round t's
        tokens, so reading results, streaming them and admitting requests overlap device work. A
        slot that finished in round t is already inactive on the device in round t+1; it is freed
        and refilled on the host one round later.

        `should_stop(result)` is asked when a live request's new tokens are read; True ends it
        (reason "stop", say at a stop string): its slot is freed, deactivated on the device before
        the next dispatch, and what the round in flight computed for it is dropped.
        """
        if not self._warm:
            self.warmup()
        if iter(requests) is not requests:
            requests = list(requests)
            for req in requests:
                self.check_request(req)
        source, queue, exhausted = iter(requests), deque(), False
        self.policy.starting()
        free = list(range(self.R))[::-1]
        live: dict[int, Result] = {}  # slots the host has not seen finish (a superset of active)
        serving: dict[int, Request] = {}
        started: dict[int, float] = {}
        events: deque = deque()  # device outputs not yet read, in dispatch order
        tally = Tally(self.gamma)
        dispatched = 0  # rounds dispatched so far
        ended_at: dict[int, int] = {}  # slot ended by the host -> rounds dispatched by then

        def finish(slot: int, reason: str):
            res = live.pop(slot)
            serving.pop(slot)
            res.finish_reason = reason
            tally.finished(len(res.token_ids), time.perf_counter() - started.pop(slot))
            free.append(slot)
            on_result(res)

        def read(event):
            kind, payload = event
            going = []  # slots still running after this read
            if kind == "prefill":
                chunk, out = payload
                first, codes, *lp = jax.device_get(out)
                for i, (slot, _) in enumerate(chunk):
                    live[slot].token_ids.append(int(first[i]))
                    if lp:
                        live[slot].take_logprobs(*(a[i:i + 1] for a in lp))
                    tally.prefill_token()
                    if codes[i] != RUNNING:
                        finish(slot, FINISH_REASONS[int(codes[i])])
                    else:
                        going.append(slot)
                return end_early(going)
            round_kind, F, seq, out = payload
            out = RoundOutput.unpack(jax.device_get(out))
            for slot in [slot for slot, last in ended_at.items() if last < seq]:
                del ended_at[slot]
            out.was_active[list(ended_at)] = False  # computed for a request the host ended
            tally.round(round_kind, F, int(out.was_active.sum()))
            self.policy.observe(out, list(live))
            for slot in np.flatnonzero(out.was_active):
                res = live[slot]
                c, ell, k = int(out.count[slot]), int(out.verified[slot]), int(out.accepted[slot])
                res.token_ids += out.tokens[slot, :c].tolist()
                if out.logprob is not None:
                    res.take_logprobs(out.logprob[slot, :c], out.top_ids[slot, :c],
                                      out.top_logprobs[slot, :c])
                res.accepted.append(c)
                res.verified.append(ell)
                if keep_confidences:
                    res.conf_logits.append(out.conf_logits[slot].tolist())
                    res.drafts_accepted.append(k)
                tally.slot(c, ell, k)
                if out.finish[slot] != RUNNING:
                    finish(slot, FINISH_REASONS[int(out.finish[slot])])
                else:
                    going.append(slot)
            end_early(going)

        def end_early(slots):
            """Ends the requests `should_stop` asks to end, on the host and on the device."""
            ended = [slot for slot in slots if should_stop is not None and should_stop(live[slot])]
            for slot in ended:
                finish(slot, "stop")
                ended_at[slot] = dispatched
            if ended:
                self.state = self._program(("end",))(self.state, self.tparams, self.dparams,
                                                     np.isin(np.arange(self.R), ended))

        def pull():
            """Tops the queue up to one past the free slots, so its end is seen when admitting."""
            nonlocal exhausted
            while not exhausted and len(queue) <= len(free):
                req = next(source, _END)
                if req is None:
                    break
                if req is _END:
                    exhausted = True
                else:
                    self.check_request(req)
                    queue.append(req)

        mark = _CompileCounter.count
        while True:
            pull()
            if not (queue or live or events):
                if exhausted:
                    break
                raise DSparkError("the request iterator has nothing ready and nothing is decoding")
            # Admit into free slots: group joiners by prompt bucket, up to the largest batch bucket.
            joiners = []
            while queue and free:
                slot, req = free.pop(), queue.popleft()
                joiners.append((slot, req))
                live[slot] = Result(id=req.id, token_ids=[], finish_reason="", accepted=[], verified=[])
                serving[slot] = req
                started[slot] = time.perf_counter()
                self.policy.admitted(slot)
            for chunk in self.prefill_chunks(joiners):
                events.append(("prefill", (chunk, self.prefill(chunk))))
            if exhausted and not queue and joiners:
                tally.queue_empty()
            in_flight = 0
            if live:
                out, round_kind, F = self.policy.dispatch(list(live), lambda: [
                    self._room(serving[slot], len(res.token_ids)) for slot, res in live.items()])
                dispatched += 1
                events.append(("round", (round_kind, F, dispatched, out)))
                in_flight = 1
            self._check_guard(mark)
            mark = _CompileCounter.count
            while len(events) > in_flight:
                read(events.popleft())
        return {**tally.summary(), "compilations": self.compilations,
                "compilations_after_warmup": self.compilations_after_warmup,
                "scheduler": self.scheduler.describe(self.gamma) if self.dcfg else "plain"}


_END = object()  # the end of a request iterator

PROGRAM_KINDS = ("prefill", "plain", "scheduled", "topk", "greedy_plan", "greedy_verify", "flush",
                 "end")


def program(shape: EngineShape, key: tuple, state, tparams, dparams, mesh: Mesh | None = None
            ) -> tuple[Callable, tuple, tuple, Any]:
    """The device program `key` (see `Engine._program`) as (function, example arguments, donated
    argument numbers, output shardings): what `jax.jit(fn, donate_argnums=..., out_shardings=...)
    .lower(*args)` compiles. `state`, `tparams` and `dparams` may be arrays or, for a memory plan
    that allocates nothing, jax.ShapeDtypeStruct trees with shardings (`state.abstract_state`,
    `params.abstract`); on `mesh` the state keeps its shardings (a compiled program accepts only
    the shardings it was compiled for) and the small outputs come back replicated."""
    kind, static = key[0], key[1:]
    if kind not in PROGRAM_KINDS:
        raise ValueError(f"unknown program {key}; kinds: {PROGRAM_KINDS}")
    R = shape.slots
    replicated = None if mesh is None else NamedSharding(mesh, PartitionSpec())
    state_sharding = None if mesh is None else jax.tree.map(lambda x: x.sharding, state)
    out = None if mesh is None else (state_sharding, replicated)
    args = (state, tparams, dparams)
    donate = (0,)
    sps = jax.ShapeDtypeStruct((R * shape.width + 1,), jnp.float32)
    if kind == "prefill":
        fn = functools.partial(rounds.prefill, shape)
        args += prefill_arrays(R, shape.max_stop_ids, *static)
    elif kind == "greedy_plan":
        fn = functools.partial(rounds.greedy_plan, shape)
        args += (sps,)
        out, donate = replicated, ()
    elif kind in ("flush", "end"):
        fn = functools.partial({"flush": rounds.flush_round, "end": rounds.end_requests}[kind], shape)
        args += (jax.ShapeDtypeStruct((R,), jnp.bool_),) if kind == "end" else ()
        out = state_sharding
    elif kind == "greedy_verify":
        fn = functools.partial(rounds.greedy_verify, shape, *static)
        args += (jax.eval_shape(functools.partial(rounds.greedy_plan, shape), *args, sps),)
    else:
        fn = functools.partial({"plain": rounds.plain_round, "scheduled": rounds.scheduled_round,
                                "topk": rounds.topk_round}[kind], shape, *static)
    return fn, args, donate, out


def _powers_of_two(lo: int, hi: int) -> list[int]:
    out, b = [], lo
    while b < hi:
        out.append(b)
        b *= 2
    return out + [hi]


def _group_by(items, key):
    groups: dict[Any, list] = {}
    for it in items:
        groups.setdefault(key(it), []).append(it)
    return sorted(groups.items())


def _chunks(items, size):
    return [items[i:i + size] for i in range(0, len(items), size)]
