"""The engine with an Eagle3 drafter (DESIGN §3b, §4): a chain of γ = ttt_length drafts per slot in
the same jitted round, verified by the shared lossless acceptance.

- greedy output equals plain target decoding token for token (fixed, threshold and the load-aware
  schedulers; 12 ragged requests through 4 slots, so requests join mid-run), with a briefly trained
  eagle3-tiny drafter and with a random one, and nothing compiles after warm-up;
- the drafter's context after prefill and several rounds (cut back and extended each round) is what
  a fresh prefill of the committed sequence gives;
- at T = 1 the first three generated tokens follow the exact target distribution (chi-square, as
  `test_lossless_sampling` does for DSpark), and a broken acceptance rule is caught;
- `python -m serve.decode --drafter EAGLE3_DIR` recognises the drafter's kind and decodes end to end.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tests.test_lossless_sampling as lossless
from dspark_jax.config import Eagle3Config, load_config, preset_path
from dspark_jax.decoding.engine import Engine, Request
from dspark_jax.decoding.schedulers import SchedulerConfig
from dspark_jax.decoding.state import Eagle3Context, RoundOutput
from dspark_jax.formats import deepspec
from dspark_jax.formats import eagle3 as eagle3_format
from dspark_jax.formats.records import encode_prompt_record
from dspark_jax.formats.tokenizer import load_tokenizer
from dspark_jax.models import eagle3
from dspark_jax.models.target import forward, target_spec
from dspark_jax.params import init_params
from dspark_jax.training import trainer
from tests.test_decode_cli import decode_cli, read_jsonl
from tests.test_engine import SMALL, assert_same, cheap_spec_profile, ragged_requests, run, scheduler_id
from tests.test_train import overrides

TRAIN_STEPS = 120


@pytest.fixture(scope="module")
def pair(tiny_target, tmp_path_factory):
    """(target dir, exported Eagle3 drafter dir, tcfg, target params, ecfg, drafter params, random
    drafter params, tokenizer): an eagle3-tiny drafter trained briefly against the session's tiny
    target, exported in DeepSpec's format and loaded back through `deepspec.load_pair` (which must
    recognise its kind)."""
    root = tmp_path_factory.mktemp("eagle3_pair")
    cfg = load_config(preset_path("eagle3-tiny"), overrides(
        tiny_target, root / "run", f"train.max_steps={TRAIN_STEPS}", "train.checkpoint_every=100000"))
    assert trainer.run(cfg)["step"] == TRAIN_STEPS
    cfg, params, _ = trainer.load_drafter_params(root / "run")
    _, target_params = trainer.load_target_for(cfg, None)
    drafter = eagle3_format.save_eagle3(params, cfg.target, cfg.drafter, target_params, root / "drafter")
    target = tiny_target[0]
    tcfg, tparams, ecfg, dparams = deepspec.load_pair(target, drafter)
    assert isinstance(ecfg, Eagle3Config) and ecfg == cfg.drafter
    assert tcfg.target_layer_ids == cfg.target.target_layer_ids
    random = init_params(eagle3.eagle3_spec(tcfg, ecfg), jax.random.key(7))
    return target, drafter, tcfg, tparams, ecfg, dparams, random, load_tokenizer(target)


@pytest.fixture(scope="module")
def requests(pair):
    return ragged_requests(pair[7])  # test_engine's


@pytest.fixture(scope="module")
def plain_results(pair, requests):
    tcfg, tparams = pair[2:4]
    return run(Engine(tcfg, tparams, slots=4, **SMALL), requests)[0]


SCHEDULERS = [SchedulerConfig("fixed", 0), SchedulerConfig("fixed", 2),
              SchedulerConfig("threshold", 0, 0.3), SchedulerConfig("async"), SchedulerConfig("greedy")]


@pytest.fixture(scope="module", params=SCHEDULERS, ids=scheduler_id)
def spec(request, pair):
    tcfg, tparams, ecfg, dparams = pair[2:6]
    engine = Engine(tcfg, tparams, ecfg, dparams, slots=4, scheduler=request.param, **SMALL)
    if request.param.load_aware:
        engine.use_profile(cheap_spec_profile(engine), "test")
    return engine


def test_greedy_equals_plain(spec, pair, requests, plain_results):
    assert spec.gamma == pair[4].ttt_length and isinstance(spec.state.draft_cache, Eagle3Context)
    spec.guard = True  # any compilation after warm-up is an error
    try:
        results, metrics = run(spec, requests)
        assert_same(results, plain_results)
        assert metrics["compilations_after_warmup"] == 0
        for r in results.values():
            assert sum(r.accepted) == len(r.token_ids) - 1
            assert all(v <= spec.max_verify for v in r.verified)
        if spec.scheduler.kind == "fixed":
            assert metrics["mean_verified"] > 1.0
        # The same compiled programs with a random drafter: the output does not change.
        trained, spec.dparams = spec.dparams, pair[6]
        try:
            random_results, random_metrics = run(spec, requests)
        finally:
            spec.dparams = trained
    finally:
        spec.guard = False
    assert_same(random_results, plain_results)
    assert random_metrics["compilations_after_warmup"] == 0
    print(f"\n[eagle3] {scheduler_id(spec.scheduler)}: tau {metrics['tau']:.3f} (random drafter "
          f"{random_metrics['tau']:.3f}), acceptance {metrics['acceptance_rate']:.3f}, "
          f"mean verified {metrics['mean_verified']:.3f}")
    if spec.scheduler.kind == "fixed":
        assert metrics["tau"] > random_metrics["tau"] and metrics["tau"] > 1.2, metrics


def test_context_equals_a_fresh_prefill(pair, requests):
    """After prefill and rounds that cut the drafter's cache back and extend it, the slot's cache
    rows and chain start equal a prefill of the whole committed sequence from scratch."""
    tcfg, tparams, ecfg, dparams = pair[2:6]
    engine = Engine(tcfg, tparams, ecfg, dparams, slots=2, scheduler=SchedulerConfig("fixed", 0),
                    **SMALL)
    req = Request(id="c", prompt_ids=requests[0].prompt_ids, max_new_tokens=1000)
    first, _ = jax.device_get(engine.prefill([(1, req)]))
    seq = list(req.prompt_ids) + [int(first[0])]
    accepted = []
    for _ in range(6):
        out = RoundOutput.unpack(jax.device_get(engine.run_round(("scheduled", engine.verify_buckets[0]))))
        assert out.was_active[1] and not out.was_active[0]
        seq += out.tokens[1, :out.count[1]].tolist()
        accepted.append(int(out.accepted[1]))
    assert any(accepted), accepted  # some rounds accepted drafts: rows were cut back mid-chain
    L = len(seq) - 1  # the last token (the anchor) sits at position L, its row at L - 1
    assert int(engine.state.slots.length[1]) == L
    pos = jnp.arange(L)[None]
    taps = forward(tparams, tcfg, jnp.asarray([seq[:L]], jnp.int32), pos).taps
    cache, h = eagle3.extend_context(dparams, tparams, tcfg, ecfg,
                                     eagle3.Eagle3Cache.create(tcfg, ecfg, 1, engine.S),
                                     jnp.asarray([seq[1:]], jnp.int32), taps, pos,
                                     jnp.ones((1, L), bool))
    ctx = engine.state.draft_cache
    np.testing.assert_allclose(ctx.hidden[1], h[0, -1], atol=2e-4, rtol=0)
    np.testing.assert_allclose(ctx.cache.k[1, :L], cache.k[0, :L], atol=2e-4, rtol=0)
    np.testing.assert_allclose(ctx.cache.v[1, :L], cache.v[0, :L], atol=2e-4, rtol=0)


@pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 (fake) devices")
def test_sharded_engine_matches_single_device(pair, requests, plain_results):
    """Requests over data, KV heads and weights over tensor (2 x 2 of the fake devices)."""
    from dspark_jax.config import MeshConfig
    from dspark_jax.params import shardings
    from dspark_jax.sharding import make_mesh

    tcfg, tparams, ecfg, dparams = pair[2:6]
    mesh = make_mesh(MeshConfig(data=2, fsdp=1, tensor=2))
    tp = jax.device_put(tparams, shardings(target_spec(tcfg), mesh))
    dp = jax.device_put(dparams, shardings(eagle3.eagle3_spec(tcfg, ecfg), mesh))
    engine = Engine(tcfg, tp, ecfg, dp, slots=4, scheduler=SchedulerConfig("fixed", 0), mesh=mesh,
                    **SMALL)
    assert engine.state.draft_cache.cache.k.sharding.spec == jax.sharding.PartitionSpec(
        ("data", "fsdp"), None, "tensor", None)
    results, metrics = run(engine, requests)
    assert_same(results, plain_results)
    assert metrics["compilations_after_warmup"] == 0


# ----------------------------------------------------------------------------- lossless at T > 0

ECFG = Eagle3Config(ttt_length=4)
DRAFTER_SEED, DRAFTER_SCALE = 3, 4.0
N_SAMPLES, N_CONTROL = 12_000, 4_000


@pytest.fixture(scope="module")
def models():
    """(target, Eagle3 drafter) params for `test_lossless_sampling`'s V = 8 target."""
    tcfg = lossless.TCFG
    tp = lossless._scaled(init_params(target_spec(tcfg), jax.random.key(lossless.TARGET_SEED)),
                          lossless.TARGET_SCALE)
    dp = lossless._scaled(init_params(eagle3.eagle3_spec(tcfg, ECFG), jax.random.key(DRAFTER_SEED)),
                          DRAFTER_SCALE)
    return tp, dp


