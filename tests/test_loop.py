"""The loop every trainer shares (refusion_jax.training.loop).

One test stops each trainer (supervised, D2F distillation, RL, the drafter) with real
signals and
a crash, resumes it, and compares with an uninterrupted run bit for bit, every step
logged once; then the stop notice (a second Ctrl-C stops at once) and the entry
points' one-line stops.
"""

import json
import os
import signal

import jax
import numpy as np
import pytest
from flax import nnx

from configs import d2f_tiny, drafter_tiny, rl_tiny, tiny_refusion
from configs.common import ASSETS_DIR, TINY_TRAIN
from refusion_jax import checkpoint, distill, drafter, loading, lora
from refusion_jax import config as config_lib
from refusion_jax.model import Transformer
from refusion_jax.rl import trainer as rl_trainer
from refusion_jax.training import loop, outputs, supervised


class _Crash(Exception):
  """What the test raises to stand for a process dying after a step."""


class _Runs:
  """Wraps `loop.run_loop`: records the steps each run starts, and interrupts a run as
  `plan` says: `(when, step, action)`, `when` "before" or "after" step `step` (0-based)
  runs, `action` a signal sent to this process or "crash"."""

  def __init__(self, monkeypatch):
    self.steps: list[list[int]] = []
    self.plan = None
    real = loop.run_loop

    def run_loop(task, options):
      self.steps.append([])
      task.step = self._wrap(task.step, self.plan, self.steps[-1])
      return real(task, options)

    monkeypatch.setattr(loop, "run_loop", run_loop)

  @staticmethod
  def _wrap(step_fn, plan, record):
    when, at, action = plan or (None, None, None)

    def step(state, i, stop):
      record.append(i)
      if i == at and when == "before":
        os.kill(os.getpid(), action)
      out = step_fn(state, i, stop)
      if i == at and when == "after":
        if action == "crash":
          raise _Crash(f"the process died after step {i}")
        os.kill(os.getpid(), action)
      return out

    return step


def _leaves(tree):
  return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(tree))]


class _Supervised:
  """8 steps of the miniature ReFusion on packed rows, asynchronous saves every 3 steps."""

  # SIGTERM during step 2 saves step 2; a crash after step 6 leaves checkpoint 3 and lines
  # up to step 5; the rerun resumes from 3.
  stops = ((("after", 1, signal.SIGTERM), (2, loop.EXIT_PREEMPTED)),
           (("after", 5, "crash"), None))
  starts = (0, 2, 3)

  def __init__(self, tmp_path):
    c = tiny_refusion.get_config()
    c.model.num_layers, c.data.seq_len, c.global_batch_size = 1, 64, 8
    c.data.tfds_dir, c.data.packing = str(tmp_path / "tfds"), "first_fit"
    c.num_train_steps, c.optimizer.warmup_steps = 8, 2
    c.mesh.num_devices, c.eval_every_steps, c.progress_bar = 1, 0, False
    c.checkpoint.every_steps = 3
    self.config = c

  def run(self, workdir):
    return _leaves(supervised.train_and_evaluate(self.config, str(workdir)).params)


class _Distill:
  """6 steps of D2F on a 2-layer MDM, checkpoints every 3 steps."""

  stops = ((("before", 1, signal.SIGINT), (2, loop.EXIT_INTERRUPTED)),
           (("after", 4, "crash"), None))
  starts = (0, 2, 3)

  def __init__(self, tmp_path):
    self.model_config = config_lib.tiny(num_layers=2, hidden_size=64, mlp_dim=128, num_heads=2,
                                        num_kv_heads=1, head_dim=32, attention="bidirectional")
    base = str(tmp_path / "mdm")
    checkpoint.save_model(base, self.model_config, Transformer(self.model_config, rngs=nnx.Rngs(0)))
    c = d2f_tiny.get_config()
    c.base_dir, c.steps, c.batch_size, c.save_every = base, 6, 4, 3
    c.lora_rank, c.lora_alpha, c.seq_len = 4, 4.0, 48
    self.config = c

  def run(self, workdir):
    self.config.output_dir = str(workdir)
    out = distill.run(self.config, progress=False)
    tensors = lora.read_adapter(out["adapter_dir"], self.model_config).tensors
    return [np.asarray(x) for key in sorted(tensors) for x in tensors[key]]


