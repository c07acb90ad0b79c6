"""The torch reference Eagle3 drafter (tests/torch_ref/eagle3_ref.py, written from DESIGN.md §3b and the
golden README) against the golden tensors of DeepSpec's PyTorch Eagle3 (../shared/reference/golden/eagle3).

The drafter it runs is the golden checkpoint imported by our JAX loader and exported again by our
writer (`dspark_jax.formats.eagle3`), so this also checks that an exported directory is a DeepSpec
Eagle3 checkpoint that an independent torch implementation reads and runs to the golden numbers."""

import json
from pathlib import Path

import pytest

GOLDEN = Path(__file__).resolve().parents[2] / "shared/reference/golden"
EAGLE3 = GOLDEN / "eagle3"
if not (EAGLE3 / "golden.safetensors").is_file() or not (GOLDEN / "golden.json").is_file():
    pytest.skip(f"Eagle3 golden tensors not found at {EAGLE3}", allow_module_level=True)
torch = pytest.importorskip("torch", reason="the torch reference needs torch")
pytest.importorskip("transformers", reason="the torch reference needs transformers")

from safetensors.torch import load_file  # noqa: E402

from tests.test_torch_ref_golden import _close as _close_tensors  # noqa: E402
from tests.test_torch_ref_golden import _exact as _exact_tensors  # noqa: E402
from tests.torch_ref.eagle3_ref import (  # noqa: E402
    Eagle3Cache,
    load_eagle3_ref,
    load_target,
    target_outputs,
    ttt_loss,
    ttt_position_mask,
    ttt_target_probs,
    verify_greedy,
)

META = json.loads((GOLDEN / "golden.json").read_text())["eagle3"]
ATOL = 1e-4


def _close(name, got, want, mask=None, atol=ATOL):
    _close_tensors(name, torch.as_tensor(got), torch.as_tensor(want), mask, atol)


def _exact(name, got, want):
    _exact_tensors(name, torch.as_tensor(got), torch.as_tensor(want))


@pytest.fixture(scope="module")
def gold():
    return load_file(str(EAGLE3 / "golden.safetensors"))


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """The golden drafter read by our JAX loader and written back by our exporter."""
    from dspark_jax.formats import eagle3 as eagle3_format

    tcfg, tp, ecfg, dp = eagle3_format.load_eagle3_pair(GOLDEN / "target", EAGLE3 / "drafter")
    return eagle3_format.save_eagle3(dp, tcfg, ecfg, tp, tmp_path_factory.mktemp("eagle3") / "drafter",
                                     target_name_or_path="../../target")


@pytest.fixture(scope="module")
def model(exported):
    return load_eagle3_ref(exported)


@pytest.fixture(scope="module")
def target():
    return load_target(GOLDEN / "target")


@pytest.fixture(scope="module")
def train(model, target, gold):
    with torch.no_grad():
        feats, last, tlogits = target_outputs(target, gold["input_ids"], model.target_layer_ids)
        out = model.ttt_forward(gold["input_ids"], gold["attention_mask"], feats)
    return dict(feats=feats, last=last, target_logits=tlogits, out=out)


@pytest.fixture(scope="module")
def infer(model, target, gold):
    """Prefill, first chain, one greedy verification, commit, second chain: all from the HF target."""
    prompt = gold["infer_prompt_ids"]
    n = prompt.shape[1]
    with torch.no_grad():
        feats, _, logits = target_outputs(target, prompt, model.target_layer_ids)
        anchor = logits[:, -1].argmax(-1)
        cache = Eagle3Cache()
        h = model.prefill(cache, prompt, feats, anchor)
        chain = model.propose(cache, h, torch.tensor([n - 1]))
        accepted, committed, cfeats = verify_greedy(target, prompt, anchor, chain.tokens, model.target_layer_ids)
        h2 = model.commit(cache, n, committed, cfeats, start=n)
        chain2 = model.propose(cache, h2, torch.tensor([n + accepted]))
    return dict(feats=feats, anchor=anchor, chain=chain, accepted=accepted, committed=committed,
                committed_features=cfeats, chain2=chain2, cache_len=len(cache))


