"""The sampling CLI end to end on tiny random models saved in a tmp folder."""

import json
import os
import re
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from configs import sample as sample_config
from refusion_jax import checkpoint, sample, trace
from refusion_jax import config as config_lib
from refusion_jax.decode.settings import DecodeConfig
from refusion_jax.model import Transformer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REQUIRED = {"tokens", "text", "nfe", "tokens_per_forward", "tpf_paper", "seconds"}


def _save(folder, attention):
  config = config_lib.tiny(num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1,
                           head_dim=16, mlp_dim=64, attention=attention)
  model = Transformer(config, rngs=nnx.Rngs(0))
  # Scaled weights so that greedy outputs vary (the EOS id 1 may or may not appear).
  nnx.update(model, jax.tree.map(lambda x: x * 4.0, nnx.state(model, nnx.Param)))
  checkpoint.save_model(str(folder), config, model)
  return config, model


@pytest.fixture(scope="module")
def models(tmp_path_factory):
  root = tmp_path_factory.mktemp("models")
  causal = _save(root / "causal", "causal")
  bidir = _save(root / "bidir", "bidirectional")
  return {"causal": (str(root / "causal"),) + causal, "bidir": (str(root / "bidir"),) + bidir}


def _config(model_dir, **overrides):
  c = sample_config.get_config()
  c.model_dir = model_dir
  c.prompt_bucket = 16
  c.decode.gen_length = 16
  c.decode.block_size = 8
  c.decode.slot_size = 4
  for key, value in overrides.items():
    target = c
    *parents, leaf = key.split(".")
    for p in parents:
      target = target[p]
    target[leaf] = value
  return c


def _check_results(results, n, gen_length):
  assert len(results) == n
  for r in results:
    assert REQUIRED <= set(r)
    assert 1 <= len(r["tokens"]) <= gen_length
    assert r["nfe"] >= 1 and r["seconds"] > 0
    assert r["tokens_per_forward"] == pytest.approx(len(r["tokens"]) / r["nfe"])
    if 1 in r["tokens"]:  # EOS of config.tiny(): the response ends there
      assert r["tokens"].index(1) == len(r["tokens"]) - 1


def _single_decode(model, method, ids, **decode):
  """The decoder called directly on one exact-length prompt (no bucketing)."""
  from refusion_jax.decode import autoregressive, mdm, refusion  # pylint: disable=g-import-not-at-top
  fn = {"ar": autoregressive.generate, "mdm": mdm.generate, "refusion": refusion.generate}[method]
  dc = DecodeConfig(method=method, gen_length=16, block_size=8, slot_size=4, **decode)
  out = fn(model, np.array([ids], np.int32), np.array([len(ids)], np.int32), dc)
  return [int(t) for t in out.tokens_bg[0, :int(out.length_b[0])]]


@pytest.mark.parametrize("method, which", [("ar", "causal"), ("mdm", "bidir"),
                                           ("refusion", "causal")])
def test_prompts_file_batch(models, tmp_path, method, which):
  """Through the engine: (ReFusion with both "Past the paper" options on, which the
  release's decoder meets in the server's tests) what one exact-length decode gives."""
  model_dir, _, model = models[which]
  options = ({"decode.verify": "correct", "decode.remask": True} if method == "refusion"
             else {})
  prompts = [[5, 6, 7, 8], [40, 41], [100, 7, 9, 30, 31, 200, 201], [17]]
  path = tmp_path / "prompts.jsonl"
  path.write_text("\n".join(json.dumps({"prompt_ids": p}) for p in prompts[:3])
                  + "\n\n" + json.dumps({"query": "hello"}) + "\n")
  out_path = tmp_path / "out.json"
  c = _config(model_dir, prompts_file=str(path), output_json=str(out_path),
              **{"decode.method": method, "batch_size": 2, **options})
  results = sample.run(c)
  assert json.loads(out_path.read_text()) == results
  _check_results(results, 4, 16)
  # The tiny-shaped model falls back to the bundled tokenizer: text is decoded.
  assert all(isinstance(r["text"], str) for r in results)
  # Padding to the bucket (16) and batching with longer prompts changes nothing.
  assert results[1]["tokens"] == _single_decode(
      model, method, prompts[1], **{k.split(".")[1]: v for k, v in options.items()})
  # With the options on, each result says what they did.
  counted = {"corrected", "refresh", "recheck", "remasked", "remasked_tokens"}
  assert all((counted <= set(r)) == bool(options) for r in results)


