"""refusion_jax.reproduce and refusion_jax.repro: the whole pipeline on a smoke budget,
resuming, the report, and the command line."""

import hashlib
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from configs import repro_smoke
from refusion_jax import checkpoint
from refusion_jax import tasks as tasks_lib
from refusion_jax import tokenizer as tokenizer_lib
from refusion_jax.repro import pipeline, report, scoring, settings, stages
from refusion_jax.training import outputs, supervised
from refusion_jax.training import trainer as trainer_lib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TASKS = list(tasks_lib.TASKS)
ROWS = list(repro_smoke.get_config().eval.rows)
CELL = re.compile(r"^\*{0,2}(\d+\.\d)(?: \[(\d+\.\d), (\d+\.\d)\])? / (\d+\.\d|n/a)\*{0,2}$")


def _png_size(path):
  """(width, height) from the PNG signature and IHDR chunk, read by hand."""
  with open(path, "rb") as f:
    head = f.read(24)
  assert head[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG file"
  assert head[12:16] == b"IHDR"
  return struct.unpack(">II", head[16:24])


def _table_section(text, title_prefix):
  """Rows {name: [cells]} of the first markdown table after a line starting with the title."""
  lines = text.splitlines()
  start = next(i for i, line in enumerate(lines) if line.startswith(title_prefix))
  rows, seen = {}, False
  for line in lines[start + 1:]:
    if line.startswith("|"):
      seen = True
      cells = [c.strip() for c in line.strip("|").split("|")]
      rows[cells[0]] = cells[1:]
    elif seen:
      break
  return rows


def _mtimes(root):
  out = {}
  for dirpath, _, files in os.walk(root):
    for name in files:
      path = os.path.join(dirpath, name)
      out[os.path.relpath(path, root)] = os.stat(path).st_mtime_ns
  return out


def _flat(tree):
  """{path: numpy array} of a parameter pytree (nnx pure dicts and states alike)."""
  leaves = jax.tree_util.tree_flatten_with_path(jax.device_get(tree))[0]
  return {jax.tree_util.keystr(path).replace(".value", "").replace("['value']", ""):
          np.asarray(leaf) for path, leaf in leaves}


def _run(workdir, **changes):
  """pipeline.run on configs/repro_smoke.py with `changes` ({"a.b": value}) applied."""
  config = repro_smoke.get_config()
  for key, value in changes.items():
    *parents, leaf = key.split(".")
    node = config
    for p in parents:
      node = node[p]
    node[leaf] = value
  return pipeline.run(config, str(workdir))


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("repro"))
  # Spy on the fine-tunes' initialisation: the parameters each one starts from.
  inits = []
  real_init = trainer_lib.init_params_from_hf

  def spy(trainer, directory, tokenizer):
    params = real_init(trainer, directory, tokenizer)
    inits.append((directory, trainer.model_config, _flat(params)))
    return params

  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(trainer_lib, "init_params_from_hf", spy)
    t0 = time.perf_counter()
    first = _run(workdir)
    first_seconds = time.perf_counter() - t0
  first["inits"] = inits
  return workdir, first, first_seconds


def test_pipeline_writes_every_artefact(smoke_run):
  workdir, first, _ = smoke_run
  with open(os.path.join(workdir, pipeline.TABLE_FILE)) as f:
    table = f.read()
  assert table == first["table"]
  # Main table: every decoder row, every task column plus Avg, cells "acc / tok/s".
  main = _table_section(table, "# ReFusion in miniature")
  assert main["Decoder"] == TASKS + ["Avg"]
  assert set(ROWS) <= set(main)
  for name in ROWS:
    assert len(main[name]) == len(TASKS) + 1
    for cell in main[name]:
      match = CELL.match(cell)
      assert match, f"row {name}: cell {cell!r} is not 'accuracy / tokens per second'"
      assert 0.0 <= float(match.group(1)) <= 100.0
  tpf = _table_section(table, "## Tokens per forward")
  for name in ROWS:
    assert all(float(c.strip("*")) > 0 for c in tpf[name])
  assert "Date:" in table and "Machine:" in table and "Training (each of" in table
  # The header states the base stage's budget and that the four models share it.
  assert ("- Base (stage 1, shared: all of arm, mdm, bd3lm, refusion, refusion_bl start from "
          "this one model): causal ARM, 4 steps x 8 rows x 64 tokens = 2,048 tokens") in table
  assert ("Training (each of arm, mdm, bd3lm, refusion, refusion_bl, fine-tuned from the base"
          in table)
  # The "Past the paper" row and what its levers moved.
  levers = _table_section(table, "## Past the paper")
  assert "both: boundary label + verified infill" in levers
  assert first["trained"]["refusion_bl"]["budget"]["changes"] == {"boundary_label": True}
  assert "changes" not in first["trained"]["refusion"]["budget"]

  # Results JSON: well-formed, and the table shows exactly its numbers.
  for name in ROWS:
    with open(os.path.join(workdir, scoring.RESULTS_DIR, f"{name}.json")) as f:
      result = json.load(f)
    assert set(result["per_task"]) == set(TASKS)
    for i, task in enumerate(TASKS):
      m = result["per_task"][task]
      assert m["n"] == 2 and m["speed_n"] == 1 and 0 <= m["correct"] <= 2
      assert m["accuracy"] == pytest.approx(100.0 * m["correct"] / m["n"])
      assert m["tokens_per_sec"] == pytest.approx(m["speed_tokens"] / m["speed_seconds"])
      acc, _, _, tps = CELL.match(main[name][i]).groups()
      assert float(acc) == pytest.approx(m["accuracy"], abs=0.051)
      assert float(tps) == pytest.approx(m["tokens_per_sec"], abs=0.051)
    mean_acc = sum(result["per_task"][t]["accuracy"] for t in TASKS) / len(TASKS)
    assert result["average"]["accuracy"] == pytest.approx(mean_acc)
    # The average carries its bootstrap interval over problems.
    acc, lo, hi, _ = CELL.match(main[name][-1].strip("*")).groups()
    assert (float(lo), float(hi)) == pytest.approx(report.accuracy_interval(result), abs=0.051)
    assert float(lo) <= float(acc) <= float(hi)
    assert len(result["samples"]) == 2 * len(TASKS)

  # Ratios vs ARM recomputed from the JSON.
  ratios = _table_section(table, "## Relative to ARM-AR")
  arm = first["results"]["ARM-AR"]["average"]["tokens_per_sec"]
  ref = first["results"]["ReFusion"]["average"]["tokens_per_sec"]
  assert ratios["ReFusion"][1] == f"{ref / arm:.2f}x"
  assert _png_size(os.path.join(workdir, pipeline.PLOT_FILE))[0] > 100


