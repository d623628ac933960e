"""The trainer: loss goes down, kill -9 + resume is bit-identical, SIGTERM and Ctrl-C stop
the command line with a checkpoint, sharded == single device, bad configs fail before
compiling, NaN stops cleanly, HF init rows."""

import json
import math
import os
import pathlib
import random
import re
import shutil
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from configs import tiny_arm, tiny_bd3lm, tiny_mdm, tiny_refusion
from refusion_jax import checkpoint, data, hf, objective, packaged, sharding
from refusion_jax import config as config_lib
from refusion_jax.checks import InputError
from refusion_jax.model import Transformer
from refusion_jax.training import loop, outputs, settings, supervised
from refusion_jax.training import trainer as trainer_lib
from refusion_jax.tokenizer import TINY_TOKENIZER_DIR, Tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def tfds_dir(tmp_path_factory):
  # One TFDS build of the bundled files for every run of this module.
  return str(tmp_path_factory.mktemp("tfds"))


def small_config(tfds_dir, **changes):
  """tiny_refusion cut down: 2 layers, 64-token rows, batch 8, one device."""
  c = tiny_refusion.get_config()
  c.model.num_layers = 2
  c.data.seq_len = 64
  c.data.tfds_dir = tfds_dir
  c.global_batch_size = 8
  c.num_train_steps = 30
  c.optimizer.warmup_steps = 3
  c.mesh.num_devices = 1
  c.eval_every_steps = 0
  c.progress_bar = False
  c.checkpoint.every_steps = 10
  for key, value in changes.items():
    node = c
    *parents, leaf = key.split(".")
    for p in parents:
      node = node[p]
    node[leaf] = value
  return c


def overrides(tfds_dir, **changes):
  """The same small config as command-line flags."""
  c = small_config(tfds_dir, **changes)
  flat = {
      "model.num_layers": c.model.num_layers, "data.seq_len": c.data.seq_len,
      "data.tfds_dir": c.data.tfds_dir, "global_batch_size": c.global_batch_size,
      "num_train_steps": c.num_train_steps, "optimizer.warmup_steps": c.optimizer.warmup_steps,
      "mesh.num_devices": c.mesh.num_devices, "eval_every_steps": c.eval_every_steps,
      "progress_bar": c.progress_bar, "checkpoint.every_steps": c.checkpoint.every_steps,
      "data.packing": c.data.packing}
  return [f"--config.{k}={v}" for k, v in flat.items()]


def read_metrics(workdir):
  with open(os.path.join(workdir, outputs.METRICS_FILE)) as f:
    return [json.loads(line) for line in f]


def committed_steps(workdir):
  # orbax writes each step under a temporary name and renames it when complete.
  directory = os.path.join(workdir, outputs.CHECKPOINT_DIR)
  if not os.path.isdir(directory):
    return []
  return sorted(int(n) for n in os.listdir(directory) if n.isdigit())


def host(tree):
  return jax.tree.map(np.asarray, jax.device_get(tree))


# ---------------------------------------------------------------------------


def test_configs_load_and_validate():
  for module, objective_name in ((tiny_refusion, "refusion"), (tiny_arm, "arm"),
                                 (tiny_mdm, "mdm"), (tiny_bd3lm, "bd3lm")):
    c = module.get_config()
    assert c.objective == objective_name
    model_config = settings.resolve(c).model_config
    assert (model_config.num_layers, model_config.hidden_size, model_config.vocab_size) == (
        4, 128, 512)
  assert tiny_mdm.get_config().model.attention == "bidirectional"


