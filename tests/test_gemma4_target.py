"""The Gemma4 text target against the golden tensors (transformers 5.10.2, ../shared/reference/golden/
gemma4) and against transformers itself: full-sequence logits and hidden states, incremental decode
through the ring-buffer cache past the sliding window, rejected speculative writes, flat verification
of ragged rows, export and reload, a tensor-parallel mesh, refused configs, and plain decoding with
the engine. Every program is compiled once per module: the tests share the shapes below."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.errors import CheckpointError
from dspark_jax.formats import hf_checkpoint
from dspark_jax.models import target as tmodel
from tests.conftest import GOLDEN

G4 = GOLDEN / "gemma4"
if not (G4 / "golden.safetensors").is_file():
    pytest.skip(f"Gemma4 golden tensors not found at {G4}", allow_module_level=True)

from safetensors.numpy import load_file, save_file  # noqa: E402

TAPS = tuple(range(-1, 7))  # the embedding and every layer but the last: hidden-state entries 0..7
ROWS, MAX_LEN, MAX_STEP, PREFILL, WIDTH = 2, 64, 4, 40, 4  # decode shapes shared by the tests
FORWARD = jax.jit(tmodel.forward, static_argnums=1, static_argnames="compute_logits")
FLAT = jax.jit(tmodel.forward_flat, static_argnums=(1, 8))


SELF_TOL = 2e-4  # logits of one of our paths against another's


def hidden_tol(ref: np.ndarray) -> float:
    """float32 rounding over 8 layers whose stream grows to ~120: 2.5e-6 of the entry's magnitude
    (at least 1e-4). transformers' own float32 run is 2.2e-4 from its float64 run here."""
    return max(1e-4, 2.5e-6 * float(np.abs(ref).max()))


@pytest.fixture(scope="module")
def golden():
    return load_file(G4 / "golden.safetensors")


@pytest.fixture(scope="module")
def target():
    return hf_checkpoint.load_target(G4 / "target", target_layer_ids=TAPS)


def run_full(target, ids: np.ndarray):
    """The full-sequence forward of one row of 48 tokens (one compiled program)."""
    cfg, params = target
    ids = jnp.asarray(ids, jnp.int32).reshape(1, 48)
    return FORWARD(params, cfg, ids, jnp.arange(48)[None])


@pytest.fixture(scope="module")
def full(target, golden):
    return run_full(target, golden["input_ids"])


@pytest.fixture(scope="module")
def sequences(golden):
    """Two 48-token rows: the golden ids, and a random row whose prompt is shorter (33)."""
    other = np.random.default_rng(7).integers(10, 320, size=48)
    return np.stack([golden["input_ids"][0], other]).astype(np.int32), np.array([PREFILL, 33])


def prefill(target, tokens: np.ndarray, lengths: np.ndarray):
    """Prompts [ROWS, <=PREFILL] of `lengths` into a fresh cache (one compiled program)."""
    cfg, params = target
    padded = np.zeros((ROWS, PREFILL), np.int32)
    padded[:, :tokens.shape[1]] = tokens[:, :PREFILL]
    pos = jnp.broadcast_to(jnp.arange(PREFILL), (ROWS, PREFILL))
    cache = tmodel.new_cache(cfg, ROWS, MAX_LEN, max_step=MAX_STEP)
    return FORWARD(params, cfg, jnp.asarray(padded), pos, cache=cache,
                   valid=pos < jnp.asarray(lengths)[:, None])


def step(target, cache, tokens, positions):
    """One token per row [ROWS] at `positions` [ROWS] (one compiled program)."""
    cfg, params = target
    return FORWARD(params, cfg, jnp.asarray(tokens, jnp.int32)[:, None],
                   jnp.asarray(positions, jnp.int32)[:, None], cache=cache)


