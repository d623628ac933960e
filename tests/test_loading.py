"""refusion_jax/loading.py: a model and its tokenizer by reference, one rule: a shipped
model's short name, a refusion_jax folder or a HF folder; the tokenizer from the flag,
the folder, or the bundled tiny one when the model fits it, else one error."""

import os
import shutil

import pytest
from flax import nnx

from refusion_jax import checkpoint, config as config_lib, hf, loading, packaged
from refusion_jax.model import Transformer
from refusion_jax.tokenizer import TINY_TOKENIZER_DIR, Tokenizer


def _models(tmp_path):
  """The same random tiny-shaped weights as a refusion_jax folder and as a HF folder."""
  config = config_lib.tiny(num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1,
                           head_dim=16, mlp_dim=64, max_position_embeddings=64)
  model = Transformer(config, rngs=nnx.Rngs(0))
  ours, theirs = str(tmp_path / "ours"), str(tmp_path / "hf")
  checkpoint.save_model(ours, config, model)
  hf.save(config, model, theirs)
  return config, ours, theirs


def test_a_reference_names_a_shipped_model_unless_a_folder_of_that_name_is_here(
    tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  assert loading.model_dir("refusion_tiny") == packaged.REFUSION_TINY_DIR
  assert loading.read_model_config("base_tiny") == hf.read_config(packaged.BASE_TINY_DIR)
  (tmp_path / "base_tiny").mkdir()
  assert loading.model_dir("base_tiny") == "base_tiny"
  with pytest.raises(ValueError, match=r"^--config\.model_dir is required"):
    loading.model_dir("")
  with pytest.raises(FileNotFoundError, match=r"^--base_dir='nope' is not a folder \(nor a "
                     r"shipped model: base_tiny, refusion_tiny\)$"):
    loading.model_dir("nope", "--base_dir")


def test_either_kind_of_folder_loads_the_same_model(tmp_path):
  config, ours, theirs = _models(tmp_path)
  for folder in (ours, theirs):
    assert loading.read_model_config(folder) == config
    got_config, model = loading.load_model(folder)
    assert got_config == config and isinstance(model, Transformer)
  with pytest.raises(FileNotFoundError, match="has neither model_config.json"):
    loading.read_model_config(str(tmp_path))  # the folder above both: neither kind


def test_the_tokenizer_rule(tmp_path):
  config, ours, _ = _models(tmp_path)
  # The flag first, then the folder's own tokenizer.json, then the bundled one.
  shutil.copy(os.path.join(TINY_TOKENIZER_DIR, "tokenizer.json"), ours)
  shutil.copy(os.path.join(TINY_TOKENIZER_DIR, "tokenizer_config.json"), ours)
  flag = str(tmp_path / "flag")
  shutil.copytree(TINY_TOKENIZER_DIR, flag)
  assert loading.load_tokenizer(ours, config, flag).source == flag
  assert loading.load_tokenizer(ours, config).source == ours
  os.remove(os.path.join(ours, "tokenizer.json"))
  assert loading.load_tokenizer(ours, config).source == Tokenizer.tiny().source
  # A model the tiny tokenizer does not fit, without a tokenizer.json: none.
  other = config.replace(vocab_size=1000)
  assert loading.find_tokenizer(ours, other) is None
  assert loading.load_tokenizer(ours, other, required=False) is None
  with pytest.raises(ValueError, match=r"--config\.model_dir='.*ours': no tokenizer .*; set "
                     r"--config\.tokenizer_dir$"):
    loading.load_tokenizer(ours, other)
  # A tokenizer that is found is checked against the model.
  with pytest.raises(ValueError, match="does not match the model config"):
    loading.load_tokenizer(ours, config.replace(vocab_size=100), TINY_TOKENIZER_DIR)
