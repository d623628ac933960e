"""The training loop: resume, step, log, checkpoint, evaluate, export.

`train_and_evaluate(config, workdir)`:

* checks everything before anything is compiled, loaded or written: the
  config (`settings.resolve`: every check, the model config and the
  tokenizer), the export folder, the workdir, and the data files (every line
  read; over-long examples; a training set with nothing left after dropping
  them); a failure is an `InputError` naming the field, file or line;
* builds the model on a (data, fsdp, tensor) mesh: a preset plus overrides,
  or a Hugging Face Qwen3 folder (`config.init_from_hf`) extended with
  ReFusion's two special tokens (`trainer.add_special_token_rows`);
* resumes from the newest intact checkpoint in `W/checkpoints` when there is
  one (a damaged one, with a missing or truncated file or unreadable JSON, is
  named in a warning and moved to `<step>.damaged`):
  parameters, AdamW state, step and data position are restored and the step
  rng is `fold_in(fold_in(key(seed), 0), step)`, so a resumed run is
  bit-identical to an uninterrupted one;
* logs `W/metrics.jsonl` (one JSON object per logged step) and TensorBoard
  events in `W/tensorboard`, stops on a non-finite loss or gradient without
  saving the bad state, and finally writes `W/final_model` (our model
  folder) and, when `config.export_hf_dir` is set, a HF folder.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import signal
import threading
import time
from typing import Any, Mapping

import jax
import numpy as np
from absl import logging

from refusion_jax import checkpoint, hf, sharding
from refusion_jax.checks import InputError
from refusion_jax.config import ModelConfig
from refusion_jax.training import outputs, settings
from refusion_jax.training import trainer as trainer_lib

from refusion_jax.training.outputs import (CHECKPOINT_DIR, FINAL_MODEL_DIR, METRICS_FILE,
                                           TENSORBOARD_DIR, TFDS_DIR)


class NonFiniteLossError(FloatingPointError):
  """Training produced a NaN/inf loss or gradient; nothing of that step was saved."""


# The exit status of a run stopped by a preemption notice after its checkpoint is on disk
# (EX_TEMPFAIL: run the same command again to resume).
EXIT_PREEMPTED = 75


class Preempted(Exception):
  """A preemption notice stopped training at a step boundary; its checkpoint is complete."""

  def __init__(self, step: int, directory: str):
    super().__init__(f"preempted: checkpoint of step {step} saved in {directory}; run the same "
                     "command again to resume from it")
    self.step = step


class PreemptionNotice:
  """Whether training should stop at this step boundary for a preemption.

  One process: SIGTERM (what a spot / preemptible VM receives first) sets a flag
  that the loop reads after each step, so the checkpoint is of the step running
  when the signal came. Several processes: JAX's preemption service (set up by
  `jax.distributed.initialize`) catches the signal on any process, and
  `multihost_utils.reached_preemption_sync_point` agrees on one step at which
  every process stops together.
  """

  def __init__(self):
    self._signalled = False
    self._previous = None
    self._multi = jax.process_count() > 1
    if not self._multi and threading.current_thread() is threading.main_thread():
      self._previous = signal.signal(signal.SIGTERM, self._on_signal)

  def _on_signal(self, signum, frame):  # pylint: disable=unused-argument
    if not self._signalled:
      logging.warning("SIGTERM: saving a checkpoint after this step, then stopping")
    self._signalled = True

  def reached(self, step: int) -> bool:
    if self._multi:
      from jax.experimental import multihost_utils  # only multi-process runs need it
      return bool(multihost_utils.reached_preemption_sync_point(step))
    return self._signalled

  def close(self) -> None:
    if self._previous is not None:
      signal.signal(signal.SIGTERM, self._previous)
      self._previous = None


class MetricsLog:
  """`W/metrics.jsonl` plus TensorBoard scalars; only process 0 writes."""

  def __init__(self, workdir: str, resume_step: int, enabled: bool):
    self.enabled = enabled
    self.path = os.path.join(workdir, METRICS_FILE)
    self._file = None
    self._tb = None
    if not enabled:
      return
    self._truncate_after(resume_step)
    self._file = open(self.path, "a")
    from tensorboardX import SummaryWriter  # heavy-ish; only the writing process needs it
    self._tb = SummaryWriter(os.path.join(workdir, TENSORBOARD_DIR))

  def _truncate_after(self, step: int) -> None:
    # Lines logged after the checkpoint we resume from (and a line cut by a
    # kill) are dropped: the resumed run logs those steps again.
    if not os.path.exists(self.path):
      return
    kept = []
    with open(self.path) as f:
      for line in f:
        try:
          record = json.loads(line)
        except json.JSONDecodeError:
          continue
        if isinstance(record, dict) and record.get("step", math.inf) <= step:
          kept.append(json.dumps(record) + "\n")
    tmp = self.path + ".tmp"
    with open(tmp, "w") as f:
      f.writelines(kept)
    os.replace(tmp, self.path)

  def write(self, step: int, metrics: Mapping[str, float], prefix: str = "") -> None:
    if not self.enabled:
      return
    record = {"step": int(step)}
    record.update({prefix + k: float(v) for k, v in metrics.items()})
    self._file.write(json.dumps(record) + "\n")
    self._file.flush()
    for k, v in metrics.items():
      self._tb.add_scalar(prefix + k, float(v), int(step))

  def close(self) -> None:
    if self._file is not None:
      self._file.close()
      self._file = None
    if self._tb is not None:
      self._tb.close()
      self._tb = None


@dataclasses.dataclass
class TrainResult:
  step: int  # steps completed
  model_config: ModelConfig
  params: dict  # final parameters (pure dict of arrays)
  last_metrics: dict  # host metrics of the last step run in this call ({} if none)
  eval_metrics: dict  # last eval ({} if none)
  samples_per_step: float = math.nan  # mean over the steps run in this call (nan if none)


def _resume_meta(config, model_config: ModelConfig, total_steps: int) -> dict:
  return {"seed": int(config.seed), "objective": config.objective,
          "global_batch_size": int(config.global_batch_size),
          "seq_len": int(config.data.seq_len), "packing": settings.packing(config),
          "total_steps": int(total_steps), "model_config": dataclasses.asdict(model_config)}


# Model fields a resumed run may change: how the same parameters are computed, not what
# they are (a remat policy or an attention kernel can be chosen per machine).
_RESUMABLE_MODEL_FIELDS = ("remat", "attention_impl")


def _check_resume(saved: Mapping[str, Any], wanted: Mapping[str, Any], where: str) -> None:
  # A run resumed with another seed, batch, shape or schedule would not be the same run.
  for key, value in wanted.items():
    if key not in saved:
      continue
    if key == "model_config":
      _check_resume_model(saved[key], value, where)
    elif saved[key] != value:
      raise InputError(f"{where} was written with {key}={saved[key]!r} but the config now "
                       f"gives {value!r}; use a new workdir or restore the old setting")


def _check_resume_model(saved: Mapping[str, Any], wanted: Mapping[str, Any], where: str) -> None:
  # Fields added since the checkpoint was written take their defaults (ModelConfig fills
  # them in), so an older checkpoint of the same model still resumes.
  try:
    saved = dataclasses.asdict(ModelConfig(**saved))
  except (TypeError, ValueError) as e:
    raise InputError(f"{where}: its model config cannot be read ({e})") from None
  for name, value in wanted.items():
    if name in _RESUMABLE_MODEL_FIELDS or saved.get(name) == value:
      continue
    hint = ("the parameters are stored in the other layer layout; resume with "
            f"--config.model.scan_layers={str(saved.get(name)).lower()} (a finished model "
            "folder converts with checkpoint.load_model(..., scan_layers=...))"
            if name == "scan_layers" else "use a new workdir or restore the old setting")
    raise InputError(f"{where} was written with model.{name}={saved.get(name)!r} but the config "
                     f"now gives {value!r}; {hint}")


def _evaluate(trainer: trainer_lib.Trainer, params, data_config, tokenizer) -> dict:
  from refusion_jax import data  # local: the TFDS import is slow and eval is optional

  config = trainer.config
  loader = data.loader_from_config(data_config, tokenizer, config.global_batch_size, "eval",
                                   jax.process_index(), jax.process_count(),
                                   eos_pad_response_to=settings.eos_pad_response_to(config),
                                   eos_pad_multiple=settings.eos_pad_multiple(config))
  totals: dict[str, float] = {}
  count = 0
  batches = iter(loader)
  while True:
    batch = next(batches, None)
    # The eval split keeps a short last batch; its shape would not shard evenly.
    full = batch is not None and len(batch["tokens"]) == loader.per_process_batch
    if jax.process_count() > 1:
      # Each process drops its own shard's over-long rows, so the processes may
      # hold different numbers of full batches; eval_step is a collective that
      # every process must run, so all stop at the first batch one lacks.
      from jax.experimental import multihost_utils  # only multi-process runs need it
      full = bool(np.all(multihost_utils.process_allgather(np.asarray([full]))))
    if not full:
      break
    metrics = jax.device_get(trainer.eval_step(params, trainer.shard_batch(batch), count))
    for k, v in metrics.items():
      totals[k] = totals.get(k, 0.0) + float(v)
    count += 1
    if config.eval_batches and count >= config.eval_batches:
      break
  if count == 0:
    raise ValueError(f"config.data.eval_files hold no full batch of "
                     f"{config.global_batch_size} rows")
  return {k: v / count for k, v in totals.items()}


@contextlib.contextmanager
def _as_input_errors():
  """Re-raises a ValueError or OSError (a bad setting, a missing or unreadable file) as an
  InputError with the same message: the entry point reports it in one line."""
  try:
    yield
  except InputError:
    raise
  except (ValueError, OSError) as e:
    raise InputError(str(e)) from None


def _check_data(config, data_config: dict, tokenizer) -> int:
  """Checks the data files before anything is built, written or compiled; returns the
  number of training examples.

  Every line of every file is read (malformed JSON, missing fields); at least one
  training example must fit in seq_len (with drop_overlong=False every one must,
  else the loader would stop mid-run on it; with all of them dropped it would wait
  forever); when evaluating, the eval files must fill a global batch.
  """
  from refusion_jax import data  # local: the TFDS import is slow

  seq_len, drop = int(config.data.seq_len), bool(config.data.drop_overlong)
  num_examples = data.validate_files(data_config["train_files"])
  if data_config["eval_files"]:
    data.validate_files(data_config["eval_files"])
  data.check_lengths(data.iter_examples(data_config["train_files"]), tokenizer, seq_len,
                     drop_overlong=drop, what="config.data.train_files", full=not drop)
  if data_config["eval_files"] and config.eval_every_steps:
    data.check_lengths(data.iter_examples(data_config["eval_files"]), tokenizer, seq_len,
                       drop_overlong=drop, what="config.data.eval_files", full=True,
                       min_fitting=int(config.global_batch_size))
    if settings.packing(config) != "none":
      # Packed, the samples that fill a batch one per row may fill only part of one.
      layout = data.measure_layout(
          list(data.iter_examples(data_config["eval_files"])), tokenizer, seq_len=seq_len,
          packing=settings.packing(config), packing_bins=int(config.data.packing_bins),
          batch_size=int(config.global_batch_size), seed=0, drop_overlong=drop,
          eos_pad_response_to=settings.eos_pad_response_to(config),
          eos_pad_multiple=settings.eos_pad_multiple(config), shuffle=False)
      if layout.rows < config.global_batch_size:
        raise ValueError(f"config.data.eval_files: packed ({settings.packing(config)}), their "
                         f"{layout.samples} samples fill {layout.rows} rows, fewer than one "
                         f"batch of config.global_batch_size={config.global_batch_size}; add "
                         "eval data or set config.eval_every_steps=0")
  return num_examples


def _first_line(error: BaseException, limit: int = 300) -> str:
  """The root cause of `error` on one line (orbax wraps TensorStore's precise message)."""
  seen = set()
  while id(error) not in seen and (error.__cause__ or error.__context__) is not None:
    seen.add(id(error))
    error = error.__cause__ or error.__context__
  text = " ".join(str(error).split()) or type(error).__name__
  text = f"{type(error).__name__}: {text}"
  return text if len(text) <= limit else text[:limit] + " ..."


def _restore_newest_intact(ckpt: checkpoint.TrainCheckpointer, trainer, meta: dict, data_iter,
                           is_chief: bool):
  """`(step, state)` of the newest checkpoint that reads back whole, or None when there is none.

  A checkpoint that cannot be read (a missing or truncated file, unreadable JSON) is
  named with what is wrong in a warning and moved aside to `<step>.damaged` (by the
  chief), so that it is neither retried nor confused with the step saved again later;
  the next older one is tried. A checkpoint written with other settings is not damage:
  it stops the run (`_check_resume`). When checkpoints exist but none is intact, an
  InputError names each and what is wrong with it.
  """
  skipped, found = [], None
  for step in sorted(ckpt.all_steps(), reverse=True):
    where = os.path.join(ckpt.directory, str(step))
    problem = ckpt.damage(step)
    saved_meta = None
    if problem is None:
      try:
        saved_meta = ckpt.read_meta(step)
      except Exception as e:  # pylint: disable=broad-except
        problem = f"its meta item cannot be read ({_first_line(e)})"
    if problem is None:
      _check_resume(saved_meta, meta, where)
      try:
        found = step, ckpt.restore(step, trainer.abstract_train_state(), data_iter)[0]
        break
      except Exception as e:  # pylint: disable=broad-except
        problem = f"it cannot be restored ({_first_line(e)})"
    moved = ckpt.move_aside(step) if is_chief else f"{where}.damaged by process 0"
    logging.warning("checkpoint %s is damaged and was skipped: %s; moved to %s", where,
                    problem, moved)
    skipped.append(f"{where}: {problem} (moved to {moved})")
  if jax.process_count() > 1:
    # The processes must resume from one step: the oldest any of them could read (each
    # reads its own data-iterator file). The others then see process 0's renames.
    from jax.experimental import multihost_utils  # only multi-process runs need it
    mine = -1 if found is None else found[0]
    agreed = int(np.min(multihost_utils.process_allgather(np.asarray([mine]))))
    ckpt.reload()
    if agreed != mine:
      found = None if agreed < 0 else (agreed, ckpt.restore(
          agreed, trainer.abstract_train_state(), data_iter)[0])
      skipped.append(f"step {mine} is unreadable on another process")
  if found is not None:
    if skipped:
      logging.warning("resuming from %s, the newest intact checkpoint",
                      os.path.join(ckpt.directory, str(found[0])))
    return found
  if skipped:
    raise InputError("no intact checkpoint to resume from in " + ckpt.directory + ": "
                     + "; ".join(skipped) + ". Restore a checkpoint or use a new workdir")
  return None


def train_and_evaluate(config, workdir: str) -> TrainResult:
  """Trains (resuming from `workdir` when it holds checkpoints); see the module doc."""
  from refusion_jax import data  # local: the TFDS import is slow and validation comes first

  workdir = os.path.abspath(workdir)
  # Everything the run reads or writes is checked before anything is compiled:
  # a failure here is the config's or the data's, reported as an InputError.
  with _as_input_errors():
    resolved = settings.resolve(config)
    tokenizer, model_config = resolved.tokenizer, resolved.model_config
    outputs.check_export_dir(config.export_hf_dir, workdir, config.data.tfds_dir)
    outputs.check_workdir(workdir)
    data_config = config.data.to_dict()
    data_config["train_files"] = list(data_config["train_files"])
    data_config["eval_files"] = list(data_config["eval_files"])
    data_config["tfds_dir"] = data_config["tfds_dir"] or os.path.join(workdir, TFDS_DIR)
    if os.path.lexists(data_config["tfds_dir"]) and not os.path.isdir(data_config["tfds_dir"]):
      raise ValueError(f"config.data.tfds_dir={config.data.tfds_dir!r} exists and is not a "
                       "folder")
    num_examples = _check_data(config, data_config, tokenizer)
    # Epochs of packed rows count samples: how many share a row is measured on the built
    # data below; every other step count is known now.
    measure_rows = config.num_train_steps <= 0 and settings.packing(config) != "none"
    if not measure_rows:
      total_steps = settings.total_train_steps(config, num_examples)
  # Nothing was written before this point: a run refused above leaves no trace.
  try:
    os.makedirs(workdir, exist_ok=True)
  except OSError as e:  # e.g. a path under /proc or /sys, or a read-only mount
    raise InputError(f"--workdir={workdir!r} cannot be created: "
                     f"{e.strerror or e} ({e.filename or workdir})") from None
  eos_pad = settings.eos_pad_response_to(config)
  loader = data.loader_from_config(data_config, tokenizer, config.global_batch_size, "train",
                                   jax.process_index(), jax.process_count(),
                                   eos_pad_response_to=eos_pad,
                                   eos_pad_multiple=settings.eos_pad_multiple(config))
  assert loader.num_records == num_examples, (loader.num_records, num_examples)
  if measure_rows:
    # Measured on the shuffled data as one process would read all of it, so that every
    # process derives the same count.
    layout = data.measure_layout(
        data.split_source(data_config, "train"), tokenizer, seq_len=int(config.data.seq_len),
        packing=settings.packing(config), packing_bins=int(config.data.get("packing_bins", 0)),
        batch_size=loader.per_process_batch, seed=int(config.data.shuffle_seed),
        drop_overlong=bool(config.data.drop_overlong), eos_pad_response_to=eos_pad,
        eos_pad_multiple=settings.eos_pad_multiple(config),
        max_samples=settings.SAMPLES_MEASURED)
    logging.info("packing: %.2f samples per row, %.1f%% of row tokens real (measured on %d "
                 "samples)", layout.samples_per_row, 100 * layout.real_token_fraction,
                 layout.samples)
    with _as_input_errors():
      total_steps = settings.total_train_steps(config, num_examples, layout.samples_per_row)
  mesh = sharding.make_mesh(devices=resolved.devices, **resolved.mesh_shape)
  trainer = trainer_lib.Trainer(config, model_config, mesh=mesh, pad_id=tokenizer.pad_id,
                                total_steps=total_steps)
  meta = _resume_meta(config, model_config, total_steps)
  is_chief = jax.process_index() == 0

  ckpt = checkpoint.TrainCheckpointer(os.path.join(workdir, CHECKPOINT_DIR),
                                      max_to_keep=config.checkpoint.max_to_keep,
                                      async_save=config.checkpoint.async_save)
  log = preemption = None
  try:
    data_iter = iter(loader)
    resumed = _restore_newest_intact(ckpt, trainer, meta, data_iter, is_chief)
    if resumed is not None:
      start, state = resumed
      params, opt_state = state["params"], state["opt_state"]
      logging.info("resumed from %s", os.path.join(ckpt.directory, str(start)))
    else:
      start = 0
      if config.init_from_hf:
        params = trainer_lib.init_params_from_hf(trainer, config.init_from_hf, tokenizer)
      else:
        params = trainer.init_params()
      opt_state = trainer.init_opt_state(params)

    log = MetricsLog(workdir, start, enabled=is_chief)
    tokens_per_step = config.global_batch_size * config.data.seq_len
    last_metrics, eval_metrics = {}, {}
    progress = None
    if config.progress_bar and is_chief:
      import tqdm  # local: only the bar needs it
      progress = tqdm.tqdm(total=total_steps, initial=start, desc="train", unit="step")
    preemption = PreemptionNotice()
    samples_seen = 0.0
    tick = time.perf_counter()
    for step in range(start, total_steps):
      batch = trainer.shard_batch(next(data_iter))
      params, opt_state, metrics = trainer.train_step(params, opt_state, batch, step)
      metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
      done = step + 1
      if not (math.isfinite(metrics["loss"]) and math.isfinite(metrics["grad_norm"])):
        ckpt.wait()  # pending saves of good states complete; this state is never saved
        what = "loss" if not math.isfinite(metrics["loss"]) else "gradient"
        raise NonFiniteLossError(
            f"non-finite training {what} at step {done} (update {step} -> {done}): loss="
            f"{metrics['loss']}, grad_norm={metrics['grad_norm']}; training stopped, the "
            f"last good checkpoint is step {ckpt.latest_step()} in {ckpt.directory}")
      now = time.perf_counter()
      seconds = max(now - tick, 1e-9)
      # Row tokens (padding included), samples and real tokens per second.
      metrics.update(tokens_per_sec=tokens_per_step / seconds,
                     samples_per_sec=metrics["samples"] / seconds,
                     real_tokens_per_sec=metrics["real_tokens"] / seconds)
      tick = now
      last_metrics = metrics
      samples_seen += metrics["samples"]
      if done % config.log_every_steps == 0 or done == total_steps:
        log.write(done, metrics)
      if progress is not None:
        progress.update(1)
        progress.set_postfix(loss=f"{metrics['loss']:.4f}", samples=int(metrics["samples"]),
                             real=f"{metrics['real_tokens'] / tokens_per_step:.0%}",
                             refresh=False)
      preempted = preemption.reached(done)
      if done % config.checkpoint.every_steps == 0 or done == total_steps or preempted:
        ckpt.save(done, {"params": params, "opt_state": opt_state}, data_iter, meta)
      if preempted and done < total_steps:
        ckpt.wait()  # the checkpoint is complete on disk before the process goes away
        if progress is not None:
          progress.close()
        raise Preempted(done, ckpt.directory)
      if config.eval_every_steps and (done % config.eval_every_steps == 0
                                      or done == total_steps):
        eval_metrics = _evaluate(trainer, params, data_config, tokenizer)
        log.write(done, eval_metrics, prefix="eval_")
        logging.info("step %d eval %s", done, eval_metrics)
        tick = time.perf_counter()  # eval time is not training throughput
    if progress is not None:
      progress.close()
    ckpt.wait()

    model = trainer.model(params)
    checkpoint.save_model(os.path.join(workdir, FINAL_MODEL_DIR), model_config, model,
                          overwrite=True)
    if config.export_hf_dir:
      # Checked again: the folder may have gained files while the run trained.
      outputs.check_export_dir(config.export_hf_dir, workdir, config.data.tfds_dir)
      hf.save(model_config, model, config.export_hf_dir, overwrite=True,
              extra_files=outputs.export_marker(workdir))
    steps_run = max(0, total_steps - start)
    return TrainResult(step=max(start, total_steps), model_config=model_config, params=params,
                       last_metrics=last_metrics, eval_metrics=eval_metrics,
                       samples_per_step=samples_seen / steps_run if steps_run else math.nan)
  finally:
    if preemption is not None:
      preemption.close()
    ckpt.close()
    if log is not None:
      log.close()