def flat(target, cache, chunks):
    """One flat verification of `chunks` [(row, first position, tokens)] in a bucket of 2 * WIDTH
    (one compiled program); returns (output, [(row, positions, flat indices)])."""
    cfg, params = target
    F = ROWS * WIDTH
    tok, rows, pos, grid = (np.zeros(F, np.int32) for _ in range(4))
    valid = np.zeros(F, bool)
    placed, i = [], 0
    for row, first, toks in chunks:
        n = len(toks)
        tok[i:i + n], rows[i:i + n], pos[i:i + n] = toks, row, first + np.arange(n)
        grid[i:i + n], valid[i:i + n] = row * WIDTH + np.arange(n), True
        placed.append((row, first + np.arange(n), np.arange(i, i + n)))
        i += n
    out = FLAT(params, cfg, cache, jnp.asarray(tok), jnp.asarray(rows), jnp.asarray(pos),
               jnp.asarray(valid), jnp.asarray(grid), WIDTH)
    return out, placed


# ----------------------------------------------------------------------------- golden tensors


def test_full_sequence_matches_golden(target, golden, full):
    cfg, _ = target
    np.testing.assert_allclose(full.logits, golden["target_logits"], atol=1e-4, rtol=0)
    hs, d = golden["target_hidden_states"], cfg.hidden_size
    for slot, layer in enumerate(TAPS):  # tap -1 is entry 0 (the scaled embedding), tap i entry i+1
        ref = hs[layer + 1]
        np.testing.assert_allclose(full.taps[..., slot * d:(slot + 1) * d], ref, atol=hidden_tol(ref),
                                   rtol=0, err_msg=f"tap {layer}")
    np.testing.assert_allclose(full.hidden, hs[8], atol=hidden_tol(hs[8]), rtol=0)
    np.testing.assert_allclose(full.hidden, golden["target_last_hidden"], atol=hidden_tol(hs[8]))


def test_incremental_decode_through_the_ring_equals_full_forward(target, golden, full, sequences):
    """Prefill 40 (row 1: 33), then one token at a time to 48: past the window (8) and around the
    ring (W = 8 - 1 + 4 = 11 slots), so every position of the ring is overwritten several times."""
    seqs, lengths = sequences
    out = prefill(target, seqs, lengths)
    assert out.cache.ring_k.shape[2] == 11 and out.cache.full_k.shape[2] == MAX_LEN
    np.testing.assert_allclose(out.logits[0], golden["decode_prefill_logits"][0], atol=1e-4, rtol=0)
    other = run_full(target, seqs[1])
    # Our two paths against each other: batches of other shapes sum in other orders (1.1e-4 seen on
    # logits of ~10 on a loaded machine), so the float32 budget of the golden checks, doubled.
    np.testing.assert_allclose(out.logits[1, :33], other.logits[0, :33], atol=SELF_TOL, rtol=0)
    cache, logits = out.cache, []
    for i in range(8):
        pos = lengths + i
        o = step(target, cache, seqs[[0, 1], pos], pos)
        cache = o.cache
        logits.append(o.logits[:, 0])
    logits = np.stack(logits, 1)  # [ROWS, 8, V]
    np.testing.assert_allclose(logits[0], golden["decode_step_logits"][0], atol=1e-4, rtol=0)
    np.testing.assert_allclose(logits[0], full.logits[0, 40:], atol=SELF_TOL, rtol=0)
    np.testing.assert_allclose(logits[1], other.logits[0, 33:41], atol=SELF_TOL, rtol=0)
    ring = np.asarray(cache.ring_pos)
    assert sorted(ring[0]) == list(range(37, 48)) and sorted(ring[1]) == list(range(30, 41))


def test_greedy_continuation_matches_golden(target, golden):
    """The golden greedy continuation of the first 12 ids, through prefill and single steps."""
    cfg, _ = target
    prompt = golden["input_ids"][:, :12].repeat(ROWS, 0)
    out = prefill(target, prompt, np.full(ROWS, 12))
    tokens = [np.asarray(jnp.argmax(out.logits[:, 11], -1))]
    cache = out.cache
    for i in range(15):
        o = step(target, cache, tokens[-1], np.full(ROWS, 12 + i))
        cache = o.cache
        tokens.append(np.asarray(jnp.argmax(o.logits[:, 0], -1)))
    got = np.stack(tokens, 1)
    np.testing.assert_array_equal(got, golden["target_greedy_ids"].repeat(ROWS, 0))