def test_base_stage_is_exported_and_every_model_starts_from_it(smoke_run):
  workdir, first, _ = smoke_run
  base_dir = os.path.join(workdir, "models", stages.BASE_MODEL)
  hf_dir = os.path.join(base_dir, stages.BASE_HF_DIR)
  assert first["base"]["step"] == 4 and first["base"]["budget"]["steps"] == 4
  with open(os.path.join(base_dir, stages.TRAIN_MARKER)) as f:
    assert json.load(f)["budget"] == first["base"]["budget"]
  # The HF export names the tokenizer's mask id: init_from_hf keeps the trained special rows.
  tok = tokenizer_lib.Tokenizer.from_dir(tokenizer_lib.TINY_TOKENIZER_DIR)
  with open(os.path.join(hf_dir, "config.json")) as f:
    hf_config = json.load(f)
  assert hf_config["mask_token_id"] == tok.mask_id
  assert not os.path.exists(os.path.join(hf_dir, "tokenizer.json"))  # hence tokenizer_dir
  for name in first["trained"]:
    assert first["trained"][name]["budget"]["base"] == first["base"]["budget"]

  # Each fine-tune started from exactly the base's final weights (special rows included,
  # not reset to the mean), with its own attention; the oracle is the base model on disk.
  _, base_model = checkpoint.load_model(os.path.join(base_dir, outputs.FINAL_MODEL_DIR))
  import flax.nnx as nnx  # pylint: disable=import-outside-toplevel
  want = _flat(nnx.to_pure_dict(nnx.state(base_model, nnx.Param)))
  inits = first["inits"]
  assert [d for d, _, _ in inits] == [hf_dir] * 5
  assert [c.attention for _, c, _ in inits] == ["causal", "bidirectional", "causal", "causal",
                                                "causal"]
  for _, _, got in inits:
    assert set(got) == set(want)
    for path, value in want.items():
      np.testing.assert_array_equal(got[path], value, err_msg=path)
  # The fine-tunes then moved away from it (they did train).
  _, arm = checkpoint.load_model(os.path.join(workdir, "models", "arm", outputs.FINAL_MODEL_DIR))
  moved = _flat(nnx.to_pure_dict(nnx.state(arm, nnx.Param)))
  assert any(not np.array_equal(moved[p], want[p]) for p in want)


def test_train_configs_of_the_two_stages(tmp_path):
  config = repro_smoke.get_config()
  base = stages.base_train_config(config, str(tmp_path))
  assert (base.objective, base.model.attention, base.num_train_steps) == ("arm", "causal", 4)
  assert base.optimizer.learning_rate == config.base.learning_rate
  assert base.export_hf_dir == os.path.join(str(tmp_path), "models", "base", "hf")
  assert base.init_from_hf == ""
  for name, attention in (("arm", "causal"), ("mdm", "bidirectional"),
                          ("refusion", "causal")):
    c = stages.train_config(config, name, str(tmp_path))
    assert (c.objective, c.model.attention) == (name, attention)
    assert c.init_from_hf == base.export_hf_dir
    assert c.tokenizer_dir == tokenizer_lib.TINY_TOKENIZER_DIR
    assert c.optimizer.learning_rate == config.train.optimizer.learning_rate
    assert c.export_hf_dir == ""
  # num_train_steps=0 keeps the from-scratch behaviour: no base, no init_from_hf.
  config.base.num_train_steps = 0
  assert stages.base_budget(config) is None
  assert stages.train_budget(config)["base"] is None
  c = stages.train_config(config, "refusion", str(tmp_path))
  assert c.init_from_hf == "" and c.tokenizer_dir == ""