def test_qwen3_configs_follow_the_paper_recipe(tmp_path):
  from configs import qwen3_0_6b_refusion, qwen3_8b_refusion
  c = qwen3_8b_refusion.get_config()
  assert (c.data.seq_len, c.optimizer.learning_rate, c.optimizer.warmup_steps,
          c.optimizer.weight_decay, c.num_epochs) == (4096, 2e-5, 0, 0.0, 4)
  assert (c.model.dtype, c.model.param_dtype, tuple(c.slot_sizes)) == (
      "bfloat16", "float32", (4, 8, 16, 32))
  # 64 packed rows of ~8.8 samples (the measured share at a mean of 460 tokens) give about
  # the paper's 512 samples per step, and 4 epochs count samples, not rows.
  assert (c.data.packing, c.global_batch_size) == ("best_fit", 64)
  assert 500 <= 64 * 8.8 <= 600
  assert settings.total_train_steps(c, 3_700_000, 8.8) == int(4 * 3_700_000 // (64 * 8.8))
  assert settings.total_train_steps(c, 3_700_000) == 4 * 3_700_000 // 64  # one per row
  # Without the Qwen3 folder on this machine the config is refused by name, early.
  with pytest.raises(ValueError, match=r"config\.data\.train_files: 'data/refusion_train"):
    settings.validate_config(c, num_devices=128)
  # A program compiled ahead of time (refusion_jax.aot) reads neither the data nor the folder.
  assert settings.validate_config(c, num_devices=64, check_files=False) == {
      "data": 1, "fsdp": 64, "tensor": 1}
  c.data.train_files = (tiny_refusion.common.TINY_TRAIN,)
  with pytest.raises(ValueError, match=r"--config\.init_from_hf='Qwen3-8B' is not a folder \(nor a shipped model: "):
    settings.validate_config(c, num_devices=128)
  c.init_from_hf = str(tmp_path)
  # 64 rows do not split over 128 chips of fsdp; with tensor=2 (v4-256) they do.
  with pytest.raises(ValueError, match=r"global_batch_size=64 is not divisible .* 1 x 128"):
    settings.validate_config(c, num_devices=128)
  c.mesh.tensor = 2
  assert settings.validate_config(c, num_devices=128) == {"data": 1, "fsdp": 64, "tensor": 2}
  c.mesh.tensor = 4
  assert settings.validate_config(c, num_devices=256) == {"data": 1, "fsdp": 64, "tensor": 4}
  small = qwen3_0_6b_refusion.get_config()
  assert small.init_from_hf and small.optimizer.learning_rate == 2e-5


def test_schedule_warmup_cosine_and_no_warmup():
  c = tiny_refusion.get_config()
  c.optimizer.learning_rate = 2e-5
  c.optimizer.warmup_steps = 0
  _, schedule = trainer_lib.make_optimizer(c.optimizer, 100)
  for step in (0, 1, 50, 99, 100):
    expected = 2e-5 * 0.5 * (1 + math.cos(math.pi * step / 100))
    assert float(schedule(step)) == pytest.approx(expected, rel=1e-5, abs=1e-12)
  c.optimizer.warmup_steps = 10
  c.optimizer.end_lr_ratio = 0.1
  _, schedule = trainer_lib.make_optimizer(c.optimizer, 110)
  assert float(schedule(0)) == 0.0
  assert float(schedule(5)) == pytest.approx(1e-5, rel=1e-5)
  assert float(schedule(10)) == pytest.approx(2e-5, rel=1e-5)
  assert float(schedule(110)) == pytest.approx(2e-6, rel=1e-4)


def test_training_lowers_the_loss(tmp_path, tfds_dir):
  c = small_config(tfds_dir, num_train_steps=60, eval_every_steps=30, eval_batches=2,
                   **{"optimizer.warmup_steps": 5, "checkpoint.every_steps": 60})
  result = supervised.train_and_evaluate(c, str(tmp_path))
  records = read_metrics(tmp_path)
  losses = [m["loss"] for m in records if "loss" in m]
  evals = [m for m in records if "eval_loss" in m]
  assert len(losses) == 60
  assert [m["step"] for m in evals] == [30, 60]
  assert evals[1]["eval_loss"] < evals[0]["eval_loss"]
  assert result.eval_metrics["loss"] == evals[1]["eval_loss"]
  assert {"step", "loss", "ar_loss", "mdm_loss", "lr", "grad_norm", "tokens_per_sec"} <= set(
      records[0])
  first, last = np.mean(losses[:5]), np.mean(losses[-5:])
  # A uniform guess over 512 tokens costs ln(512) = 6.24 per AR token; training must
  # cut the hybrid loss well below where it started.
  assert last < 0.6 * first, (first, last)
  assert result.step == 60
  # The final model folder holds exactly the returned parameters.
  _, model = checkpoint.load_model(str(tmp_path / outputs.FINAL_MODEL_DIR))
  loaded = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  jax.tree.map(np.testing.assert_array_equal, host(loaded), host(result.params))
  assert any(n.startswith("events.out.tfevents")
             for n in os.listdir(tmp_path / outputs.TENSORBOARD_DIR))


def test_bd3lm_trains_on_packed_rows_of_whole_blocks(tmp_path, tfds_dir, monkeypatch):
  # The loader EOS-pads every response to whole blocks; the step halves nothing away.
  seen = []
  real_loss_fn = objective.loss_fn

  def loss_fn(model, batch, rng, **kwargs):
    seen.append(kwargs["bd3lm_block_size"])
    return real_loss_fn(model, batch, rng, **kwargs)

  monkeypatch.setattr(objective, "loss_fn", loss_fn)
  c = small_config(tfds_dir, objective="bd3lm", bd3lm_block_size=4, num_train_steps=40,
                   **{"data.packing": "best_fit", "checkpoint.every_steps": 40,
                      "optimizer.warmup_steps": 2})
  tokenizer = settings.load_tokenizer(c)
  loader = data.loader_from_config(dict(c.data, tfds_dir=tfds_dir), tokenizer, 8,
                                   eos_pad_multiple=settings.eos_pad_multiple(c))
  batch = next(iter(loader))
  starts = (batch["segment_ids"] > 0) & (batch["positions"] == 0)
  p, r = batch["segment_prompt_len"][starts], batch["segment_response_len"][starts]
  assert ((r % 4 == 0) | (p + r == 64)).all() and (r % 4 == 0).mean() > 0.9
  assert (batch["segment_ids"] > 0).sum() / batch["tokens"].size > 0.6  # packed
  supervised.train_and_evaluate(c, str(tmp_path))
  assert set(seen) == {4}
  losses = [m["loss"] for m in read_metrics(tmp_path) if "loss" in m]
  assert len(losses) == 40 and np.mean(losses[-5:]) < 0.7 * np.mean(losses[:5])


def _train_command(workdir, tfds_dir, **changes):
  return [sys.executable, "-m", "refusion_jax.train",
          "--config=" + os.path.join(REPO, "configs", "tiny_refusion.py"),
          "--workdir=" + str(workdir)] + overrides(tfds_dir, **changes)


INTERRUPTED_RUN = {"num_train_steps": 40, "checkpoint.every_steps": 4,
                   "data.packing": "first_fit"}


def _cached_env(tmp_path_factory):
  # The runs compile the same programs: a shared persistent compilation cache lets the
  # later ones load them instead of compiling again.
  cache = tmp_path_factory.getbasetemp() / "interrupted_runs_jax_cache"
  return dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(cache),
              JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
              JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")


def _run_to_end(workdir, tfds_dir, env, log_path):
  with open(log_path, "w") as log_file:
    done = subprocess.run(_train_command(workdir, tfds_dir, **INTERRUPTED_RUN), cwd=REPO,
                          env=env, stdout=log_file, stderr=subprocess.STDOUT, timeout=300)
  assert done.returncode == 0, log_path.read_text()[-3000:]


@pytest.fixture(scope="module")
def uninterrupted_run(tmp_path_factory, tfds_dir):
  """A packed run of 40 steps, uninterrupted: what every interrupted one must end as."""
  workdir = tmp_path_factory.mktemp("uninterrupted") / "run"
  env = _cached_env(tmp_path_factory)
  _run_to_end(workdir, tfds_dir, env, workdir.parent / "train.log")
  return workdir, env


def _interrupt(workdir, tfds_dir, env, log_path, after_steps: int, signum: int):
  """Starts the packed run and sends `signum` once `after_steps` steps are logged (and a
  checkpoint exists); returns the exit status."""
  with open(log_path, "w") as log_file:  # a file, not a pipe: a full pipe would stall the child
    proc = subprocess.Popen(_train_command(workdir, tfds_dir, **INTERRUPTED_RUN), cwd=REPO,
                            env=env, stdout=log_file, stderr=subprocess.STDOUT)
    try:
      deadline = time.monotonic() + 300
      while time.monotonic() < deadline and proc.poll() is None:
        path = os.path.join(workdir, outputs.METRICS_FILE)
        if committed_steps(workdir) and os.path.exists(path):
          with open(path) as f:
            logged = f.read().count("\n")
          if logged >= after_steps:
            break
        time.sleep(0.01)
      assert proc.poll() is None, log_path.read_text()[-3000:]
      os.kill(proc.pid, signum)
      proc.wait(timeout=120)
    finally:
      if proc.poll() is None:
        proc.kill()
        proc.wait()
  return proc.returncode


def _assert_same_run(workdir, reference):
  finals = []
  for w in (workdir, reference):
    _, model = checkpoint.load_model(os.path.join(w, outputs.FINAL_MODEL_DIR))
    finals.append(host(nnx.to_pure_dict(nnx.state(model, nnx.Param))))
  for a, b in zip(jax.tree.leaves(finals[0]), jax.tree.leaves(finals[1])):
    assert a.dtype == b.dtype and np.array_equal(a, b)
  # Every step's loss is logged once and matches the uninterrupted run exactly.
  ours = {m["step"]: m["loss"] for m in read_metrics(workdir)}
  theirs = {m["step"]: m["loss"] for m in read_metrics(reference)}
  assert sorted(ours) == list(range(1, INTERRUPTED_RUN["num_train_steps"] + 1))
  assert ours == theirs


def test_a_run_says_only_its_own_lines_and_where_its_model_went(uninterrupted_run):
  """No library's log lines (orbax's saves, TFDS's) unless --verbosity asks; the last line
  names the model folder written and how to decode it."""
  workdir, _ = uninterrupted_run
  log = (workdir.parent / "train.log").read_text()
  lines = [line for line in log.replace("\r", "\n").splitlines() if line.strip()]
  assert not [line for line in lines if line[:1] in "IWE" and line[1:5].isdigit()], log[-3000:]
  assert "Downloading and preparing" not in log
  final = os.path.join(workdir, outputs.FINAL_MODEL_DIR)
  assert lines[-1].startswith(f"[train] wrote {final} (decode it: python -m "
                              "refusion_jax.sample"), lines[-3:]


def test_kill_9_then_resume_is_bit_identical(tmp_path, tfds_dir, uninterrupted_run):
  reference, env = uninterrupted_run
  steps = INTERRUPTED_RUN["num_train_steps"]
  workdir = str(tmp_path / "killed")
  kill_after = random.Random(os.getpid()).randrange(6, 30)
  code = _interrupt(workdir, tfds_dir, env, tmp_path / "train.log", kill_after, signal.SIGKILL)
  assert code == -signal.SIGKILL
  saved = committed_steps(workdir)
  assert saved and max(saved) < steps, saved
  assert not os.path.exists(os.path.join(workdir, outputs.FINAL_MODEL_DIR))

  _run_to_end(workdir, tfds_dir, env, tmp_path / "train.log")  # resumes from the newest one
  _assert_same_run(workdir, reference)
  # The rows were packed: more samples than rows in every step.
  assert all(m["samples"] > 8 for m in read_metrics(workdir))


@pytest.mark.parametrize("signum, status, what", [
    (signal.SIGTERM, loop.EXIT_PREEMPTED, "preempted"),
    (signal.SIGINT, loop.EXIT_INTERRUPTED, "interrupted (Ctrl-C)")])
def test_sigterm_or_ctrl_c_saves_the_step_it_interrupts(tmp_path, tmp_path_factory, tfds_dir,
                                                         signum, status, what):
  # How the command line stops; resuming from the checkpoint is tests/test_loop.py's.
  workdir = str(tmp_path / "stopped")
  log_path = tmp_path / "train.log"
  after = random.Random(os.getpid() + signum).randrange(6, 30)
  code = _interrupt(workdir, tfds_dir, _cached_env(tmp_path_factory), log_path, after, signum)
  log = log_path.read_text()
  assert code == status, log[-3000:]
  last = max(m["step"] for m in read_metrics(workdir))
  # The step running when the signal came was finished and saved, and nothing after it.
  assert after <= last < INTERRUPTED_RUN["num_train_steps"]
  assert max(committed_steps(workdir)) == last
  assert log.strip().splitlines()[-1] == (
      f"refusion_jax.train: {what}: checkpoint of step {last} saved in "
      f"{os.path.join(workdir, outputs.CHECKPOINT_DIR)}; run the same command again to resume "
      "from it")
  assert "Traceback" not in log
  assert not os.path.exists(os.path.join(workdir, outputs.FINAL_MODEL_DIR))


def _one_step(config, model_config, mesh, params_host, batch):
  trainer = trainer_lib.Trainer(config, model_config, mesh=mesh,
                                pad_id=Tokenizer.tiny().pad_id, total_steps=10)
  params = trainer.place_params(params_host)
  opt_state = trainer.init_opt_state(params)
  params, opt_state, metrics = trainer.train_step(params, opt_state, trainer.shard_batch(batch),
                                                  0)
  # The sharded run really is sharded as the rules say.
  q = params["layers"][0]["attn"]["q_proj"]
  return host(params), host(metrics), q.sharding.spec, host(opt_state)


@pytest.mark.parametrize("objective_name", ["refusion"])
def test_sharded_step_equals_single_device_step(tfds_dir, objective_name):
  # No warmup, so the first update moves the parameters by about the learning rate. Adam's
  # first step is ~lr * sign(g): where |g| is near Adam's eps, float reordering between
  # the layouts shows up as a fraction of lr, so lr is 1e-4 here (the paper's is 2e-5): a
  # gradient of ~1e-8 moved one weight 0.06 lr apart at 2e-4.
  # The gradients themselves are compared through Adam's first moment (0.1 * grad).
  c = small_config(tfds_dir, objective=objective_name, **{"optimizer.warmup_steps": 0,
                                                          "optimizer.learning_rate": 1e-4,
                                                          "model.num_layers": 1})
  tok = Tokenizer.tiny()
  model_config = settings.build_model_config(c, tok)
  batch = next(iter(data.loader_from_config(c.data, tok, c.global_batch_size)))
  params_host = host(nnx.to_pure_dict(nnx.state(Transformer(model_config, rngs=nnx.Rngs(1)),
                                                nnx.Param)))
  devices = jax.devices()
  assert len(devices) == 8
  single = sharding.make_mesh(1, 1, 1, devices=devices[:1])
  sharded = sharding.make_mesh(1, 4, 2, devices=devices)
  p1, m1, _, o1 = _one_step(c, model_config, single, params_host, batch)
  p8, m8, spec, o8 = _one_step(c, model_config, sharded, params_host, batch)
  assert spec == jax.sharding.PartitionSpec("fsdp", "tensor", None)
  for k in ("loss", "ar_loss", "mdm_loss", "grad_norm"):
    assert abs(m1[k] - m8[k]) <= 1e-5 * max(1.0, abs(m1[k])), (k, m1[k], m8[k])
  for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p8)):
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
  for a, b in zip(jax.tree.leaves(o1), jax.tree.leaves(o8)):
    np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)
  # The update did move the parameters (a step that changed nothing would pass trivially).
  assert not np.array_equal(p1["embed"], params_host["embed"])