def test_rejected_speculation_leaves_no_trace(target, sequences):
    """Speculative chunks written by flat verification, then decoding resumes earlier with other
    tokens (row 0 keeps one speculated token, row 1 none): every logit equals a full forward over
    the sequence finally decoded, so stale ring entries and cache slots are never read."""
    seqs, lengths = sequences
    rng = np.random.default_rng(3)
    spec = rng.integers(10, 320, size=(ROWS, WIDTH)).astype(np.int32)
    final = seqs.copy()
    final[0, 40] = spec[0, 0]  # row 0 accepted its first speculated token; row 1 none
    cache = prefill(target, seqs, lengths).cache
    o1, _ = flat(target, cache, [(0, 40, spec[0]), (1, 33, spec[1])])
    o2, placed2 = flat(target, o1.cache, [(0, 41, final[0, 41:45]), (1, 33, final[1, 33:37])])
    o3, placed3 = flat(target, o2.cache, [(0, 45, final[0, 45:48]), (1, 37, final[1, 37:41])])
    refs = [run_full(target, final[r]) for r in range(ROWS)]
    np.testing.assert_allclose(o1.logits[0], refs[0].logits[0, 40], atol=1e-4, rtol=0)
    for out, placed in ((o2, placed2), (o3, placed3)):
        for row, pos, idx in placed:
            np.testing.assert_allclose(out.logits[idx], refs[row].logits[0, pos], atol=1e-4, rtol=0)
            np.testing.assert_allclose(out.taps[idx], refs[row].taps[0, pos], atol=3e-4, rtol=0)


def test_flat_rows_at_different_lengths_equal_per_row_forward(target, sequences):
    """Row 1's tokens first, 4 of them from 33; row 0's 3 from 40; one padding token."""
    seqs, lengths = sequences
    cache = prefill(target, seqs, lengths).cache
    out, placed = flat(target, cache, [(1, 33, seqs[1, 33:37]), (0, 40, seqs[0, 40:43])])
    for row, pos, idx in placed:
        ref = run_full(target, seqs[row])
        np.testing.assert_allclose(out.logits[idx], ref.logits[0, pos], atol=1e-4, rtol=0)
        np.testing.assert_allclose(out.taps[idx], ref.taps[0, pos], atol=3e-4, rtol=0)
        np.testing.assert_allclose(out.hidden[idx], ref.hidden[0, pos], atol=3e-4, rtol=0)
    # the padding token wrote nothing: row 0's ring and full cache hold positions up to 42 only
    ring = np.asarray(out.cache.ring_pos[0])
    assert ring.max() == 42 and 43 not in ring


# ----------------------------------------------------------------------------- transformers


def hf_logits(directory, ids: np.ndarray, dtype=None):
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        directory, dtype=dtype or torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        out = model(torch.from_numpy(ids).long(), output_hidden_states=True)
    return model, out.logits.float().numpy(), [h.float().numpy() for h in out.hidden_states]


def test_transformers_parity(target, golden, full):
    import transformers

    model, logits, hidden = hf_logits(G4 / "target", golden["input_ids"])
    assert isinstance(model, transformers.Gemma4ForCausalLM)
    np.testing.assert_allclose(full.logits, logits, atol=1e-4, rtol=0)
    np.testing.assert_allclose(full.hidden, hidden[-1], atol=hidden_tol(hidden[-1]), rtol=0)


def test_export_reloads_in_transformers(target, golden, full, tmp_path):
    cfg, params = target
    out = hf_checkpoint.save_target(params, cfg, tmp_path / "export", tokenizer_dir=G4 / "target")
    _, logits, _ = hf_logits(out, golden["input_ids"])
    np.testing.assert_allclose(logits, full.logits, atol=1e-4, rtol=0)
    cfg2, params2 = hf_checkpoint.load_target(out, target_layer_ids=TAPS)
    assert cfg2 == cfg
    jax.tree.map(np.testing.assert_array_equal, params2, params)


