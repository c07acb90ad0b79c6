"""What the engine takes besides requests: random streams per request, calibration temperatures and
SPS profiles, with the errors a user can cause."""

import dataclasses
import json

import numpy as np
import pytest

from dspark_jax.decoding import profile
from dspark_jax.decoding.calibration import Sts, survival
from dspark_jax.decoding.engine import Engine, Request
from dspark_jax.decoding.schedulers import SchedulerConfig
from dspark_jax.errors import DSparkError

S = 64
SMALL = dict(max_len=S, prefill_buckets=(S,), max_prefill_batch=2)


@pytest.fixture(scope="module")
def sampled_requests(engine_pair):
    """Sixteen sampled requests (T = 1, some filtered), half with their own seed."""
    tok = engine_pair[5]
    rng = np.random.default_rng(3)
    asks = ["Count from 3 to 17.", "Repeat 'green river' 4 times.", "Continue the pattern: a b c"]
    return [Request(id=f"s{i}", prompt_ids=tuple(tok.encode(asks[i % 3] * (1 + i % 2))),
                    max_new_tokens=int(rng.integers(6, 20)), temperature=1.0,
                    top_p=[1.0, 0.9][i % 2], top_k=[0, 0, 40][i % 3],
                    seed=i * 7919 if i % 2 else None) for i in range(16)]


def tokens_by_id(engine, reqs):
    out = {}
    engine.generate(reqs, lambda r: out.__setitem__(r.id, r.token_ids))
    return out


@pytest.mark.parametrize("scheduler", [None, SchedulerConfig("fixed", 0)], ids=["plain", "fixed-gamma"])
def test_sampled_output_does_not_depend_on_slot_count_or_batch_mates(engine_pair, sampled_requests,
                                                                     scheduler):
    """A request's random stream is derived from the engine seed, the request and the position: with
    plain decoding or fixed(ℓ) it samples the same tokens through 3 slots or 8, in any order."""
    tcfg, tparams, dcfg, dparams = engine_pair[:4]
    models = (dcfg, dparams) if scheduler else ()
    kw = dict(SMALL, seed=7, scheduler=scheduler or SchedulerConfig("fixed"))
    engine = Engine(tcfg, tparams, *models, slots=3, **kw)
    three = tokens_by_id(engine, sampled_requests)
    eight = tokens_by_id(Engine(tcfg, tparams, *models, slots=8, **kw), sampled_requests[::-1])
    assert three == eight
    reseeded = [dataclasses.replace(r, seed=(r.seed or 0) + 1) for r in sampled_requests]
    other = tokens_by_id(engine, reseeded)  # a second call: nothing of the first carries over
    assert sum(other[k] != three[k] for k in three) >= 12  # the seed does matter


def test_calibration_temperatures_reach_the_confidences(engine_pair):
    """threshold(t) on σ(z / T + b): with T = 1000 every confidence is ~0.5, so t = 0.45 verifies
    every draft the budget allows and t = 0.55 none; the bias moves them."""
    tcfg, tparams, dcfg, dparams, _, tok = engine_pair
    req = [Request(id="c", prompt_ids=tuple(tok.encode("Count from 3 to 17.")), max_new_tokens=16)]
    flat = (1000.0,) * dcfg.block_size
    kw = dict(SMALL, slots=1)
    low = Engine(tcfg, tparams, dcfg, dparams, sts=flat, scheduler=SchedulerConfig(
        "threshold", threshold=0.45), **kw)
    high = Engine(tcfg, tparams, dcfg, dparams, sts=flat, scheduler=SchedulerConfig(
        "threshold", threshold=0.55), **kw)
    results = {}
    low.generate(req, lambda r: results.__setitem__("low", r))
    high.generate(req, lambda r: results.__setitem__("high", r))
    generated = np.cumsum([1] + results["low"].accepted)[:-1]  # tokens before each round
    assert results["low"].verified == [min(dcfg.block_size, 16 - g - 1) for g in generated]
    assert set(results["high"].verified) == {0}
    # A bias of +3 lifts every ~0.5 confidence to σ(3) = 0.95: t = 0.9 now verifies every draft.
    shifted = Engine(tcfg, tparams, dcfg, dparams, sts=Sts(flat, (3.0,) * dcfg.block_size),
                     scheduler=SchedulerConfig("threshold", threshold=0.9), **kw)
    shifted.generate(req, lambda r: results.__setitem__("shifted", r))
    assert results["shifted"].verified == results["low"].verified
    with pytest.raises(DSparkError, match=f"3 calibration temperatures for a drafter with block size "
                                          f"{dcfg.block_size}"):
        Engine(tcfg, tparams, dcfg, dparams, sts=(1.0, 1.0, 1.0), **kw)


