"""GRPO on verifiable rewards (refusion_jax.rl): a short run on the shipped miniature
ReFusion that learns; rewards, their faults and bad settings. (Its stops and resumes
are tested with the other trainers', tests/test_loop.py.)"""

import json
import os
import time
import types

import numpy as np
import pytest

from configs import planner_lossless, rl_lossless, rl_tiny
from configs.common import ASSETS_DIR, TINY_TRAIN
from refusion_jax import loading
from refusion_jax.rl import rewards, trainer

MODEL = os.path.join(ASSETS_DIR, "refusion_tiny")


def _config(out, train_file, **changes):
  c = rl_tiny.get_config()
  c.model_dir, c.output_dir, c.train_file = MODEL, str(out), str(train_file)
  c.steps, c.prompts_per_step, c.group_size, c.micro_batch = 2, 2, 4, 4
  c.engine_rows, c.save_every, c.learning_rate = 8, 1, 3e-3
  c.decode.gen_length, c.decode.block_size = 16, 16
  c.update(changes)
  return c


def _train_file(tmp_path):
  with open(TINY_TRAIN, encoding="utf-8") as f:
    rows = [json.loads(line) for line in f][:40]
  # Queries the shipped model answers about half the time at temperature 1 (rewards vary
  # within a group, so the advantages and the update are not zero).
  keep = [r for r in rows if r["query"].split()[0] in ("arith", "lookup", "fib")][:4]
  path = tmp_path / "train.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in keep))
  return path


def _params(path):
  _, model = loading.load_model(path)
  from flax import nnx  # pylint: disable=import-outside-toplevel
  return [np.asarray(x) for x in __import__("jax").tree.leaves(nnx.state(model, nnx.Param))]


def test_a_run_learns(tmp_path):
  data = _train_file(tmp_path)
  straight = trainer.run(_config(tmp_path / "a", data), progress=False)
  assert straight["steps"] == 2 and straight["final_model"]
  lines = [json.loads(x) for x in open(tmp_path / "a" / "metrics.jsonl", encoding="utf-8")]
  assert [x["step"] for x in lines] == [1, 2]
  assert all(np.isfinite(x["loss"]) and x["tokens_per_forward"] > 0 for x in lines)
  base = _params(MODEL)
  after = _params(straight["final_model"])
  assert any(not np.array_equal(x, y) for x, y in zip(base, after))  # it learned something
  # The reference's KL is measured against the starting weights: zero at the first update.
  assert lines[0]["kl"] == pytest.approx(0.0, abs=1e-6) and lines[1]["kl"] > 0


def test_a_run_on_the_lossless_sampler_learns(tmp_path):
  """configs/rl_lossless.py: the rollouts are the model's AR samples (fused passes, more
  than one token each), scored by one causal forward."""
  data = _train_file(tmp_path)
  c = _config(tmp_path / "l", data)
  c.decode = rl_lossless.get_config().decode
  c.decode.gen_length = 16
  result = trainer.run(c, progress=False)
  lines = [json.loads(x) for x in open(tmp_path / "l" / "metrics.jsonl", encoding="utf-8")]
  assert [x["step"] for x in lines] == [1, 2] and result["final_model"]
  assert all(np.isfinite(x["loss"]) and x["tokens_per_forward"] > 1.0 for x in lines)
  assert lines[0]["kl"] == pytest.approx(0.0, abs=1e-6) and lines[1]["kl"] > 0
  assert any(not np.array_equal(x, y)
             for x, y in zip(_params(MODEL), _params(result["final_model"])))
  c.train_policy = "both"
  with pytest.raises(ValueError, match="the slot choice changes no answer there"):
    trainer.check_config(c)


def test_the_planner_trains_for_speed_on_the_lossless_sampler(tmp_path):
  """configs/planner_lossless.py: the selection policy alone, greedy lossless rollouts (a
  group's answers are one answer; its plans differ), the reward each rollout's tokens per
  forward."""
  data = _train_file(tmp_path)
  out = tmp_path / "p"
  c = _config(out, data, train_policy="selector", learning_rate=0.05, beta=0.0)
  c.decode = planner_lossless.get_config().decode
  c.decode.gen_length = 16
  c.decode.plan_weights = (0.0,) * 6  # every slot drawn with probability one half
  r = trainer.run(c, progress=False)
  assert r["final_model"] is None and r["plan_weights"] != [0.0] * 6
  lines = [json.loads(x) for x in open(out / "metrics.jsonl", encoding="utf-8")]
  for x in lines:
    assert x["reward_mean"] == pytest.approx(x["tokens_per_forward"]) and x["plan_entropy"] > 0
  assert any(x["reward_std"] > 0 for x in lines)  # the plans of one answer differ in passes