class _RL:
  """2 GRPO steps on the shipped miniature ReFusion."""

  # SIGTERM before step 1's rollouts end: the step is abandoned and the state before it
  # saved (step 0). SIGTERM during its update: the step finishes and is saved.
  stops = ((("before", 0, signal.SIGTERM), (0, loop.EXIT_PREEMPTED)),
           (("after", 0, signal.SIGTERM), (1, loop.EXIT_PREEMPTED)))
  starts = (0, 0, 1)

  def __init__(self, tmp_path):
    with open(TINY_TRAIN, encoding="utf-8") as f:
      rows = [json.loads(line) for line in f][:40]
    # Queries the shipped model answers about half the time (the advantages are not zero).
    keep = [r for r in rows if r["query"].split()[0] in ("arith", "lookup", "fib")][:4]
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in keep))
    c = rl_tiny.get_config()
    c.model_dir, c.train_file = os.path.join(ASSETS_DIR, "refusion_tiny"), str(data)
    c.steps, c.prompts_per_step, c.group_size, c.micro_batch = 2, 2, 4, 4
    c.engine_rows, c.save_every, c.learning_rate = 8, 5, 3e-3
    c.decode.gen_length, c.decode.block_size = 16, 16
    self.config = c

  def run(self, workdir):
    self.config.output_dir = str(workdir)
    final = rl_trainer.run(self.config, progress=False)["final_model"]
    return _leaves(nnx.state(loading.load_model(final)[1], nnx.Param))


class _Drafter:
  """6 steps of the shipped miniature's draft head on its answers to 16 prompts."""

  stops = ((("before", 1, signal.SIGINT), (2, loop.EXIT_INTERRUPTED)),
           (("after", 4, "crash"), None))
  starts = (0, 2, 3)

  def __init__(self, tmp_path):
    c = drafter_tiny.get_config()
    c.model_dir = os.path.join(ASSETS_DIR, "refusion_tiny")
    c.num_prompts, c.gen_length, c.engine_rows, c.draft_rank = 16, 16, 8, 4
    c.steps, c.batch_size, c.save_every = 6, 4, 3
    self.config = c

  def run(self, workdir):
    self.config.output_dir = str(workdir)
    final = drafter.run(self.config, progress=False)["final_model"]
    return _leaves(nnx.state(loading.load_model(final)[1], nnx.Param))


TRAINERS = {"supervised": _Supervised, "distill": _Distill, "rl": _RL, "drafter": _Drafter}


def _metrics(workdir):
  with open(os.path.join(workdir, outputs.METRICS_FILE), encoding="utf-8") as f:
    return [json.loads(line) for line in f]


@pytest.mark.parametrize("name", sorted(TRAINERS))
def test_a_stopped_run_resumes_bit_identically(name, tmp_path, monkeypatch):
  trainer = TRAINERS[name](tmp_path)
  runs = _Runs(monkeypatch)
  reference = trainer.run(tmp_path / "straight")
  workdir = tmp_path / "stopped"
  for plan, stopped in trainer.stops:
    runs.plan = plan
    with pytest.raises((loop.Stopped, _Crash)) as caught:
      trainer.run(workdir)
    if stopped is None:
      assert isinstance(caught.value, _Crash)
    else:
      assert isinstance(caught.value, loop.Stopped)
      assert (caught.value.step, caught.value.exit_status) == stopped
      saved = sorted(int(n) for n in os.listdir(workdir / outputs.CHECKPOINT_DIR) if n.isdigit())
      assert saved[-1] == stopped[0]
  # The handlers are the test's again once a run has stopped.
  assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
  runs.plan = None
  resumed = trainer.run(workdir)
  # Each run after the first started where the newest checkpoint was.
  assert tuple(steps[0] for steps in runs.steps[1:]) == trainer.starts
  assert len(resumed) == len(reference)
  for a, b in zip(resumed, reference):
    assert a.dtype == b.dtype and np.array_equal(a, b)
  # Every step logged once, with the uninterrupted run's loss exactly.
  ours, theirs = _metrics(workdir), _metrics(tmp_path / "straight")
  assert [m["step"] for m in ours] == [m["step"] for m in theirs] == list(
      range(1, len(theirs) + 1))
  assert [m["loss"] for m in ours] == [m["loss"] for m in theirs]


def test_a_second_ctrl_c_stops_at_once():
  notice = loop.StopNotice()
  try:
    assert not notice.requested and not notice.reached(1)
    os.kill(os.getpid(), signal.SIGINT)
    assert notice.requested and notice.reached(1) and notice.signum == signal.SIGINT
    os.kill(os.getpid(), signal.SIGTERM)  # a later notice changes nothing
    assert notice.signum == signal.SIGINT
    with pytest.raises(KeyboardInterrupt):
      os.kill(os.getpid(), signal.SIGINT)
  finally:
    notice.close()
  assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_entry_points_report_a_stop_in_one_line(capsys):
  for signum, status, what in ((signal.SIGTERM, 75, "preempted"),
                               (signal.SIGINT, 130, "interrupted (Ctrl-C)")):
    with pytest.raises(SystemExit) as caught, loop.stops_reported("refusion_jax.x"):
      raise loop.Stopped(4, "/w/checkpoints", signum)
    assert caught.value.code == status
    assert capsys.readouterr().err == (f"refusion_jax.x: {what}: checkpoint of step 4 saved in "
                                       "/w/checkpoints; run the same command again to resume "
                                       "from it\n")
  with pytest.raises(SystemExit) as caught, loop.stops_reported("refusion_jax.x"):
    raise loop.NonFiniteLossError("non-finite training loss at step 3")
  assert caught.value.code == "refusion_jax.x: non-finite training loss at step 3"
