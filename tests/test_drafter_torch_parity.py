"""The JAX drafter against the torch reference drafter (tests/torch_ref/dspark_ref.py) on random
weights, through the DeepSpec export: every head type, training forward and one proposal (greedy and
sampled), the export/import round trip and the import's error cases.

The torch reference is itself validated against golden tensors of the original implementation
(tests/test_torch_ref_golden.py), so agreement here means the JAX drafter and its exporter match
the original on weights that are not the golden ones (larger, with random norms and biases, GQA and
head_dim != hidden / heads)."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from dspark_jax.config import DrafterConfig
from dspark_jax.errors import CheckpointError
from dspark_jax.formats import deepspec, hf_checkpoint
from dspark_jax.models import drafter
from dspark_jax.models.target import forward
from dspark_jax.params import init_params, is_info
from tests.torch_ref import dspark_ref as ref

ATOL = 1e-4
TARGET_KW = dict(vocab=96, hidden=32, heads=4, kv_heads=2, head_dim=12, layers=3, seed=3)
LAYER_IDS = [0, 1]
MASK_ID = 7
BLOCK = 5
RANK = 8

VARIANTS = {
    "vanilla": dict(markov_rank=RANK, markov_head_type="vanilla"),
    "gated": dict(markov_rank=RANK, markov_head_type="gated"),
    "rnn": dict(markov_rank=RANK, markov_head_type="rnn"),
    "vanilla_conf_no_markov": dict(markov_rank=RANK, markov_head_type="vanilla",
                                   confidence_head_with_markov=False),
    "dflash": dict(markov_rank=0, enable_confidence_head=False, confidence_head_with_markov=False),
}

# Training sequence: loss mask off on a prompt prefix and one hole; one dummy anchor (keep False);
# the block at 36 runs past the end of the sequence.
SEQ_LEN = 40
PREFIX = 8
HOLE = 25
ANCHORS = [3, 7, 14, 22, 36, 0]
KEEP = [True, True, True, True, True, False]
# Proposal: two prompts of the same length.
PROMPT_LEN = 12
CACHE_LEN = 32


def _close(name, got, want, mask=None):
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    assert got.shape == want.shape, f"{name}: shape {got.shape} != {want.shape}"
    diff = np.abs(got - want)
    if mask is not None:
        diff = diff[np.asarray(mask, bool)]
    err = float(diff.max()) if diff.size else 0.0
    assert err <= ATOL, f"{name}: max abs err {err:.3g} > {ATOL}"


def _t(x, dtype=None):
    a = torch.from_numpy(np.array(x))
    return a if dtype is None else a.to(dtype)


def randomise(spec, params, seed: int):
    """Makes random init non-trivial: normal weights O(0.3), norms around 1, nonzero biases."""
    rng = np.random.default_rng(seed)

    def one(info, x):
        x = np.asarray(x, np.float32)
        if info.init == "normal":
            return jnp.asarray(x * (0.3 / info.scale))
        if info.init == "ones":
            return jnp.asarray(rng.uniform(0.5, 1.5, x.shape).astype(np.float32))
        assert info.init == "zeros", info.init
        return jnp.asarray(rng.normal(0.0, 0.3, x.shape).astype(np.float32))

    return jax.tree.map(one, spec, params, is_leaf=is_info)


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def target(hf_models):
    """The tiny HF target on both sides, and its features for the training sequence and prompts."""
    directory = hf_models(**TARGET_KW)
    tcfg, tp = hf_checkpoint.load_target(directory, target_layer_ids=LAYER_IDS,
                                         mask_token_id=MASK_ID)
    assert tcfg.head_dim * tcfg.num_attention_heads != tcfg.hidden_size
    tmodel = ref.load_target(directory)
    rng = np.random.default_rng(11)
    V = tcfg.vocab_size

    ids = rng.integers(0, V, (1, SEQ_LEN)).astype(np.int32)
    loss_mask = np.ones((1, SEQ_LEN), np.int32)
    loss_mask[:, :PREFIX] = 0
    loss_mask[:, HOLE] = 0
    prompt = rng.integers(0, V, (2, PROMPT_LEN)).astype(np.int32)

    fwd = jax.jit(forward, static_argnums=1)
    out_train = fwd(tp, tcfg, jnp.asarray(ids), jnp.arange(SEQ_LEN)[None])
    out_prompt = fwd(tp, tcfg, jnp.asarray(prompt), jnp.broadcast_to(jnp.arange(PROMPT_LEN), prompt.shape))
    t_taps, _ = ref.target_features(tmodel, _t(ids, torch.long), LAYER_IDS)
    t_ptaps, t_plast = ref.target_features(tmodel, _t(prompt, torch.long), LAYER_IDS)
    # Sanity: both targets see the same features (the drafters' inputs).
    _close("target taps (train)", out_train.taps, t_taps.numpy())
    _close("target taps (prompt)", out_prompt.taps, t_ptaps.numpy())
    _close("target last logits (prompt)", out_prompt.logits[:, -1], t_plast.numpy())
    anchor = np.asarray(jnp.argmax(out_prompt.logits[:, -1], -1)).astype(np.int32)
    np.testing.assert_array_equal(anchor, t_plast.argmax(-1).numpy())
    return dict(tcfg=tcfg, tp=tp, tmodel=tmodel, ids=ids, loss_mask=loss_mask, prompt=prompt,
                anchor=anchor, taps=out_train.taps, ptaps=out_prompt.taps, t_taps=t_taps,
                t_ptaps=t_ptaps)


@pytest.fixture(scope="module", params=list(VARIANTS))
def case(request, target, tmp_path_factory):
    """One drafter variant: randomised JAX params exported, loaded by the torch reference, and both
    sides run once (training forward; greedy and temperature-1 proposals)."""
    name = request.param
    tcfg, tp = target["tcfg"], target["tp"]
    dcfg = DrafterConfig(num_draft_layers=2, block_size=BLOCK, num_anchors=len(ANCHORS),
                         **VARIANTS[name])
    spec = drafter.drafter_spec(tcfg, dcfg)
    seed = list(VARIANTS).index(name)
    dp = randomise(spec, init_params(spec, jax.random.key(seed)), 100 + seed)
    directory = deepspec.save_drafter(dp, tcfg, dcfg, tp, tmp_path_factory.mktemp(f"drafter_{name}"))
    tref = ref.load_drafter(directory)

    # JAX: training forward.
    train = jax.jit(drafter.train_forward, static_argnums=(2, 3))(
        dp, tp, tcfg, dcfg, jnp.asarray(target["ids"]), jnp.asarray(target["loss_mask"]),
        target["taps"], jnp.asarray([ANCHORS]), jnp.asarray([KEEP]))
    # JAX: one proposal after the prompts, greedy and at temperature 1 (one compilation).
    B = target["prompt"].shape[0]
    cache = drafter.DraftCache.create(tcfg, dcfg, B, CACHE_LEN)
    pos = jnp.broadcast_to(jnp.arange(PROMPT_LEN), (B, PROMPT_LEN))
    cache = jax.jit(drafter.extend_context, static_argnums=(1, 2))(
        dp, tcfg, dcfg, cache, target["ptaps"], pos, jnp.ones((B, PROMPT_LEN), bool))
    prop_fn = jax.jit(drafter.propose, static_argnums=(2, 3))
    anchor, anchor_pos = jnp.asarray(target["anchor"]), jnp.full((B,), PROMPT_LEN)
    greedy = prop_fn(dp, tp, tcfg, dcfg, cache, anchor, anchor_pos, jnp.zeros((B,)),
                     jax.random.split(jax.random.key(1), B))
    sampled = prop_fn(dp, tp, tcfg, dcfg, cache, anchor, anchor_pos, jnp.ones((B,)),
                      jax.random.split(jax.random.key(2), B))

    # Torch reference on its own target's features.
    with torch.no_grad():
        t_train = tref.train_forward(_t(target["ids"], torch.long), _t(target["loss_mask"]),
                                     target["t_taps"], ANCHORS, KEEP)
        t_prop = tref.propose(_t(target["prompt"], torch.long), target_model=target["tmodel"])
    return dict(name=name, dcfg=dcfg, dp=dp, dir=directory, tref=tref, train=train,
                greedy=greedy, sampled=sampled, t_train=t_train, t_prop=t_prop)


# ----------------------------------------------------------------------------- (a) training forward


def test_training_forward(case):
    tb, tt, dcfg = case["train"], case["t_train"], case["dcfg"]
    np.testing.assert_array_equal(np.asarray(tb.labels), tt.target_ids.numpy())
    np.testing.assert_array_equal(np.asarray(tb.eval_mask), tt.eval_mask.numpy())
    em = tt.eval_mask.numpy()
    # The case is not degenerate: some blocks fully, some partly, some not supervised.
    per_block = em[0].sum(-1)
    assert per_block.max() == BLOCK and 0 < per_block[3] < BLOCK and per_block[-1] == 0, per_block
    _close("train draft logits", tb.logits, tt.draft_logits.numpy())
    _close("train draft logits (eval mask)", tb.logits, tt.draft_logits.numpy(), em)
    if dcfg.enable_confidence_head:
        _close("train confidence logits (eval mask)", tb.conf_logits, tt.confidence_logits.numpy(), em)
        _close("train confidence logits", tb.conf_logits, tt.confidence_logits.numpy())
    else:
        assert tb.conf_logits is None and tt.confidence_logits is None
    # The Markov head changes the logits (so the check above covers it).
    if dcfg.has_markov:
        assert (tt.draft_logits - tt.base_logits).abs().max().item() > 1e-2


# ----------------------------------------------------------------------------- (b) proposal


def test_greedy_proposal(case, target):
    g, tp_, dcfg = case["greedy"], case["t_prop"], case["dcfg"]
    np.testing.assert_array_equal(tp_.anchor.numpy(), target["anchor"])
    _close("block hidden", g.hidden, tp_.block_hidden.numpy())
    _close("base logits", g.base_logits, tp_.base_logits.numpy())
    # Greedy tokens are only comparable where the top two logits are well apart (data sanity).
    top2 = torch.topk(tp_.draft_logits, 2, dim=-1).values
    assert (top2[..., 0] - top2[..., 1]).min().item() > 10 * ATOL
    np.testing.assert_array_equal(np.asarray(g.tokens), tp_.draft_tokens.numpy())
    np.testing.assert_array_equal(np.argmax(np.asarray(g.probs), -1), np.asarray(g.tokens))
    if dcfg.enable_confidence_head:
        _close("greedy confidence logits", g.conf_logits, tp_.confidence_logits.numpy())
    else:
        np.testing.assert_array_equal(np.asarray(g.conf_logits), 0)


def test_sampled_proposal_probs(case, target):
    """At temperature 1 the probs are softmax(base + Markov bias given the sampled previous tokens)."""
    s, tp_, tref, dcfg = case["sampled"], case["t_prop"], case["tref"], case["dcfg"]
    tokens = np.asarray(s.tokens)
    B, T = tokens.shape
    h, base = tp_.block_hidden, tp_.base_logits
    prev = torch.cat([_t(target["anchor"], torch.long)[:, None], _t(tokens[:, :-1], torch.long)], 1)
    with torch.no_grad():
        logits = base.clone()
        if tref.markov_head is not None:
            state = tref.markov_head.init_state(B)
            for k in range(T):
                bias, state = tref.markov_head.step(h[:, k], prev[:, k], state)
                logits[:, k] += bias
        want = torch.log_softmax(logits, -1).numpy()
        conf = tref.confidence_logits(h, prev)
    _close("base logits (sampled)", s.base_logits, base.numpy())
    probs = np.asarray(s.probs)
    assert np.all(probs > 0)
    np.testing.assert_allclose(probs.sum(-1), 1.0, atol=1e-5)
    _close("sampled log probs", np.log(probs), want)
    if dcfg.enable_confidence_head:
        _close("sampled confidence logits", s.conf_logits, conf.numpy())
    # Sampling actually differs from greedy somewhere (so the Markov prev tokens are exercised).
    assert not np.array_equal(tokens, np.asarray(case["greedy"].tokens))


# ----------------------------------------------------------------------------- (c) round trip


def test_export_import_round_trip(case, target, tmp_path):
    tcfg, tp, dp, dcfg = target["tcfg"], target["tp"], case["dp"], case["dcfg"]
    dcfg2, dp2 = deepspec.load_drafter(case["dir"], tcfg, tp)
    assert dcfg2 == dcfg
    assert jax.tree.structure(dp2) == jax.tree.structure(dp)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), dp2, dp)
    jax.tree.map(lambda a: (a.dtype == jnp.float32) or pytest.fail(f"dtype {a.dtype}"), dp2)

    # bfloat16 export: config and every stored tensor say BF16; import gives the rounded values.
    out = deepspec.save_drafter(dp, tcfg, dcfg, tp, tmp_path / "bf16", dtype="bfloat16")
    hf = json.loads((out / "config.json").read_text())
    assert hf["dtype"] == "bfloat16" and hf["torch_dtype"] == "bfloat16"
    raw = (out / "model.safetensors").read_bytes()
    header = json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])
    dtypes = {k: v["dtype"] for k, v in header.items() if k != "__metadata__"}
    assert dtypes and set(dtypes.values()) == {"BF16"}, dtypes
    assert {"embed_tokens.weight", "lm_head.weight"} <= set(dtypes)
    dcfg3, dp3 = deepspec.load_drafter(out, tcfg, tp)  # copies compared at the stored precision
    assert dcfg3 == dcfg
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(
        np.asarray(a), np.asarray(jnp.asarray(b).astype(jnp.bfloat16).astype(jnp.float32))), dp3, dp)


# ----------------------------------------------------------------------------- (d) import errors


@pytest.fixture(scope="module")
def exported(target, tmp_path_factory):
    """A vanilla drafter export (float32) to damage in the error tests."""
    tcfg, tp = target["tcfg"], target["tp"]
    dcfg = DrafterConfig(num_draft_layers=2, block_size=BLOCK, markov_rank=RANK, num_anchors=4)
    spec = drafter.drafter_spec(tcfg, dcfg)
    dp = randomise(spec, init_params(spec, jax.random.key(9)), 9)
    return deepspec.save_drafter(dp, tcfg, dcfg, tp, tmp_path_factory.mktemp("exported")), dp


def _copy(src, tmp_path):
    dst = tmp_path / "drafter"
    shutil.copytree(src, dst)
    return dst


def _edit_config(directory, **changes):
    path = directory / "config.json"
    hf = json.loads(path.read_text())
    hf.update(changes)
    path.write_text(json.dumps(hf))


def _edit_tensors(directory, fn):
    from safetensors.numpy import load_file, save_file

    path = directory / "model.safetensors"
    tensors = load_file(str(path))
    fn(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


@pytest.mark.parametrize("field, changes", [
    ("hidden_size", dict(hidden_size=48)),
    ("vocab_size", dict(vocab_size=128)),
    ("target_layer_ids", dict(target_layer_ids=[0])),
    ("mask_token_id", dict(mask_token_id=MASK_ID + 1)),
])
def test_load_rejects_drafter_that_does_not_fit(exported, target, tmp_path, field, changes):
    d = _copy(exported[0], tmp_path)
    _edit_config(d, **changes)
    with pytest.raises(CheckpointError, match=field):
        deepspec.load_drafter(d, target["tcfg"], target["tp"])


@pytest.mark.parametrize("key", ["embed_tokens.weight", "lm_head.weight"])
def test_load_target_copy_mismatch(exported, target, tmp_path, key):
    d = _copy(exported[0], tmp_path)

    def perturb(t):
        t[key] = t[key].copy()
        t[key][3, 1] += 0.25

    _edit_tensors(d, perturb)
    tcfg, tp = target["tcfg"], target["tp"]
    with pytest.raises(CheckpointError, match=key.replace(".", r"\.")):
        deepspec.load_drafter(d, tcfg, tp)
    with pytest.warns(UserWarning, match=key.replace(".", r"\.")):
        _, dp = deepspec.load_drafter(d, tcfg, tp, on_mismatch="warn")
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 dp, exported[1])


def test_load_missing_tensors(exported, target, tmp_path):
    d = _copy(exported[0], tmp_path)
    gone = ["layers.1.mlp.up_proj.weight", "markov_head.markov_w2.weight"]

    def drop(t):
        for k in gone:
            del t[k]

    _edit_tensors(d, drop)
    with pytest.raises(CheckpointError, match="missing") as info:
        deepspec.load_drafter(d, target["tcfg"], target["tp"])
    for k in gone:
        assert k in str(info.value)