def test_loss_chunk_step_equals_full_logits_step(tfds_dir, monkeypatch):
  # 64-token rows in chunks of 24 (two scanned chunks and a remainder) on a (fsdp 4,
  # tensor 2) mesh, where each chunk's logits keep the vocabulary split, against the
  # full logits on one device.
  c = small_config(tfds_dir, **{"optimizer.warmup_steps": 0, "model.num_layers": 1})
  tok = Tokenizer.tiny()
  model_config = settings.build_model_config(c, tok)
  rng = np.random.default_rng(4)
  prompt_len = rng.integers(1, 20, 8).astype(np.int32)
  response_len = rng.integers(1, 64 - prompt_len + 1).astype(np.int32)
  tokens = rng.integers(4, tok.id_limit, (8, 64)).astype(np.int32)
  batch = {"tokens": tokens, "prompt_len": prompt_len, "response_len": response_len}
  params_host = host(nnx.to_pure_dict(nnx.state(Transformer(model_config, rngs=nnx.Rngs(2)),
                                                nnx.Param)))
  single = sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
  _, m_full, _, o_full = _one_step(c, model_config, single, params_host, batch)
  chunk_lens = []
  real_chunked = objective.chunked_token_cross_entropy

  def chunked(h_btd, unembed, labels_bt, chunk_len):
    chunk_lens.append(chunk_len)
    return real_chunked(h_btd, unembed, labels_bt, chunk_len)

  monkeypatch.setattr(objective, "chunked_token_cross_entropy", chunked)
  c.loss_chunk = 24
  _, metrics, _, opt_state = _one_step(c, model_config, sharding.make_mesh(1, 4, 2),
                                       params_host, batch)
  assert chunk_lens == [24]  # the trainer did take the chunked path
  assert m_full["ar_tokens"] > 0 and m_full["mdm_tokens"] > 0
  for k in ("loss", "ar_loss", "mdm_loss", "ar_tokens", "mdm_tokens", "grad_norm"):
    assert abs(metrics[k] - m_full[k]) <= 1e-5 * max(1.0, abs(m_full[k])), (
        k, metrics[k], m_full[k])
  # Adam's first moment after one step is 0.1 * grad: the gradients agree leaf by leaf.
  for a, b in zip(jax.tree.leaves(opt_state), jax.tree.leaves(o_full)):
    np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)