def test_golden_covered(gold):
    """Every tensor in the golden file is checked by one of the tests below."""
    assert set(gold) == set(META["tensors"])
    checked = {
        "input_ids", "loss_mask", "attention_mask", "target_context_features", "target_last_hidden",
        "train_target_logits", "train_step_input_ids", "train_step_rope_positions", "train_step_hidden",
        "train_draft_logits", "train_target_probs", "train_position_mask", "train_step_ce",
        "infer_prompt_ids", "infer_anchor", "infer_prompt_features", "infer_draft_tokens",
        "infer_draft_hidden", "infer_draft_logits", "infer_draft_positions", "infer_accepted",
        "infer_committed_tokens", "infer_committed_features", "infer2_draft_tokens", "infer2_draft_hidden",
        "infer2_draft_logits", "infer2_draft_positions",
    }
    assert set(gold) <= checked, sorted(set(gold) - checked)


def test_export_is_the_golden_checkpoint(exported, model):
    """The exported directory holds the golden tensors, and the reference reads both alike."""
    ours, theirs = load_file(str(exported / "model.safetensors")), load_file(str(EAGLE3 / "drafter/model.safetensors"))
    assert sorted(ours) == sorted(theirs)
    for key in theirs:
        assert torch.equal(ours[key], theirs[key]), key
    direct = load_eagle3_ref(EAGLE3 / "drafter").state_dict()
    for key, value in model.state_dict().items():
        assert torch.equal(value, direct[key]), key
    assert model.ttt_length == META["ttt_length"] and model.step_loss_decay == META["step_loss_decay"]
    assert model.target_layer_ids == META["target_layer_ids"]


def test_target_inputs(train, gold):
    _close("target_context_features", train["feats"], gold["target_context_features"])
    _close("target_last_hidden", train["last"], gold["target_last_hidden"])
    _close("train_target_logits", train["target_logits"], gold["train_target_logits"])
    assert gold["input_ids"].shape == (1, META["seq_len"]) and bool(gold["attention_mask"].all())


def test_training_forward(train, gold):
    out = train["out"]
    _exact("train_step_input_ids", out.step_input_ids, gold["train_step_input_ids"])
    _exact("train_step_rope_positions", out.rope_positions, gold["train_step_rope_positions"])
    # train_step_hidden[k]: step k's layer output, behind its logits and fed to step k+1.
    _close("train_step_hidden", out.hidden, gold["train_step_hidden"])
    m = gold["train_position_mask"].bool()
    _close("train_draft_logits (counted)", out.logits, gold["train_draft_logits"], m)
    _close("train_draft_logits (all)", out.logits, gold["train_draft_logits"])


def test_shorter_horizon_gives_the_first_steps(model, gold):
    with torch.no_grad():
        out = model.ttt_forward(gold["input_ids"], gold["attention_mask"], gold["target_context_features"],
                                ttt_length=3)
    _close("ttt_length 3 logits", out.logits, gold["train_draft_logits"][:, :3])


