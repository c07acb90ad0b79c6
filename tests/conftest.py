"""Shared fixtures. Eight fake CPU devices for the sharding tests; tiny random Qwen3 checkpoints
written by transformers' own `save_pretrained`, so our loader is tested against the real format."""

import os
from importlib.metadata import version

# XLA:CPU compiling fast rather than well: the tests run tiny models, so compiling their programs
# is most of the suite's time. Its LLVM back end without the costly passes, and the legacy
# elemental emitters in place of the MLIR fusion emitters, cut it by more than half
# (tests/test_engine.py alone: 508 CPU seconds with XLA's defaults, 339 with the first two flags,
# 221 with the third). No fast-math either way; the emitters' exp and log may differ from the
# defaults' in the last bits, which no test depends on (each compares within one process, or
# against torch and the golden tensors within tolerances). Subprocesses get the same (`xla_flags`).
FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
if version("jaxlib").startswith("0.10."):
    # measured on jaxlib 0.10; an unknown flag in XLA_FLAGS is fatal, and this switch may go away
    # with the legacy emitters, so other versions go without it
    FAST_COMPILE += " --xla_cpu_use_fusion_emitters=false"


def xla_flags(devices: int) -> str:
    """XLA_FLAGS for a test process (or subprocess) with `devices` fake CPU devices."""
    return f"--xla_force_host_platform_device_count={devices} {FAST_COMPILE}"


os.environ.setdefault("XLA_FLAGS", xla_flags(8))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent compilation cache per test session (outside the repo), shared with the
# subprocesses that the command-line tests start, so identical programs compile once.
import tempfile  # noqa: E402

os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", tempfile.mkdtemp(prefix="dspark-jax-cache-"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
# SPS profiles that engines measure at start-up are cached under the user's cache directory: keep
# the tests' own out of the real one, one directory for the whole session (the xdist workers and
# the subprocesses inherit it from the process that made it), so each profile is measured once.
os.environ.setdefault("DSPARK_TEST_CACHE_HOME", tempfile.mkdtemp(prefix="dspark-jax-xdg-"))
os.environ["XDG_CACHE_HOME"] = os.environ["DSPARK_TEST_CACHE_HOME"]

from pathlib import Path

import pytest

SHARED = Path(__file__).resolve().parents[2] / "shared"


def gloo_available() -> bool:
    """Whether this jaxlib has gloo CPU collectives (what the multi-process CPU tests need)."""
    try:
        from jax._src.lib import _jax
    except ImportError:  # pragma: no cover - other jaxlib layouts
        return False
    return hasattr(_jax, "make_gloo_tcp_collectives")
GOLDEN = SHARED / "reference" / "golden"