@pytest.mark.parametrize("changes, message", [
    ({"slot_sizes": (4, 0, 16)}, r"config\.slot_sizes.*0"),
    ({"slot_sizes": (4, -8)}, r"config\.slot_sizes.*-8"),
    ({"global_batch_size": 6, "mesh.num_devices": 0, "mesh.data": 4, "mesh.fsdp": -1},
     r"config\.global_batch_size=6 is not divisible by the mesh's data x fsdp = 4 x 2"),
    ({"objective": "bert"}, r"config\.objective must be one of .* got 'bert'"),
    ({"loss_chunk": -1}, r"config\.loss_chunk must be a non-negative int .*got -1"),
    ({"objective": "arm", "boundary_label": True},
     r"config\.boundary_label=True labels ReFusion's clean slots; config\.objective='arm'"),
    ({"data.seq_len": 2048}, r"config\.data\.seq_len=2048 exceeds .*max_position_embeddings=1024"),
    ({"model.preset": "qwen3_0_6b", "model.dtype": "float32"},
     r"config\.objective='refusion' needs a mask token"),
    ({"model.vocab_size": 256}, r"vocabulary mismatch .* vocab_size is 256"),
    ({"objective": "mdm"}, r"needs config\.model\.attention='bidirectional'"),
    ({"mesh.tensor": 3, "mesh.num_devices": 0}, r"config\.mesh: 8 devices are not divisible"),
    ({"data.packing": "greedy"}, r"config\.data\.packing must be one of .*got 'greedy'"),
    ({"data.packing_bins": -1}, r"config\.data\.packing_bins must be an int >= 0"),
    ({"mdm_response_len": -3}, r"config\.mdm_response_len must be an int >= 0"),
    ({"optimizer.learning_rate": float("inf")},
     r"config\.optimizer\.learning_rate must be a positive float, got inf"),
    ({"optimizer.weight_decay": float("inf")}, r"config\.optimizer\.weight_decay must be a "),
    ({"optimizer.learning_rate": float("nan")},
     r"config\.optimizer\.learning_rate must be a positive float, got nan"),
    ({"objective": "bd3lm", "bd3lm_block_size": 0}, r"config\.bd3lm_block_size must be a "),
    ({"objective": "bd3lm", "bd3lm_eps_min": 0.9, "bd3lm_eps_max": 0.5},
     r"config\.bd3lm_eps_min=0\.9 exceeds bd3lm_eps_max=0\.5"),
    ({"objective": "bd3lm", "model.attention_impl": "splash"},
     r"config\.objective='bd3lm' needs config\.model\.attention_impl='xla', got 'splash'"),
    ({"data.packing": "first_fit", "model.attention_impl": "cudnn"},
     r"attention_impl='cudnn' cannot keep packed samples apart .*data\.packing='first_fit'"),
])
def test_bad_config_fails_before_compiling(tmp_path, tfds_dir, monkeypatch, changes, message):
  def no_compile(*args, **kwargs):
    raise AssertionError("the trainer was built although the config is invalid")

  monkeypatch.setattr(trainer_lib, "Trainer", no_compile)
  monkeypatch.setattr(data, "loader_from_config", no_compile)
  c = small_config(tfds_dir, **changes)
  with pytest.raises(ValueError, match=message):
    supervised.train_and_evaluate(c, str(tmp_path / "w"))
  assert not os.path.exists(tmp_path / "w")