def test_a_survival_form_calibration_reaches_the_confidences(engine_pair):
    """An sts-rank calibration (the survival form) as the engine applies it: threshold(t) verifies
    the leading drafts with c_j = a_j / a_{j-1} >= t, where a_j = exp(log Π σ(z_i) / T_j + b_j) is
    computed here from the raw logits each round recorded, and the output is plain decoding's."""
    tcfg, tparams, dcfg, dparams, _, tok = engine_pair
    g = dcfg.block_size
    sts = Sts(tuple(np.linspace(2.0, 1.0, g).tolist()), tuple(np.linspace(0.0, -0.3, g).tolist()),
              "survival")
    asks = ["Count from 3 to 17.", "Repeat 'green river' 4 times.", "Continue the pattern: a b c"]
    reqs = [Request(id=f"r{i}", prompt_ids=tuple(tok.encode(a)), max_new_tokens=24)
            for i, a in enumerate(asks)]
    t = 0.3
    kw = dict(SMALL, slots=1, sts=sts)  # one slot: fewer verification buckets to compile
    results = []
    Engine(tcfg, tparams, dcfg, dparams, scheduler=SchedulerConfig("threshold", threshold=t),
           **kw).generate(reqs, results.append, keep_confidences=True)
    checked = set()
    for res in results:
        generated = np.cumsum([1] + res.accepted)[:-1]  # tokens before each round
        for z, verified, before in zip(res.conf_logits, res.verified, generated):
            if not z:
                continue
            a = survival(np.asarray([z]), sts)[0]
            c = a / np.concatenate([[1.0], a[:-1]])
            if np.any(np.abs(c - t) < 1e-4):  # float32 against float64 could go either way
                continue
            assert verified == min(int(np.cumprod(c >= t).sum()), 24 - before - 1)
            checked.add(verified)
    assert len(checked) >= 3  # rounds that stopped at different positions
    plain = tokens_by_id(Engine(tcfg, tparams, slots=3, **SMALL), reqs)
    assert {r.id: r.token_ids for r in results} == plain  # lossless under it, as under any
    with pytest.raises(DSparkError, match=r"survival form, temperature 2 is 2.0 > temperature 1 1.0"):
        Engine(tcfg, tparams, dcfg, dparams, **dict(kw, sts=Sts((1.0, 2.0) + (1.0,) * (g - 2),
                                                                (0.0,) * g, "survival")))


# ----------------------------------------------------------------------------- SPS profiles


@pytest.fixture(scope="module")
def async_engine(engine_pair):
    tcfg, tparams, dcfg, dparams = engine_pair[:4]
    return Engine(tcfg, tparams, dcfg, dparams, slots=2, scheduler=SchedulerConfig("async"),
                  cache_profile=False, **SMALL)


@pytest.fixture(scope="module")
def measured(async_engine, tmp_path_factory):
    """A profile measured on the real engine and written to disk."""
    prof = profile.measure(async_engine, trials=1, min_seconds=0.0, context=16)
    return prof, profile.save(prof, tmp_path_factory.mktemp("sps") / "sps.json")


