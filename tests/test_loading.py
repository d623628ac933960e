"""refusion_jax/loading.py: a model and its tokenizer by reference, one rule: a shipped
model's short name, a refusion_jax folder or a HF folder; the tokenizer from the flag,
the folder, or the bundled tiny one when the model fits it, else one error."""

import os
import re
import shutil
import subprocess
import sys

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


# Every entry point that loads a model, with a reference that names no folder and no
# shipped model: each refuses it with the same line before it loads or compiles anything.
_MISSING = "no_such_model_here"
_SHIPPED = r"is not a folder \(nor a shipped model: base_tiny, refusion_tiny\)"
_ENTRY_POINTS = {
    "sample": ["-m", "refusion_jax.sample", "--config=configs/sample.py",
               f"--config.model_dir={_MISSING}", "--config.prompt=copy 42"],
    "serve": ["-m", "refusion_jax.serve", "--config=configs/serve.py",
              f"--config.model_dir={_MISSING}"],
    "evaluate": ["-m", "refusion_jax.evaluate", "--config=configs/eval/synthetic.py",
                 f"--config.model_dir={_MISSING}", "--config.output_dir={out}"],
    "evaluate a benchmark": ["-m", "refusion_jax.evaluate", "--config=configs/eval/gsm8k.py",
                             f"--config.model_dir={_MISSING}", "--config.output_dir={out}"],
    "train": ["-m", "refusion_jax.train", "--config=configs/tiny_refusion.py",
              "--workdir={out}", f"--config.init_from_hf={_MISSING}"],
    "distill": ["-m", "refusion_jax.distill", "--config=configs/d2f_tiny.py",
                f"--config.base_dir={_MISSING}", "--config.output_dir={out}"],
    "rl": ["-m", "refusion_jax.rl", "--config=configs/rl_tiny.py",
           f"--config.model_dir={_MISSING}", "--config.output_dir={out}"],
    "drafter": ["-m", "refusion_jax.drafter", "--config=configs/drafter_tiny.py",
                f"--config.model_dir={_MISSING}", "--config.output_dir={out}"],
    "convert": ["-m", "refusion_jax.convert", f"--hf_dir={_MISSING}", "--out_dir={out}"],
    "benchmark": ["benchmarks/decode_options.py", f"--model_dir={_MISSING}"],
}


def test_every_entry_point_refuses_a_missing_model_by_one_rule(tmp_path):
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ, PYTHONPATH=repo)
  runs = {name: subprocess.Popen(
      [sys.executable, *(a.replace("{out}", str(tmp_path / name.split()[0])) for a in args)],
      cwd=repo, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
      for name, args in _ENTRY_POINTS.items()}
  for name, run in runs.items():
    _, err = run.communicate(timeout=300)
    assert run.returncode != 0, name
    last = err.strip().splitlines()[-1]
    assert re.search(rf"{_MISSING}' {_SHIPPED}$", last), (name, err[-2000:])
    assert "Traceback" not in err, (name, err[-2000:])
    assert not os.path.exists(tmp_path / name.split()[0]), name  # nothing written


def test_every_entry_point_takes_a_shipped_models_name(tmp_path):
  """Each entry point's checks (before loading) take the shipped names; the loaders
  behind them are `loading`'s (sample and evaluate run on `refusion_tiny` in
  test_runtime.py and below; serve in test_serve.py)."""
  # pylint: disable=import-outside-toplevel
  from configs import d2f_tiny, drafter_tiny, rl_tiny, serve as serve_config, tiny_refusion
  from configs.eval import gsm8k
  from refusion_jax import convert, distill, drafter, serve
  from refusion_jax.lmeval import model as lm_model, run as lmeval_run
  from refusion_jax.rl import trainer as rl_trainer
  from refusion_jax.training import settings

  c = serve_config.get_config()
  c.model_dir = "refusion_tiny"
  serve.check_flags(c)
  c = rl_tiny.get_config()
  c.model_dir, c.output_dir = "refusion_tiny", str(tmp_path / "rl")
  rl_trainer.check_config(c)
  c = d2f_tiny.get_config()
  c.base_dir, c.output_dir = "base_tiny", str(tmp_path / "d2f")
  distill.check_config(c)
  c = drafter_tiny.get_config()
  c.model_dir, c.output_dir = "refusion_tiny", str(tmp_path / "drafter")
  drafter.check_config(c)
  c = gsm8k.get_config()
  c.model_dir, c.output_dir = "refusion_tiny", str(tmp_path / "lmeval")
  lmeval_run.check_config(c)
  lm = lm_model.RefusionLM("refusion_tiny", gen_length=8, slot_size=4, block_size=8)
  assert lm.model_dir == "refusion_tiny" and lm.tokenizer.vocab_size == lm.model.config.vocab_size
  with pytest.raises(FileNotFoundError, match=rf"model_dir='{_MISSING}' {_SHIPPED}$"):
    lm_model.RefusionLM(_MISSING)
  c = tiny_refusion.get_config()
  c.init_from_hf = "base_tiny"
  settings.validate_config(c, num_devices=1)
  convert.convert("base_tiny", str(tmp_path / "ours"))
  assert loading.read_model_config(str(tmp_path / "ours")) == loading.read_model_config(
      "base_tiny")
