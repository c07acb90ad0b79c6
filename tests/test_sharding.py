"""On 8 fake CPU devices with a (data, tensor) mesh, the sharded target equals the single-device one."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dspark_jax.config import MeshConfig
from dspark_jax.errors import ConfigError
from dspark_jax.formats import hf_checkpoint
from dspark_jax.models.target import KVCache, forward, target_spec
from dspark_jax.params import init_params
from dspark_jax.sharding import logical_to_spec, make_mesh, named_sharding

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (fake) devices")


@pytest.fixture(scope="module")
def model(hf_models):
    d = hf_models(seed=3, heads=4, kv_heads=2, head_dim=8, vocab=96, hidden=32)
    return d, *hf_checkpoint.load_target(d, target_layer_ids=[0, 1])


def test_rules_and_conflicts():
    assert logical_to_spec(("layers", "embed", "heads", "head_dim")) == P(None, "fsdp", "tensor", None)
    assert logical_to_spec(("batch", "seq")) == P(("data", "fsdp"), None)
    with pytest.raises(ConfigError, match="onto mesh axis 'tensor'"):
        logical_to_spec(("heads", "mlp"))
    with pytest.raises(ConfigError, match="logical axis 'bogus' has no sharding rule"):
        logical_to_spec(("bogus",))
    mesh = make_mesh(MeshConfig(data=2, fsdp=1, tensor=4))
    with pytest.raises(ConfigError, match=r"layers/wk: dimension 2 \(kv_heads, size 2\) is not divisible"):
        named_sharding(mesh, ("layers", "embed", "kv_heads", "head_dim"), (3, 32, 2, 8), "layers/wk")
    with pytest.raises(ConfigError, match="need 24 devices"):
        make_mesh(MeshConfig(data=3, fsdp=2, tensor=4))


def test_sharded_load_and_forward_match_single_device(model):
    d, cfg, params = model
    mesh = make_mesh(MeshConfig(data=4, fsdp=1, tensor=2))
    _, sharded = hf_checkpoint.load_target(d, mesh=mesh, target_layer_ids=[0, 1])
    wq = sharded["layers"]["wq"]
    assert wq.sharding.spec == P(None, "fsdp", "tensor", None)
    assert wq.addressable_shards[0].data.shape == (3, 32, 2, 8)  # half the heads per device
    assert sharded["embed"].addressable_shards[0].data.shape == (48, 32)  # half the vocabulary

    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, size=(8, 9))
    pos = np.broadcast_to(np.arange(9), ids.shape)
    step = jax.jit(forward, static_argnums=1, static_argnames="compute_logits")
    ref = step(params, cfg, jnp.asarray(ids), jnp.asarray(pos), cache=KVCache.create(cfg, 8, 16))

    batch = NamedSharding(mesh, P("data"))
    cache = KVCache.create(cfg, 8, 16)
    cache = jax.device_put(cache, NamedSharding(mesh, P(None, "data", None, "tensor", None)))
    out = step(sharded, cfg, jax.device_put(jnp.asarray(ids), batch),
               jax.device_put(jnp.asarray(pos), batch), cache=cache)
    assert out.logits.sharding.num_devices == 8
    np.testing.assert_allclose(out.logits, ref.logits, atol=2e-5, rtol=0)
    np.testing.assert_allclose(out.taps, ref.taps, atol=2e-5, rtol=0)
    np.testing.assert_allclose(out.cache.k, ref.cache.k, atol=2e-5, rtol=0)


def test_random_init_is_created_sharded():
    from dspark_jax.config import TargetConfig
    cfg = TargetConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    params = init_params(target_spec(cfg), jax.random.key(0), mesh)
    w = params["layers"]["w_gate"]
    assert w.sharding.spec == P(None, "fsdp", "tensor")
    assert w.addressable_shards[0].data.shape == (2, 16, 32)
    single = init_params(target_spec(cfg), jax.random.key(0))
    jax.tree.map(np.testing.assert_array_equal, params, single)
