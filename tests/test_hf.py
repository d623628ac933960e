"""HF checkpoint I/O: safetensors round trips, shards, meshes, bf16, config.json, errors.

Files are inspected with the `safetensors` library itself (an independent
reader/writer), and logits are checked against the transformers goldens of
the committed fixture tests/fixtures/hf_tiny.
"""

import json
import os
import re
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from refusion_jax import checkpoint, config as config_lib, hf, loading, sharding
from refusion_jax.model import Transformer

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "hf_tiny")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Qwen3, Qwen2 (Qwen2.5) and Llama (Llama-3; llama31: 3.1's RoPE scaling) layouts.
NAMES = ("gqa", "tied", "qwen2_gqa", "qwen2_tied", "llama_gqa", "llama31")


def _tensors(folder):
  """Every tensor of a HF folder, read with the safetensors library."""
  index = os.path.join(folder, hf.INDEX_FILE)
  if os.path.exists(index):
    with open(index) as f:
      files = sorted(set(json.load(f)["weight_map"].values()))
  else:
    files = [hf.SAFETENSORS_FILE]
  out = {}
  for name in files:
    with safe_open(os.path.join(folder, name), framework="numpy") as f:
      for key in f.keys():
        assert key not in out
        out[key] = f.get_tensor(key)
  return out


def _assert_same_tensors(a, b):
  assert sorted(a) == sorted(b)
  for key in a:
    assert a[key].dtype == b[key].dtype, key
    assert a[key].shape == b[key].shape, key
    assert a[key].tobytes() == b[key].tobytes(), key


def _copy_fixture(tmp_path, name="gqa"):
  dst = tmp_path / name
  shutil.copytree(os.path.join(FIXTURES, name), dst)
  return dst


def _logits(model, golden, kind="perm"):
  return np.asarray(model(golden["input_ids"], golden[f"positions_{kind}"]))


@pytest.mark.parametrize("name", NAMES)
def test_load_save_is_byte_identical(tmp_path, name):
  config, model = hf.load(os.path.join(FIXTURES, name))
  hf.save(config, model, tmp_path / "out")
  assert sorted(os.listdir(tmp_path / "out")) == ["config.json", "model.safetensors"]
  _assert_same_tensors(_tensors(os.path.join(FIXTURES, name)), _tensors(tmp_path / "out"))
  # The written config.json describes the same model.
  assert config_lib.from_hf_config(tmp_path / "out") == config


def test_layout_against_independent_transpose():
  # Hand mapping of one tensor of each kind (HF Linear weight is [out, in]).
  config, model = hf.load(os.path.join(FIXTURES, "gqa"))
  ref = _tensors(os.path.join(FIXTURES, "gqa"))
  d, n, k, h = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
  attn = model.layers[1].attn
  q = ref["model.layers.1.self_attn.q_proj.weight"]  # [n*h, d]
  for head in range(n):
    np.testing.assert_array_equal(np.asarray(attn.q_proj[...])[:, head, :],
                                  q[head * h:(head + 1) * h, :].T)
  kw = ref["model.layers.1.self_attn.k_proj.weight"]
  np.testing.assert_array_equal(np.asarray(attn.k_proj[...])[:, k - 1, :], kw[(k - 1) * h:, :].T)
  o = ref["model.layers.1.self_attn.o_proj.weight"]  # [d, n*h]
  np.testing.assert_array_equal(np.asarray(attn.o_proj[...])[n - 1], o[:, (n - 1) * h:].T)
  np.testing.assert_array_equal(np.asarray(model.layers[0].mlp.down_proj[...]),
                                ref["model.layers.0.mlp.down_proj.weight"].T)
  np.testing.assert_array_equal(np.asarray(model.lm_head[...]), ref["lm_head.weight"].T)
  np.testing.assert_array_equal(np.asarray(attn.k_norm.scale[...]),
                                ref["model.layers.1.self_attn.k_norm.weight"])
  assert d == 64


@pytest.mark.parametrize("name", NAMES)
def test_sharded_save_and_load(tmp_path, name):
  folder = os.path.join(FIXTURES, name)
  config, model = hf.load(folder)
  limit = 40_000
  hf.save(config, model, tmp_path / "out", max_shard_bytes=limit)
  files = sorted(f for f in os.listdir(tmp_path / "out") if f.endswith(".safetensors"))
  assert len(files) > 2 and hf.SAFETENSORS_FILE not in files
  assert files[0] == f"model-00001-of-{len(files):05d}.safetensors"
  with open(tmp_path / "out" / hf.INDEX_FILE) as f:
    index = json.load(f)
  original = _tensors(folder)
  assert sorted(index["weight_map"]) == sorted(original)
  assert index["metadata"]["total_size"] == sum(t.nbytes for t in original.values())
  for file_name in files:
    shard = load_file(tmp_path / "out" / file_name)
    assert all(index["weight_map"][key] == file_name for key in shard)
    # Over the limit only when a single tensor alone is bigger than it.
    assert sum(t.nbytes for t in shard.values()) <= limit or len(shard) == 1
  _assert_same_tensors(original, _tensors(tmp_path / "out"))
  config2, model2 = hf.load(tmp_path / "out")
  assert config2 == config
  golden = np.load(os.path.join(folder, "golden.npz"))
  np.testing.assert_array_equal(_logits(model2, golden), _logits(model, golden))


@pytest.mark.parametrize("name", NAMES)
def test_load_onto_mesh_matches_unsharded(name):
  folder = os.path.join(FIXTURES, name)
  mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
  config, model = hf.load(folder, mesh=mesh)
  q = model.layers[0].attn.q_proj[...]
  assert q.sharding.mesh.shape == {"data": 2, "fsdp": 2, "tensor": 2}
  assert q.sharding.spec[:2] == ("fsdp", "tensor")
  assert len({repr(s.index) for s in q.addressable_shards}) == 4  # really split, not replicated
  _, plain = hf.load(folder)
  golden = np.load(os.path.join(folder, "golden.npz"))
  with sharding.use_mesh(mesh):
    sharded = np.asarray(jax.jit(lambda m, i, p: m(i, p))(
        model, golden["input_ids"], golden["positions_perm"]))
  assert np.abs(sharded - _logits(plain, golden)).max() <= 1e-5
  assert np.abs(sharded - golden["logits_perm"]).max() <= 1e-4


def _write_bf16_copy(src, dst):
  """A bf16 checkpoint written by the safetensors library (not by hf.save)."""
  os.makedirs(dst)
  with open(os.path.join(src, "config.json")) as f:
    cfg = json.load(f)
  cfg.pop("dtype", None)
  cfg["torch_dtype"] = "bfloat16"
  with open(os.path.join(dst, "config.json"), "w") as f:
    json.dump(cfg, f)
  tensors = load_file(os.path.join(src, hf.SAFETENSORS_FILE))
  bf16 = {k: v.astype(ml_dtypes.bfloat16) for k, v in tensors.items()}
  save_file(bf16, os.path.join(dst, hf.SAFETENSORS_FILE), metadata={"format": "pt"})
  return tensors, bf16


def test_bf16_checkpoint(tmp_path):
  src = os.path.join(FIXTURES, "gqa")
  f32, bf16 = _write_bf16_copy(src, tmp_path / "bf16")
  config, model = hf.load(tmp_path / "bf16")
  assert config.param_dtype == "bfloat16"
  assert model.embed[...].dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(model.embed[...]), bf16["model.embed_tokens.weight"])
  np.testing.assert_array_equal(np.asarray(model.layers[1].mlp.up_proj[...]),
                                bf16["model.layers.1.mlp.up_proj.weight"].T)
  # Upcast on load is exact; downcast of a float32 file rounds like ml_dtypes.
  _, model32 = hf.load(tmp_path / "bf16", dtype="float32")
  assert model32.embed[...].dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(model32.final_norm.scale[...]),
                                bf16["model.norm.weight"].astype(np.float32))
  _, down = hf.load(src, dtype=jnp.bfloat16)
  np.testing.assert_array_equal(np.asarray(down.embed[...]), bf16["model.embed_tokens.weight"])
  rounding = np.asarray(down.embed[...], np.float32) - f32["model.embed_tokens.weight"]
  assert np.abs(rounding).max() > 0
  # A bf16 model saves as BF16 tensors, bit for bit.
  hf.save(config, model, tmp_path / "again")
  _assert_same_tensors(_tensors(tmp_path / "bf16"), _tensors(tmp_path / "again"))
  with safe_open(tmp_path / "again" / hf.SAFETENSORS_FILE, framework="numpy") as f:
    assert f.metadata() == {"format": "pt"}