def test_stale_model_state_is_discarded_not_resumed(tmp_path, monkeypatch):
  """A finished model of another budget, or any model after a new base, restarts clean."""
  seen = []

  class _Config:
    num_params = staticmethod(lambda: 7)

  class _Result:
    step, last_metrics, model_config, samples_per_step = 3, {"loss": 1.0}, _Config(), 8.0

  def fake_train(cfg, model_dir):
    seen.append(sorted(os.listdir(model_dir)) if os.path.isdir(model_dir) else None)
    return _Result()

  monkeypatch.setattr(supervised, "train_and_evaluate", fake_train)
  config = repro_smoke.get_config()
  cfg = stages.train_config(config, "arm", str(tmp_path))
  budget = stages.train_budget(config)
  model_dir = str(tmp_path / "arm")

  def leave_state(budget):
    os.makedirs(os.path.join(model_dir, "checkpoints"), exist_ok=True)
    with open(os.path.join(model_dir, stages.TRAIN_MARKER), "w") as f:
      json.dump({"budget": budget, "step": 3}, f)

  leave_state(dict(budget, steps=1))  # finished under another budget
  marker, trained = stages.train_stage("arm", cfg, budget, model_dir, print)
  assert trained and seen[-1] is None and marker["budget"] == budget
  # Same budget but no final model (interrupted): its checkpoints are resumed, kept.
  os.makedirs(os.path.join(model_dir, "checkpoints"))
  stages.train_stage("arm", cfg, budget, model_dir, print)
  assert seen[-1] == ["checkpoints", stages.TRAIN_MARKER]
  # restart (the base was retrained): everything goes, whatever the marker says.
  stages.train_stage("arm", cfg, budget, model_dir, print, restart=True)
  assert seen[-1] is None


def test_rerun_resumes_without_retraining_or_reevaluating(smoke_run, monkeypatch):
  workdir, first, first_seconds = smoke_run

  def must_not_run(*args, **kwargs):
    raise AssertionError("a finished run trained or loaded a model again")

  monkeypatch.setattr(supervised, "train_and_evaluate", must_not_run)
  monkeypatch.setattr(checkpoint, "load_model", must_not_run)
  before = _mtimes(os.path.join(workdir, "models"))
  results_before = _mtimes(os.path.join(workdir, scoring.RESULTS_DIR))
  t0 = time.perf_counter()
  second = _run(workdir)
  seconds = time.perf_counter() - t0
  assert _mtimes(os.path.join(workdir, "models")) == before  # no checkpoint or model rewritten
  assert _mtimes(os.path.join(workdir, scoring.RESULTS_DIR)) == results_before
  for name in second["trained"]:
    assert second["trained"][name]["step"] == 4
  assert second["base"] == first["base"]  # the base stage was skipped too
  for name in ROWS:
    assert second["results"][name]["average"] == first["results"][name]["average"]
  assert seconds < first_seconds / 3


def test_sweep_writes_its_plot_and_table(smoke_run):
  workdir, _, _ = smoke_run
  out = _run(workdir, sweep=True)
  points = {(p, v) for p, v in out["sweep"]}
  assert points == {("slot_size", 4), ("block_size", 16), ("slot_threshold", 0.5),
                    ("slot_threshold", 0.9), ("token_threshold", 0.2), ("token_threshold", 0.4)}
  _png_size(os.path.join(workdir, pipeline.SWEEP_PLOT_FILE))
  with open(os.path.join(workdir, pipeline.SWEEP_TABLE_FILE)) as f:
    rows = [line for line in f if line.startswith(("| slot", "| token", "| block"))]
  assert len(rows) == 6


