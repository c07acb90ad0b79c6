"""SPS profiles (DESIGN §5): the measured seconds of one engine round per verification bucket.

A profile is a small JSON table keyed by what it was measured on (target and drafter shapes, slots,
context, device kind and count); the load-aware schedulers read steps per second, SPS(B) =
1 / seconds of the bucket that B tokens pad up to. Two kinds of round are timed: `spec` (propose,
fill the bucket, verify, commit) for every verification bucket, and `plain` (no proposal: anchors
only) for every anchor bucket; plus the host loop's own time per round, which every round pays. `Engine.profile_rounds` measures; this module names, validates,
stores and caches.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
import time
from pathlib import Path

import jax
import numpy as np

from dspark_jax import distributed
from dspark_jax.decoding.requests import Request
from dspark_jax.errors import DSparkError

FORMAT, VERSION = "dspark-sps", 3
# What a profile must match to be used: the rest of `measured_on` is informative.
MATCH_KEYS = ("target", "drafter", "slots", "max_len", "device_kind", "devices")


class ProfileError(DSparkError):
    """An SPS profile that does not fit this engine."""


@dataclasses.dataclass(frozen=True)
class SpsProfile:
    measured_on: dict
    spec: dict[int, float]  # verification bucket F -> seconds per round
    plain: dict[int, float]  # anchor bucket F -> seconds per round (no proposal)
    rounds: int = 0  # timed rounds per trial (median)
    host_seconds: float = 0.0  # the host loop's own time per round, on top of every entry

    def to_json(self) -> dict:
        return {"format": FORMAT, "version": VERSION, "measured_on": self.measured_on,
                "rounds_per_trial": self.rounds, "host_seconds_per_round": self.host_seconds,
                "seconds": {"spec": {str(F): t for F, t in sorted(self.spec.items())},
                            "plain": {str(F): t for F, t in sorted(self.plain.items())}}}

    def round_seconds(self) -> "SpsProfile":
        """What a round costs the running engine: each entry plus the host loop's time per round,
        made non-decreasing in the bucket size by pool-adjacent-violators (least squares; a bigger
        verification never costs less, and on a noisy machine a smaller bucket that measured
        slower would steer the schedulers)."""
        def total(table):
            return _isotonic({F: t + self.host_seconds for F, t in table.items()})
        return dataclasses.replace(self, spec=total(self.spec), plain=total(self.plain),
                                   host_seconds=0.0)

    def sps_table(self, largest: int) -> list[float]:
        """SPS(B) for B = 0..largest: 1 / seconds of the smallest spec bucket >= B, 0 past the
        largest one (a verification that does not fit never improves throughput)."""
        buckets = sorted(self.spec)
        table = []
        for B in range(largest + 1):
            F = next((F for F in buckets if F >= B), None)
            table.append(0.0 if F is None else 1.0 / self.spec[F])
        return table


def _isotonic(table: dict[int, float]) -> dict[int, float]:
    """Non-decreasing least-squares fit of {bucket: seconds} (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [sum, count] of pooled runs, in bucket order
    for F in sorted(table):
        blocks.append([table[F], 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    fitted = [total / count for total, count in blocks for _ in range(int(count))]
    return dict(zip(sorted(table), fitted))


@functools.cache
def code_fingerprint() -> str:
    """A digest of the package's source. The rounds a profile times are programs this code builds,
    and a change to it can change what they cost (at 32 slots on 2 CPU cores one release cut a
    round without a proposal from 22 to 16 ms), so the start-up cache keeps one profile per
    version of the code and never hands an engine the round times of another."""
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def measured_on(tcfg, dcfg, slots: int, max_len: int, context: int, mesh_shape: dict | None
                ) -> dict:
    """The key a profile is stored under: model shapes, slots, context, device, and the code
    that built the rounds (`code_fingerprint`)."""
    shapes = lambda cfg: None if cfg is None else {  # noqa: E731
        k: v for k, v in sorted(dataclasses.asdict(cfg).items())
        if isinstance(v, (int, float, str, bool, list, tuple))}
    device = jax.devices()[0]
    return _normal({"target": shapes(tcfg), "drafter": shapes(dcfg), "slots": slots, "max_len": max_len,
            "context": context, "device_kind": device.device_kind, "platform": device.platform,
            "devices": len(jax.devices()), "mesh": mesh_shape, "jax": jax.__version__,
            "code": code_fingerprint()})


def default_context(engine) -> int:
    """Cached positions per slot a start-up profile is measured at: a quarter of the context, so
    its rounds attend over half of it (`target.attention_spans`; a round over shorter contexts
    costs less, one over longer ones more, and the async policy's measured overhead takes up the
    difference where it is a cost); the rest leaves room to time."""
    return max(1, engine.S // 4)


def engine_key(engine, context: int | None = None) -> dict:
    mesh = None if engine.mesh is None else dict(engine.mesh.shape)
    return measured_on(engine.tcfg, engine.dcfg, engine.R, engine.S,
                       default_context(engine) if context is None else context, mesh)


def measure(engine, trials: int = 5, min_seconds: float = 0.06, context: int | None = None,
            extra_passes: int = 2) -> SpsProfile:
    """Times the engine's spec round (propose, fill, verify, commit) for every verification bucket
    and its plain round for every anchor bucket, on all slots filled with `context` cached
    positions. A trial times every program once, in turn: fill the slots, two untimed rounds,
    then rounds dispatched as the engine's loop does (one in flight, each read back and unpacked
    on the host while the next runs) until `min_seconds` have passed or the context is full; the
    median over trials of the mean round time. Leaves the engine's slots empty.

    A table that contradicts itself (`inconsistent`: a smaller bucket slower than a larger one of
    its kind, or a round without a proposal slower than one with) was disturbed while it was
    measured; up to `extra_passes` more passes of `trials` trials each are then run and the
    medians taken over all of them. On 2 busy CPU cores a start-up profile at 8 slots came out
    with plain rounds at 7.2-15.8 ms in no order (the engine then ran them in 8.6 ms) and a
    proposal round cheaper than a plain one; the schedulers it steered ran at 0.85x plain
    decoding. Three standalone profiles of the same engine agreed within 10 %; a bucket counts
    as out of order past INCONSISTENT_BY (25 %).

    In a job of several processes every process runs the same rounds: after the first three, how
    many more is process 0's call, from its clock."""

    context = default_context(engine) if context is None else context
    most = (engine.S - 1 - context) // engine.W - 2  # timed rounds that fit after the untimed two
    if context < 1 or most < 1:
        raise ProfileError(f"profile context {context}: needs >= 1 and room for 3 rounds of "
                           f"{engine.W} tokens within {engine.S} positions")
    rng = np.random.default_rng(0)
    fillers = [(slot, Request(id=f"profile-{slot}", max_new_tokens=10 ** 9, prompt_ids=tuple(
        rng.integers(0, engine.tcfg.vocab_size, context).tolist()))) for slot in range(engine.R)]
    programs = [(kind, program, F) for kind, program, buckets in (
        ("spec", "topk", engine.spec_buckets), ("plain", "plain", engine.plain_buckets))
        for F in buckets]
    means: dict[tuple, list[float]] = {p: [] for p in programs}
    rounds_timed = []
    shared = jax.process_count() > 1
    passes = 0
    while True:
        _measure_pass(engine, programs, fillers, trials, most, min_seconds, shared, means,
                      rounds_timed)
        seconds: dict[str, dict[int, float]] = {"spec": {}, "plain": {}}
        for (kind, _, F), m in means.items():
            seconds[kind][F] = float(np.median(m))
        bad = inconsistent(seconds["spec"], seconds["plain"])
        if shared:  # every process runs the same rounds: process 0 decides for all
            bad = bool(distributed.from_lead([int(bad)])[0])
        if not bad or passes >= extra_passes:
            break
        passes += 1
    host = loop_overhead(engine, fillers, seconds["plain"][engine.plain_buckets[-1]], trials)
    engine.reset()
    return SpsProfile(measured_on=engine_key(engine, context), spec=seconds["spec"],
                      plain=seconds["plain"], rounds=int(np.median(rounds_timed)),
                      host_seconds=host)


# A bucket this much slower than a larger one (or a plain round than a proposal round) is noise.
# Not less: neighbouring buckets of one kind cost nearly the same, and some programs run a little
# slower than the next larger one every time (the bundled pair at 8 slots: a proposal round at 2
# drafts 13 % above one at 4, in all three passes of one start-up), which no re-measuring settles.
INCONSISTENT_BY = 0.25


def inconsistent(spec: dict[int, float], plain: dict[int, float]) -> bool:
    """Whether measured round times contradict the work the rounds do: within a kind, a bucket
    more than INCONSISTENT_BY slower than a larger one; or the largest plain round (every slot's
    anchor verified) slower by as much than the smallest proposal round (which verifies the same
    anchors and more, besides proposing)."""
    def falls(table):
        times = [table[F] for F in sorted(table)]
        return any(t > (1 + INCONSISTENT_BY) * min(times[i + 1:]) for i, t in enumerate(times[:-1]))

    crossed = bool(spec and plain) and \
        plain[max(plain)] > (1 + INCONSISTENT_BY) * spec[min(spec)]
    return falls(spec) or falls(plain) or crossed


def _measure_pass(engine, programs, fillers, trials, most, min_seconds, shared, means,
                  rounds_timed) -> None:
    """`trials` trials of every program, appended to `means` and `rounds_timed`."""
    for _ in range(trials):  # every bucket once per trial: the machine's drift hits them alike
        for kind, program, F in programs:
            engine.reset()
            for chunk in engine.prefill_chunks(fillers):
                engine.prefill(chunk)
            for _ in range(2):
                engine.run_round((program, F))
            jax.block_until_ready(engine.state)
            t0, n, previous, limit = time.perf_counter(), 0, None, most
            while n < limit and (n < 3 or shared or time.perf_counter() - t0 < min_seconds):
                out = engine.run_round((program, F))
                if previous is not None:  # the host's part of a round, as the engine's loop
                    _read(previous)
                previous, n = out, n + 1
                if shared and n == min(3, most):
                    rate = n / max(time.perf_counter() - t0, 1e-9)
                    limit = int(distributed.from_lead([min(most, max(n, math.ceil(
                        min_seconds * rate)))])[0])
            _read(previous)
            means[kind, program, F].append((time.perf_counter() - t0) / n)
            rounds_timed.append(n)


def loop_overhead(engine, fillers, plain_seconds: float, trials: int) -> float:
    """Seconds the engine's host loop adds to every round beyond what `measure` times (admission,
    per-request bookkeeping, the policy): `generate` on full slots with plain rounds, once with a
    few rounds and once with more, differenced so that prefill and start-up cancel, less the
    plain round's own time. Never negative."""
    import dataclasses as dc

    from dspark_jax.decoding.policies import Policy  # plain rounds whatever the scheduler

    context = len(fillers[0][1].prompt_ids)
    few, more = 4, 4 + max(4, min(48, engine.S - context - 8))
    saved, engine.policy = engine.policy, Policy(engine)
    try:
        per_round = []
        for _ in range(trials):
            runs = []
            for n in (few, more):
                m = engine.generate([dc.replace(r, max_new_tokens=n) for _, r in fillers])
                runs.append((m["elapsed_s"], m["rounds"]))
            (t1, r1), (t2, r2) = runs
            per_round.append((t2 - t1) / max(r2 - r1, 1))
    finally:
        engine.policy = saved
    return max(0.0, float(np.median(per_round)) - plain_seconds)


def _read(packed) -> None:
    """What the host loop does with a round's output: read it back and take each slot's tokens."""
    from dspark_jax.decoding.state import RoundOutput

    out = RoundOutput.unpack(jax.device_get(packed))
    for slot in np.flatnonzero(out.was_active):
        out.tokens[slot, :out.count[slot]].tolist()


def save(profile: SpsProfile, path: str | os.PathLike) -> Path:
    """Writes the profile as JSON (atomically: a temporary file of this process renamed into
    place, so that processes sharing a cache directory never see each other's half-written file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(profile.to_json(), indent=1) + "\n")
    os.replace(tmp, path)
    return path


def load(path: str | os.PathLike) -> SpsProfile:
    """Reads a profile, checking its format and that every time is a positive number."""
    path = Path(path)
    if not path.is_file():
        raise ProfileError(f"{path}: SPS profile not found")
    try:
        obj = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ProfileError(f"{path}: not valid JSON ({e})") from None
    return from_json(obj, path)


def from_json(obj, path) -> SpsProfile:
    """`SpsProfile.to_json`'s object back, checked as `load` checks a file (`path` names it)."""
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        raise ProfileError(f"{path}: not an SPS profile (expected \"format\": \"{FORMAT}\"; "
                           "write one with python -m serve.profile)")
    if obj.get("version") != VERSION:
        raise ProfileError(f"{path}: profile version {obj.get('version')!r}, expected {VERSION}")
    seconds = obj.get("seconds")
    if not isinstance(seconds, dict) or not isinstance(obj.get("measured_on"), dict):
        raise ProfileError(f"{path}: needs \"measured_on\" and \"seconds\" objects")
    tables = {}
    for kind in ("spec", "plain"):
        table = seconds.get(kind, {})
        if not isinstance(table, dict):
            raise ProfileError(f"{path}: seconds.{kind} must map bucket sizes to seconds")
        parsed = {}
        for F, t in table.items():
            if not str(F).isdigit() or int(F) < 1:
                raise ProfileError(f"{path}: seconds.{kind}: bucket {F!r} is not a positive integer")
            if not isinstance(t, (int, float)) or isinstance(t, bool) or not math.isfinite(t) or t <= 0:
                raise ProfileError(f"{path}: seconds.{kind}[{F}] = {t!r}: round times must be "
                                   "positive numbers of seconds")
            parsed[int(F)] = float(t)
        tables[kind] = parsed
    return SpsProfile(measured_on=obj["measured_on"], spec=tables["spec"], plain=tables["plain"],
                      rounds=int(obj.get("rounds_per_trial", 0)),
                      host_seconds=float(obj.get("host_seconds_per_round", 0.0)))


def check(profile: SpsProfile, expected: dict, spec_buckets, plain_buckets, where: str) -> None:
    """Raises ProfileError unless the profile was measured for this model, slots, context and
    device, and times every bucket the engine compiles."""
    for key in MATCH_KEYS:
        got, want = _normal(profile.measured_on.get(key)), _normal(expected.get(key))
        if got != want:
            if isinstance(got, dict) and isinstance(want, dict):
                fields = sorted(k for k in got.keys() | want.keys() if got.get(k) != want.get(k))
                got = {k: got.get(k) for k in fields}
                want = {k: want.get(k) for k in fields}
            raise ProfileError(f"{where}: measured for {key} {_short(got)}; this engine has "
                               f"{_short(want)} (profile it again with python -m serve.profile)")
    for kind, table, buckets in (("spec", profile.spec, spec_buckets),
                                 ("plain", profile.plain, plain_buckets)):
        missing = sorted(set(buckets) - set(table))
        if missing:
            raise ProfileError(f"{where}: no {kind} round time for bucket(s) {missing}; the engine "
                               f"compiles {sorted(buckets)}")


def cache_path(expected: dict) -> Path:
    """Where start-up profiles are cached: the user's cache directory, one file per key. The key
    includes the jax version and the code's fingerprint: a cached profile describes the programs
    that were timed, and an upgrade measures again. (A profile file named on the command line
    is the user's choice and only has to match MATCH_KEYS.)"""
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dspark-jax" / "sps"
    key = json.dumps({k: expected.get(k) for k in MATCH_KEYS + ("context", "jax", "code")},
                     sort_keys=True)
    return root / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def resolve(engine, given: "SpsProfile | str | os.PathLike | None", use_cache: bool
            ) -> tuple[SpsProfile, str]:
    """The engine's profile and where it came from: `given` (a profile or a path; checked), else a
    valid cached one, else one measured now (and cached when `use_cache`).

    In a job of several processes the profile is process 0's, in every process: process 0 alone
    reads `given` or its cache; when it has none, all measure together (`measure`) and schedule by
    what process 0 measured, which process 0 caches."""
    shared = jax.process_count() > 1
    found = _lookup_shared(engine, given, use_cache) if shared else _lookup(engine, given, use_cache)
    if found is not None:
        return found
    prof = measure(engine)
    if shared:
        prof = from_json(distributed.share_json(prof.to_json()), "process 0's SPS profile")
    cached = cache_path(engine_key(engine))
    if use_cache and distributed.is_lead():
        save(prof, cached)
    return prof, "measured at start-up" + (f", cached in {cached}" if use_cache else "")


def _lookup_shared(engine, given, use_cache) -> tuple[SpsProfile, str] | None:
    """`_lookup` in process 0, its answer (or its error) in every process."""
    answer = None
    if distributed.is_lead():
        try:
            found = _lookup(engine, given, use_cache)
            answer = {} if found is None else {"profile": found[0].to_json(), "source": found[1]}
        except (DSparkError, OSError) as e:
            answer = {"error": str(e)}
    answer = distributed.share_json(answer)
    if "error" in answer:
        raise ProfileError(answer["error"])
    if "profile" in answer:
        return from_json(answer["profile"], answer["source"]), answer["source"]
    return None


def _lookup(engine, given, use_cache) -> tuple[SpsProfile, str] | None:
    """`given` (checked), else a valid cached profile, else None (to be measured)."""
    key = engine_key(engine)
    buckets = (engine.spec_buckets, engine.plain_buckets)
    if given is not None:
        prof = given if isinstance(given, SpsProfile) else load(given)
        where = "the SPS profile" if isinstance(given, SpsProfile) else str(given)
        check(prof, key, *buckets, where)
        return prof, where
    cached = cache_path(key)
    if use_cache and cached.is_file():
        try:
            prof = load(cached)
            check(prof, key, *buckets, str(cached))
            return prof, f"cache {cached}"
        except ProfileError:
            pass  # stale or damaged: to be measured again
    return None


def _normal(value):
    return json.loads(json.dumps(value, sort_keys=True))


def _short(value) -> str:
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= 120 else text[:117] + "..."
