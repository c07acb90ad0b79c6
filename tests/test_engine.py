"""The engine against plain target decoding: exact greedy equality for both schedulers, batch sizes
1 to R, ragged prompts, requests joining mid-run, trained and random drafters; stop tokens inside
accepted blocks, full contexts, exact budgets, no compilation after warm-up."""

import jax
import numpy as np
import pytest

from dspark_jax.decoding.engine import Engine, RecompileError, Request
from dspark_jax.decoding.schedulers import SchedulerConfig
from dspark_jax.errors import DSparkError
from dspark_jax.formats.records import encode_chat_prompt
from dspark_jax.models.drafter import drafter_spec

S = 96
SMALL = dict(max_len=S, prefill_buckets=(32, S), max_prefill_batch=2)


@pytest.fixture(scope="module")
def pair(engine_pair):
    return engine_pair


@pytest.fixture(scope="module")
def requests(pair):
    return ragged_requests(pair[5])


def ragged_requests(tok) -> list[Request]:
    """Chat prompts of ragged lengths, and a few raw ones, with mixed budgets."""
    rng = np.random.default_rng(0)
    asks = ["Count from 3 to 17.", "Repeat 'green river' 4 times.", "Continue the pattern: stone paper",
            "Count from 21 to 30.", "Repeat 'music' 5 times.", "Continue the pattern: a b c"]
    out = []
    for i in range(12):
        ids = encode_chat_prompt(tok, [{"role": "user", "content": asks[i % len(asks)] * (1 + i % 3)}])
        if i % 4 == 3:
            ids = tok.encode("raw prompt number " * (1 + i % 5))
        out.append(Request(id=str(i), prompt_ids=tuple(ids), max_new_tokens=int(rng.integers(1, 40))))
    return out


def run(engine, reqs, **kwargs):
    results = {}
    metrics = engine.generate(reqs, lambda r: results.__setitem__(r.id, r), **kwargs)
    return results, metrics


@pytest.fixture(scope="module")
def plain(pair):
    tcfg, tparams = pair[:2]
    return Engine(tcfg, tparams, slots=4, **SMALL)


@pytest.fixture(scope="module")
def plain_results(plain, requests):
    return run(plain, requests)[0]


SCHEDULERS = [SchedulerConfig("fixed", 0), SchedulerConfig("fixed", 2), SchedulerConfig("threshold", 0, 0.2),
              SchedulerConfig("greedy"), SchedulerConfig("greedy", bucket_fill=True), SchedulerConfig("async"),
              SchedulerConfig("threshold", 0, 0.6, bucket_fill=True)]


def scheduler_id(s):
    name = {"fixed": f"fixed{s.verify_len}", "threshold": f"threshold{s.threshold}"}.get(s.kind, s.kind)
    return name + ("-fill" if s.bucket_fill else "")


def cheap_spec_profile(engine):
    """A real profile object with made-up times under which verifying drafts usually pays: rounds
    with a proposal cost 1 + F/400 (so the bucket chosen depends on the survival estimates),
    rounds without one 1.0. Measured profiles would make the buckets machine-dependent."""
    from dspark_jax.decoding import profile

    return profile.SpsProfile(measured_on=profile.engine_key(engine),
                              spec={F: 1 + F / 400 for F in engine.spec_buckets},
                              plain={F: 1.0 for F in engine.plain_buckets})


@pytest.fixture(scope="module", params=SCHEDULERS, ids=scheduler_id)
def spec(request, pair):
    tcfg, tparams, dcfg, dparams = pair[:4]
    engine = Engine(tcfg, tparams, dcfg, dparams, slots=4, scheduler=request.param, **SMALL)
    if request.param.load_aware:
        engine.use_profile(cheap_spec_profile(engine), "test")
    return engine


def assert_same(got, want):
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].token_ids == want[k].token_ids, k
        assert got[k].finish_reason == want[k].finish_reason, k