def test_nan_loss_stops_and_keeps_last_good_checkpoint(tmp_path, tfds_dir, monkeypatch):
  c = small_config(tfds_dir, num_train_steps=12, **{"checkpoint.every_steps": 3,
                                                     "model.num_layers": 1})
  real_loss_fn = objective.loss_fn
  poisoned = jax.random.key_data(trainer_lib.step_rng(c.seed, 7))  # update 7 -> 8 goes bad

  def loss_fn(model, batch, rng, **kwargs):
    loss, metrics = real_loss_fn(model, batch, rng, **kwargs)
    bad = jnp.all(jax.random.key_data(rng) == poisoned)
    return jnp.where(bad, jnp.nan, loss), metrics

  monkeypatch.setattr(objective, "loss_fn", loss_fn)
  workdir = str(tmp_path)
  with pytest.raises(loop.NonFiniteLossError,
                     match=r"non-finite training loss at step 8 .*last good checkpoint is step 6"):
    supervised.train_and_evaluate(c, workdir)
  assert committed_steps(workdir) == [3, 6]
  assert [m["step"] for m in read_metrics(workdir)] == list(range(1, 8))
  assert not os.path.exists(os.path.join(workdir, outputs.FINAL_MODEL_DIR))
  # The kept checkpoint is complete and finite.
  tok = Tokenizer.tiny()
  model_config = settings.build_model_config(c, tok)
  mesh = sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
  trainer = trainer_lib.Trainer(c, model_config, mesh=mesh, pad_id=tok.pad_id, total_steps=12)
  it = iter(data.loader_from_config(c.data, tok, c.global_batch_size))
  with checkpoint.TrainCheckpointer(os.path.join(workdir, outputs.CHECKPOINT_DIR),
                                    max_to_keep=3) as ckpt:
    state, meta = ckpt.restore(6, trainer.abstract_train_state(), it)
  assert meta["step"] == 6
  assert all(np.isfinite(x).all() for x in jax.tree.leaves(host(state)))
  # Resuming that workdir with another seed would not continue the same run: refused.
  c.seed = 1
  with pytest.raises(ValueError, match=r"checkpoints/6 was written with seed=0 but the config "
                                       r"now gives 1"):
    supervised.train_and_evaluate(c, workdir)


@pytest.mark.parametrize("model_type", ["qwen3", "qwen2"])
def test_init_from_hf_adds_special_rows_as_mean(tmp_path, tfds_dir, model_type):
  tok = Tokenizer.tiny()
  assert (tok.bos_id, tok.mask_id, tok.id_limit) == (2, 3, 512)
  # A plain Qwen3 or Qwen2.5 (no ReFusion tokens) with a smaller vocabulary and an untied
  # head: ReFusion trained on Qwen2.5 is the paper's Table 3 row.
  hf_config = config_lib.tiny(num_layers=1, vocab_size=500, tie_embeddings=False,
                              mask_token_id=None, bos_token_id=None, model_type=model_type)
  source = Transformer(hf_config, rngs=nnx.Rngs(7))
  if model_type == "qwen2":  # biases start at 0: make them count
    attn = source.layers[0].attn
    attn.q_bias[...] = jax.random.normal(jax.random.key(1), attn.q_bias[...].shape)
  hf_dir = str(tmp_path / "hf")
  hf.save(hf_config, source, hf_dir)
  embed_vd = np.asarray(source.embed[...], np.float64)
  head_dv = np.asarray(source.lm_head[...], np.float64)

  c = small_config(tfds_dir, init_from_hf=hf_dir, tokenizer_dir=TINY_TOKENIZER_DIR,
                   num_train_steps=1)
  c.model.num_layers = None  # the folder decides the shapes
  model_config = settings.build_model_config(c, tok)
  assert (model_config.vocab_size, model_config.mask_token_id, model_config.bos_token_id) == (
      512, 3, 2)
  assert model_config.num_layers == 1 and not model_config.tie_embeddings
  assert model_config.model_type == model_type
  mesh = sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
  trainer = trainer_lib.Trainer(c, model_config, mesh=mesh, pad_id=tok.pad_id, total_steps=1)
  params = host(trainer_lib.init_params_from_hf(trainer, hf_dir, tok))

  kept = [i for i in range(500) if i not in (2, 3)]
  mean_d = embed_vd[kept].mean(axis=0)
  head_mean_d = head_dv[:, kept].mean(axis=1)
  assert params["embed"].shape == (512, 128) and params["lm_head"].shape == (128, 512)
  for i in list(range(500, 512)) + [2, 3]:
    np.testing.assert_allclose(params["embed"][i], mean_d, atol=1e-6)
    np.testing.assert_allclose(params["lm_head"][:, i], head_mean_d, atol=1e-6)
  np.testing.assert_array_equal(params["embed"][kept], embed_vd[kept].astype(np.float32))
  np.testing.assert_array_equal(params["lm_head"][:, kept], head_dv[:, kept].astype(np.float32))
  np.testing.assert_array_equal(params["layers"][0]["mlp"]["up_proj"],
                                np.asarray(source.layers[0].mlp.up_proj[...]))
  if model_type == "qwen2":
    np.testing.assert_array_equal(params["layers"][0]["attn"]["q_bias"],
                                  np.asarray(source.layers[0].attn.q_bias[...]))
    assert "q_norm" not in params["layers"][0]["attn"]

  # The whole loop from the folder: two steps, then the HF export holds the final params.
  export = str(tmp_path / "export")
  c.export_hf_dir = export
  c.num_train_steps = 2
  c.optimizer.warmup_steps = 0
  result = supervised.train_and_evaluate(c, str(tmp_path / "w"))
  _, exported = hf.load(export)
  jax.tree.map(np.testing.assert_array_equal,
               host(nnx.to_pure_dict(nnx.state(exported, nnx.Param))), host(result.params))
  assert not np.array_equal(host(result.params)["embed"], params["embed"])

  # A shape field that contradicts the folder is refused.
  c.model.num_layers = 4
  with pytest.raises(ValueError, match=r"config\.model\.num_layers=4 conflicts with init_from_hf"):
    settings.build_model_config(c, tok)


