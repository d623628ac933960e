"""Model/decode configs: presets, validation, HF config.json mapping, model folders."""

import json

import numpy as np
import pytest
from flax import nnx

from refusion_jax import checkpoint
from refusion_jax import config as config_lib
from refusion_jax import model as model_lib
from refusion_jax.decode import settings
from refusion_jax.decode.settings import DecodeConfig


def test_qwen3_8b_preset_has_qwen3_8b_shapes():
  cfg = config_lib.qwen3_8b()
  assert (cfg.vocab_size, cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads,
          cfg.head_dim, cfg.mlp_dim) == (151936, 4096, 36, 32, 8, 128, 12288)
  assert cfg.rope_theta == 1e6 and not cfg.tie_embeddings
  # Qwen3-8B has 8.19B parameters (untied 151936-row embedding and head).
  assert 8.15e9 < cfg.num_params() < 8.25e9
  small = config_lib.qwen3_0_6b()
  assert small.tie_embeddings and 0.55e9 < small.num_params() < 0.65e9


def test_presets_are_hashable_and_overridable():
  a, b = config_lib.tiny(), config_lib.tiny()
  assert a == b and hash(a) == hash(b)
  assert config_lib.get_preset("tiny", num_layers=2).num_layers == 2
  with pytest.raises(ValueError, match="unknown model preset 'huge'"):
    config_lib.get_preset("huge")


@pytest.mark.parametrize("field,value,message", [
    ("num_heads", 5, "multiple of num_kv_heads"),
    ("head_dim", 33, "head_dim must be even"),
    ("hidden_size", 0, "hidden_size must be a positive int"),
    ("dtype", "float8", "ModelConfig.dtype must be one of"),
    ("attention", "sliding", "ModelConfig.attention must be one of"),
    ("mask_token_id", 512, "mask_token_id=512 is outside the vocabulary"),
])
def test_model_config_rejects_bad_values(field, value, message):
  with pytest.raises(ValueError, match=message):
    config_lib.tiny(**{field: value})