def test_greedy_equals_plain(spec, pair, requests, plain_results):
    """12 requests through 4 slots: ragged prompts, requests joining as others finish."""
    results, metrics = run(spec, requests)
    assert_same(results, plain_results)
    assert metrics["compilations_after_warmup"] == 0
    assert metrics["mean_verified"] > {"fixed": 1.0, "threshold": 0.2}.get(spec.scheduler.kind, 0.0)
    assert sum(metrics["buckets"].values()) == metrics["rounds"]
    for r in results.values():
        assert sum(r.accepted) == len(r.token_ids) - 1  # the first token comes from prefill
        assert r.logprobs == [] and r.top_logprobs == []  # logprobs off: none computed
        assert all(v <= spec.max_verify for v in r.verified)
    # The same compiled programs with a random drafter: acceptance collapses, output does not change.
    trained = spec.dparams
    spec.dparams = pair[4]
    try:
        random_results, random_metrics = run(spec, requests)
    finally:
        spec.dparams = trained
    assert_same(random_results, plain_results)
    assert random_metrics["tau"] < metrics["tau"] or spec.scheduler.kind != "fixed"


def test_batch_size_one(pair, requests, plain_results):
    tcfg, tparams, dcfg, dparams = pair[:4]
    engine = Engine(tcfg, tparams, dcfg, dparams, slots=1, scheduler=SchedulerConfig("fixed", 0), **SMALL)
    results, metrics = run(engine, requests[:5])
    assert_same(results, {k: plain_results[k] for k in results})
    assert metrics["tau"] > 1.05  # the trained drafter is accepted


def test_stop_token_inside_accepted_block(spec, requests, plain, pair):
    """A stop id that the target emits in the middle of an accepted block ends the request there."""
    results, _ = run(spec, requests)
    stop = None
    for r in results.values():
        pos = 1
        for count in r.accepted:
            if count >= 3:
                stop = (r.id, r.token_ids[pos + 1])  # an interior token of an accepted block
                break
            pos += count
        if stop:
            break
    assert stop, "no multi-token accepted block to test with"
    rid, token = stop
    req = next(q for q in requests if q.id == rid)
    req = Request(id=rid, prompt_ids=req.prompt_ids, max_new_tokens=req.max_new_tokens, stop_ids=(token,))
    got = run(spec, [req])[0][rid]
    want = run(plain, [req])[0][rid]
    assert got.token_ids == want.token_ids and got.finish_reason == "stop"
    assert got.token_ids[-1] == token and token not in got.token_ids[:-1]


def test_host_ends_requests_early(spec, requests, plain_results):
    """`should_stop` (serve.decode's stop strings) ends a request as soon as the host reads enough
    of it: "stop" there, its slot reused at once, and the other requests decode exactly as without
    it (nothing the ended request's round in flight computed leaks into the slot's next request)."""
    cut = {r.id: 2 + i % 3 for i, r in enumerate(requests) if i % 2 == 0}
    spec.guard = True
    try:
        results, metrics = run(spec, requests, should_stop=lambda r: r.id in cut and len(
            r.token_ids) >= cut[r.id])
    finally:
        spec.guard = False
    assert metrics["compilations_after_warmup"] == 0
    assert results.keys() == plain_results.keys()
    early = 0
    for rid, want in plain_results.items():
        got = results[rid]
        if rid not in cut or got.finish_reason != "stop" or got.token_ids == want.token_ids:
            assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason, rid
            continue
        early += 1
        assert cut[rid] <= len(got.token_ids) < len(want.token_ids), rid
        assert got.token_ids == want.token_ids[:len(got.token_ids)], rid
        assert sum(got.accepted) == len(got.token_ids) - 1
    assert early >= 3


def test_full_context_ends_with_context(spec, plain, pair):
    """A prompt near the capacity: generation stops when the next anchor has no cache slot."""
    tok = pair[5]
    ids = tuple(tok.encode("Count from 1 to 90. " * 20)[: S - 6])
    req = Request(id="ctx", prompt_ids=ids, max_new_tokens=50)
    got, want = run(spec, [req])[0]["ctx"], run(plain, [req])[0]["ctx"]
    assert got.finish_reason == want.finish_reason == "context"
    assert got.token_ids == want.token_ids
    assert len(ids) + len(got.token_ids) == S + 1  # the last token is never written to the cache


def test_max_new_tokens_is_exact(spec, requests):
    results, _ = run(spec, requests)
    for req in requests:
        r = results[req.id]
        if r.finish_reason == "length":
            assert len(r.token_ids) == req.max_new_tokens
        else:
            assert len(r.token_ids) <= req.max_new_tokens