def test_init_from_hf_names_the_shipped_base_and_finds_its_tokenizer(tmp_path, tfds_dir,
                                                                      monkeypatch):
  # The shipped base by its short name (no folder of that name here); its folder has no
  # tokenizer.json, and its vocabulary and special ids are the bundled tokenizer's.
  monkeypatch.chdir(tmp_path)
  c = small_config(tfds_dir, init_from_hf="base_tiny", num_train_steps=4)
  c.model.num_layers = None  # the folder decides the shapes
  settings.validate_config(c, num_devices=1)
  tok = settings.load_tokenizer(c)
  assert tok.source == Tokenizer.tiny().source
  model_config = settings.build_model_config(c, tok)
  assert model_config.num_layers == config_lib.from_hf_config(packaged.BASE_TINY_DIR).num_layers
  mesh = sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
  trainer = trainer_lib.Trainer(c, model_config, mesh=mesh, pad_id=tok.pad_id, total_steps=1)
  params = trainer_lib.init_params_from_hf(trainer, "base_tiny", tok)
  _, base = hf.load(packaged.BASE_TINY_DIR)
  np.testing.assert_array_equal(np.asarray(params["embed"]), np.asarray(base.embed[...]))
  # A folder without a tokenizer.json whose model the bundled tokenizer does not fit.
  folder = tmp_path / "other"
  shutil.copytree(packaged.BASE_TINY_DIR, folder)
  with open(folder / "config.json") as f:
    hf_config = json.load(f)
  hf_config["eos_token_id"] = 7
  with open(folder / "config.json", "w") as f:
    json.dump(hf_config, f)
  c.init_from_hf = str(folder)
  with pytest.raises(ValueError, match=r"config\.init_from_hf='.*other': no tokenizer .*; set "
                     r"config\.tokenizer_dir"):
    settings.load_tokenizer(c)


def _export_case(tmp_path, case):
  """(workdir, export_hf_dir, files that must survive) for one unsafe export target."""
  workdir = tmp_path / "w"
  if case == "folder with other files":
    export = tmp_path / "mine"
    export.mkdir()
    (export / "notes.txt").write_text("keep me")
    (export / "config.json").write_text("{}")  # looks like an export, but is not this run's
    return workdir, export, [export / "notes.txt", export / "config.json"]
  if case == "the workdir":
    (workdir / outputs.CHECKPOINT_DIR / "10").mkdir(parents=True)
    (workdir / outputs.CHECKPOINT_DIR / "10" / "state").write_text("checkpoint")
    (workdir / outputs.METRICS_FILE).write_text('{"step": 10}\n')
    return workdir, workdir, [workdir / outputs.CHECKPOINT_DIR / "10" / "state",
                              workdir / outputs.METRICS_FILE]
  if case == "a parent of the workdir":
    workdir = tmp_path / "runs" / "w"
    workdir.mkdir(parents=True)
    (workdir / outputs.METRICS_FILE).write_text('{"step": 1}\n')
    return workdir, tmp_path / "runs", [workdir / outputs.METRICS_FILE]
  if case == "inside the checkpoints":
    (workdir / outputs.CHECKPOINT_DIR / "10").mkdir(parents=True)
    (workdir / outputs.CHECKPOINT_DIR / "10" / "state").write_text("checkpoint")
    return workdir, workdir / outputs.CHECKPOINT_DIR / "hf", [
        workdir / outputs.CHECKPOINT_DIR / "10" / "state"]
  if case == "the final model":
    return workdir, workdir / outputs.FINAL_MODEL_DIR, []
  if case == "a file":
    export = tmp_path / "model.bin"
    export.write_text("weights")
    return workdir, export, [export]
  if case == "another run's export":
    export = tmp_path / "hf"
    export.mkdir()
    (export / outputs.EXPORT_MARKER).write_text(json.dumps({"workdir": str(tmp_path / "other")}))
    (export / "model.safetensors").write_text("other run's weights")
    return workdir, export, [export / "model.safetensors"]
  raise AssertionError(case)


@pytest.mark.parametrize("case, message", [
    ("folder with other files", r"holds files this run did not write"),
    ("the workdir", r"is the workdir"),
    ("a parent of the workdir", r"contains the workdir"),
    ("inside the checkpoints", r"overlaps .*checkpoints"),
    ("the final model", r"overlaps .*final_model"),
    ("a file", r"exists and is not a folder"),
    ("another run's export", r"holds files this run did not write"),
])
def test_export_that_would_delete_files_is_refused_before_work(tmp_path, tfds_dir, monkeypatch,
                                                               case, message):
  workdir, export, keep = _export_case(tmp_path, case)
  before = {str(p): p.read_text() for p in keep}

  def no_work(*args, **kwargs):
    raise AssertionError("training started although the export target is unsafe")

  monkeypatch.setattr(trainer_lib, "Trainer", no_work)
  monkeypatch.setattr(data, "loader_from_config", no_work)
  c = small_config(tfds_dir, export_hf_dir=str(export))
  with pytest.raises(ValueError, match=r"config\.export_hf_dir=.*" + message):
    supervised.train_and_evaluate(c, str(workdir))
  assert {str(p): p.read_text() for p in keep} == before


def test_export_replaces_only_its_own_earlier_export(tmp_path, tfds_dir):
  workdir, export = tmp_path / "w", tmp_path / "hf"
  c = small_config(tfds_dir, num_train_steps=2, export_hf_dir=str(export),
                   **{"optimizer.warmup_steps": 0, "model.num_layers": 1})
  supervised.train_and_evaluate(c, str(workdir))
  assert outputs.EXPORT_MARKER in os.listdir(export)
  hf.load(str(export))  # the marker does not disturb loading
  # A rerun of the finished run exports again over its own export (the damaged weights
  # file shows that it did).
  (export / "model.safetensors").write_bytes(b"damaged")
  result = supervised.train_and_evaluate(c, str(workdir))
  _, exported = hf.load(str(export))
  jax.tree.map(np.testing.assert_array_equal,
               host(nnx.to_pure_dict(nnx.state(exported, nnx.Param))), host(result.params))
  # Another run may not replace it.
  with pytest.raises(ValueError, match=r"holds files this run did not write"):
    supervised.train_and_evaluate(c, str(tmp_path / "w2"))
  # A file added by hand to this run's own export is not deleted either.
  (export / "notes.txt").write_text("added by hand")
  with pytest.raises(ValueError, match=r"\['notes.txt'\] are not export files"):
    supervised.train_and_evaluate(c, str(workdir))
  assert (export / "notes.txt").read_text() == "added by hand"