def test_a_measured_profile_times_every_compiled_bucket(async_engine, measured):
    prof, path = measured
    assert sorted(prof.spec) == async_engine.spec_buckets
    assert sorted(prof.plain) == async_engine.plain_buckets
    assert all(t > 0 for t in [*prof.spec.values(), *prof.plain.values()])
    assert prof.measured_on["slots"] == 2 and prof.measured_on["context"] == 16
    again = profile.load(path)
    assert again == prof
    table = prof.sps_table(async_engine.R * async_engine.W)
    assert table[3] == 1 / prof.spec[4] and table[-1] == 1 / prof.spec[async_engine.spec_buckets[-1]]


def test_a_profile_that_contradicts_itself_is_measured_again(async_engine, monkeypatch):
    """A pass whose table contradicts the rounds' work (a smaller bucket slower, plain slower than
    a proposal) is followed by more passes, up to `extra_passes`, and the medians span them all."""
    e = async_engine
    passes = []

    def fake_pass(engine, programs, fillers, trials, most, min_seconds, shared, means, rounds):
        disturbed = not passes  # the first pass: every smaller bucket 3x slower, so out of order
        passes.append(disturbed)
        for kind, program, F in programs:
            base = (2.0 if kind == "spec" else 1.0) + F / 1000
            means[kind, program, F] += [base * (3.0 if disturbed and F < max(
                e.spec_buckets if kind == "spec" else e.plain_buckets) else 1.0)] * trials
            rounds.append(3)

    monkeypatch.setattr(profile, "_measure_pass", fake_pass)
    monkeypatch.setattr(profile, "loop_overhead", lambda *a: 0.0)
    prof = profile.measure(e, trials=2, context=16)
    assert passes == [True, False, False]  # the 50/50 median of two passes still contradicted
    assert not profile.inconsistent(prof.spec, prof.plain)
    assert prof.plain[1] == pytest.approx(1.001)
    passes.clear()
    prof = profile.measure(e, trials=2, context=16, extra_passes=0)
    assert passes == [True] and profile.inconsistent(prof.spec, prof.plain)


def test_inconsistent_profiles():
    assert not profile.inconsistent({2: 20.0, 8: 21.0, 64: 30.0}, {1: 7.0, 8: 8.5})
    assert not profile.inconsistent({2: 20.5, 8: 20.0}, {1: 7.0, 8: 7.1})  # within 25 %
    # the bundled pair's start-up profile at 8 slots: 2 drafts 13 % above 4 in every pass
    assert not profile.inconsistent({2: 25.7, 4: 22.7, 8: 25.1, 16: 26.0, 32: 29.3, 64: 36.0},
                                    {1: 9.6, 2: 10.6, 4: 10.3, 8: 10.8})
    # the start-up profile at 8 slots that steered async to 0.85x plain decoding (ms)
    assert profile.inconsistent({2: 20.1, 4: 15.2, 8: 15.3, 16: 16.8, 32: 22.2, 64: 26.5},
                                {1: 13.4, 2: 7.2, 4: 15.8, 8: 13.2})
    assert profile.inconsistent({2: 10.0, 8: 12.0}, {1: 5.0, 8: 13.0})  # plain above a proposal
    assert profile.inconsistent({2: 20.0, 8: 21.0}, {1: 9.0, 8: 7.0})


def test_an_engine_uses_a_given_profile_and_decodes(engine_pair, measured):
    tcfg, tparams, dcfg, dparams, _, tok = engine_pair
    _, path = measured
    engine = Engine(tcfg, tparams, dcfg, dparams, slots=2, scheduler=SchedulerConfig("async"),
                    sps=path, **SMALL)
    m = engine.generate([Request(id=str(i), prompt_ids=tuple(tok.encode("Count from 1 to 9.")),
                                 max_new_tokens=6) for i in range(3)])
    assert engine.profile_source == str(path) and m["output_tokens"] == 18