def test_bad_dtype_argument():
  with pytest.raises(ValueError, match="dtype must be one of"):
    hf.load(os.path.join(FIXTURES, "gqa"), dtype="int8")


def test_from_hf_config_variants():
  configs = os.path.join(FIXTURES, "configs")
  c4 = config_lib.from_hf_config(os.path.join(configs, "qwen3_4x.json"))
  assert (c4.vocab_size, c4.hidden_size, c4.num_layers, c4.num_heads, c4.num_kv_heads,
          c4.head_dim, c4.mlp_dim) == (151936, 1024, 28, 16, 8, 128, 3072)
  assert c4.rope_theta == 1e6 and c4.tie_embeddings and c4.param_dtype == "bfloat16"
  assert c4.eos_token_id == 151645 and c4.bos_token_id == 151643 and c4.mask_token_id is None
  c5 = config_lib.from_hf_config(os.path.join(configs, "qwen3_5x.json"))
  assert c5.rope_theta == 500000.0 and not c5.tie_embeddings and c5.param_dtype == "float32"
  assert (c5.num_layers, c5.mlp_dim, c5.pad_token_id) == (36, 12288, 151643)
  cr = config_lib.from_hf_config(os.path.join(configs, "refusion.json"))
  assert cr.vocab_size == 151671 and cr.mask_token_id == 151670 and cr.bos_token_id == 151669
  assert cr == config_lib.qwen3_8b(vocab_size=151671, mask_token_id=151670, bos_token_id=151669)
  # The fixtures' own configs (written by transformers 5.x).
  tied = config_lib.from_hf_config(os.path.join(FIXTURES, "tied"))
  assert tied.rope_theta == 10000.0 and tied.rms_eps == 1e-5 and tied.tie_embeddings
  # Qwen2.5-7B (transformers 4.x layout): biases, no q/k norm, head_dim = hidden / heads.
  q25 = config_lib.from_hf_config(os.path.join(configs, "qwen2_5_7b.json"))
  assert (q25.model_type, q25.qkv_bias, q25.qk_norm) == ("qwen2", True, False)
  assert (q25.vocab_size, q25.hidden_size, q25.num_layers, q25.num_heads, q25.num_kv_heads,
          q25.head_dim, q25.mlp_dim, q25.rope_theta) == (152064, 3584, 28, 28, 4, 128, 18944,
                                                         1e6)
  # 7.62B parameters, as Qwen2.5-7B's model card says (biases included).
  assert round(q25.num_params() / 1e9, 2) == 7.62
  assert q25 == config_lib.qwen2_5_7b(bos_token_id=151643, eos_token_id=151643,
                                      pad_token_id=None)
  assert config_lib.from_hf_config(config_lib.to_hf_config(q25)) == q25
  assert config_lib.to_hf_config(q25)["architectures"] == ["Qwen2ForCausalLM"]


