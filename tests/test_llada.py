"""LLaDA-8B's layout: its folders loaded and exported under its own tensor names and
config keys, its logits against transformers, and its checks.

The fixture tests/fixtures/hf_tiny/llada is a random LlamaForCausalLM (no GQA, untied)
saved under LLaDA's tensor names with LLaDA's config.json; its golden logits are the
Llama model run with a full (non-causal) mask (scripts/make_hf_fixture.py), which is
what LLaDA's model computes (shared/TABLE1-BASELINES.md section 1.3).
"""

import json
import os
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file

from refusion_jax import config as config_lib
from refusion_jax import hf
from refusion_jax.decode import engine
from refusion_jax.decode.settings import DecodeConfig

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "hf_tiny")
LLADA = os.path.join(FIXTURES, "llada")


def _copy(tmp_path):
  dst = tmp_path / "llada"
  shutil.copytree(LLADA, dst)
  return dst


def _edit_config(folder, **changes):
  path = folder / "config.json"
  cfg = json.loads(path.read_text())
  cfg.update(changes)
  path.write_text(json.dumps(cfg))


def test_logits_match_transformers_llama_without_a_causal_mask():
  config, model = hf.load(LLADA, dtype="float32")
  assert (config.model_type, config.attention, config.shift_logits, config.qkv_bias,
          config.qk_norm, config.num_kv_heads, config.mask_token_id) == (
              "llada", "bidirectional", False, False, False, 4, 126)
  golden = np.load(os.path.join(LLADA, "golden.npz"))
  ids = golden["input_ids"]
  positions = np.broadcast_to(np.arange(ids.shape[1]), ids.shape)
  logits = np.asarray(model(ids, positions))
  assert np.abs(logits - golden["logits_bidir"]).max() <= 1e-4
  # Its config.json's precision (amp_bf16) is the default dtype, as LLaDA-8B ships.
  assert hf.load(LLADA)[0].param_dtype == "bfloat16"


def test_export_keeps_llada_names_and_keys_and_reloads_the_same(tmp_path):
  config, model = hf.load(LLADA, dtype="float32")
  hf.save(config, model, tmp_path / "out")
  before, after = load_file(os.path.join(LLADA, "model.safetensors")), load_file(
      tmp_path / "out" / "model.safetensors")
  assert sorted(after) == sorted(before)
  assert all(k.startswith("model.transformer.") for k in after)
  for name, value in before.items():
    assert value.tobytes() == after[name].tobytes(), name
  written = json.loads((tmp_path / "out" / "config.json").read_text())
  assert (written["model_type"], written["d_model"], written["n_kv_heads"],
          written["mlp_hidden_size"], written["block_type"]) == ("llada", 64, 4, 96, "llama")
  assert "hidden_size" not in written
  assert hf.load(tmp_path / "out", dtype="float32")[0] == config


def test_llada_8b_config_file_is_the_preset():
  config = config_lib.from_hf_config(os.path.join(FIXTURES, "configs", "llada_8b_instruct.json"))
  # Its config.json names no BOS (the tokenizer's config does: 126080).
  assert config == config_lib.llada_8b(bos_token_id=None)
  # shared/TABLE1-BASELINES.md: 8,015,581,184 parameters, the index's bf16 total size / 2.
  assert config.num_params() == 8_015_581_184


@pytest.mark.parametrize("changes, match", [
    (dict(block_type="sequential"), r"model_type='llada' with \{'block_type': 'sequential'\}"),
    (dict(include_bias=True), r"'include_bias': True"),
    (dict(alibi=True), r"'alibi': True"),
    (dict(attention_layer_norm=True), r"'attention_layer_norm': True"),
    (dict(mask_token_id=None), r"model_type='llada' needs mask_token_id"),
    (dict(embedding_size=130), r"embedding_size=130 differs from vocab_size=128"),
])
def test_a_llada_folder_that_is_not_llama_s_block_is_named(tmp_path, changes, match):
  folder = _copy(tmp_path)
  _edit_config(folder, **changes)
  with pytest.raises(ValueError, match=match):
    hf.load(folder)


def test_a_llada_folder_read_as_llama_names_every_tensor(tmp_path):
  folder = _copy(tmp_path)
  _edit_config(folder, model_type="llama", hidden_size=64, num_hidden_layers=2,
               num_attention_heads=4, intermediate_size=96)
  with pytest.raises(ValueError) as info:
    hf.load(folder)
  message = str(info.value)
  assert "unexpected tensor 'model.transformer.wte.weight' (no parameter of a llama model" in (
      message)
  assert "missing tensor 'model.embed_tokens.weight'" in message


def test_llada_decodes_as_an_mdm_and_is_refused_by_causal_decoders():
  config, model = hf.load(LLADA, dtype="float32")
  dc = DecodeConfig(method="mdm", gen_length=8, slot_size=4, block_size=4)
  ids = np.array([[5, 9, 30, 7]], np.int32)
  out = engine.Decoder(model, dc).generate(ids, np.array([4], np.int32))
  n = int(out.length_b[0])
  assert 1 <= n <= 8 and int(out.counters.nfe_b()[0]) >= 2
  assert config.mask_token_id not in np.asarray(out.tokens_bg[0, :n]).tolist()
  with pytest.raises(ValueError, match="attention"):
    engine.Decoder(model, dc.replace(method="ar", slot_size=8, block_size=8)).generate(
        ids, np.array([4], np.int32))