def test_targets_masks_and_loss(model, train, gold):
    K = model.ttt_length
    probs = ttt_target_probs(train["target_logits"], K)
    _close("train_target_probs", probs, gold["train_target_probs"])
    pm = ttt_position_mask(gold["loss_mask"], gold["attention_mask"], K)
    _exact("train_position_mask", pm, gold["train_position_mask"])
    t = ttt_loss(train["out"].logits, probs, pm, model.step_loss_decay)
    _close("train_step_ce", t["step_ce"], gold["train_step_ce"])

    ref = META["loss_terms"]
    _close("step_ce_num", t["step_ce_num"], torch.tensor(ref["step_ce_num"]))
    _exact("step_den", t["step_den"], torch.tensor(ref["step_den"]))
    _close("step_loss", t["step_loss"], torch.tensor(ref["step_loss"]))
    _close("step_weight", t["step_weight"], torch.tensor(ref["step_weight"], dtype=torch.float64), atol=1e-12)
    _close("total_loss", t["total_loss"], torch.tensor(ref["total_loss"]))
    metrics = META["metrics"]
    for k in range(K):
        _close(f"accuracy@{k}", t["accuracy_num"][k], torch.tensor(metrics[f"accuracy@{k}"]["num"]))
        _close(f"accept_rate@{k}", t["accept_rate_num"][k], torch.tensor(metrics[f"accept_rate@{k}"]["num"]))
        assert float(t["valid_tokens"][k]) == metrics[f"valid_tokens@{k}"] == metrics[f"accept_rate@{k}"]["den"]
        assert metrics[f"accuracy@{k}"]["den"] == metrics[f"valid_tokens@{k}"]
        _close(f"ploss_{k}", t["step_loss"][k], torch.tensor(metrics[f"ploss_{k}"]))
    _close("tau_greedy", t["tau_greedy_num"], torch.tensor(metrics["tau_greedy"]["num"]))
    _close("tau_probabilistic", t["tau_probabilistic_num"], torch.tensor(metrics["tau_probabilistic"]["num"]))
    assert float(t["tau_den"]) == metrics["tau_greedy"]["den"] == metrics["tau_probabilistic"]["den"]
    _close("loss", t["total_loss"], torch.tensor(metrics["loss"]))


def test_greedy_chain(infer, gold):
    n = gold["infer_prompt_ids"].shape[1]
    assert n == META["prompt_len"]
    _exact("infer_prompt_ids", gold["infer_prompt_ids"], gold["input_ids"][:, :n])
    _close("infer_prompt_features", infer["feats"], gold["infer_prompt_features"])
    _exact("infer_anchor", infer["anchor"], gold["infer_anchor"])
    c = infer["chain"]
    assert c.tokens.shape[1] == META["proposal_length"]
    _exact("infer_draft_tokens", c.tokens, gold["infer_draft_tokens"])
    _close("infer_draft_logits", c.logits, gold["infer_draft_logits"])
    _close("infer_draft_hidden", c.hidden, gold["infer_draft_hidden"])
    _exact("infer_draft_positions", c.positions, gold["infer_draft_positions"])


def test_verification_and_second_chain(infer, gold):
    assert infer["accepted"] == int(gold["infer_accepted"][0])
    _exact("infer_committed_tokens", infer["committed"], gold["infer_committed_tokens"])
    _close("infer_committed_features", infer["committed_features"], gold["infer_committed_features"])
    c = infer["chain2"]
    _exact("infer2_draft_tokens", c.tokens, gold["infer2_draft_tokens"])
    _close("infer2_draft_logits", c.logits, gold["infer2_draft_logits"])
    _close("infer2_draft_hidden", c.hidden, gold["infer2_draft_hidden"])
    _exact("infer2_draft_positions", c.positions, gold["infer2_draft_positions"])
    # the prompt rows, the committed rows, and the chain's rows but its last
    n = gold["infer_prompt_ids"].shape[1]
    assert infer["cache_len"] == n + infer["committed"].shape[1] + c.tokens.shape[1] - 1


def test_loader_is_strict(tmp_path, exported):
    import shutil

    from safetensors.torch import save_file

    sd = load_file(str(exported / "model.safetensors"))
    for mutate in ("drop", "extra", "shape"):
        d = tmp_path / mutate
        d.mkdir()
        shutil.copy(exported / "config.json", d / "config.json")
        bad = dict(sd)
        if mutate == "drop":
            bad.pop("layers.0.hidden_norm.weight")
        elif mutate == "extra":
            bad["layers.0.self_attn.q_proj.bias"] = torch.zeros(64)
        else:
            bad["layers.0.self_attn.q_proj.weight"] = bad["layers.0.self_attn.q_proj.weight"][:, :64].contiguous()
        save_file(bad, str(d / "model.safetensors"), metadata={"format": "pt"})
        with pytest.raises(KeyError if mutate != "shape" else ValueError):
            load_eagle3_ref(d)