def test_bad_settings_are_one_line(tmp_path):
  data = _train_file(tmp_path)
  cases = [({"group_size": 1}, "group_size must be an int >= 2"),
           ({"beta": -0.1}, "beta .the KL weight. must be >= 0"),
           ({"micro_batch": 3}, "micro_batch=3 must divide the step's 8 rollouts"),
           ({"reward": "bleu"}, "reward must be one of"),
           ({"model_dir": str(tmp_path / "nope")},
            r"is not a folder \(nor a shipped model: base_tiny, refusion_tiny\)")]
  for changes, match in cases:
    with pytest.raises((ValueError, FileNotFoundError), match=match):
      trainer.check_config(_config(tmp_path / "x", data, **changes))
  c = _config(tmp_path / "x", data)
  c.decode.temperature = 0.0
  with pytest.raises(ValueError, match="temperature must be > 0"):
    trainer.check_config(c)
  # A rollout longer than the canvas the model has positions for.
  c = _config(tmp_path / "x", data)
  c.decode.gen_length, c.decode.block_size = 1024, 1024
  with pytest.raises(ValueError, match="exceed the model's 1024 positions"):
    trainer.run(c, progress=False)
  assert not os.path.exists(tmp_path / "x")  # nothing written


def test_benchmark_rows_read_as_they_come(tmp_path):
  from refusion_jax import config as config_lib  # pylint: disable=import-outside-toplevel
  from refusion_jax.tokenizer import Tokenizer  # pylint: disable=import-outside-toplevel
  path = tmp_path / "gsm8k.jsonl"
  path.write_text(json.dumps({"question": "2 + 3?", "answer": "so\n#### 5"}) + "\n")
  mc = config_lib.tiny()
  rows, prompts = trainer.read_rows(str(path), "gsm8k", Tokenizer.tiny(), mc, 16)
  assert rows[0]["query"] == "2 + 3?" and prompts[0] == Tokenizer.tiny().encode_prompt("2 + 3?")
  path.write_text(json.dumps({"answer": "#### 5"}) + "\n")
  with pytest.raises(ValueError, match="needs the fields \\['query'\\]"):
    trainer.read_rows(str(path), "gsm8k", Tokenizer.tiny(), mc, 16)


def test_rewards_by_hand():
  assert rewards.gsm8k_reward({"answer": "so 3 + 4 = 7\n#### 1,234"}, "It is 1234.") == 1.0
  assert rewards.gsm8k_reward({"answer": "#### 7"}, "7 apples, then 8") == 0.0
  assert rewards.gsm8k_reward({"answer": "#### -3"}, "the answer is $-3") == 1.0
  assert rewards.tasks_reward({"query": "sort 312"}, "123") == 1.0
  assert rewards.tasks_reward({"query": "sort 312"}, "132") == 0.0
  assert rewards.math_reward({"answer": "\\frac{1}{2}"}, "so \\boxed{\\frac12}") == 1.0
  assert rewards.math_reward({"solution": "is \\boxed{3}"}, "\\boxed{4}") == 0.0
  with pytest.raises(ValueError, match="needs the fields \\['answer'\\]"):
    rewards.check_row("gsm8k", {"query": "q"}, "row 1")


def test_a_reward_that_raises_or_hangs_is_a_logged_zero():
  def fn(row, text):
    if text == "raise":
      raise KeyError("no such field")
    if text == "hang":
      time.sleep(3)
    return 1.0

  log = []
  out, failed = rewards.score_all(fn, [{}] * 3, ["ok", "raise", "hang"], timeout=0.5,
                                  log=log.append)
  assert out.tolist() == [1.0, 0.0, 0.0] and failed == 2
  assert "sample 1 raised KeyError" in log[0] and "sample 2 timed out" in log[1]