def built_once(tmp_path_factory, name: str, build) -> Path:
    """The directory `name` that `build(directory)` fills, built once per test session: the xdist
    workers share the session's base temporary directory, and the first worker to ask builds it
    under a file lock while the others wait (the trained fixtures cost a minute each on 2 cores).
    A build that failed (no marker) is retried by the next worker to ask."""
    import fcntl
    import shutil

    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # the session's directory, above each worker's own
    directory, done = base / name, base / f"{name}.done"
    with open(base / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            shutil.rmtree(directory, ignore_errors=True)
            directory.mkdir()
            build(directory)
            done.touch()
    return directory


def make_hf_qwen3(directory: Path, *, seed: int = 0, vocab: int = 96, hidden: int = 32,
                  layers: int = 3, heads: int = 4, kv_heads: int = 2, head_dim: int = 8,
                  intermediate: int = 48, tied: bool = False, max_shard_size=None) -> Path:
    """Saves a random float32 Qwen3ForCausalLM with transformers; norm weights randomised too."""
    import torch
    import transformers

    torch.manual_seed(seed)
    config = transformers.Qwen3Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=head_dim, tie_word_embeddings=tied, max_position_embeddings=256,
        rms_norm_eps=1e-6, rope_theta=10000.0, initializer_range=0.2, eos_token_id=2,
        attn_implementation="eager")
    model = transformers.Qwen3ForCausalLM(config).to(torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(0.5 + torch.rand_like(p))
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(directory, **kwargs)
    return directory


@pytest.fixture(scope="session")
def hf_models(tmp_path_factory):
    """Factory of cached tiny HF checkpoints keyed by their arguments."""
    cache = {}

    def get(**kwargs):
        key = tuple(sorted(kwargs.items()))
        if key not in cache:
            d = tmp_path_factory.mktemp("hf_qwen3")
            cache[key] = make_hf_qwen3(d, **kwargs)
        return cache[key]

    return get


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory):
    """(target dir, data file): a random Qwen3 with the `tiny` preset's shapes, a BPE tokenizer
    trained on synthetic chat data (mask token id 3, as the preset says), and that data."""
    import json

    from dspark_jax.config import load_config, preset_path
    from dspark_jax.training.synthetic import write_synthetic_conversations

    def build(root: Path) -> None:
        data = write_synthetic_conversations(root / "train.jsonl", 96, seed=0)
        texts = [m["content"] for line in data.read_text().splitlines()
                 for m in json.loads(line)["conversations"]]
        t = load_config(preset_path("tiny")).target
        target = make_hf_qwen3(root / "target", seed=11, vocab=t.vocab_size, hidden=t.hidden_size,
                               layers=t.num_hidden_layers, heads=t.num_attention_heads,
                               kv_heads=t.num_key_value_heads, head_dim=t.head_dim,
                               intermediate=t.intermediate_size)
        cfg = json.loads((target / "config.json").read_text())
        cfg["rope_parameters"]["rope_theta"] = t.rope_theta
        cfg["max_position_embeddings"] = t.max_position_embeddings
        (target / "config.json").write_text(json.dumps(cfg))
        from dspark_jax.formats.tokenizer import train_bpe_tokenizer

        train_bpe_tokenizer(texts, t.vocab_size, target)
        # Stop ids as Qwen3's own generation_config lists them: <|im_end|> (2) ends a chat turn,
        # <|endoftext|> (0) a document.
        gen = json.loads((target / "generation_config.json").read_text())
        (target / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": [2, 0]}))
        fit_on_data(target, data, t, steps=300)

    root = built_once(tmp_path_factory, "tiny_target", build)
    return root / "target", root / "train.jsonl"


@pytest.fixture(scope="session")
def tiny_cache(tiny_target, tmp_path_factory):
    """A tokenized cache (3 shards) of `tiny_target`'s data, made with the dspark-tiny preset's
    settings: a run may read it in place of the JSONL file."""
    from dspark_jax.config import load_config, preset_path
    from dspark_jax.training.token_cache import tokenize_corpus

    target, data = tiny_target
    cfg = load_config(preset_path("dspark-tiny"))
    out = tmp_path_factory.mktemp("tiny_cache") / "cache"
    tokenize_corpus(target, [data], out, max_length=cfg.train.max_length,
                    min_length=cfg.drafter.proposal_length + 1, system_prompt=cfg.train.system_prompt,
                    enable_thinking=cfg.train.enable_thinking, shard_lines=32)
    return out


def fit_on_data(target: Path, data: Path, t, steps: int) -> Path:
    """Trains the random target on the data (next-token CE) and saves it back in place."""
    from dspark_jax.formats import hf_checkpoint
    from dspark_jax.formats.tokenizer import load_tokenizer
    from dspark_jax.training.data import BatchIterator, load_conversations
    from dspark_jax.training.pretrain import fit_target

    cfg, params = hf_checkpoint.load_target(target, target_layer_ids=list(t.target_layer_ids),
                                            mask_token_id=t.mask_token_id)
    ds = load_conversations(data, load_tokenizer(target), max_length=64, min_length=5,
                            system_prompt="")  # as the dspark-tiny preset
    batches = BatchIterator(ds, global_batch_size=16, num_anchors=1, block_size=4, seed=1)
    params, _ = fit_target(params, cfg, iter(batches), steps)
    hf_checkpoint.save_target(params, cfg, target)
    return target


@pytest.fixture(scope="session")
def tiny_pair(tiny_target, tmp_path_factory):
    """(target dir, training workdir, exported DeepSpec drafter dir): a dspark-tiny drafter trained
    150 steps against `tiny_target`, shared by the engine and decode tests."""
    from dspark_jax.config import load_config, preset_path
    from dspark_jax.formats import deepspec
    from dspark_jax.training import trainer

    target, data = tiny_target

    def build(root: Path) -> None:
        cfg = load_config(preset_path("dspark-tiny"), [
            f"train.target_dir={target}", f"train.data_file={data}", f"train.workdir={root / 'run'}",
            "train.max_steps=150", "train.checkpoint_every=100000", "mesh.data=1"])
        assert trainer.run(cfg)["step"] == 150
        cfg, params, _ = trainer.load_drafter_params(root / "run")
        _, target_params = trainer.load_target_for(cfg, None)
        deepspec.save_drafter(params, cfg.target, cfg.drafter, target_params, root / "drafter")

    root = built_once(tmp_path_factory, "tiny_pair", build)
    return target, root / "run", root / "drafter"


@pytest.fixture(scope="session")
def engine_pair(tiny_pair):
    """(tcfg, target params, dcfg, trained drafter params, random drafter params, tokenizer) of the
    session's tiny trained pair, loaded once."""
    import jax

    from dspark_jax.formats import hf_checkpoint
    from dspark_jax.formats.tokenizer import load_tokenizer
    from dspark_jax.models.drafter import drafter_spec
    from dspark_jax.params import init_params
    from dspark_jax.training import trainer

    target, work, _ = tiny_pair
    cfg, dparams, _ = trainer.load_drafter_params(work)
    tcfg, tparams = hf_checkpoint.load_target(target, target_layer_ids=list(cfg.target.target_layer_ids),
                                              mask_token_id=cfg.target.mask_token_id)
    random = init_params(drafter_spec(tcfg, cfg.drafter), jax.random.key(7))
    return tcfg, tparams, cfg.drafter, dparams, random, load_tokenizer(target)
