"""The JAX drafter reproduces the golden tensors of the original PyTorch implementation
(../shared/reference/golden): training forward, loss terms and one greedy proposal, every head type."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.formats import deepspec, hf_checkpoint
from dspark_jax.models import drafter
from dspark_jax.models.target import KVCache, forward, lm_head
from dspark_jax.training.losses import loss_terms
from tests.conftest import GOLDEN

if not (GOLDEN / "golden.json").is_file():
    pytest.skip(f"golden tensors not found at {GOLDEN}", allow_module_level=True)

from safetensors.numpy import load_file  # noqa: E402

CASES = ["vanilla", "gated", "rnn", "dflash"]
META = json.loads((GOLDEN / "golden.json").read_text())


@pytest.fixture(scope="module")
def target():
    return hf_checkpoint.load_target(GOLDEN / "target", target_layer_ids=[0, 2], mask_token_id=3)


@pytest.fixture(scope="module", params=CASES)
def case(request, target):
    tcfg, tp = target
    dcfg, dp = deepspec.load_drafter(GOLDEN / request.param / "drafter", tcfg, tp)
    return request.param, dcfg, dp, load_file(GOLDEN / request.param / "golden.safetensors")


def test_training_forward_and_losses(case, target):
    name, dcfg, dp, g = case
    tcfg, tp = target
    ids, lm = jnp.asarray(g["input_ids"]), jnp.asarray(g["loss_mask"])
    out = forward(tp, tcfg, ids, jnp.arange(ids.shape[1])[None])
    np.testing.assert_allclose(out.taps, g["target_context_features"], atol=1e-4, rtol=0)
    np.testing.assert_allclose(out.hidden, g["target_last_hidden"], atol=1e-4, rtol=0)
    anchors, keep = jnp.asarray([META["anchors"]]), jnp.asarray([META["anchor_keep"]])
    tb = jax.jit(drafter.train_forward, static_argnums=(2, 3))(dp, tp, tcfg, dcfg, ids, lm, out.taps,
                                                               anchors, keep)
    em = g["train_eval_mask"].astype(bool)
    # Attention over 3 blocks at a time (7 blocks: the last group padded) gives the same blocks.
    chunked = jax.jit(drafter.train_forward, static_argnums=(2, 3))(
        dp, tp, tcfg, dataclasses.replace(dcfg, attention_chunk=3), ids, lm, out.taps, anchors, keep)
    np.testing.assert_allclose(chunked.logits, tb.logits, atol=1e-5, rtol=0)
    np.testing.assert_array_equal(tb.labels, g["train_target_ids"])
    np.testing.assert_array_equal(tb.eval_mask, em)
    np.testing.assert_allclose(np.asarray(tb.logits)[em], g["train_draft_logits"][em], atol=1e-4, rtol=0)
    if dcfg.enable_confidence_head:
        np.testing.assert_allclose(np.asarray(tb.conf_logits)[em], g["train_confidence_logits"][em],
                                   atol=1e-4, rtol=0)
    else:
        assert tb.conf_logits is None
    B, N, T = tb.labels.shape
    hidden = jnp.take_along_axis(out.hidden, tb.aligned_index.reshape(B, N * T)[..., None], axis=1)
    target_logits = lm_head(tp, tcfg, hidden).reshape(B, N, T, -1)
    np.testing.assert_allclose(np.asarray(target_logits)[em], g["train_aligned_target_logits"][em],
                               atol=1e-4, rtol=0)
    terms, _ = loss_terms(tb.logits, tb.conf_logits, target_logits, tb.labels, tb.eval_mask, 4.0)
    ref = META["cases"][name]["loss_terms"]
    np.testing.assert_allclose(terms["ce_num"], ref["ce_loss_num"], rtol=1e-4)
    np.testing.assert_allclose(terms["l1_num"], ref["l1_loss_num"], rtol=1e-4)
    np.testing.assert_allclose(terms["den"], ref["ce_loss_den"], rtol=1e-4)
    if dcfg.enable_confidence_head:
        np.testing.assert_allclose(terms["confidence_num"], ref["confidence_loss_num"], rtol=1e-4)


def test_greedy_proposal(case, target):
    _, dcfg, dp, g = case
    tcfg, tp = target
    prompt = jnp.asarray(g["infer_prompt_ids"])
    n = prompt.shape[1]
    pos = jnp.arange(n)[None]
    out = forward(tp, tcfg, prompt, pos, cache=KVCache.create(tcfg, 1, 32))
    anchor = jnp.argmax(out.logits[:, -1], -1)
    np.testing.assert_array_equal(anchor, g["infer_anchor"])
    cache = drafter.DraftCache.create(tcfg, dcfg, 1, 32)
    cache = drafter.extend_context(dp, tcfg, dcfg, cache, out.taps, pos, jnp.ones_like(prompt, bool))
    prop = drafter.propose(dp, tp, tcfg, dcfg, cache, anchor, jnp.asarray([n]), jnp.zeros((1,)),
                           jax.random.split(jax.random.key(0), 1))
    np.testing.assert_allclose(prop.hidden, g["infer_block_hidden"], atol=1e-4, rtol=0)
    np.testing.assert_allclose(prop.base_logits, g["infer_base_logits"], atol=1e-4, rtol=0)
    np.testing.assert_array_equal(prop.tokens, g["infer_draft_tokens"])
    if dcfg.enable_confidence_head:
        np.testing.assert_allclose(prop.conf_logits, g["infer_confidence_logits"], atol=1e-4, rtol=0)
    # Greedy draft distributions are the one-hot of the drafted tokens.
    np.testing.assert_array_equal(np.argmax(prop.probs, -1), prop.tokens)