def test_resume_checks_the_model_layout_but_not_how_it_is_computed(tmp_path, tfds_dir):
  workdir = str(tmp_path / "w")
  c = small_config(tfds_dir, num_train_steps=2, **{"optimizer.warmup_steps": 0,
                                                   "model.num_layers": 1})
  first = supervised.train_and_evaluate(c, workdir)
  # Another layer layout stores the parameters differently: refused, naming the flag.
  c.model.scan_layers = True
  with pytest.raises(ValueError, match=r"checkpoints/2 was written with model\.scan_layers=False "
                                       r"but the config now gives True; .*"
                                       r"--config\.model\.scan_layers=false"):
    supervised.train_and_evaluate(c, workdir)
  # A remat policy is how the same step is computed: the run resumes (nothing left to do).
  c.model.scan_layers = False
  c.model.remat = "full"
  assert supervised.train_and_evaluate(c, workdir).step == 2
  # A checkpoint written before the layout fields existed (remat a bool) still resumes.
  meta_files = [os.path.join(d, f) for d, _, files in os.walk(os.path.join(
      workdir, outputs.CHECKPOINT_DIR, "2")) for f in files if "meta" in d and not f.startswith(".")]
  edited = 0
  for path in meta_files:
    with open(path) as f:
      try:
        meta = json.load(f)
      except json.JSONDecodeError:
        continue
    if "model_config" in meta:
      for field in ("scan_layers", "attention_impl"):
        meta["model_config"].pop(field)
      meta["model_config"]["remat"] = False
      with open(path, "w") as f:
        json.dump(meta, f)
      edited += 1
  assert edited == 1
  c.model.remat = "none"
  again = supervised.train_and_evaluate(c, workdir)
  jax.tree.map(np.testing.assert_array_equal, host(again.params), host(first.params))


# --- Bad inputs are found before any compile; damaged checkpoints are skipped. -------------


def _forbid_training(monkeypatch):
  def no_work(*args, **kwargs):
    raise AssertionError("the trainer was built although the input is bad")

  monkeypatch.setattr(trainer_lib, "Trainer", no_work)


def _jsonl(path, rows):
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return str(path)


LONG = {"query": "copy " + "7" * 60, "response": "7" * 60}  # > 64 tokens with the tiny tokenizer
SHORT = {"query": "sort 321", "response": "123"}


@pytest.mark.parametrize("case, message", [
    # Every example is over-long and dropped: an error, not a loader waiting forever.
    ("all over-long", r"config\.data\.train_files: only 0 of 3 example\(s\) fit in "
                      r"config\.data\.seq_len=64 .*raise seq_len"),
    ("over-long kept", r"config\.data\.train_files: example .*train\.jsonl:2 has \d+ tokens .*"
                       r"> config\.data\.seq_len=64; .*drop_overlong"),
    ("malformed eval", r"data file .*eval\.jsonl:2: malformed JSON"),
    ("malformed eval, evaluated", r"data file .*eval\.jsonl:2: malformed JSON"),
    ("eval smaller than a batch", r"config\.data\.eval_files: only 2 of 2 example\(s\) fit .*"
                                  r"8 needed"),
    ("eval over-long kept", r"config\.data\.eval_files: example .*eval\.jsonl:1 has"),
    ("packed eval smaller than a batch", r"config\.data\.eval_files: packed \(first_fit\), "
                                         r"their 8 samples fill [1-7] rows, fewer than one batch "
                                         r"of config\.global_batch_size=8"),
    ("epochs give no step", r"config\.num_epochs=1 over 3 examples at "
                            r"config\.global_batch_size=8 gives no step"),
    ("workdir is a file", r"--workdir=.* exists and is not a folder"),
    ("workdir under /proc", r"--workdir='/proc/refusion_jax_test/w' cannot be created: "),
    ("workdir under /sys", r"--workdir='/sys/refusion_jax_test/w' cannot be created: "),
    ("tfds_dir is a file", r"config\.data\.tfds_dir=.* exists and is not a folder"),
    ("checkpoints is a file", r"checkpoints' is a file, where the run keeps its checkpoints"),
])
def test_bad_data_and_paths_fail_before_compiling(tmp_path, tfds_dir, monkeypatch, case,
                                                  message):
  _forbid_training(monkeypatch)
  changes = {}
  workdir = tmp_path / "w"
  if case == "all over-long":
    changes["data.train_files"] = (_jsonl(tmp_path / "train.jsonl", [LONG] * 3),)
  elif case == "over-long kept":
    changes["data.train_files"] = (_jsonl(tmp_path / "train.jsonl", [SHORT, LONG, SHORT]),)
    changes["data.drop_overlong"] = False
  elif case.startswith("malformed eval"):
    path = tmp_path / "eval.jsonl"
    path.write_text(json.dumps(SHORT) + "\n" + '{"query": "sort 1", "response": \n')
    changes["data.eval_files"] = (str(path),)
    if case.endswith("evaluated"):
      changes["eval_every_steps"] = 10
  elif case == "eval smaller than a batch":
    changes["data.eval_files"] = (_jsonl(tmp_path / "eval.jsonl", [SHORT] * 2),)
    changes["eval_every_steps"] = 10
  elif case == "packed eval smaller than a batch":
    changes["data.eval_files"] = (_jsonl(tmp_path / "eval.jsonl", [SHORT] * 8),)
    changes["eval_every_steps"] = 10
    changes["data.packing"] = "first_fit"
  elif case == "eval over-long kept":
    changes["data.eval_files"] = (_jsonl(tmp_path / "eval.jsonl", [LONG] + [SHORT] * 8),)
    changes["eval_every_steps"] = 10
    changes["data.drop_overlong"] = False
  elif case == "epochs give no step":
    changes["data.train_files"] = (_jsonl(tmp_path / "train.jsonl", [SHORT] * 3),)
    changes.update(num_train_steps=0, num_epochs=1)
    changes["optimizer.warmup_steps"] = 0
  elif case == "workdir is a file":
    workdir.write_text("not a folder")
  elif case.startswith("workdir under"):
    workdir = pathlib.Path("/" + case.split("/")[-1]) / "refusion_jax_test" / "w"
  elif case == "tfds_dir is a file":
    (tmp_path / "tfds_file").write_text("x")
    changes["data.tfds_dir"] = str(tmp_path / "tfds_file")
  elif case == "checkpoints is a file":
    workdir.mkdir()
    (workdir / outputs.CHECKPOINT_DIR).write_text("x")
  c = small_config(tfds_dir, **changes)
  existed = workdir.exists()
  start = time.monotonic()
  with pytest.raises(InputError, match=message):
    supervised.train_and_evaluate(c, str(workdir))
  assert time.monotonic() - start < 60
  assert workdir.exists() == existed  # nothing written