def test_from_hf_config_both_transformers_layouts_and_refusion_fields(tmp_path):
  base = {"model_type": "qwen3", "vocab_size": 151671, "hidden_size": 4096,
          "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
          "head_dim": 128, "intermediate_size": 12288, "rms_norm_eps": 1e-6,
          "tie_word_embeddings": False, "max_position_embeddings": 40960,
          "eos_token_id": 151645, "torch_dtype": "bfloat16"}
  v4 = dict(base, rope_theta=1000000.0, mask_token_id=151670)
  v5 = dict(base, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
  path = tmp_path / "config.json"
  path.write_text(json.dumps(v4))
  cfg4 = config_lib.from_hf_config(tmp_path)  # a folder works as well as the file
  cfg5 = config_lib.from_hf_config(v5)
  assert cfg4.rope_theta == cfg5.rope_theta == 1e6
  assert cfg4.mask_token_id == 151670 and cfg5.mask_token_id is None
  assert cfg4.replace(mask_token_id=None) == cfg5
  assert cfg4.dtype == "bfloat16" and cfg4.eos_token_id == 151645
  # Our own export reads back to the same config.
  assert config_lib.from_hf_config(config_lib.to_hf_config(cfg4)) == cfg4


def test_from_hf_config_errors(tmp_path):
  with pytest.raises(FileNotFoundError, match="no config.json"):
    config_lib.from_hf_config(tmp_path)
  (tmp_path / "config.json").write_text("{not json")
  with pytest.raises(ValueError, match="not valid JSON"):
    config_lib.from_hf_config(tmp_path)
  with pytest.raises(ValueError, match=r"missing field\(s\) \['hidden_size'"):
    config_lib.from_hf_config({"vocab_size": 10})
  with pytest.raises(ValueError, match="model_type='mistral'"):
    config_lib.from_hf_config({"model_type": "mistral"})
  with pytest.raises(ValueError, match="rope_type='yarn'"):
    config_lib.from_hf_config({"model_type": "qwen3", "vocab_size": 8, "hidden_size": 8,
                               "num_hidden_layers": 1, "num_attention_heads": 2,
                               "intermediate_size": 8,
                               "rope_parameters": {"rope_type": "yarn", "rope_theta": 1.0}})


@pytest.mark.parametrize("text, message", [
    ("{not json", "model_config.json: not valid JSON"),
    ("[" * 5000 + "]" * 5000, "model_config.json: not valid JSON"),
    ("[1, 2]", "model_config.json: expected a JSON object of ModelConfig fields, got list"),
    ('{"vocab_size": 8, "hidden_sise": 4}', r"unknown ModelConfig field\(s\) \['hidden_sise'\]"),
    ('{"vocab_size": 8}', "model_config.json: .*missing"),
    (json.dumps({**config_lib.tiny().__dict__, "head_dim": 33}), "head_dim must be even"),
])
def test_read_model_config_names_its_file(tmp_path, text, message):
  (tmp_path / config_lib.MODEL_CONFIG_FILE).write_text(text)
  with pytest.raises(ValueError, match=message):
    config_lib.read_model_config(str(tmp_path))


@pytest.mark.parametrize("changes,message", [
    ({"block_size": 12}, "block_size=12 must be a multiple of decode.slot_size=8"),
    ({"gen_length": 100}, "gen_length=100 must be a multiple of decode.block_size=32"),
    ({"slot_threshold": 1.5}, "slot_threshold must lie in"),
    ({"token_threshold": -0.1}, "token_threshold must lie in"),
    ({"temperature": -1.0}, "temperature must be >= 0"),
    ({"method": "beam"}, "decode.method must be one of"),
    ({"slot_size": 0}, "slot_size must be a positive int"),
    ({"kv_chunk": -1}, r"decode.kv_chunk must be an int >= 0 \(0: the whole buffer\)"),
    ({"kv_chunk": 64.0}, "decode.kv_chunk must be an int >= 0"),
    ({"kv_chunk": True}, "decode.kv_chunk must be an int >= 0"),
    ({"matmul_precision": "float64"}, r"decode.matmul_precision must be one of \('default', "),
    ({"matmul_precision": "HIGHEST"}, "decode.matmul_precision must be one of"),
])
def test_decode_config_rejects_bad_values(changes, message):
  with pytest.raises(ValueError, match=message):
    DecodeConfig(**changes)


def test_decode_config_kv_chunk_per_platform():
  auto = DecodeConfig()
  assert auto.kv_chunk is None
  assert [auto.kv_chunk_on(p) for p in ("cpu", "tpu", "gpu")] == [
      settings.KV_CHUNK_AUTO["cpu"], settings.KV_CHUNK_AUTO["tpu"], 0]
  assert [DecodeConfig(kv_chunk=k).kv_chunk_on("gpu") for k in (0, 16)] == [0, 16]


def test_decode_config_matmul_precision_per_platform():
  # Unset: "highest" on GPUs (whose float32 products are TF32 by default), JAX's default
  # (None) on CPUs and TPUs; a value given is used everywhere.
  auto = DecodeConfig()
  assert auto.matmul_precision is None
  assert [auto.matmul_precision_on(p) for p in ("cpu", "tpu", "gpu")] == [None, None, "highest"]
  assert [DecodeConfig(matmul_precision=v).matmul_precision_on(p)
          for v in ("default", "high") for p in ("cpu", "gpu")] == [
              "default", "default", "high", "high"]


def test_decode_config_fits_model_positions():
  decode = DecodeConfig(gen_length=128)
  model_cfg = config_lib.tiny(max_position_embeddings=256)
  decode.check_fits(model_cfg, prompt_len=128)
  with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings=256"):
    decode.check_fits(model_cfg, prompt_len=129)
  with pytest.raises(ValueError, match="needs a mask token"):
    decode.check_fits(model_cfg.replace(mask_token_id=None), prompt_len=8)


def test_model_folder_round_trip_is_exact_and_atomic(tmp_path):
  cfg = config_lib.tiny(num_layers=1, tie_embeddings=False)
  model = model_lib.Transformer(cfg, rngs=nnx.Rngs(3))
  out = tmp_path / "m"
  checkpoint.save_model(str(out), cfg, model)
  with pytest.raises(FileExistsError, match="already exists"):
    checkpoint.save_model(str(out), cfg, model)
  loaded_cfg, loaded = checkpoint.load_model(str(out))
  assert loaded_cfg == cfg
  for a, b in zip(nnx.to_flat_state(nnx.state(model, nnx.Param)),
                  nnx.to_flat_state(nnx.state(loaded, nnx.Param))):
    assert a[0] == b[0]
    np.testing.assert_array_equal(np.asarray(a[1][...]), np.asarray(b[1][...]))
  assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]  # no temp folder left
  with pytest.raises(FileNotFoundError, match="does not exist"):
    checkpoint.load_model(str(tmp_path / "missing"))
