"""LoRA adapters (refusion_jax.lora): PEFT folders read and written, merged weights equal
the adapter run live through qwix, and an adapter for another base is one clear error."""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from refusion_jax import config as config_lib, hf, lora
from refusion_jax.model import Transformer


def _config(**overrides):
  base = dict(num_layers=2, vocab_size=48, hidden_size=32, num_heads=4, num_kv_heads=2,
              head_dim=8, mlp_dim=48, tie_embeddings=False, mask_token_id=3,
              attention="bidirectional", model_type="llada", max_position_embeddings=64)
  base.update(overrides)
  return config_lib.tiny(**base)


def _hf_linear_shape(config, proj):
  """The HF Linear weight `[out, in]` of an attention projection."""
  q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
  return {"q_proj": (q, config.hidden_size), "k_proj": (kv, config.hidden_size),
          "v_proj": (kv, config.hidden_size), "o_proj": (config.hidden_size, q)}[proj]


def _random_adapter(config, rank=4, alpha=8.0, seed=0, projections=lora.PROJECTIONS):
  rng = np.random.default_rng(seed)
  tensors = {}
  for layer in range(config.num_layers):
    for proj in projections:
      out_dim, in_dim = _hf_linear_shape(config, proj)
      tensors[layer, proj] = (rng.normal(0, 0.3, (rank, in_dim)).astype(np.float32),
                              rng.normal(0, 0.3, (out_dim, rank)).astype(np.float32))
  return lora.Adapter(rank=rank, alpha=alpha, tensors=tensors)


def _logits(model, ids):
  pos = jnp.broadcast_to(jnp.arange(ids.shape[1])[None], ids.shape)
  return np.asarray(model(ids, pos))


IDS = jnp.asarray([[5, 9, 17, 3, 3, 3, 4, 8]], jnp.int32)


@pytest.mark.parametrize("model_type", ["llada", "qwen3"])
def test_merged_weights_equal_the_adapter_run_live(model_type, tmp_path):
  config = _config(model_type=model_type)
  base = Transformer(config, rngs=nnx.Rngs(0))
  adapter = _random_adapter(config)
  lora.save_adapter(tmp_path / "a", config, adapter, base_model="tiny")
  read = lora.read_adapter(tmp_path / "a", config)
  assert (read.rank, read.alpha, sorted(read.tensors)) == (4, 8.0, sorted(adapter.tensors))
  for k, (a, b) in adapter.tensors.items():
    np.testing.assert_array_equal(read.tensors[k][0], a)
    np.testing.assert_array_equal(read.tensors[k][1], b)
  live = lora.apply(base, read.rank, read.alpha)
  before = _logits(live, IDS)
  np.testing.assert_allclose(before, _logits(base, IDS), atol=1e-6)  # B starts at zero
  lora.load_into(live, read)
  merged = lora.merge(Transformer(config, rngs=nnx.Rngs(0)), read)
  got, want = _logits(merged, IDS), _logits(live, IDS)
  assert np.abs(want - before).max() > 0.1  # the adapter changes the model
  np.testing.assert_allclose(got, want, atol=2e-5)
  # A hand restatement of the merge for one projection: W_hf + (alpha / r) B A.
  w_hf = np.asarray(base.layers[1].attn.o_proj[...]).transpose(2, 0, 1).reshape(32, 32)
  a, b = read.tensors[1, "o_proj"]
  merged_hf = np.asarray(merged.layers[1].attn.o_proj[...]).transpose(2, 0, 1).reshape(32, 32)
  np.testing.assert_allclose(merged_hf, w_hf + 2.0 * b @ a, atol=1e-5)
  # extract() reads the live parameters back in PEFT's layout.
  back = lora.extract(live, read.alpha)
  for k, (a, b) in read.tensors.items():
    np.testing.assert_allclose(back.tensors[k][0], a, atol=1e-7)
    np.testing.assert_allclose(back.tensors[k][1], b, atol=1e-7)


def test_adapter_tensor_names_follow_the_family(tmp_path):
  for model_type, name in (("llada", "base_model.model.model.transformer.blocks.0.attn_out"),
                           ("qwen3", "base_model.model.model.layers.0.self_attn.o_proj")):
    config = _config(model_type=model_type)
    lora.save_adapter(tmp_path / model_type, config, _random_adapter(config))
    header = hf.read_safetensors(str(tmp_path / model_type / lora.ADAPTER_WEIGHTS))
    assert f"{name}.lora_A.weight" in header and f"{name}.lora_B.weight" in header
    cfg = json.loads((tmp_path / model_type / lora.ADAPTER_CONFIG).read_text())
    assert cfg["peft_type"] == "LORA" and cfg["r"] == 4 and cfg["lora_alpha"] == 8.0


def _edit_config(path, **changes):
  cfg = json.loads((path / lora.ADAPTER_CONFIG).read_text())
  cfg.update(changes)
  (path / lora.ADAPTER_CONFIG).write_text(json.dumps(cfg))


def test_bad_adapters_are_one_clear_line(tmp_path):
  config = _config()
  path = tmp_path / "a"
  lora.save_adapter(path, config, _random_adapter(config))
  # An adapter for another base: its shapes do not fit.
  with pytest.raises(ValueError, match=r"an adapter for another base"):
    lora.read_adapter(path, config.replace(hidden_size=48))
  with pytest.raises(ValueError, match=r"layer 1, but the model has 1"):
    lora.read_adapter(path, config.replace(num_layers=1))
  _edit_config(path, r=8)
  with pytest.raises(ValueError, match=r"but r=8"):
    lora.read_adapter(path, config)
  _edit_config(path, r=4, lora_alpha=0)
  with pytest.raises(ValueError, match="lora_alpha must be a positive number"):
    lora.read_adapter(path, config)
  _edit_config(path, lora_alpha=8, use_dora=True)
  with pytest.raises(ValueError, match="use_dora=True is not supported"):
    lora.read_adapter(path, config)
  _edit_config(path, use_dora=False, target_modules=["ff_proj"])
  with pytest.raises(ValueError, match=r"target_modules \['ff_proj'\] are not attention"):
    lora.read_adapter(path, config)
  with pytest.raises(FileNotFoundError, match="does not exist"):
    lora.read_adapter(tmp_path / "nowhere", config)
  os.remove(path / lora.ADAPTER_WEIGHTS)
  with pytest.raises(FileNotFoundError, match="has no adapter_model.safetensors"):
    lora.read_adapter(path, config)


def test_scanned_layers_are_refused():
  config = _config(scan_layers=True)
  model = Transformer(config, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="scanned layers is not supported"):
    lora.apply(model, 4, 8.0)
  with pytest.raises(ValueError, match="scanned layers is not supported"):
    lora.merge(model, _random_adapter(_config()))