def test_cli_prompt_ids_to_stdout_with_trace(models, tmp_path):
  model_dir = models["causal"][0]
  html_path = tmp_path / "trace.html"
  proc = subprocess.run(
      [sys.executable, "-m", "refusion_jax.sample", "--config=configs/sample.py",
       f"--config.model_dir={model_dir}", "--config.prompt_ids=40,41",
       # AR checks only its own fields: a gen_length that is no multiple of the
       # config's default ReFusion block (32) is an AR decode of 16 tokens.
       "--config.decode.method=ar", "--config.prompt_bucket=16",
       "--config.decode.gen_length=16", "--config.trace=true",
       f"--config.trace_html={html_path}", "--config.output_json=-"],
      cwd=REPO, capture_output=True, text=True, timeout=300,
      env=dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu"))
  assert proc.returncode == 0, proc.stderr
  results = json.loads(proc.stdout)
  _check_results(results, 1, 16)
  assert results[0]["tokens"] == _single_decode(models["causal"][2], "ar", [40, 41])
  assert "\x1b[38;5;" in proc.stderr  # the coloured terminal trace
  page = html_path.read_text()
  assert page.startswith("<!DOCTYPE html>") and "<script>" in page
  assert "src=" not in page and "href=" not in page and "http" not in page  # self-contained
  data = json.loads(page.split("const DATA = ", 1)[1].split(";\n", 1)[0])
  steps = data["records"][0]["steps"]
  assert len(steps) == len(results[0]["tokens"]) and min(steps) >= 0


def test_trace_views():
  pieces, steps = ["a", "</script>", "c"], [0, 2, 1]
  text = trace.ansi(pieces, steps)
  assert text.count("\x1b[38;5;") == 3 + 3  # three tokens and three legend entries
  page = trace.html([{"prompt": "p", "pieces": pieces, "steps": steps, "meta": "m"}])
  assert page.count("</script>") == 1  # the token cannot close the script element
  data = json.loads(page.split("const DATA = ", 1)[1].split(";\n", 1)[0].replace("<\\/", "</"))
  assert data["records"][0]["pieces"] == pieces and data["max_step"] == 2
  with pytest.raises(ValueError, match="2 token pieces but 3"):
    trace.ansi(["a", "b"], [0, 1, 2])


@pytest.mark.parametrize("overrides, error, match", [
    (dict(model_dir=""), ValueError, "model_dir is required"),
    (dict(prompt="hi", prompt_ids="1,2"), ValueError, "exactly one of"),
    (dict(), ValueError, "exactly one of"),
    (dict(prompts_file="/nonexistent/p.jsonl"), FileNotFoundError, "prompts_file"),
    (dict(model_dir="/nonexistent/model", prompt_ids="1"), FileNotFoundError, "model_dir"),
    (dict(prompt_ids="1,x"), ValueError, "comma-separated"),
    (dict(prompt_ids="1,2", **{"decode.method": "beam"}), ValueError, "decode.method"),
    (dict(prompt_ids="1,2", **{"decode.block_size": 6}), ValueError, "block_size"),
    (dict(prompt_ids="1,900"), ValueError, "token id 900"),
    (dict(prompt_ids="1,2", **{"decode.method": "mdm"}), ValueError, "bidirectional"),
    (dict(prompt_ids="1,2", **{"decode.matmul_precision": "fp64"}), ValueError,
     "decode.matmul_precision must be one of"),
    (dict(prompt_ids="1,2", output_json="/nonexistent/o.json"), FileNotFoundError, "output_json"),
])
def test_bad_flags(models, overrides, error, match):
  overrides.setdefault("model_dir", models["causal"][0])
  c = _config(**overrides)
  with pytest.raises(error, match=match):
    sample.run(c)


def test_bad_prompts_file_line(models, tmp_path):
  path = tmp_path / "bad.jsonl"
  path.write_text(json.dumps({"prompt_ids": [1, 2]}) + "\n{not json\n")
  with pytest.raises(ValueError, match="bad.jsonl:2: not valid JSON"):
    sample.run(_config(models["causal"][0], prompts_file=str(path)))
  path.write_text(json.dumps({"prompt_ids": [1, 2]}) + '\n{"query": "ab\\ud800"}\n')
  with pytest.raises(ValueError, match="bad.jsonl:2: query is not valid Unicode: a lone "
                     "surrogate at character 2"):
    sample.run(_config(models["causal"][0], prompts_file=str(path)))
  path.write_text(json.dumps({"prompt_ids": [1, 2]}) + "\n" + "[" * 100_000 + "]" * 100_000)
  with pytest.raises(ValueError, match=r"bad.jsonl:2: not valid JSON here \(nested too deeply\)"):
    sample.run(_config(models["causal"][0], prompts_file=str(path)))
  path.write_text('{"prompt_ids": [' + "1" * 5000 + "]}\n")
  with pytest.raises(ValueError, match=r"bad.jsonl:1: not valid JSON \(Exceeds the limit"):
    sample.run(_config(models["causal"][0], prompts_file=str(path)))
  with pytest.raises(ValueError, match="--config.prompt: the query is not valid Unicode"):
    sample.run(_config(models["causal"][0], prompt="x\udc80"))


def test_a_folder_above_a_model_names_the_model_folders_below_it(models, tmp_path):
  # A training workdir holds its model in models/NAME/final_model.
  work = tmp_path / "work"
  shutil.copytree(models["causal"][0], work / "models" / "refusion" / "final_model")
  (work / "models" / "refusion" / "checkpoints" / "100").mkdir(parents=True)
  with pytest.raises(FileNotFoundError, match=re.escape(
      f"has neither model_config.json (refusion_jax) nor config.json (HF); model folders "
      f"below it: {work / 'models' / 'refusion' / 'final_model'}")):
    sample.run(_config(str(work), prompt_ids="1,2"))
  (tmp_path / "empty").mkdir()
  with pytest.raises(FileNotFoundError, match=r"config.json \(HF\)$"):
    sample.run(_config(str(tmp_path / "empty"), prompt_ids="1,2"))


def test_cli_missing_model_dir_exits_with_message():
  proc = subprocess.run(
      [sys.executable, "-m", "refusion_jax.sample", "--config=configs/sample.py",
       "--config.prompt_ids=1,2"],
      cwd=REPO, capture_output=True, text=True, timeout=120,
      env=dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu"))
  assert proc.returncode == 2
  assert "model_dir is required" in proc.stderr and proc.stdout == ""


def test_hf_model_folder(models, tmp_path):
  from refusion_jax import hf  # pylint: disable=g-import-not-at-top
  _, config, model = models["causal"]
  hf_dir = tmp_path / "hf"
  hf.save(config, model, str(hf_dir))
  results = sample.run(_config(str(hf_dir), prompt_ids="40,41", output_json="",
                               **{"decode.method": "ar"}))
  _check_results(results, 1, 16)
  assert results[0]["tokens"] == _single_decode(model, "ar", [40, 41])


def test_the_summary_line_counts_as_the_json_does():
  """One prompt's line says its tokens and nfe as its JSON result does (the prefill
  counted), in the singular where there is one, and what the time includes."""
  import types  # pylint: disable=import-outside-toplevel
  from refusion_jax import sample  # pylint: disable=import-outside-toplevel
  one = types.SimpleNamespace(tokens=[5], counters={"nfe_b": 1.0})
  run = types.SimpleNamespace(results=[one], passes=0, admissions=1, seconds=0.5)
  assert sample.summary_line(run, 1, 1, False) == (
      "[sample] 1 prompt through 1 row: 1 token, nfe 1 in 0.50s (programs compiled or "
      "loaded included; --config.warmup=true excludes them)")
  two = types.SimpleNamespace(tokens=[5, 6, 7], counters={"nfe_b": 2.0})
  run = types.SimpleNamespace(results=[one, two], passes=2, admissions=1, seconds=1.0)
  assert sample.summary_line(run, 2, 2, True) == (
      "[sample] 2 prompts through 2 rows: 4 tokens, nfe 3 (2 batched passes, 1 admission) "
      "in 1.00s")
