"""The torch reference drafter (tests/torch_ref/dspark_ref.py, written from DESIGN.md) against golden
tensors produced by the original PyTorch DSpark implementation (DeepSpec) on tiny random models.

Once this passes, `tests.torch_ref.dspark_ref` is a trusted parity oracle for the JAX drafter."""

import json
from pathlib import Path

import pytest
import torch

GOLDEN = Path(__file__).resolve().parents[2] / "shared/reference/golden"
if not GOLDEN.is_dir():
    pytest.skip(f"golden reference tensors not found at {GOLDEN}", allow_module_level=True)

from safetensors.torch import load_file  # noqa: E402

from tests.torch_ref.dspark_ref import load_drafter, load_target, target_features  # noqa: E402

HEADS = ["vanilla", "gated", "rnn", "dflash"]
ATOL = 1e-4
RTOL_LOSS = 1e-4


@pytest.fixture(scope="module")
def meta():
    return json.loads((GOLDEN / "golden.json").read_text())


@pytest.fixture(scope="module")
def target():
    return load_target(GOLDEN / "target")


@pytest.fixture(scope="module", params=HEADS)
def case(request, meta, target):
    head = request.param
    gold = load_file(str(GOLDEN / head / "golden.safetensors"))
    model = load_drafter(GOLDEN / head / "drafter")
    with torch.no_grad():
        train = model.train_forward(
            gold["input_ids"], gold["loss_mask"], gold["target_context_features"],
            meta["anchors"], meta["anchor_keep"],
            target_last_hidden=gold["target_last_hidden"],
            target_lm_head=target.lm_head.weight)
        prop = model.propose(gold["infer_prompt_ids"], target_model=target)
    return dict(head=head, gold=gold, model=model, train=train, prop=prop,
                loss_terms=meta["cases"][head]["loss_terms"], meta=meta)


def _close(name, got, want, mask=None, atol=ATOL):
    assert got is not None, f"{name}: not produced"
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    diff = (got.double() - want.double()).abs()
    if mask is not None:
        diff = diff[mask]
    err = diff.max().item() if diff.numel() else 0.0
    assert err <= atol, f"{name}: max abs err {err:.3g} > {atol}"


def _exact(name, got, want):
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert torch.equal(got.long(), want.long()), f"{name}:\n got {got.tolist()}\nwant {want.tolist()}"


def test_golden_covered(case):
    """Every tensor in the golden file is checked by one of the tests below."""
    checked = {
        "input_ids", "loss_mask", "target_context_features", "target_last_hidden",
        "train_draft_logits", "train_target_ids", "train_eval_mask", "train_aligned_target_logits",
        "train_confidence_logits", "infer_prompt_ids", "infer_anchor", "infer_block_hidden",
        "infer_base_logits", "infer_draft_tokens", "infer_confidence_logits",
    }
    assert set(case["gold"]) <= checked, sorted(set(case["gold"]) - checked)
    assert set(case["gold"]) == set(case["meta"]["cases"][case["head"]]["tensors"])


def test_target_inputs(case, target):
    """The golden inputs are what the golden target produces (tapping convention: HF hidden_states[i+1])."""
    g, model = case["gold"], case["model"]
    assert g["input_ids"].shape == (1, case["meta"]["seq_len"])
    assert g["infer_prompt_ids"].shape[1] == int(g["loss_mask"][0].nonzero()[0])  # prompt = loss-masked head
    _exact("infer_prompt_ids", g["infer_prompt_ids"], g["input_ids"][:, : g["infer_prompt_ids"].shape[1]])
    feats, _ = target_features(target, g["input_ids"], model.target_layer_ids)
    _close("target_context_features", feats, g["target_context_features"])
    with torch.no_grad():
        last = target(g["input_ids"], output_hidden_states=True).hidden_states[-1]
    _close("target_last_hidden", last, g["target_last_hidden"])
    lm = g["loss_mask"][0]
    assert lm[:12].sum() == 0 and lm[30] == 0 and lm[12:30].all() and lm[31:].all()


def test_train_ids_and_masks(case):
    g, t = case["gold"], case["train"]
    _exact("train_target_ids", t.target_ids, g["train_target_ids"])
    _exact("train_eval_mask", t.eval_mask, g["train_eval_mask"])


def test_train_logits(case):
    g, t = case["gold"], case["train"]
    m = g["train_eval_mask"].bool()
    _close("train_draft_logits", t.draft_logits, g["train_draft_logits"], m)
    _close("train_aligned_target_logits", t.aligned_target_logits, g["train_aligned_target_logits"], m)
    if "train_confidence_logits" in g:
        _close("train_confidence_logits", t.confidence_logits, g["train_confidence_logits"], m)
    else:
        assert t.confidence_logits is None


def test_train_loss_terms(case):
    t = case["train"]
    for name, want in case["loss_terms"].items():
        got = float(t.loss_terms[name])
        if want == 0.0:
            assert got == 0.0, f"{name}: {got} != 0"
        else:
            assert abs(got - want) <= RTOL_LOSS * abs(want), f"{name}: {got} vs golden {want}"
    lt = case["loss_terms"]
    total = 0.1 * lt["ce_loss_num"] / lt["ce_loss_den"] + 0.9 * lt["l1_loss_num"] / lt["l1_loss_den"]
    if lt["confidence_loss_den"] > 0:
        total += lt["confidence_loss_num"] / lt["confidence_loss_den"]
    assert abs(float(t.loss_terms["loss"]) - total) <= RTOL_LOSS * total


def test_inference_proposal(case):
    g, p = case["gold"], case["prop"]
    _exact("infer_anchor", p.anchor, g["infer_anchor"])
    _close("infer_block_hidden", p.block_hidden, g["infer_block_hidden"])
    _close("infer_base_logits", p.base_logits, g["infer_base_logits"])
    _exact("infer_draft_tokens", p.draft_tokens, g["infer_draft_tokens"])
    if "infer_confidence_logits" in g:
        _close("infer_confidence_logits", p.confidence_logits, g["infer_confidence_logits"])
    else:
        assert p.confidence_logits is None


def test_propose_from_features_matches(case):
    """propose() given precomputed features/anchor equals propose() driving the target itself."""
    g, model, p = case["gold"], case["model"], case["prop"]
    n = g["infer_prompt_ids"].shape[1]
    with torch.no_grad():
        q = model.propose(g["infer_prompt_ids"], target_context_features=g["target_context_features"][:, :n],
                          anchor=g["infer_anchor"])
    _close("block_hidden", q.block_hidden, p.block_hidden, atol=1e-6)
    _exact("draft_tokens", q.draft_tokens, p.draft_tokens)


def test_loader_is_strict(tmp_path):
    import shutil

    from safetensors.torch import save_file

    src = GOLDEN / "gated" / "drafter"
    sd = load_file(str(src / "model.safetensors"))
    for mutate in ("drop", "extra"):
        d = tmp_path / mutate
        d.mkdir()
        shutil.copy(src / "config.json", d / "config.json")
        bad = dict(sd)
        if mutate == "drop":
            bad.pop("markov_head.gate_proj.bias")
        else:
            bad["markov_head.joint_proj.bias"] = torch.zeros(48)
        save_file(bad, str(d / "model.safetensors"), metadata={"format": "pt"})
        with pytest.raises(KeyError):
            load_drafter(d)