def test_bfloat16_round_trip(target, tmp_path):
    """bf16 export: transformers loads bf16 tensors equal to ours; reloading gives them back."""
    import torch
    import transformers

    cfg, params = target
    bf16 = dataclasses.replace(cfg, dtype="bfloat16")  # every tensor is written in bf16
    cast = jax.tree.map(lambda a, info: a.astype(jnp.bfloat16).astype(info.dtype), params,
                        tmodel.target_spec(bf16))  # matrices bf16, norms float32 of bf16 values
    out = hf_checkpoint.save_target(cast, bf16, tmp_path / "bf16")
    model = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager")
    assert model.dtype == torch.bfloat16
    state = model.state_dict()
    for key, ours in hf_checkpoint.iter_torch_tensors(cast, hf_checkpoint.target_key_map(bf16)):
        np.testing.assert_array_equal(state[key].float().numpy(), np.asarray(ours, np.float32),
                                      err_msg=key)
    cfg2, params2 = hf_checkpoint.load_target(out, target_layer_ids=TAPS)
    assert cfg2 == bf16 and params2["sliding"]["wq"].dtype == jnp.bfloat16
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a, np.float32),
                                                            np.asarray(b, np.float32)), params2, cast)


def test_multimodal_checkpoint_reads_the_text_model(target, tmp_path):
    """model_type gemma4: the text config under text_config, weights under model.language_model.,
    the towers' tensors beside them ignored."""
    cfg, params = target
    d = tmp_path / "multimodal"
    d.mkdir()
    text = json.loads((G4 / "target" / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({"model_type": "gemma4", "text_config": text,
                                               "architectures": ["Gemma4ForConditionalGeneration"]}))
    tensors = {k.replace("model.", "model.language_model.", 1): v
               for k, v in load_file(G4 / "target" / "model.safetensors").items()}
    tensors["model.vision_tower.proj.weight"] = np.zeros((2, 2), np.float32)
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    cfg2, params2 = hf_checkpoint.load_target(d, target_layer_ids=TAPS)
    assert cfg2 == cfg
    jax.tree.map(np.testing.assert_array_equal, params2, params)


def test_multimodal_refusal_names_the_text_config_field():
    text = json.loads((G4 / "target" / "config.json").read_text()) | {"enable_moe_block": True}
    with pytest.raises(CheckpointError, match=r"^mm/config\.json: text_config\.enable_moe_block is true"):
        hf_checkpoint.config_from_hf({"model_type": "gemma4", "text_config": text}, "mm/config.json")


def test_stray_rope_keys_and_all_full_layer_types():
    """The DeepSpec drafter's config (a gemma4_text config): a stray top-level rope_type and
    rope_theta beside the per-type entries, every layer full."""
    hf = json.loads((G4 / "drafter" / "config.json").read_text())
    cfg = hf_checkpoint.config_from_hf(hf, "drafter/config.json")
    assert cfg.full_layers == tuple(range(5)) and cfg.full_rope_theta == 1e6
    assert cfg.partial_rotary_factor == 0.25 and not cfg.tie_word_embeddings


# ----------------------------------------------------------------------------- refused configs

REFUSED = [
    ("hidden_size_per_layer_input", 256, "per-layer inputs"),
    ("enable_moe_block", True, "mixture-of-experts"),
    ("num_kv_shared_layers", 2, "KV sharing"),
    ("use_double_wide_mlp", True, "double-wide MLP"),
    ("use_bidirectional_attention", "all", "causal"),
    ("attention_bias", True, "biases"),
    ("hidden_activation", "gelu", "gelu_pytorch_tanh"),
    ("attn_logit_softcapping", 50.0, "soft-capping"),
    ("rope_parameters.full_attention.rope_type", "yarn", "supported 'default' and 'proportional'"),
    ("rope_parameters.sliding_attention.rope_type", "proportional", "supported 'default'"),
    ("hidden_size_per_layer_input", None, "absent means transformers' 256"),  # None: key removed
]


@pytest.mark.parametrize("key,value,why", REFUSED, ids=[f"{k}={v}" for k, v, _ in REFUSED])
def test_unsupported_config_is_refused(tmp_path, key, value, why):
    hf = json.loads((G4 / "target" / "config.json").read_text())
    *parents, last = key.split(".")
    node = hf
    for p in parents:
        node = node[p]
    if value is None:
        del node[last]
    else:
        node[last] = value
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(hf))
    with pytest.raises(CheckpointError) as err:
        hf_checkpoint.load_target_config(d)
    message = str(err.value)
    assert message.startswith(str(d / "config.json")) and "\n" not in message
    assert key in message and why in message