@pytest.mark.parametrize("name", ["llama_gqa", "llama31"])
def test_llama_in_bfloat16_matches_transformers_in_bfloat16(name):
  # transformers' LlamaForCausalLM run in bfloat16 (weights and activations), as Llama-3
  # ships: ours in bfloat16 is as close to it as it is to its own float32 logits.
  folder = os.path.join(FIXTURES, name)
  _, model = hf.load(folder, dtype="bfloat16")
  golden = np.load(os.path.join(folder, "golden.npz"))
  ours = np.asarray(model(golden["input_ids"], golden["positions_perm"])).astype(np.float32)
  theirs = golden["logits_perm_bf16"]
  assert np.abs(ours - theirs).max() <= 0.05
  assert np.abs(theirs - golden["logits_perm"]).max() <= 0.05


def test_llama31_rope_scaling_is_read_and_matters():
  folder = os.path.join(FIXTURES, "llama31")
  config, model = hf.load(folder)
  assert (config.rope_scaling_factor, config.rope_low_freq_factor, config.rope_high_freq_factor,
          config.rope_original_max_positions) == (8.0, 1.0, 4.0, 32)
  # The oracle shows it: the same weights without the scaling give other logits.
  plain = Transformer(config.replace(rope_scaling_factor=0.0), rngs=nnx.Rngs(0))
  nnx.update(plain, nnx.state(model))
  golden = np.load(os.path.join(folder, "golden.npz"))
  assert np.abs(_logits(plain, golden) - golden["logits_perm"]).max() > 0.1
  assert np.abs(_logits(model, golden) - golden["logits_perm"]).max() <= 1e-4
  # Written back in transformers 4.x's layout (rope_scaling), read back the same.
  hf_config = config_lib.to_hf_config(config)
  assert hf_config["rope_scaling"] == {
      "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 32}
  assert hf_config["architectures"] == ["LlamaForCausalLM"]
  assert config_lib.from_hf_config(hf_config) == config


def test_llama3_and_31_config_files_are_the_presets():
  configs = os.path.join(FIXTURES, "configs")
  l3 = config_lib.from_hf_config(os.path.join(configs, "llama3_8b_instruct.json"))
  assert l3 == config_lib.llama3_8b()
  assert round(l3.num_params() / 1e9, 2) == 8.03  # Llama-3-8B's model card
  l31 = config_lib.from_hf_config(os.path.join(configs, "llama31_8b_instruct.json"))
  assert l31 == config_lib.llama3_8b(
      rope_scaling_factor=8.0, rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
      rope_original_max_positions=8192, max_position_embeddings=131072,
      eos_token_id=config_lib.LLAMA3_EOS_ID, stop_token_ids=(128008, 128009))
  # Llama 3.1's eos_token_id list [128001, 128008, 128009]: EOS first, the rest stop too.
  assert config_lib.to_hf_config(l31)["eos_token_id"] == [128001, 128008, 128009]
  assert not l31.qk_norm and not l31.qkv_bias and not l31.shift_logits


@pytest.mark.parametrize("changes, message", [
    ({"model_type": "mistral"},
     r"model_type='mistral' is not supported; supported: qwen3, qwen2, Dream, llama, llada"),
    ({"model_type": "llama", "attention_bias": True}, r"attention_bias=true"),
    ({"model_type": "llama", "mlp_bias": True}, r"mlp_bias=true"),
    ({"model_type": "llama", "hidden_act": "gelu"}, r"hidden_act='gelu'"),
    ({"model_type": "llama", "rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
     r"rope_scaling.rope_type='yarn' is not supported"),
    # A Llama-3.1 folder whose rope scaling lost its keys.
    ({"model_type": "llama", "rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
     r"rope_scaling has rope_type 'llama3' but lacks \['low_freq_factor', "
     r"'high_freq_factor', 'original_max_position_embeddings'\]"),
    ({"model_type": "qwen2", "use_sliding_window": True}, r"use_sliding_window=true"),
    ({"model_type": "qwen3", "attention_bias": True}, r"attention_bias=true"),
])
def test_other_families_are_named(changes, message):
  hf_config = config_lib.to_hf_config(config_lib.tiny())
  hf_config.update(changes)
  with pytest.raises(ValueError, match=message):
    config_lib.from_hf_config(hf_config)


def test_a_qwen3_folder_read_as_qwen2_names_every_mismatch(tmp_path):
  folder = _copy_fixture(tmp_path, "gqa")
  with open(folder / "config.json") as f:
    cfg = json.load(f)
  cfg.update(model_type="qwen2", architectures=["Qwen2ForCausalLM"])
  with open(folder / "config.json", "w") as f:
    json.dump(cfg, f)
  with pytest.raises(ValueError) as info:
    hf.load(folder)
  message = str(info.value)
  assert "unexpected tensor 'model.layers.0.self_attn.q_norm.weight' (a qwen2 model has none" \
      in message
  assert "missing tensor 'model.layers.1.self_attn.v_proj.bias'" in message
  assert "(10 problem(s))" in message  # 2 layers x (2 unexpected norms + 3 missing biases)


def test_vocab_size_comes_from_embedding(tmp_path):
  # ReFusion keeps a stale vocab_size in config.json after resizing the embedding.
  folder = _copy_fixture(tmp_path)
  with open(folder / "config.json") as f:
    cfg = json.load(f)
  cfg["vocab_size"] = 151936
  with open(folder / "config.json", "w") as f:
    json.dump(cfg, f)
  config, _ = hf.load(folder)
  assert config.vocab_size == 128
  # Read without the weights (the server checks its tokenizer against it first).
  assert hf.read_config(folder) == config
  assert loading.read_model_config(str(folder)) == config


# ---------------------------------------------------------------- errors


def test_error_nonexistent_directory(tmp_path):
  with pytest.raises(FileNotFoundError, match="does not exist"):
    hf.load(tmp_path / "nowhere")


def test_error_missing_config(tmp_path):
  folder = _copy_fixture(tmp_path)
  os.remove(folder / "config.json")
  with pytest.raises(FileNotFoundError, match="no config.json"):
    hf.load(folder)


def test_error_no_safetensors(tmp_path):
  folder = _copy_fixture(tmp_path)
  os.rename(folder / "model.safetensors", folder / "model-00001-of-00002.safetensors")
  with pytest.raises(FileNotFoundError, match=r"no safetensors weights .*found \['model-00001"):
    hf.load(folder)
  os.remove(folder / "model-00001-of-00002.safetensors")
  with pytest.raises(FileNotFoundError, match="expected model.safetensors"):
    hf.load(folder)


def _rewrite(folder, edit):
  tensors = load_file(folder / "model.safetensors")
  edit(tensors)
  save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def test_error_missing_tensor(tmp_path):
  folder = _copy_fixture(tmp_path)
  _rewrite(folder, lambda t: t.pop("model.layers.1.self_attn.k_norm.weight"))
  with pytest.raises(ValueError, match=r"missing tensor 'model.layers.1.self_attn.k_norm.weight'"):
    hf.load(folder)


def test_error_missing_untied_head(tmp_path):
  folder = _copy_fixture(tmp_path)
  _rewrite(folder, lambda t: t.pop("lm_head.weight"))
  with pytest.raises(ValueError, match=r"missing tensor 'lm_head.weight'"):
    hf.load(folder)


def test_error_wrong_shape(tmp_path):
  folder = _copy_fixture(tmp_path)

  def edit(t):
    t["model.layers.0.mlp.gate_proj.weight"] = np.zeros((95, 64), np.float32)

  _rewrite(folder, edit)
  with pytest.raises(ValueError) as err:
    hf.load(folder)
  msg = str(err.value)
  assert "'model.layers.0.mlp.gate_proj.weight' has shape [95, 64], expected [96, 64]" in msg
  assert "missing" not in msg  # reported once, as mis-shaped


def test_error_unknown_tensor_name(tmp_path):
  folder = _copy_fixture(tmp_path)

  def edit(t):
    t["model.layers.0.self_attn.q_proj.bias"] = np.zeros((64,), np.float32)
    t["model.layers.2.mlp.up_proj.weight"] = np.zeros((96, 64), np.float32)

  _rewrite(folder, edit)
  with pytest.raises(ValueError) as err:
    hf.load(folder)
  msg = str(err.value)
  assert "unexpected tensor 'model.layers.0.self_attn.q_proj.bias'" in msg
  assert "unexpected tensor 'model.layers.2.mlp.up_proj.weight'" in msg
  assert "num_hidden_layers=2" in msg


def test_all_problems_reported_together(tmp_path):
  folder = _copy_fixture(tmp_path)

  def edit(t):
    t.pop("model.norm.weight")
    t["model.embed_tokens.weight"] = t["model.embed_tokens.weight"][:, :32].copy()
    t["extra.weight"] = np.zeros((2,), np.float32)

  _rewrite(folder, edit)
  with pytest.raises(ValueError) as err:
    hf.load(folder)
  msg = str(err.value)
  assert "3 problem(s)" in msg
  assert "missing tensor 'model.norm.weight'" in msg
  assert "'model.embed_tokens.weight' has shape [128, 32], expected [128, 64]" in msg
  assert "unexpected tensor 'extra.weight'" in msg


def test_tied_head_must_equal_embedding(tmp_path):
  folder = _copy_fixture(tmp_path, "tied")
  base = load_file(folder / "model.safetensors")
  # An identical copy of the embedding is accepted (and ignored).
  _rewrite(folder, lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"].copy()}))
  config, model = hf.load(folder)
  assert config.tie_embeddings and not hasattr(model, "lm_head")
  np.testing.assert_array_equal(np.asarray(model.embed[...]), base["model.embed_tokens.weight"])
  # A different one would be silently dropped: refused.
  _rewrite(folder, lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"] + 1}))
  with pytest.raises(ValueError, match="'lm_head.weight' differs from 'model.embed_tokens.weight'"):
    hf.load(folder)


def test_error_truncated_file(tmp_path):
  folder = _copy_fixture(tmp_path)
  path = folder / "model.safetensors"
  data = path.read_bytes()
  path.write_bytes(data[:-100])
  with pytest.raises(ValueError, match="truncated"):
    hf.load(folder)


@pytest.mark.parametrize("header, needle", [
    (b"[" * 5000 + b"]" * 5000, "corrupt safetensors header (maximum recursion depth"),
    (b'{"a": ' + b"1" * 5000 + b"}", "corrupt safetensors header (Exceeds the limit"),
    (b"[1, 2]", "corrupt safetensors header (a JSON list, not an object of tensors)"),
    (b'{"w": 3}', "tensor 'w' has a corrupt header entry 3"),
    (b'{"w": {"dtype": "F32", "shape": [2], "data_offsets": [0]}}',
     "tensor 'w' has a corrupt header entry"),
    (b'{"w": {"dtype": "F32", "shape": ["2"], "data_offsets": [0, 8]}}',
     "tensor 'w' has a corrupt header entry"),
])
def test_error_corrupt_safetensors_header(tmp_path, header, needle):
  # Whatever a damaged (or hostile) header holds, the error names the file.
  folder = _copy_fixture(tmp_path)
  path = folder / "model.safetensors"
  path.write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 64)
  with pytest.raises(ValueError, match=re.escape(f"{path}: {needle}")):
    hf.load(folder)


def test_error_config_json_that_is_not_an_object(tmp_path):
  folder = _copy_fixture(tmp_path)
  (folder / "config.json").write_text("[" * 5000 + "]" * 5000)
  with pytest.raises(ValueError, match="config.json: not valid JSON"):
    hf.load(folder)
  (folder / "config.json").write_text("[1, 2]")
  with pytest.raises(ValueError, match="config.json: expected a JSON object, got list"):
    hf.load(folder)


def test_save_refuses_existing_and_leaves_nothing_on_failure(tmp_path):
  config, model = hf.load(os.path.join(FIXTURES, "tied"))
  (tmp_path / "out").mkdir()
  with pytest.raises(FileExistsError, match="already exists"):
    hf.save(config, model, tmp_path / "out")
  # A config that does not describe the model fails before anything is written.
  with pytest.raises(ValueError, match="config implies"):
    hf.save(config.replace(mlp_dim=81), model, tmp_path / "bad")
  with pytest.raises(ValueError, match="max_shard_bytes"):
    hf.save(config, model, tmp_path / "bad", max_shard_bytes=0)
  assert sorted(os.listdir(tmp_path)) == ["out"]


# ---------------------------------------------------------------- CLI


def _cli(*args):
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO, XLA_FLAGS="")
  return subprocess.run([sys.executable, "-m", "refusion_jax.convert", *args], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=300)


def test_convert_cli_round_trip(tmp_path):
  src = os.path.join(FIXTURES, "gqa")
  ours, back = tmp_path / "ours", tmp_path / "hf"
  result = _cli(f"--hf_dir={src}", f"--out_dir={ours}")
  assert result.returncode == 0, result.stderr[-2000:]
  assert checkpoint.is_model_dir(ours)
  result = _cli("--to_hf", f"--out_dir={ours}", f"--hf_dir={back}")
  assert result.returncode == 0, result.stderr[-2000:]
  _assert_same_tensors(_tensors(src), _tensors(back))
  # Refuses to overwrite, naming the folder.
  result = _cli(f"--hf_dir={src}", f"--out_dir={ours}")
  assert result.returncode != 0 and "already exists" in result.stderr


def test_convert_errors(tmp_path):
  # Through the CLI: importing the module here would register its absl flags
  # in the test process, where other entry points may define the same names.
  result = _cli("--to_hf", f"--out_dir={tmp_path / 'missing'}", f"--hf_dir={tmp_path / 'hf'}")
  assert result.returncode != 0 and "does not exist" in result.stderr
  assert "--out_dir=" in result.stderr
  result = _cli(f"--hf_dir={tmp_path}", f"--out_dir={tmp_path}", "--overwrite")
  assert result.returncode != 0 and "are the same folder" in result.stderr
