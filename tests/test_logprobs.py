"""Per-token logprobs (Engine(logprobs=N)): every output token's target log-probability (log-softmax
of the raw logits, T = 1, before temperature and filters) and its top N, against the target's own
full forward over prompt + output, through plain and speculative decoding, greedy and sampled."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.decoding.engine import Engine, Request
from dspark_jax.decoding.schedulers import SchedulerConfig
from dspark_jax.models.target import forward

N = 3
SMALL = dict(slots=2, max_len=64, prefill_buckets=(32, 64), max_prefill_batch=2, logprobs=N)


@pytest.fixture(scope="module")
def requests(engine_pair):
    tok = engine_pair[5]
    asks = ["Count from 3 to 17.", "Repeat 'green river' 4 times.", "Continue the pattern: a b c",
            "Count from 21 to 30."]
    return [Request(id=str(i), prompt_ids=tuple(tok.encode(ask)), max_new_tokens=12,
                    temperature=(0.0, 0.8)[i % 2], top_p=(1.0, 0.9)[i % 2], top_k=(0, 5)[i % 2],
                    seed=i) for i, ask in enumerate(asks)]


@pytest.fixture(scope="module", params=["plain", "fixed"])
def results(request, engine_pair, requests):
    tcfg, tparams, dcfg, dparams = engine_pair[:4]
    if request.param == "plain":
        engine = Engine(tcfg, tparams, **SMALL)
    else:
        engine = Engine(tcfg, tparams, dcfg, dparams, scheduler=SchedulerConfig("fixed", 0), **SMALL)
    engine.guard = True
    out = {}
    metrics = engine.generate(requests, lambda r: out.__setitem__(r.id, r))
    assert metrics["compilations_after_warmup"] == 0
    return request.param, out


def reference_logprobs(engine_pair, prompt, output) -> np.ndarray:
    """[len(output), V] log-softmax of the target's full forward (no cache) at the positions that
    predict each output token."""
    tcfg, tparams = engine_pair[:2]
    ids = list(prompt) + list(output[:-1])
    padded = jnp.asarray([ids + [0] * (SMALL["max_len"] - len(ids))], jnp.int32)  # one compile
    logits = forward(tparams, tcfg, padded, jnp.arange(padded.shape[1])[None]).logits[0]
    logp = np.asarray(jax.nn.log_softmax(logits.astype(jnp.float32), -1))
    return logp[len(prompt) - 1:len(ids)]


def test_logprobs_match_the_target_forward(results, requests, engine_pair):
    kind, out = results
    spec_blocks = 0
    for req in requests:
        res = out[req.id]
        n = len(res.token_ids)
        assert len(res.logprobs) == len(res.top_logprobs) == n, res
        want = reference_logprobs(engine_pair, req.prompt_ids, res.token_ids)
        got = np.asarray(res.logprobs)
        np.testing.assert_allclose(got, want[np.arange(n), res.token_ids], atol=2e-4, rtol=1e-4)
        for i, top in enumerate(res.top_logprobs):
            ids, lps = zip(*top)
            assert len(top) == N and all(isinstance(t, int) for t in ids)
            np.testing.assert_allclose(lps, np.sort(want[i])[::-1][:N], atol=2e-4, rtol=1e-4)
            np.testing.assert_allclose(lps, want[i, list(ids)], atol=2e-4, rtol=1e-4)
            if req.temperature == 0:  # greedy: the chosen token is the most likely one
                assert got[i] == pytest.approx(lps[0], abs=2e-4)
        spec_blocks += sum(a > 1 for a in res.accepted)
    if kind == "fixed":  # tokens from accepted drafts were covered, not just bonus tokens
        assert spec_blocks > 0