def test_bad_settings_fail_before_training(tmp_path):
  with pytest.raises(ValueError, match="config.eval.rows: unknown row 'GPT'"):
    _run(tmp_path, **{"eval.rows": ("ARM-AR", "GPT")})
  with pytest.raises(ValueError, match="needs the 'mdm' model"):
    _run(tmp_path, models=("arm", "refusion"))
  with pytest.raises(ValueError, match="row 'ReFusion-BL-verify' needs the 'refusion_bl' model"):
    _run(tmp_path, models=("arm", "mdm", "bd3lm", "refusion", "d2f"))
  with pytest.raises(ValueError, match="'d2f' is made from the 'mdm' model"):
    _run(tmp_path, models=("arm", "bd3lm", "refusion", "refusion_bl", "d2f"))
  with pytest.raises(ValueError, match="config.distill: --config.steps must be a positive int"):
    _run(tmp_path, **{"distill.steps": 0})
  with pytest.raises(ValueError, match="'refusion_bl_rl' is made from the 'refusion_bl' model"):
    _run(tmp_path, models=("arm", "mdm", "bd3lm", "refusion", "d2f", "refusion_bl_rl"))
  with pytest.raises(ValueError, match="config.rl: --config.steps must be a positive int"):
    _run(tmp_path, **{"rl.steps": 0})
  with pytest.raises(ValueError, match="config.rl: --config.train_policy='both' with "
                                       "decode.verify='lossless'"):
    _run(tmp_path, **{"rl.train_policy": "both"})
  with pytest.raises(ValueError, match="config.rl.train_policy='selector': the RL stage makes"):
    _run(tmp_path, **{"rl.train_policy": "selector"})
  with pytest.raises(ValueError, match=r"config.models=\('arm', 'gpt'\): each must be one of"):
    _run(tmp_path, models=("arm", "gpt"))
  with pytest.raises(ValueError, match=r"config.decode.tasks.sort\): decode.block_size=16 must be "
                     "a multiple of decode.slot_size=3"):
    _run(tmp_path, **{"decode.tasks.sort.slot_size": 3})
  with pytest.raises(ValueError, match="config.sweep_grid.slot_size=3"):
    _run(tmp_path, sweep=True, **{"sweep_grid.slot_size": (4, 3), "select.enabled": False})
  with pytest.raises(ValueError, match="may pair slot_size=3 with block_size=16"):
    _run(tmp_path, **{"sweep_grid.slot_size": (4, 3)})
  with pytest.raises(ValueError, match="may pair slot_size=4 with block_size=6"):
    _run(tmp_path, **{"sweep_grid.block_size": (16, 6)})
  with pytest.raises(ValueError, match="config.base.num_train_steps must be an int >= 0"):
    _run(tmp_path, **{"base.num_train_steps": -1})
  with pytest.raises(ValueError, match="config.base.learning_rate must be a number > 0"):
    _run(tmp_path, **{"base.learning_rate": 0.0})
  with pytest.raises(ValueError, match="config.eval.speed_repeats must be a positive int"):
    _run(tmp_path, **{"eval.speed_repeats": 0})
  with pytest.raises(ValueError, match=r"config.train.num_train_steps must be a positive int "
                                       r".*or 0 with train.num_epochs > 0"):
    _run(tmp_path, **{"train.num_train_steps": 0, "train.num_epochs": 0})
  assert os.listdir(tmp_path) == []  # nothing was trained or written


def test_the_training_line_says_steps_or_epochs_and_how_rows_were_filled():
  budget = {"steps": 0, "num_epochs": 1, "global_batch_size": 9, "seq_len": 64,
            "tokens": 0, "packing": "best_fit"}
  trained = {"arm": {"step": 1300, "samples_per_step": 15.4},
             "mdm": {"step": 2222, "samples_per_step": 9.0}}
  assert report._training_size(budget, trained) == (
      "1 epoch of the training samples each (arm 1300 steps, mdm 2222 steps) x 9 rows x 64 "
      "tokens, samples packed best_fit (arm 15.4, mdm 9.0 samples per step)")
  budget.update(steps=100, num_epochs=0, tokens=100 * 9 * 64, packing="none")
  assert report._training_size(budget, trained) == (
      "100 steps x 9 rows x 64 tokens = 57,600 row tokens, one sample per row")


