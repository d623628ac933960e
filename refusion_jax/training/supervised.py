"""Supervised training (ReFusion, ARM, MDM, BD3-LM) as a task of the one loop.

`train_and_evaluate(config, workdir)`:

* checks everything before anything is compiled, loaded or written: the
  config (`settings.resolve`: every check, the model config and the
  tokenizer), the export folder, the workdir, and the data files (every line
  read; over-long examples; a training set with nothing left after dropping
  them); a failure is an `InputError` naming the field, file or line;
* builds the model on a (data, fsdp, tensor) mesh: a preset plus overrides,
  or a Hugging Face Qwen3 folder (`config.init_from_hf`) extended with
  ReFusion's two special tokens (`trainer.add_special_token_rows`);
* trains in `loop.run_loop`: resumed from the newest intact checkpoint in
  `W/checkpoints` (parameters, AdamW state, step and the data iterator's
  position; the step rng is `fold_in(fold_in(key(seed), 0), step)`, so a resumed
  run is bit-identical to an uninterrupted one), `W/metrics.jsonl` and
  TensorBoard events in `W/tensorboard`, evaluation every `eval_every_steps`,
  SIGTERM / Ctrl-C stops with a checkpoint;
* finally writes `W/final_model` (our model folder) and, when
  `config.export_hf_dir` is set, a HF folder.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import time

import jax
import numpy as np
from jax.experimental import multihost_utils

from refusion_jax import checkpoint, data, hf, runtime, sharding
from refusion_jax.checks import InputError
from refusion_jax.config import ModelConfig
from refusion_jax.training import loop, outputs, settings
from refusion_jax.training import trainer as trainer_lib
from refusion_jax.training.outputs import FINAL_MODEL_DIR, TFDS_DIR

# The data shipped in the package (the tiny tasks' splits).
BUNDLED_DATA_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "assets", "data")


@dataclasses.dataclass
class TrainResult:
  step: int  # steps completed
  model_config: ModelConfig
  params: dict  # final parameters (pure dict of arrays)
  last_metrics: dict  # host metrics of the last step run in this call ({} if none)
  eval_metrics: dict  # last eval ({} if none)
  samples_per_step: float = math.nan  # mean over the steps run in this call (nan if none)


def _resume_meta(config, model_config: ModelConfig, total_steps: int) -> dict:
  # A run resumed with another seed, batch, shape or schedule would not be the same run.
  return {"seed": int(config.seed), "objective": config.objective,
          "global_batch_size": int(config.global_batch_size),
          "seq_len": int(config.data.seq_len), "packing": settings.packing(config),
          "total_steps": int(total_steps), "model_config": dataclasses.asdict(model_config)}


def _evaluate(trainer: trainer_lib.Trainer, params, data_config, tokenizer) -> dict:

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


class SupervisedTask(loop.Task):
  """One objective's update per step on the loader's next batch; evaluation on the eval
  files every `config.eval_every_steps` steps."""

  label = "train"

  def __init__(self, trainer: trainer_lib.Trainer, tokenizer, data_config: dict,
               data_iterator, meta: dict):
    self.trainer, self.config = trainer, trainer.config
    self.tokenizer, self.data_config = tokenizer, data_config
    self.data_iterator = data_iterator
    self.total_steps = trainer.total_steps
    self._meta = meta
    self._tokens_per_step = self.config.global_batch_size * self.config.data.seq_len
    self._tick = None  # when the previous step's metrics were read
    self.samples_seen, self.steps_run, self.eval_metrics = 0.0, 0, {}

  def meta(self) -> dict:
    return self._meta

  def abstract_state(self):
    return self.trainer.abstract_train_state()

  def init_state(self):
    if self.config.init_from_hf:
      params = trainer_lib.init_params_from_hf(self.trainer, self.config.init_from_hf,
                                               self.tokenizer)
    else:
      params = self.trainer.init_params()
    return {"params": params, "opt_state": self.trainer.init_opt_state(params)}

  def step(self, state, step, stop):
    if self._tick is None:
      self._tick = time.perf_counter()
    batch = self.trainer.shard_batch(next(self.data_iterator))
    params, opt_state, metrics = self.trainer.train_step(state["params"], state["opt_state"],
                                                         batch, step)
    metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
    now = time.perf_counter()
    seconds, self._tick = max(now - self._tick, 1e-9), now
    # Row tokens (padding included), samples and real tokens per second.
    metrics.update(tokens_per_sec=self._tokens_per_step / seconds,
                   samples_per_sec=metrics["samples"] / seconds,
                   real_tokens_per_sec=metrics["real_tokens"] / seconds)
    self.samples_seen += metrics["samples"]
    self.steps_run += 1
    return {"params": params, "opt_state": opt_state}, metrics

  def postfix(self, metrics):
    return {"loss": f"{metrics['loss']:.4f}", "samples": int(metrics["samples"]),
            "real": f"{metrics['real_tokens'] / self._tokens_per_step:.0%}"}

  def evaluate(self, state, done):
    every = self.config.eval_every_steps
    if not every or (done % every and done != self.total_steps):
      return {}
    self.eval_metrics = _evaluate(self.trainer, state["params"], self.data_config,
                                  self.tokenizer)
    runtime.note("train", f"step {done} eval: " + ", ".join(
        f"{k} {v:.4g}" for k, v in sorted(self.eval_metrics.items())))
    self._tick = time.perf_counter()  # eval time is not training throughput
    return {"eval_" + k: v for k, v in self.eval_metrics.items()}


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


def _is_bundled(path: str) -> bool:
  """A data file shipped in the package (refusion_jax/assets/data)."""
  return os.path.dirname(os.path.abspath(path)) == BUNDLED_DATA_DIR


def _note_bundled_eval(config, data_config: dict) -> None:
  """Says so when the run trains on the user's files but evaluates on the bundled tasks
  (the configs' default eval_files): the two losses measure different data."""
  if (config.eval_every_steps and data_config["eval_files"]
      and all(_is_bundled(p) for p in data_config["eval_files"])
      and not all(_is_bundled(p) for p in data_config["train_files"])):
    names = ", ".join(os.path.basename(p) for p in data_config["eval_files"])
    runtime.note("train", f"training on your files but evaluating on the bundled tasks' "
                 f"held-out split ({names}): set --config.data.eval_files to your own "
                 "held-out files, or --config.eval_every_steps=0")


def _check_data(config, data_config: dict, tokenizer) -> int:
  """Checks the data files before anything is built, written or compiled; returns the
  number of training examples.

  Every line of every file is read (malformed JSON, missing fields); at least one
  training example must fit in seq_len (with drop_overlong=False every one must,
  else the loader would stop mid-run on it; with all of them dropped it would wait
  forever); when evaluating, the eval files must fill a global batch.
  """

  seq_len, drop = int(config.data.seq_len), bool(config.data.drop_overlong)
  _note_bundled_eval(config, data_config)
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


@dataclasses.dataclass
class _Inputs:
  """What the checks before any work found: the resolved config, the data and (unless it
  must be measured on packed rows) the number of steps."""
  resolved: settings.Resolved
  data_config: dict
  num_examples: int
  total_steps: int | None


def _check_inputs(config, workdir: str) -> _Inputs:
  """Every check of the config, the outputs and the data; raises InputError."""
  with _as_input_errors():
    resolved = settings.resolve(config)
    outputs.check_export_dir(config.export_hf_dir, workdir, config.data.tfds_dir)
    outputs.check_workdir(workdir)
    data_config = config.data.to_dict()
    data_config["train_files"] = list(data_config["train_files"])
    data_config["eval_files"] = list(data_config["eval_files"])
    data_config["tfds_dir"] = data_config["tfds_dir"] or os.path.join(workdir, TFDS_DIR)
    if os.path.lexists(data_config["tfds_dir"]) and not os.path.isdir(data_config["tfds_dir"]):
      raise ValueError(f"config.data.tfds_dir={config.data.tfds_dir!r} exists and is not a "
                       "folder")
    num_examples = _check_data(config, data_config, resolved.tokenizer)
    # Epochs of packed rows count samples: how many share a row is measured on the built
    # data; every other step count is known now.
    measure_rows = config.num_train_steps <= 0 and settings.packing(config) != "none"
    total_steps = None if measure_rows else settings.total_train_steps(config, num_examples)
  return _Inputs(resolved, data_config, num_examples, total_steps)


def _measured_total_steps(config, inputs: _Inputs, loader) -> int:
  """The step count of epochs of packed rows, measured on the shuffled data as one process
  would read all of it, so that every process derives the same count."""

  layout = data.measure_layout(
      data.split_source(inputs.data_config, "train"), inputs.resolved.tokenizer,
      seq_len=int(config.data.seq_len), packing=settings.packing(config),
      packing_bins=int(config.data.get("packing_bins", 0)),
      batch_size=loader.per_process_batch, seed=int(config.data.shuffle_seed),
      drop_overlong=bool(config.data.drop_overlong),
      eos_pad_response_to=settings.eos_pad_response_to(config),
      eos_pad_multiple=settings.eos_pad_multiple(config), max_samples=settings.SAMPLES_MEASURED)
  runtime.note("train", "packing: %.2f samples per row, %.1f%% of row tokens real (measured on %d "
               "samples)", layout.samples_per_row, 100 * layout.real_token_fraction,
               layout.samples)
  with _as_input_errors():
    return settings.total_train_steps(config, inputs.num_examples, layout.samples_per_row)


def _export(config, workdir: str, model_config: ModelConfig, model) -> None:
  final = os.path.join(workdir, FINAL_MODEL_DIR)
  # The model folder says what it was trained for (a decoder that needs its own refuses
  # it otherwise: ModelConfig.objective).
  model_config = model_config.replace(objective=config.objective)
  checkpoint.save_model(final, model_config, model, overwrite=True)
  written = final
  if config.export_hf_dir:
    # Checked again: the folder may have gained files while the run trained.
    outputs.check_export_dir(config.export_hf_dir, workdir, config.data.tfds_dir)
    hf.save(model_config, model, config.export_hf_dir, overwrite=True,
            extra_files=outputs.export_marker(workdir))
    written += f" and the HF folder {config.export_hf_dir}"
  runtime.note("train", f"wrote {written} (decode it: {runtime.sample_command(final)})")


def train_and_evaluate(config, workdir: str) -> TrainResult:
  """Trains (resuming from `workdir` when it holds checkpoints); see the module doc."""

  workdir = os.path.abspath(workdir)
  # Everything the run reads or writes is checked before anything is compiled: a
  # failure here is the config's or the data's, and leaves no trace.
  inputs = _check_inputs(config, workdir)
  tokenizer, model_config = inputs.resolved.tokenizer, inputs.resolved.model_config
  try:
    os.makedirs(workdir, exist_ok=True)
  except OSError as e:  # e.g. a path under /proc or /sys, or a read-only mount
    raise InputError(f"--workdir={workdir!r} cannot be created: "
                     f"{e.strerror or e} ({e.filename or workdir})") from None
  loader = data.loader_from_config(inputs.data_config, tokenizer, config.global_batch_size,
                                   "train", jax.process_index(), jax.process_count(),
                                   eos_pad_response_to=settings.eos_pad_response_to(config),
                                   eos_pad_multiple=settings.eos_pad_multiple(config))
  assert loader.num_records == inputs.num_examples, (loader.num_records, inputs.num_examples)
  total_steps = inputs.total_steps
  if total_steps is None:
    total_steps = _measured_total_steps(config, inputs, loader)
  mesh = sharding.make_mesh(devices=inputs.resolved.devices, **inputs.resolved.mesh_shape)
  trainer = trainer_lib.Trainer(config, model_config, mesh=mesh, pad_id=tokenizer.pad_id,
                                total_steps=total_steps)
  task = SupervisedTask(trainer, tokenizer, inputs.data_config, iter(loader),
                        _resume_meta(config, model_config, total_steps))
  result = loop.run_loop(task, loop.LoopOptions(
      workdir=workdir, save_every=int(config.checkpoint.every_steps),
      max_to_keep=config.checkpoint.max_to_keep, async_save=bool(config.checkpoint.async_save),
      log_every=int(config.log_every_steps), progress=bool(config.progress_bar),
      tensorboard=True))
  params = result.state["params"]
  _export(config, workdir, model_config, trainer.model(params))
  return TrainResult(step=result.step, model_config=model_config, params=params,
                     last_metrics=result.metrics, eval_metrics=task.eval_metrics,
                     samples_per_step=(task.samples_seen / task.steps_run if task.steps_run
                                       else math.nan))