@pytest.fixture(scope="module")
def exact_logits(models):
    """float64 logits [V, V, 3, V] of the target after the prompt, after t1 and after t2, for every
    prefix (t1, t2), from one full-sequence forward over all continuations."""
    tcfg, prompt = lossless.TCFG, lossless.PROMPT
    V, n = tcfg.vocab_size, len(prompt)
    t1, t2 = np.meshgrid(np.arange(V), np.arange(V), indexing="ij")
    seqs = np.concatenate([np.tile(prompt, (V * V, 1)), t1.reshape(-1, 1), t2.reshape(-1, 1)], 1)
    pos = np.broadcast_to(np.arange(n + 2), seqs.shape)
    logits = jax.jit(lambda p, t, q: forward(p, tcfg, t, q).logits)(
        models[0], jnp.asarray(seqs, jnp.int32), jnp.asarray(pos, jnp.int32))
    return np.asarray(logits, np.float64)[:, n - 1:n + 2].reshape(V, V, 3, V)


def _engine(models, scheduler, slots, **kwargs):
    tp, dp = models
    return Engine(lossless.TCFG, tp, ECFG, dp, slots=slots, max_len=lossless.MAX_LEN,
                  scheduler=scheduler, prefill_buckets=(lossless.MAX_LEN,), max_prefill_batch=slots,
                  seed=0, **kwargs)