def _edit(path, tmp_path, name, change):
    data = json.loads(path.read_text())
    change(data)
    out = tmp_path / name
    out.write_text(json.dumps(data))
    return out


@pytest.mark.parametrize("name, change, message", [
    ("slots.json", lambda d: d["measured_on"].update(slots=8),
     "measured for slots 8; this engine has 2"),
    ("model.json", lambda d: d["measured_on"]["target"].update(hidden_size=128),
     "measured for target"),
    ("missing.json", lambda d: d["seconds"]["spec"].pop("4"),
     r"no spec round time for bucket\(s\) \[4\]"),
    ("zero.json", lambda d: d["seconds"]["plain"].update({"1": 0.0}),
     r"seconds.plain\[1\] = 0.0: round times must be positive"),
    ("negative.json", lambda d: d["seconds"]["spec"].update({"2": -1}),
     r"seconds.spec\[2\] = -1: round times must be positive"),
    ("format.json", lambda d: d.update(format="other"), "not an SPS profile"),
])
def test_a_profile_that_does_not_fit_is_one_clear_error(engine_pair, measured, tmp_path, name,
                                                        change, message):
    tcfg, tparams, dcfg, dparams = engine_pair[:4]
    bad = _edit(measured[1], tmp_path, name, change)
    engine = Engine(tcfg, tparams, dcfg, dparams, slots=2, scheduler=SchedulerConfig("async"),
                    sps=bad, **SMALL)
    with pytest.raises(profile.ProfileError, match=f"{bad}: .*{message}"):
        engine.warmup()


def test_profile_file_errors(tmp_path):
    missing = tmp_path / "none.json"
    with pytest.raises(profile.ProfileError, match=f"{missing}: SPS profile not found"):
        profile.load(missing)
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(profile.ProfileError, match=f"{broken}: not valid JSON"):
        profile.load(broken)


def test_a_stale_cached_profile_is_measured_again(engine_pair, measured, monkeypatch, tmp_path):
    """The start-up cache: a damaged file in the cache is replaced by a new measurement, and a
    profile cached by another version of the code is not used."""
    tcfg, tparams, dcfg, dparams = engine_pair[:4]
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    engine = Engine(tcfg, tparams, dcfg, dparams, slots=2, scheduler=SchedulerConfig("greedy"),
                    **SMALL)
    cached = profile.cache_path(profile.engine_key(engine))
    cached.parent.mkdir(parents=True)
    cached.write_text("{damaged")
    engine.warmup()
    assert engine.profile_source.startswith("measured at start-up, cached in")
    assert profile.load(cached).spec.keys() == dataclasses.asdict(engine.profile)["spec"].keys()
    second = Engine(tcfg, tparams, dcfg, dparams, slots=2, scheduler=SchedulerConfig("greedy"), **SMALL)
    assert profile.resolve(second, None, True)[1] == f"cache {cached}"  # found, not measured
    # Other code builds other programs: their round times are not this code's.
    assert engine.profile.measured_on["code"] == profile.code_fingerprint()
    monkeypatch.setattr(profile, "code_fingerprint", lambda: "0" * 16)
    assert profile.cache_path(profile.engine_key(second)) != cached
    assert profile._lookup(second, None, True) is None  # to be measured again