# ----------------------------------------------------------------------------- sharding


@pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 (fake) devices")
def test_tensor_parallel_mesh_matches_one_device(target, sequences):
    """(data 2, tensor 2): sliding layers' 2 KV heads split over tensor, the full layers' single KV
    head replicated; prefill logits and every cache array equal the single-device run."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from dspark_jax.config import MeshConfig
    from dspark_jax.sharding import logical_to_spec, make_mesh

    cfg, _ = target
    seqs, lengths = sequences
    ref = prefill(target, seqs, lengths)
    mesh = make_mesh(MeshConfig(data=2, fsdp=1, tensor=2), jax.devices()[:4])
    _, sharded = hf_checkpoint.load_target(G4 / "target", mesh=mesh, target_layer_ids=TAPS)
    assert sharded["sliding"]["wk"].sharding.spec == P(None, "fsdp", "tensor", None)
    assert sharded["full"]["wk"].sharding.spec == P(None, "fsdp", None, None)
    cache = tmodel.new_cache(cfg, ROWS, MAX_LEN, max_step=MAX_STEP)
    shard = jax.tree.map(lambda axes: NamedSharding(mesh, logical_to_spec(axes)), cache.logical_axes(),
                         is_leaf=lambda x: isinstance(x, tuple))
    assert shard.full_k.spec == P(None, ("data", "fsdp"), None, None, None)
    assert shard.ring_k.spec == P(None, ("data", "fsdp"), None, "tensor", None)
    cache = jax.device_put(cache, shard)
    padded = np.zeros((ROWS, PREFILL), np.int32)
    padded[:] = seqs[:, :PREFILL]
    pos = jnp.broadcast_to(jnp.arange(PREFILL), (ROWS, PREFILL))
    batch = NamedSharding(mesh, P("data"))
    out = FORWARD(sharded, cfg, jax.device_put(jnp.asarray(padded), batch), jax.device_put(pos, batch),
                  cache=cache, valid=jax.device_put(pos < jnp.asarray(lengths)[:, None], batch))
    # our own path against our own (the tensor split sums in other orders): 1.1e-4 seen under load
    np.testing.assert_allclose(out.logits, ref.logits, atol=SELF_TOL, rtol=0)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=SELF_TOL, rtol=0), out.cache, ref.cache)


# ----------------------------------------------------------------------------- engine


def test_plain_engine_decoding_equals_transformers_generate(target, golden):
    """The engine without a drafter, greedy, on prompts longer than the window; one slot for three
    requests, so a slot is reused while its ring still holds the previous request's keys (rows at
    different lengths side by side are `forward_flat`'s test above; a second slot would cost a
    second round program); stop ids <eos> and <turn|> as transformers' generation config has them."""
    import torch
    import transformers

    from dspark_jax.decoding.engine import Engine, Request

    cfg, params = target
    rng = np.random.default_rng(11)
    prompts = [golden["input_ids"][0, :12]] + [rng.integers(10, 320, size=n) for n in (25, 17)]
    reqs = [Request(id=str(i), prompt_ids=tuple(int(t) for t in p), max_new_tokens=20, stop_ids=(1, 6))
            for i, p in enumerate(prompts)]
    engine = Engine(cfg, params, slots=1, max_len=48, prefill_buckets=(48,), max_prefill_batch=1)
    results = {}
    engine.generate(reqs, lambda r: results.__setitem__(r.id, r))
    model = transformers.AutoModelForCausalLM.from_pretrained(
        G4 / "target", dtype=torch.float32, attn_implementation="eager").eval()
    for req, prompt in zip(reqs, prompts):
        with torch.no_grad():
            ids = model.generate(torch.from_numpy(prompt[None]).long(), max_new_tokens=20,
                                 do_sample=False)[0, len(prompt):].tolist()
        assert results[req.id].token_ids == ids, req.id
    assert engine.compilations_after_warmup == 0