def test_two_hundred_requests_compile_nothing_after_warmup(pair):
    tcfg, tparams, dcfg, dparams, _, tok = pair
    engine = Engine(tcfg, tparams, dcfg, dparams, slots=8, scheduler=SchedulerConfig("threshold", 0, 0.4),
                    **SMALL)
    engine.guard = True
    rng = np.random.default_rng(1)
    reqs = [Request(id=str(i), prompt_ids=tuple(rng.integers(4, tcfg.vocab_size, rng.integers(1, 80)).tolist()),
                    max_new_tokens=int(rng.integers(1, 24)), temperature=float(rng.choice([0.0, 0.7, 1.0])),
                    top_p=float(rng.choice([1.0, 0.9])), top_k=int(rng.choice([0, 20])),
                    stop_ids=tuple(tok.stop_token_ids)) for i in range(200)]
    results, metrics = run(engine, reqs)
    assert len(results) == 200 and metrics["compilations_after_warmup"] == 0
    assert metrics["compilations"] == len(engine._compiled)
    # The guard turns a compilation after warm-up into an error.
    engine._compiled.pop(("scheduled", engine.verify_buckets[0]))
    with pytest.raises(RecompileError, match="recompile guard on"):
        run(engine, reqs[:1])


def test_engines_of_one_shape_share_the_programs_no_scheduler_reads(pair, requests, plain_results):
    """Side by side, a fixed and a greedy engine of one shape compile the prefills and plain rounds
    once (the second engine compiles only its scheduler's own rounds) and both stay lossless; a
    different slot count shares nothing."""
    tcfg, tparams, dcfg, dparams = pair[:4]
    fixed = Engine(tcfg, tparams, dcfg, dparams, slots=3, scheduler=SchedulerConfig("fixed", 0), **SMALL)
    greedy = Engine(tcfg, tparams, dcfg, dparams, slots=3, scheduler=SchedulerConfig("greedy"), **SMALL)
    greedy.use_profile(cheap_spec_profile(greedy), "test")
    other = Engine(tcfg, tparams, dcfg, dparams, slots=2, scheduler=SchedulerConfig("fixed", 0), **SMALL)
    for engine in (fixed, greedy):
        engine.warmup()
    shared = [k for k in fixed._compiled if k[0] in ("prefill", "plain", "end")]
    assert len(shared) > 4 and all(greedy._compiled[k] is fixed._compiled[k] for k in shared)
    # one program of each shared kind is enough to see that another shape gets its own
    for kind in sorted({k[0] for k in shared}):
        key = min(k for k in shared if k[0] == kind)  # the smallest: one a 2-slot engine has too
        assert other._program(key) is not fixed._compiled[key], key
    assert greedy.compilations == len(greedy._compiled) - len(shared)
    for engine in (fixed, greedy):
        assert_same(run(engine, requests)[0], plain_results)


def test_bad_requests(plain):
    with pytest.raises(DSparkError, match="request e: empty prompt"):
        plain.check_request(Request(id="e", prompt_ids=(), max_new_tokens=3))
    with pytest.raises(DSparkError, match=r"request l: prompt of 97 tokens is longer than the context \(96"):
        plain.check_request(Request(id="l", prompt_ids=(5,) * 97, max_new_tokens=3))
    with pytest.raises(DSparkError, match="outside the vocabulary"):
        plain.check_request(Request(id="v", prompt_ids=(100000,), max_new_tokens=3))


def test_sharded_engine_matches_single_device(pair, requests, plain_results):
    """Requests over data, KV heads and weights over tensor (2 x 2 of the 8 fake devices)."""
    from dspark_jax.config import MeshConfig
    from dspark_jax.models.target import target_spec
    from dspark_jax.params import shardings
    from dspark_jax.sharding import make_mesh

    tcfg, tparams, dcfg, dparams = pair[:4]
    mesh = make_mesh(MeshConfig(data=2, fsdp=1, tensor=2))
    tp = jax.device_put(tparams, shardings(target_spec(tcfg), mesh))
    dp = jax.device_put(dparams, shardings(drafter_spec(tcfg, dcfg), mesh))
    engine = Engine(tcfg, tp, dcfg, dp, slots=4, scheduler=SchedulerConfig("fixed", 0), mesh=mesh, **SMALL)
    assert engine.state.target_cache.k.sharding.spec == jax.sharding.PartitionSpec(
        None, ("data", "fsdp"), None, "tensor", None)
    results, metrics = run(engine, requests)
    assert_same(results, plain_results)
    assert metrics["compilations_after_warmup"] == 0