def test_command_line_names_a_bad_setting_and_exits_2(tmp_path):
  workdir = tmp_path / "w"
  done = subprocess.run(
      [sys.executable, "-m", "refusion_jax.reproduce", "--config=configs/repro_smoke.py",
       f"--workdir={workdir}", "--config.eval.rows=('ARM-AR', 'GPT')"],
      cwd=REPO, capture_output=True, text=True, timeout=300,
      env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert done.returncode == 2, done.stderr[-3000:]
  assert ("refusion_jax.reproduce: error: config.eval.rows: unknown row 'GPT'"
          in done.stderr), done.stderr[-3000:]
  assert not workdir.exists()


def _fake_result(acc, tps, tpf):
  per_task = {t: {"n": 200, "correct": round(2 * acc), "accuracy": acc, "tokens_per_sec": tps,
                  "tokens_per_forward": tpf, "speed_n": 5, "tpf_paper": tpf + 1.0,
                  "engine_tokens_per_sec": 2 * tps} for t in TASKS}
  return {"per_task": per_task,
          "average": {"accuracy": acc, "tokens_per_sec": tps, "tokens_per_forward": tpf,
                      "tpf_paper": tpf + 1.0}}


def _render(results):
  """The report of `results` from a fake run (one trained model, a fixed date and machine)."""
  return report.render_table(
      repro_smoke.get_config(), results,
      {"arm": {"budget": {"steps": 4, "global_batch_size": 8, "seq_len": 96, "tokens": 3072},
               "num_params": 1000, "seconds": 1.0}},
      "2026-01-01", {"platform": "Linux", "processor": "x86_64", "cpus": 2, "jax": "0",
                     "backend": "cpu", "python": "3"})


def test_targets_and_rows_in_the_report():
  results = {"ARM-AR": _fake_result(90.0, 100.0, 1.0),
             "MDM-LLaDA": _fake_result(60.0, 10.0, 1.0),
             "MDM-FastdLLM": _fake_result(60.0, 20.0, 2.0),
             "BD3LM": _fake_result(70.0, 150.0, 2.5),
             "ReFusion": _fake_result(88.5, 350.0, 4.5),
             "ReFusion-L2R": _fake_result(70.0, 90.0, 1.0),
             "ReFusion-recompute-KV": _fake_result(88.0, 300.0, 4.5)}
  verdicts = {t: met for t, _, met in report.targets(results)}
  # 3.5x ARM at 1.5 points lower; 35x and 17.5x the MDMs; 4.5 tokens/forward; Table 2:
  # within 6 points at >= 3 tokens/forward, MDMs and BD3-LM above 10%; reuse 1.17x faster
  # than recompute and 0.5 points *better*; past the paper: 18.5 points above its model left
  # to right at 4.5 tokens/forward, 1.5 below ARM.
  assert list(verdicts.values()) == [True, True, False, True, True, True, True, True, True,
                                     True, True]
  results["ReFusion"] = _fake_result(87.5, 350.0, 4.5)  # 2.5 points below ARM
  assert report.targets(results)[0][2] is False
  assert report.targets(results)[4][2] is True  # but within Table 2's 6 points
  results["ReFusion"] = _fake_result(83.5, 350.0, 4.5)  # 6.5 points below
  assert report.targets(results)[4][2] is False
  results["ReFusion"] = _fake_result(87.5, 350.0, 4.5)
  table = _render(results)
  main = _table_section(table, "# ReFusion in miniature")
  for name, r in results.items():
    lo, hi = report.accuracy_interval(r)
    assert lo < r["average"]["accuracy"] < hi
  lo, hi = report.accuracy_interval(results["ReFusion-L2R"])
  assert main["ReFusion-L2R"][-1] == f"**70.0 [{lo:.1f}, {hi:.1f}] / 90.0**"
  lo, hi = report.accuracy_interval(results["ReFusion"])
  assert main["ReFusion"][-1] == f"**87.5 [{lo:.1f}, {hi:.1f}] / 350.0**"
  assert "bootstrap 95% interval over problems" in table
  assert _table_section(table, "## Relative to ARM-AR")["ReFusion"] == ["-2.5", "3.50x"]
  tpf = _table_section(table, "## The paper's TPF")
  assert tpf["ReFusion"] == ["5.50 / 700.0"] * len(TASKS) + ["**5.50 / 700.0**"]
  # Table 2 in miniature, the paper's figures beside ours (hand-computed).
  t2 = _table_section(table, "## Table 2 in miniature")
  assert t2["Qwen3-8B retrained (AR) (ARM-AR)"] == ["90.0", "+0.0", "1.00", "1.00x", "65.7",
                                                    "+0.0", "1.00x"]
  assert t2["LLaDA retrained (MDM) (MDM-LLaDA)"] == ["60.0", "-30.0", "1.00", "0.10x", "47.4",
                                                     "-18.3", "–"]
  assert t2["BD3-LMs retrained (block 8) (BD3LM)"] == ["70.0", "-20.0", "2.50", "1.50x", "52.9",
                                                       "-12.8", "–"]
  assert t2["ReFusion (ReFusion)"] == ["87.5", "-2.5", "4.50", "3.50x", "59.9", "-5.8", "1.75x"]
  del results["BD3LM"]
  table = _render(results)
  t2 = _table_section(table, "## Table 2 in miniature")
  assert t2["BD3-LMs retrained (block 8): missing (no row BD3LM in this run)"] == [
      "–", "–", "–", "–", "52.9", "-12.8", "–"]


def test_past_the_paper_section_names_what_each_lever_moved():
  results = {"ARM-AR": _fake_result(90.0, 100.0, 1.0),
             "ReFusion": _fake_result(60.0, 300.0, 2.6),
             "ReFusion-L2R": _fake_result(75.0, 90.0, 1.0),
             "ReFusion-verify": _fake_result(76.0, 270.0, 2.4),
             "ReFusion-BL": _fake_result(61.0, 240.0, 2.7),
             "ReFusion-BL-verify": _fake_result(83.0, 300.0, 2.7),
             "ReFusion-BL-L2R": _fake_result(85.0, 90.0, 1.0)}
  results["ReFusion-BL-verify"]["average"]["corrected_per_answer"] = 1.25
  table = _render(results)
  levers = _table_section(table, "## Past the paper")
  assert levers["verified infill"] == ["ReFusion -> ReFusion-verify", "60.0 -> 76.0 (+16.0)",
                                       "2.60 -> 2.40", "0.90x"]
  assert levers["the boundary label (training)"] == [
      "ReFusion -> ReFusion-BL", "60.0 -> 61.0 (+1.0)", "2.60 -> 2.70", "0.80x"]
  assert levers["both: boundary label + verified infill"][1] == "60.0 -> 83.0 (+23.0)"
  assert "sub-slot re-masking" not in levers  # no row for it in this run
  lines = table.splitlines()
  start = lines.index("| Parallel decoder | accuracy | - its model left to right (points) | "
                      "- ARM (points) | tokens per forward | corrected tokens per answer |")
  rows = _table_section("\n".join(lines[start - 1:]), "")
  assert rows["ReFusion-BL-verify"] == ["83.0", "-2.0 (ReFusion-BL-L2R)", "-7.0", "2.70", "1.25"]
  assert rows["ReFusion-verify"] == ["76.0", "+1.0 (ReFusion-L2R)", "-14.0", "2.40", "n/a"]
  targets = {t: (m, met) for t, m, met in report.targets(results)}
  # The closest to its own left-to-right decode at >= 2.5 tokens per forward (ReFusion-verify
  # decodes 2.4), and the closest to ARM.
  assert targets["Past the paper: a parallel ReFusion row within 3 points of its model "
                 "decoded left to right, at >= 2.5 tokens per forward"] == (
      "ReFusion-BL-verify: -2.0 points against ReFusion-BL-L2R, 2.70 tokens per forward", True)
  assert targets["Past the paper: a parallel ReFusion row within 6 points of ARM"] == (
      "ReFusion-BL-verify: -7.0 points against ARM", False)


def test_average_accuracy_interval_is_a_bootstrap_over_problems():
  # Tasks of different sizes and accuracies, as right/wrong outcomes per problem.
  outcomes = {t: np.arange(n) < k for t, n, k in zip(TASKS, (30, 30, 12, 50, 30, 8, 40),
                                                     (21, 30, 5, 44, 0, 6, 33))}
  result = {"per_task": {t: {"n": len(o), "correct": int(o.sum()),
                             "accuracy": 100.0 * o.mean()} for t, o in outcomes.items()}}
  result["average"] = {"accuracy": float(np.mean([m["accuracy"]
                                                  for m in result["per_task"].values()]))}
  lo, hi = report.accuracy_interval(result)
  assert (lo, hi) == report.accuracy_interval(result)  # a fixed seed: the same interval
  assert lo < result["average"]["accuracy"] < hi
  # Oracle: the plain bootstrap, resampling each task's problems by index.
  rng = np.random.default_rng(123)
  draws = [np.mean([100.0 * o[rng.integers(0, len(o), len(o))].mean()
                    for o in outcomes.values()]) for _ in range(4000)]
  ref_lo, ref_hi = np.percentile(draws, [2.5, 97.5])
  assert abs(lo - ref_lo) < 0.8 and abs(hi - ref_hi) < 0.8, ((lo, hi), (ref_lo, ref_hi))
  # With 30 problems per task the interval is several points wide, as the table now says.
  assert hi - lo > 3.0
  # No spread where every outcome is the same; none without problems.
  perfect = {"per_task": {t: {"n": 5, "correct": 5, "accuracy": 100.0} for t in TASKS},
             "average": {"accuracy": 100.0}}
  assert report.accuracy_interval(perfect) == (100.0, 100.0)
  perfect["per_task"][TASKS[0]]["n"] = 0
  assert report.accuracy_interval(perfect) is None


def test_refusion_settings_are_chosen_on_the_validation_split(smoke_run):
  workdir, first, _ = smoke_run
  assert list(first["chosen"]) == ["ReFusion", "ReFusion-BL-verify"]
  chosen = first["chosen"]["ReFusion"]
  assert set(chosen) == set(TASKS)
  config = repro_smoke.get_config()
  # Oracle: redo the coordinate search from the cached validation results.
  start = {t: {k: config.decode.tasks[t][k] for k in ("slot_size", "block_size",
                                                      "slot_threshold", "token_threshold")}
           for t in TASKS}
  for param in settings.SWEEP_PARAMS:
    per_value = {}
    for value in config.sweep_grid[param]:
      path = os.path.join(workdir, scoring.RESULTS_DIR, scoring.SELECT_DIR,
                          f"{param}={value}.json")
      with open(path) as f:
        result = json.load(f)
      for t in TASKS:
        d = result["decode"][t]
        assert d[param] == value and all(d[k] == start[t][k] for k in start[t] if k != param)
        assert result["per_task"][t]["speed_n"] == 0  # accuracy only
      per_value[value] = result["per_task"]
    for t in TASKS:
      best = max(per_value, key=lambda v: (per_value[v][t]["accuracy"],
                                           per_value[v][t]["tokens_per_forward"]))
      start[t][param] = best
  assert chosen == start
  # The test rows decode with the chosen settings, and the table says so.
  with open(os.path.join(workdir, scoring.RESULTS_DIR, "ReFusion.json")) as f:
    decode = json.load(f)["decode"]
  for t in TASKS:
    assert {k: decode[t][k] for k in chosen[t]} == chosen[t]
  assert "chosen on the validation split (tiny_valid.jsonl" in first["table"]
  # A row with options of its own is searched with them, on its own model, in its own
  # folder, and decodes at what it chose.
  bl = first["chosen"]["ReFusion-BL-verify"]
  folder = os.path.join(workdir, scoring.RESULTS_DIR, scoring.SELECT_DIR, "ReFusion-BL-verify")
  for param in settings.SWEEP_PARAMS:
    for value in config.sweep_grid[param]:
      with open(os.path.join(folder, f"{param}={value}.json")) as f:
        result = json.load(f)
      assert result["key"]["model"] == first["trained"]["refusion_bl"]
      assert all(d["verify"] == "correct" for d in result["decode"].values())
  with open(os.path.join(workdir, scoring.RESULTS_DIR, "ReFusion-BL-verify.json")) as f:
    decode = json.load(f)["decode"]
  for t in TASKS:
    assert {k: decode[t][k] for k in bl[t]} == bl[t] and decode[t]["verify"] == "correct"
  own = "(block_size 8, slot_size 4, slot_threshold 0 in every task)"
  assert (f"ReFusion-BL-verify / ReFusion-BL-RL {own} / ReFusion-BL-drafter {own} / "
          f"ReFusion-BL-planner {own} settings per task (k, b, tau_s, tau_t), its own "
          "search") in first["table"]


def test_the_rl_stage_trains_from_its_source_and_its_row_decodes_losslessly(smoke_run):
  """Stage 3's RL: refusion_bl_rl is refusion_bl after GRPO on the lossless sampler; its row
  is keyed on its marker, decodes losslessly, and the report says how it was trained."""
  workdir, first, _ = smoke_run
  marker = first["distilled"]["refusion_bl_rl"]
  assert marker["step"] == 2 and marker["budget"]["from"]["model"] == "refusion_bl"
  assert marker["budget"]["rl"]["decode"]["verify"] == "lossless"
  assert marker["budget"]["rl"]["decode"]["gen_length"] == 16  # the rows' gen_length
  with open(os.path.join(workdir, scoring.RESULTS_DIR, "ReFusion-BL-RL.json")) as f:
    result = json.load(f)
  assert result["key"]["model"] == marker
  assert all(d["verify"] == "lossless" and d["block_size"] == 8
             for d in result["decode"].values())
  start = _flat(checkpoint.load_model(stages.final_model_dir(workdir, "refusion_bl"))[1])
  after = _flat(checkpoint.load_model(stages.final_model_dir(workdir, "refusion_bl_rl"))[1])
  assert any(not np.array_equal(start[k], after[k]) for k in start)
  assert "- Trained by RL (refusion_bl_rl, from refusion_bl; GRPO on the lossless sampler" in (
      first["table"])


def test_the_drafter_and_planner_stages_make_their_rows(smoke_run):
  """Stage 4's drafter (refusion_bl with draft adapters) and planner (the selection policy
  trained for speed on refusion_bl's lossless sampler): each row is keyed on its marker,
  decodes losslessly, the planner's with the trained weights; the report says both."""
  workdir, first, _ = smoke_run
  drafter_marker = first["distilled"]["refusion_bl_drafter"]
  planner_marker = first["distilled"]["refusion_bl_planner"]
  assert drafter_marker["step"] == 2 and planner_marker["step"] == 2
  assert drafter_marker["budget"]["from"]["model"] == "refusion_bl"
  assert planner_marker["budget"]["planner"]["train_policy"] == "selector"
  weights = json.loads(open(os.path.join(stages.model_dir(workdir, "refusion_bl_planner"),
                                         stages.PLAN_WEIGHTS_FILE), encoding="utf-8").read())
  assert weights["plan_weights"] == planner_marker["plan_weights"]
  with open(os.path.join(workdir, scoring.RESULTS_DIR, "ReFusion-BL-planner.json")) as f:
    planned = json.load(f)
  assert planned["key"]["model"] == first["trained"]["refusion_bl"]
  assert all(d["verify"] == "lossless" and d["planner"] == "policy"
             and list(d["plan_weights"]) == pytest.approx(planner_marker["plan_weights"])
             for d in planned["decode"].values())
  with open(os.path.join(workdir, scoring.RESULTS_DIR, "ReFusion-BL-drafter.json")) as f:
    drafted = json.load(f)
  assert drafted["key"]["model"] == drafter_marker
  config, after = checkpoint.load_model(stages.final_model_dir(workdir, "refusion_bl_drafter"))
  assert config.draft_rank == 4
  # Its data: the model's own greedy answers (the AR decoder's, token for token).
  from refusion_jax import drafter  # pylint: disable=import-outside-toplevel
  from refusion_jax.decode import engine  # pylint: disable=import-outside-toplevel
  from refusion_jax.decode.settings import DecodeConfig  # pylint: disable=import-outside-toplevel
  rows = [json.loads(x) for x in open(os.path.join(
      stages.model_dir(workdir, "refusion_bl_drafter"), drafter.ANSWERS_FILE), encoding="utf-8")]
  _, start = checkpoint.load_model(stages.final_model_dir(workdir, "refusion_bl"))
  ar = engine.Decoder(start, DecodeConfig(method="ar", gen_length=16)).engine(4).run(
      [r["prompt"] for r in rows])
  assert len(rows) == 8 and [r["answer"] for r in rows] == [list(x.tokens) for x in ar.results]
  # Every weight but the adapters' is the model's; the adapters moved.
  s, t = _flat(start), _flat(after)
  added = set(t) - set(s)
  assert added and all(any(name in k for name in drafter.ADAPTER_PARAMS) for k in added)
  assert all(np.array_equal(s[k], t[k]) for k in s)
  assert any(np.abs(t[k]).max() > 0 for k in added if "draft_b" in k)
  assert "- Draft adapters (refusion_bl_drafter, from refusion_bl;" in first["table"]
  assert "- Slot planner (refusion_bl_planner, for refusion_bl;" in first["table"]


def test_select_refuses_the_test_split():
  config = repro_smoke.get_config()
  config.select.data = config.eval.data
  with pytest.raises(ValueError, match="must be chosen on a validation split"):
    settings.validate(config)


def test_a_shipped_base_is_checked_and_every_model_starts_from_it(smoke_run, tmp_path):
  workdir = smoke_run[0]
  shipped = tmp_path / "base"
  shutil.copytree(os.path.join(workdir, "models", stages.BASE_MODEL, stages.BASE_HF_DIR),
                  shipped)
  digest = hashlib.sha256((shipped / "model.safetensors").read_bytes()).hexdigest()
  (shipped / "model.safetensors.sha256").write_text(f"{digest}  model.safetensors\n")
  config = repro_smoke.get_config()
  config.base.pretrained = str(shipped)
  config.base.num_train_steps = 0
  settings.validate(config)
  assert stages.base_budget(config) == {"pretrained": str(shipped), "sha256": digest}
  assert stages.train_budget(config)["base"]["sha256"] == digest
  for name in ("arm", "mdm", "bd3lm", "refusion"):
    assert stages.train_config(config, name, str(tmp_path)).init_from_hf == str(shipped)
  marker, trained = stages.train_base(config, str(tmp_path), log=lambda _: None)
  assert not trained and marker["budget"]["sha256"] == digest
  config.base.num_train_steps = 3
  with pytest.raises(ValueError, match="both ask for a base"):
    settings.validate(config)
  config.base.num_train_steps = 0
  (shipped / "model.safetensors.sha256").write_text("0" * 64 + "  model.safetensors\n")
  with pytest.raises(ValueError, match="its checksum file says"):
    settings.validate(config)
  os.remove(shipped / "model.safetensors.sha256")
  with pytest.raises(FileNotFoundError, match="model.safetensors.sha256 is missing"):
    settings.validate(config)


# Cache keys as the reproduction wrote them when DecodeConfig kept every method's fields
# in one flat dataclass (ignore_eos, kv_chunk, matmul_precision and the RL / planner fields
# left out at their defaults): the settings below, read back from such a results file.
_OLD = dict(slot_threshold=0.9, token_threshold=0.4, temperature=0.0, mdm_tokens_per_step=1,
            mdm_threshold=None, mdm_ranking="confidence", mdm_steps=None, mdm_schedule=None,
            mdm_ban_eos=False, mdm_defer_stop=False, mdm_cfg_scale=0.0, mdm_cache=None,
            mdm_cache_refresh=0, mdm_factor=None, d2f_add_threshold=0.1,
            d2f_act_threshold=0.95, d2f_conf_threshold=0.9, d2f_window=4,
            left_to_right=False, recompute_kv=False, verify="off", boundary_check=True,
            remask=False, remask_threshold=0.5)
_OLD_KEYS = {
    "ar": dict(_OLD, method="ar", gen_length=24, slot_size=24, block_size=24),
    "mdm": dict(_OLD, method="mdm", gen_length=24, slot_size=8, block_size=8,
                mdm_threshold=0.9, mdm_cache="dual"),
    "refusion": dict(_OLD, method="refusion", gen_length=24, slot_size=4, block_size=24,
                     verify="correct"),
}


def test_decode_cache_keys_written_before_still_count():
  """A result cached under a key of every method's fields (some inert) is the same decode
  as today's key of the method's own fields; a changed setting is not."""
  from refusion_jax.decode.settings import DecodeConfig  # pylint: disable=import-outside-toplevel
  now = {"ar": DecodeConfig(method="ar", gen_length=24),
         "mdm": DecodeConfig(method="mdm", gen_length=24, block_size=8, mdm_threshold=0.9,
                             mdm_cache="dual"),
         "refusion": DecodeConfig(gen_length=24, slot_size=4, block_size=24, verify="correct")}
  key = {"row": "x", "decode": {t: scoring._decode_key(c) for t, c in now.items()}}  # pylint: disable=protected-access
  assert key["decode"]["ar"] == {"method": "ar", "gen_length": 24, "temperature": 0.0,
                                 "ignore_eos": False, "kv_chunk": None,
                                 "matmul_precision": None}
  assert scoring.same_key({"row": "x", "decode": _OLD_KEYS}, key)
  for task, change in (("ar", dict(gen_length=32)), ("mdm", dict(mdm_cache="prefix")),
                       ("refusion", dict(verify="exact")), ("refusion", dict(kv_chunk=0)),
                       ("ar", dict(ignore_eos=True))):
    old = {**_OLD_KEYS, task: {**_OLD_KEYS[task], **change}}
    assert not scoring.same_key({"row": "x", "decode": old}, key), (task, change)
  assert not scoring.same_key({"row": "y", "decode": _OLD_KEYS}, key)
  assert not scoring.same_key({"row": "x", "decode": {**_OLD_KEYS, "ar": {"method": "?"}}}, key)
