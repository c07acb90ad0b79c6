"""The constructed pair of `benchmarks/accelerator_sweep.py` (`dspark_jax.models.counting`): its
acceptance is the one it was built with, through the real engine. Greedy decoding counts and accepts
every draft; sampled decoding accepts each draft with the overlap of the two distributions, which
the confidence head states."""

import numpy as np
import pytest

from dspark_jax.decoding.engine import Engine, Request
from dspark_jax.decoding.schedulers import SchedulerConfig
from dspark_jax.errors import DSparkError
from dspark_jax.models.counting import counting_pair

ACCEPTANCE, MAX_LEN = 0.7, 128


@pytest.fixture(scope="module")
def pair():
    return counting_pair("tiny", ACCEPTANCE, MAX_LEN)


@pytest.fixture(scope="module")
def engine(pair):
    tcfg, tparams, dcfg, dparams, _ = pair
    return Engine(tcfg, tparams, dcfg, dparams, slots=4, max_len=MAX_LEN, max_prefill_batch=2,
                  scheduler=SchedulerConfig("fixed", 0), prefill_buckets=(8,))


def test_the_pair_has_the_acceptance_it_was_built_with(pair):
    tcfg, tparams, dcfg, dparams, facts = pair
    assert facts["target_successor_mass"] == pytest.approx(ACCEPTANCE, abs=0.01)
    assert facts["drafter_successor_mass"] == pytest.approx(ACCEPTANCE, abs=0.01)
    assert ACCEPTANCE - 0.05 < facts["acceptance_per_draft"] < ACCEPTANCE + 0.15
    conf = 1 / (1 + np.exp(-float(dparams["conf_b"][0])))
    assert conf == pytest.approx(facts["acceptance_per_draft"], rel=1e-3)
    assert tcfg.dtype == "bfloat16" and tparams["layers"]["w_gate"].dtype == np.dtype("bfloat16")
    assert dcfg.block_size == 7 and dcfg.markov_head_type == "vanilla"


def test_greedy_decoding_counts_and_accepts_every_draft(pair, engine):
    V = pair[0].vocab_size
    prompts = [(5, 9, 100 + 50 * i) for i in range(8)]
    results = {}
    metrics = engine.generate([Request(id=str(i), prompt_ids=p, max_new_tokens=33)
                               for i, p in enumerate(prompts)],
                              lambda r: results.__setitem__(int(r.id), r))
    for i, p in enumerate(prompts):
        assert results[i].token_ids == [(p[-1] + 1 + k) % V for k in range(33)]
    assert metrics["tau"] == 8.0  # 32 tokens after prefill: four rounds of 7 drafts + 1


def test_sampled_drafts_are_accepted_at_the_stated_rate(pair, engine):
    facts = pair[4]
    metrics = engine.generate([Request(id=str(i), prompt_ids=(7, 300 + i), max_new_tokens=96,
                                       temperature=1.0, seed=i) for i in range(48)])
    accepted_first = metrics["conditional_acceptance"][0]  # over ~1000 first drafts
    assert accepted_first == pytest.approx(facts["acceptance_per_draft"], abs=0.05)
    assert metrics["tau"] == pytest.approx(facts["tau_whole_block"], rel=0.12)


@pytest.mark.parametrize("preset, acceptance, message", [("2b", 0.8, "preset '2b'"),
                                                         ("tiny", 1.0, "acceptance 1.0")])
def test_bad_arguments_are_refused(preset, acceptance, message):
    with pytest.raises(DSparkError, match=message):
        counting_pair(preset, acceptance, MAX_LEN)