def test_rounds_without_a_proposal_still_build_the_drafters_context(engine_pair):
    """Rounds without a proposal hold the committed tokens' features back (PendingContext) and
    project them in one batch later: the drafter's context cache ends up as a fixed(γ) engine,
    which projects every committed token at once, builds it (greedy: the same tokens)."""
    import jax

    from dspark_jax.decoding import rounds

    tcfg, tparams, dcfg, dparams, _, tok = engine_pair
    req = [Request(id="p", prompt_ids=tuple(tok.encode("Count from 3 to 17.")), max_new_tokens=40)]
    lazy = Engine(tcfg, tparams, dcfg, dparams, slots=1, scheduler=SchedulerConfig("async"),
                  pending_context=16, **SMALL)
    # Proposals priced out: every round but the periodic probe is a round without one.
    lazy.use_profile(profile.SpsProfile(measured_on=profile.engine_key(lazy),
                                        spec={F: 100.0 for F in lazy.spec_buckets},
                                        plain={F: 1.0 for F in lazy.plain_buckets}), "test")
    eager = Engine(tcfg, tparams, dcfg, dparams, slots=1, scheduler=SchedulerConfig("fixed"), **SMALL)
    m = lazy.generate(req)
    eager.generate(req)
    assert m["buckets"].get("plain:1", 0) >= 30  # more than a pending buffer's worth in a row
    state = rounds.flush_pending(lazy.shape, lazy.state, dparams)
    n = int(eager.state.slots.length[0])
    assert int(state.slots.length[0]) == n and int(state.pending.count[0]) == 0
    for got, want in ((state.draft_cache.k, eager.state.draft_cache.k),
                      (state.draft_cache.v, eager.state.draft_cache.v)):
        np.testing.assert_allclose(jax.device_get(got)[:, 0, :n], jax.device_get(want)[:, 0, :n],
                                   atol=1e-5, rtol=1e-5)


def test_a_flush_projects_what_is_held_back_at_the_width_that_holds_it(engine_pair):
    """A flush projects the first 4, 16 or all held-back positions, whichever holds every slot's
    count: the drafter's context ends up as a projection of the whole buffer makes it."""
    import jax
    import jax.numpy as jnp

    from dspark_jax.decoding import rounds
    from dspark_jax.models.drafter import extend_context

    tcfg, tparams, dcfg, dparams, _, _ = engine_pair
    engine = Engine(tcfg, tparams, dcfg, dparams, slots=2, scheduler=SchedulerConfig("async"),
                    pending_context=64, **SMALL)
    assert rounds.flush_widths(64) == (4, 16, 64) and rounds.flush_widths(8) == (4, 8)
    assert rounds.flush_widths(3) == (3,)
    rng = np.random.default_rng(0)
    taps = jnp.asarray(rng.normal(0, 1, engine.state.pending.taps.shape), jnp.float32)
    for counts in ([3, 1], [10, 0], [4, 16], [40, 64]):
        count = jnp.asarray(counts, jnp.int32)
        length = count + 5
        state = engine.state.replace(pending=engine.state.pending.replace(taps=taps, count=count),
                                     slots=engine.state.slots.replace(length=length))
        got = rounds.flush_pending(engine.shape, state, dparams)
        offset = jnp.arange(64)
        want = extend_context(dparams, tcfg, dcfg, state.draft_cache, taps,
                              length[:, None] - count[:, None] + offset, offset < count[:, None])
        np.testing.assert_array_equal(np.asarray(got.pending.count), 0)
        for a, b in ((got.draft_cache.k, want.k), (got.draft_cache.v, want.v)):
            np.testing.assert_allclose(jax.device_get(a), jax.device_get(b), atol=1e-5, rtol=1e-5)


def test_round_seconds_add_the_host_loop_and_never_fall_with_the_bucket():
    """What the schedulers see: each round's time plus the host's, fitted non-decreasing in the
    bucket (least squares: an inversion pools to its mean, an ordered table is kept)."""
    prof = profile.SpsProfile(measured_on={}, spec={2: 1.0, 4: 3.0, 8: 2.0, 16: 5.0},
                              plain={1: 0.5, 2: 0.7}, host_seconds=0.25)
    seen = prof.round_seconds()
    assert seen.spec == {2: 1.25, 4: 2.75, 8: 2.75, 16: 5.25}
    assert seen.plain == {1: 0.75, 2: 0.95}
    assert seen.host_seconds == 0.0 and prof.spec[4] == 3.0  # a new profile; the measured one stays
    assert seen.sps_table(16)[5] == pytest.approx(1 / 2.75)
