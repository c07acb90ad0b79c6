"""Shared fixtures. Eight fake CPU devices for the sharding tests; tiny random Qwen3 checkpoints
written by transformers' own `save_pretrained`, so our loader is tested against the real format."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from pathlib import Path

import pytest

SHARED = Path(__file__).resolve().parents[2] / "shared"
GOLDEN = SHARED / "reference" / "golden"


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