@pytest.mark.parametrize("scheduler", [SchedulerConfig("fixed", 4), SchedulerConfig("threshold", 0, 0.4)],
                         ids=scheduler_id)
def test_sampling_matches_target_distribution(models, exact_logits, scheduler):
    """Chi-square goodness of fit (p > 1e-3) of the first three generated tokens of N identical
    requests at T = 1 against the exact target distribution, drafts really exercised."""
    engine = _engine(models, scheduler, 8)
    counts, m, results = lossless.run_joint(engine, N_SAMPLES, 1.0)
    joint = lossless.exact_joint(exact_logits, 1.0)
    pv, stat, bins = lossless.chi_square_p(counts, joint)
    print(f"\n[eagle3 lossless] {scheduler_id(scheduler)}: p={pv:.4g} chi2={stat:.1f} bins={bins} "
          f"acceptance={m['acceptance_rate']:.3f} mean_verified={m['mean_verified']:.3f}")
    assert 0.1 < m["acceptance_rate"] < 0.95, m
    assert m["compilations_after_warmup"] == 0, m
    if scheduler.kind == "fixed":
        assert all(r.verified[0] == 2 for r in results)  # fixed(4) clipped to the budget
    else:  # the stand-in confidences vary: rounds verify different numbers of drafts
        assert 0.0 < m["mean_verified"] < engine.max_verify, m
        verified = [v for r in results for v in r.verified]
        share = np.bincount(verified, minlength=3) / len(verified)
        assert np.sum(share > 0.02) >= 2, share
    assert pv > lossless.PASS_P, (pv, stat, bins)