def test_code_rewards_run_in_the_sandbox():
  from refusion_jax.lmeval import sandbox  # pylint: disable=import-outside-toplevel
  fn = rewards.reward_fn("mbpp", sandbox.Limits(wall_seconds=2.0, cpu_seconds=2))
  row = {"query": "q", "test_setup_code": "",
         "test_list": ["assert add(2, 3) == 5", "assert add(0, 0) == 0", "assert add(-1, 1) == 0"]}
  log = []
  out, failed = rewards.score_all(
      fn, [row] * 3, ["def add(a, b):\n    return a + b\n",
                      "def add(a, b):\n    return a - b\n",
                      "def add(a, b):\n    while True:\n        pass\n"],
      timeout=30, log=log.append)
  assert out.tolist() == [1.0, 0.0, 0.0] and failed == 1
  assert "TimeoutError" in log[0]


def test_the_selection_policy_trains_alone_with_the_base_frozen(tmp_path):
  data = _train_file(tmp_path)
  out = tmp_path / "sel"
  r = trainer.run(_config(out, data, train_policy="selector", learning_rate=0.05),
                  progress=False)
  assert r["final_model"] is None  # the model is not trained, so not written
  saved = json.loads((out / "plan_weights.json").read_text())
  assert saved["plan_weights"] == r["plan_weights"] and len(saved["features"]) == 5
  start = [20.0, 0.0, 0.0, 0.0, 0.0, -18.0]  # the soft threshold at tau_s 0.9
  assert saved["plan_weights"] != start
  lines = [json.loads(x) for x in open(out / "metrics.jsonl", encoding="utf-8")]
  assert all(x["plan_entropy"] > 0 and "token_entropy" not in x for x in lines)
  # The learnt weights decode (deterministic choice: above one half).
  from refusion_jax.decode import engine  # pylint: disable=import-outside-toplevel
  from refusion_jax.decode.settings import DecodeConfig  # pylint: disable=import-outside-toplevel
  _, model = loading.load_model(MODEL)
  dc = DecodeConfig(gen_length=16, slot_size=4, block_size=16, planner="policy",
                    plan_weights=tuple(saved["plan_weights"]))
  res = engine.Decoder(model, dc).engine(rows=2).run([[2, 10, 11, 12]])
  assert res.results[0].tokens


def test_a_sharded_run(tmp_path):
  import jax  # pylint: disable=import-outside-toplevel
  data = _train_file(tmp_path)
  c = _config(tmp_path / "m", data, steps=1)
  c.mesh.shard = True
  r = trainer.run(c, progress=False)
  assert r["devices"] == len(jax.devices()) > 1  # the suite's 8 virtual CPU devices
  assert np.isfinite(r["last"]["loss"]) and r["final_model"]


def test_the_command_line_reports_a_bad_setting_in_one_line(tmp_path):
  import subprocess  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  done = subprocess.run([sys.executable, "-m", "refusion_jax.rl", "--config=configs/rl_tiny.py",
                         f"--config.model_dir={MODEL}", f"--config.output_dir={tmp_path}/out",
                         "--config.group_size=1"], cwd=repo, capture_output=True, text=True,
                        check=False, env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert done.returncode == 2, done.stderr
  assert done.stderr.strip().splitlines()[-1].startswith(
      "refusion_jax.rl: error: --config.group_size must be an int >= 2")
  assert not os.path.exists(tmp_path / "out")  # nothing written


def test_both_policies_train_in_one_likelihood(tmp_path, capsys):
  data = _train_file(tmp_path)
  out = tmp_path / "both"
  c = _config(out, data, train_policy="both", steps=1, learning_rate=0.01)
  trainer.main(["rl"], types.SimpleNamespace(value=c))
  printed = capsys.readouterr()
  r = json.loads(printed.out)
  # It ends on the lines naming what it wrote and how to decode with each.
  weights = ",".join(f"{w:.6g}" for w in r["plan_weights"])
  assert printed.err.strip().splitlines()[-2:] == [
      f"[rl] wrote {r['final_model']} (decode it: python -m refusion_jax.sample "
      f"--config=configs/sample.py --config.model_dir={r['final_model']} --config.prompt=...)",
      f"[rl] wrote {out}/plan_weights.json (decode with it: python -m refusion_jax.sample "
      f"--config=configs/sample.py --config.model_dir={r['final_model']} "
      f"--config.decode.planner=policy --config.decode.plan_weights='({weights})' "
      "--config.prompt=...)"]
  (line,) = [json.loads(x) for x in open(out / "metrics.jsonl", encoding="utf-8")]
  assert line["token_entropy"] > 0 and line["plan_entropy"] > 0  # tokens and plan choices
  assert r["final_model"] and (out / "plan_weights.json").exists()
  assert any(not np.array_equal(x, y) for x, y in zip(_params(MODEL), _params(r["final_model"])))