def test_killed_dataset_build_is_cleaned_and_builds_do_not_collide(tmp_path):
  import threading

  train = _jsonl(tmp_path / "train.jsonl", [SHORT, {"query": "sort 21", "response": "12"}])
  out = tmp_path / "tfds"
  # What a build killed mid-write leaves: TFDS's temporary folder beside the version folder.
  builder = data.prepare([train], str(out))
  config_dir = os.path.dirname(os.fspath(builder.data_path))
  version = os.path.basename(os.fspath(builder.data_path))
  leftover = os.path.join(config_dir, f"incomplete.ABC123_{version}")
  shutil.copytree(os.fspath(builder.data_path), leftover)
  shutil.rmtree(os.fspath(builder.data_path))
  rebuilt = data.prepare([train], str(out))
  assert sorted(os.listdir(config_dir)) == [version]  # the leftover is gone, the build is whole
  assert len(data.source_of(rebuilt, "train")) == 2
  # Two builds of the same new files at once: one builds, the other waits and reuses it.
  other = _jsonl(tmp_path / "other.jsonl", [SHORT] * 3)
  results, errors = [], []

  def build():
    try:
      results.append(len(data.source_of(data.prepare([other], str(out)), "train")))
    except Exception as e:  # pylint: disable=broad-except
      errors.append(e)

  threads = [threading.Thread(target=build) for _ in range(2)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert not errors and results == [3, 3]
  assert not [n for d, dirs, _ in os.walk(out) for n in dirs if n.startswith("incomplete.")]


def _damage(step_dir, how):
  if how == "truncated array file":
    files = [os.path.join(d, f) for d, _, fs in os.walk(os.path.join(step_dir, "state"))
             for f in fs if os.sep + "d" + os.sep in os.path.join(d, f) + os.sep
             and os.path.basename(d) == "d"]
    big = max(files, key=os.path.getsize)
    with open(big, "r+b") as f:
      f.truncate(os.path.getsize(big) // 2)
  elif how == "missing _METADATA":
    os.remove(os.path.join(step_dir, "state", "_METADATA"))
  elif how == "corrupt data iterator JSON":
    path = os.path.join(step_dir, "data", "process_0-of-1.json")
    with open(path, "w") as f:
      f.write('{"last_seen_indices": {"0": 1')
  else:
    raise AssertionError(how)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, tfds_dir):
  """A 4-step run checkpointed at steps 2 and 4, and its final parameters."""
  workdir = tmp_path_factory.mktemp("finished") / "w"
  c = small_config(tfds_dir, num_train_steps=4, **{
      "optimizer.warmup_steps": 0, "model.num_layers": 1, "checkpoint.every_steps": 2})
  result = supervised.train_and_evaluate(c, str(workdir))
  assert committed_steps(str(workdir)) == [2, 4]
  return c, workdir, host(result.params)


@pytest.fixture(scope="module")
def resumed_from_2(finished_run, tmp_path_factory):
  """Final parameters of an undamaged resume from step 2 (step 4 removed)."""
  c, workdir, _ = finished_run
  copy = tmp_path_factory.mktemp("resume2") / "w"
  shutil.copytree(workdir, copy)
  shutil.rmtree(copy / outputs.CHECKPOINT_DIR / "4")
  return host(supervised.train_and_evaluate(c, str(copy)).params)


@pytest.mark.parametrize("how, named", [
    ("truncated array file", r"it cannot be restored \(.*(OUT_OF_RANGE|DATA_LOSS|Error reading)"),
    ("missing _METADATA", r"state/_METADATA \(the array metadata\) is missing"),
    ("corrupt data iterator JSON", r"data/process_0-of-1\.json is not valid JSON"),
])
def test_damaged_newest_checkpoint_falls_back_to_the_intact_one(finished_run, resumed_from_2,
                                                                tmp_path, how, named, capsys):
  c, workdir, final = finished_run
  copy = tmp_path / "w"
  shutil.copytree(workdir, copy)
  _damage(str(copy / outputs.CHECKPOINT_DIR / "4"), how)
  capsys.readouterr()
  result = supervised.train_and_evaluate(c, str(copy))
  warning = capsys.readouterr().err
  assert re.search(rf"checkpoint .*checkpoints/4 is damaged and was skipped: {named}.*moved to "
                   r".*checkpoints/4\.damaged", warning), warning
  # Moved aside (kept for inspection, never retried); step 4 was trained and saved again.
  assert committed_steps(str(copy)) == [2, 4]
  assert os.path.isdir(copy / outputs.CHECKPOINT_DIR / "4.damaged")
  jax.tree.map(np.testing.assert_array_equal, host(result.params), resumed_from_2)
  jax.tree.map(np.testing.assert_array_equal, host(result.params), final)


def test_no_intact_checkpoint_is_a_clear_error(finished_run, tmp_path):
  c, workdir, _ = finished_run
  copy = tmp_path / "w"
  shutil.copytree(workdir, copy)
  _damage(str(copy / outputs.CHECKPOINT_DIR / "4"), "missing _METADATA")
  _damage(str(copy / outputs.CHECKPOINT_DIR / "2"), "corrupt data iterator JSON")
  with pytest.raises(InputError, match=r"(?s)no intact checkpoint to resume from in .*checkpoints: "
                                       r".*checkpoints/4: state/_METADATA .*missing.*"
                                       r"checkpoints/2: data/process_0-of-1\.json is not valid"):
    supervised.train_and_evaluate(c, str(copy))


def test_training_on_your_files_says_when_it_evaluates_on_the_bundled_tasks(tmp_path, capsys):
  """The configs evaluate on the bundled tasks by default: a run on the user's own files
  says so (their eval loss measures other data), and says nothing otherwise."""
  own = tmp_path / "mine.jsonl"
  own.write_text('{"query": "q", "response": "r"}\n')
  bundled = os.path.join(supervised.BUNDLED_DATA_DIR, "tiny_test.jsonl")
  c = ml_collections.ConfigDict({"eval_every_steps": 10})
  supervised._note_bundled_eval(c, {"train_files": [str(own)], "eval_files": [bundled]})  # pylint: disable=protected-access
  err = capsys.readouterr().err
  assert "[train] training on your files but evaluating on the bundled tasks' held-out " \
         "split (tiny_test.jsonl): set --config.data.eval_files" in err
  for train, evals, every in (([bundled], [bundled], 10), ([str(own)], [str(own)], 10),
                              ([str(own)], [bundled], 0)):
    supervised._note_bundled_eval(ml_collections.ConfigDict({"eval_every_steps": every}),  # pylint: disable=protected-access
                                  {"train_files": train, "eval_files": evals})
  assert capsys.readouterr().err == ""