def test_broken_acceptance_is_detected(models, exact_logits):
    """The same check rejects a rule that resamples rejected drafts from p (not the residual)."""
    engine = _engine(models, SchedulerConfig("fixed", 4), 2, acceptance=lossless.resample_from_target)
    counts, m, _ = lossless.run_joint(engine, N_CONTROL, 1.0)
    pv, stat, bins = lossless.chi_square_p(counts, lossless.exact_joint(exact_logits, 1.0))
    print(f"\n[eagle3 lossless] broken rule: p={pv:.4g} chi2={stat:.1f} "
          f"acceptance={m['acceptance_rate']:.3f}")
    assert pv < lossless.FAIL_P, (pv, stat, bins)


# ----------------------------------------------------------------------------- serve.decode

MAX_NEW = 12


def test_decode_cli_with_an_eagle3_drafter(pair, tmp_path):
    """`serve.decode --drafter EAGLE3_DIR` (greedy, fixed): the kind comes from config.json, and the
    output equals plain target decoding of the same records in this process."""
    target, drafter, tcfg, tparams = pair[:4]
    tok = pair[7]
    records = [{"id": "raw", "prompt": "<|im_start|>user\nCount from 3 to 9.<|im_end|>\n"
                                      "<|im_start|>assistant\n"},
               {"id": "turns", "turns": ["Repeat 'red blue' 3 times."]},
               {"id": "pattern", "turns": ["Continue the pattern: cat dog"]},
               {"id": "count", "turns": ["Count from 10 to 20."]},
               {"id": "words", "prompt": "apple silver cat dog red blue apple"}]
    prompts, out, metrics = tmp_path / "prompts.jsonl", tmp_path / "out.jsonl", tmp_path / "m.json"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    proc = decode_cli("--target", target, "--drafter", drafter, "--prompts", prompts, "--out", out,
                      "--metrics", metrics, "--slots", 4, "--max-len", 96, "--prefill-buckets", "32,96",
                      "--max-new-tokens", MAX_NEW, "--temperature", 0, "--scheduler", "fixed",
                      "--recompile-guard")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"speculative, Eagle3 chain {pair[4].ttt_length}, fixed({pair[4].ttt_length})" in proc.stderr
    got = {r["id"]: r for r in read_jsonl(out)}
    m = json.loads(metrics.read_text())
    assert m["compilations_after_warmup"] == 0 and m["tau"] >= 1.0, m
    reqs = [Request(id=rec.id, prompt_ids=rec.token_ids, max_new_tokens=MAX_NEW,
                    stop_ids=tuple(tok.stop_token_ids))
            for rec in (encode_prompt_record(tok, r, index=i) for i, r in enumerate(records))]
    want = run(Engine(tcfg, tparams, slots=4, **SMALL), reqs)[0]
    assert got.keys() == want.keys()
    for rid, res in want.items():
        assert got[rid]["token_ids"] == res.token_ids, rid
        assert got[rid]["finish_reason"] == res.finish_reason, rid
        assert sum(got[rid]["accepted"]) == len(res.token_ids) - 1, rid
