"""The paper's main comparison in miniature, in one command.

  python -m refusion_jax.reproduce --config=configs/repro_tiny.py --workdir=W \\
      [--config.sweep=true] [--config.field=value ...]

0. Stage 1 (`config.base.num_train_steps` > 0): trains one causal ARM "base"
   model in `W/models/base` and exports it in HF layout
   (`W/models/base/hf`), the miniature of the paper's pretrained Qwen3 start.
1. Trains ARM, MDM and ReFusion models of one size on the same data for the
   same number of tokens (`config.train`, only the objective and MDM's
   bidirectional attention differ) in `W/models/<name>`: with a base stage,
   each is fine-tuned from the base (`init_from_hf`); without, each starts
   from scratch. An interrupted run resumes from the trainer's checkpoints; a
   finished stage (the base included) is skipped.
2. Scores every decoder row on the held-out problems (`evaluate.evaluate`):
   accuracy batched, speed at batch 1 with compilation excluded. Each row's
   result is cached in `W/results/<row>.json` (written atomically, keyed by
   the decode settings, the problems, the trained model and the machine), so
   a rerun skips finished work.
3. Writes `W/table.md` (the paper's Table 1 shape: per task "accuracy /
   tokens per second", an average column, tokens per forward, ratios vs ARM
   and the targets) and `W/speed_accuracy.png` (the paper's Figure 1), and
   prints the table. With `config.sweep`, also `W/sweep.png` and
   `W/sweep.md` (the paper's Figure 4: ReFusion's accuracy and speed as slot
   size and each threshold vary).

Rows whose decoder option is not implemented by decode/refusion.py are
reported as unavailable, never estimated.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import hashlib
import inspect
import json
import math
import os
import platform
import re
import shutil
import sys
import time
from typing import Callable, Mapping

import jax
import ml_collections
import numpy as np

from refusion_jax import checkpoint, evaluate, fileio
from refusion_jax import tasks as tasks_lib
from refusion_jax import tokenizer as tokenizer_lib
from refusion_jax.config import DecodeConfig
from refusion_jax.decode import refusion as refusion_decoder
from refusion_jax.training import loop
from refusion_jax.training import settings as train_settings

MODELS_DIR = "models"
RESULTS_DIR = "results"
SWEEP_DIR = "sweep"
TABLE_FILE = "table.md"
PLOT_FILE = "speed_accuracy.png"
SWEEP_PLOT_FILE = "sweep.png"
SWEEP_TABLE_FILE = "sweep.md"
TRAIN_MARKER = "reproduce_train.json"
BASE_MODEL = "base"  # W/models/base: the stage-1 causal ARM every model starts from
BASE_HF_DIR = "hf"  # its HF export, inside W/models/base
# The attention each objective trains with (ALGORITHM.md "Baselines").
MODEL_ATTENTION = {"arm": "causal", "mdm": "bidirectional", "refusion": "causal"}
REFERENCE_ROW = "ARM-AR"
SWEEP_PARAMS = ("slot_size", "slot_threshold", "token_threshold")


# ---------------------------------------------------------------------------
# Decoder rows.


@dataclasses.dataclass(frozen=True)
class Row:
  name: str
  model: str  # which trained model it decodes
  description: str
  build: Callable[[ml_collections.ConfigDict, str], DecodeConfig]  # (config, task) -> settings
  requires: str | None = None  # DecodeConfig switch decode/refusion.py must implement


def _refusion_config(config, task: str, **changes) -> DecodeConfig:
  t = config.decode.tasks[task]
  return DecodeConfig(method="refusion", gen_length=config.decode.gen_length,
                      slot_size=t.slot_size, block_size=t.block_size,
                      slot_threshold=t.slot_threshold, token_threshold=t.token_threshold,
                      **changes)


def _mdm_config(config, task: str, threshold) -> DecodeConfig:
  del task
  d = config.decode
  return DecodeConfig(method="mdm", gen_length=d.gen_length, slot_size=d.mdm_block_size,
                      block_size=d.mdm_block_size, mdm_tokens_per_step=d.mdm_tokens_per_step,
                      mdm_threshold=threshold)


ROWS: dict[str, Row] = {row.name: row for row in (
    Row("ARM-AR", "arm", "ARM, greedy left-to-right decoding with a KV cache",
        lambda c, t: DecodeConfig(method="ar", gen_length=c.decode.gen_length,
                                  slot_size=c.decode.gen_length,
                                  block_size=c.decode.gen_length)),
    Row("MDM-LLaDA", "mdm", "MDM, LLaDA decoding (fixed tokens per step, no KV cache)",
        lambda c, t: _mdm_config(c, t, None)),
    Row("MDM-FastdLLM", "mdm", "MDM, Fast-dLLM threshold decoding",
        lambda c, t: _mdm_config(c, t, c.decode.mdm_threshold)),
    Row("ReFusion", "refusion", "ReFusion, plan-and-infill", _refusion_config),
    Row("ReFusion-L2R", "refusion", "ReFusion model decoded left to right, one slot per "
        "step, no drafting", lambda c, t: _refusion_config(c, t, left_to_right=True),
        requires="left_to_right"),
    Row("ReFusion-recompute-KV", "refusion", "ReFusion, KV of infilled slots recomputed "
        "instead of reused (paper's Table 8)",
        lambda c, t: _refusion_config(c, t, recompute_kv=True), requires="recompute_kv"),
)}


def decoder_supports(field: str) -> bool:
  """Whether decode/refusion.py reads the DecodeConfig switch `field`.

  A decoder that never reads a switch would silently decode the plain way and
  report those numbers under the ablation's name; such rows are skipped.
  """
  return re.search(rf"\b{re.escape(field)}\b", inspect.getsource(refusion_decoder)) is not None


def row_unavailable(row: Row) -> str | None:
  if row.requires and not decoder_supports(row.requires):
    return (f"decode/refusion.py does not implement DecodeConfig.{row.requires} yet; "
            "no numbers are reported for this row")
  return None


# ---------------------------------------------------------------------------
# Validation (before anything is trained, loaded or compiled).


def _positive_int(value) -> bool:
  return isinstance(value, int) and not isinstance(value, bool) and value > 0


def validate(config) -> dict[str, dict[str, DecodeConfig]]:
  """Checks the reproduction fields; returns {row: {task: DecodeConfig}}."""
  models = tuple(config.models)
  unknown = [m for m in models if m not in MODEL_ATTENTION]
  if not models or unknown:
    raise ValueError(f"config.models={models!r}: each must be one of {sorted(MODEL_ATTENTION)}")
  steps = config.train.num_train_steps
  if not _positive_int(steps):
    raise ValueError(f"config.train.num_train_steps must be a positive int (the models train "
                     f"for the same number of steps), got {steps!r}")
  pretrained = config.base.get("pretrained", "")
  if pretrained:
    check_pretrained_base(pretrained)
    if config.base.num_train_steps:
      raise ValueError("config.base.pretrained and config.base.num_train_steps > 0 both ask "
                       "for a base: set one (pretrained='' trains stage 1 instead)")
  base_steps = config.base.num_train_steps
  if not isinstance(base_steps, int) or isinstance(base_steps, bool) or base_steps < 0:
    raise ValueError(f"config.base.num_train_steps must be an int >= 0 (0 = no base stage), "
                     f"got {base_steps!r}")
  base_lr = config.base.learning_rate
  if base_steps and (not isinstance(base_lr, (int, float)) or isinstance(base_lr, bool)
                     or not base_lr > 0):
    raise ValueError(f"config.base.learning_rate must be a number > 0, got {base_lr!r}")
  rows = tuple(config.eval.rows)
  if not rows:
    raise ValueError("config.eval.rows is empty")
  for name in rows:
    if name not in ROWS:
      raise ValueError(f"config.eval.rows: unknown row {name!r}; known: {list(ROWS)}")
    if ROWS[name].model not in models:
      raise ValueError(f"config.eval.rows: row {name!r} needs the {ROWS[name].model!r} model, "
                       f"which config.models={models!r} does not train")
  if not os.path.isfile(config.eval.data):
    raise ValueError(f"config.eval.data={config.eval.data!r} is not a file")
  for field in ("batch_size", "prompt_bucket", "speed_repeats"):
    if not _positive_int(config.eval[field]):
      raise ValueError(f"config.eval.{field} must be a positive int, got {config.eval[field]!r}")
  for field in ("per_task", "speed_per_task"):
    value = config.eval[field]
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
      raise ValueError(f"config.eval.{field} must be an int >= 0, got {value!r}")
  missing = [t for t in tasks_lib.TASKS if t not in config.decode.tasks]
  if missing:
    raise ValueError(f"config.decode.tasks has no settings for task(s) {missing}")
  configs = {}
  for name in rows:
    configs[name] = {}
    for task in tasks_lib.TASKS:
      try:
        configs[name][task] = ROWS[name].build(config, task)
      except (TypeError, ValueError) as e:
        raise ValueError(f"decode settings of row {name!r}, task {task!r} "
                         f"(config.decode / config.decode.tasks.{task}): {e}") from None
  if select_enabled(config):
    if "refusion" not in models:
      raise ValueError("config.select.enabled=true needs the 'refusion' model in config.models")
    if not os.path.isfile(config.select.data):
      raise ValueError(f"config.select.data={config.select.data!r} is not a file")
    if os.path.abspath(config.select.data) == os.path.abspath(config.eval.data):
      raise ValueError("config.select.data is the test split (config.eval.data): decode "
                       "settings must be chosen on a validation split")
    for param in SWEEP_PARAMS:
      if not tuple(config.sweep_grid[param]):
        raise ValueError(f"config.sweep_grid.{param} is empty")
  if config.sweep:
    if "refusion" not in models:
      raise ValueError("config.sweep=true needs the 'refusion' model in config.models")
    if not _positive_int(config.sweep_grid.per_task):
      raise ValueError(f"config.sweep_grid.per_task must be a positive int, "
                       f"got {config.sweep_grid.per_task!r}")
    sweep_configs(config)  # raises on a bad grid value
  return configs


# ---------------------------------------------------------------------------
# Training.


def has_base(config) -> bool:
  """Whether the models start from a base (the shipped one, or one stage 1 trains)."""
  return bool(config.base.get("pretrained", "")) or config.base.num_train_steps > 0


def base_hf_dir(workdir: str) -> str:
  return os.path.join(workdir, MODELS_DIR, BASE_MODEL, BASE_HF_DIR)


def base_init_dir(config, workdir: str) -> str:
  """The HF folder every model starts from: the shipped base, or stage 1's export."""
  return config.base.get("pretrained", "") or base_hf_dir(workdir)


def _sha256(path: str) -> str:
  digest = hashlib.sha256()
  with open(path, "rb") as f:
    for chunk in iter(lambda: f.read(1 << 20), b""):
      digest.update(chunk)
  return digest.hexdigest()


def check_pretrained_base(folder: str) -> str:
  """The SHA-256 of a shipped base's weights, checked against its checksum file."""
  weights = os.path.join(folder, "model.safetensors")
  listed = weights + ".sha256"
  for path in (os.path.join(folder, "config.json"), weights, listed):
    if not os.path.isfile(path):
      raise FileNotFoundError(f"config.base.pretrained={folder!r}: {os.path.basename(path)} is "
                              "missing (bash launch/train_base.sh makes the shipped base)")
  with open(listed, encoding="utf-8") as f:
    expected = (f.read().split() or [""])[0]
  actual = _sha256(weights)
  if actual != expected:
    raise ValueError(f"config.base.pretrained={folder!r}: model.safetensors has SHA-256 "
                     f"{actual}, its checksum file says {expected!r} (a damaged or "
                     "replaced file; restore it or rerun launch/train_base.sh)")
  return actual


def _common_train_config(config, workdir: str) -> ml_collections.ConfigDict:
  c = copy.deepcopy(config.train)
  c.progress_bar = bool(config.progress_bar)
  if not c.data.tfds_dir:
    c.data.tfds_dir = os.path.join(workdir, "tfds")  # one TFDS build for every model
  return c


def base_train_config(config, workdir: str) -> ml_collections.ConfigDict:
  """Stage 1: config.train as a causal ARM with the base's steps and rate, exported to HF."""
  c = _common_train_config(config, workdir)
  c.objective = "arm"
  c.model.attention = "causal"
  c.num_train_steps = int(config.base.num_train_steps)
  c.optimizer.learning_rate = float(config.base.learning_rate)
  c.export_hf_dir = base_hf_dir(workdir)
  return c


def train_config(config, model_name: str, workdir: str) -> ml_collections.ConfigDict:
  """config.train with the model's objective and attention set (and, with a base, its init)."""
  c = _common_train_config(config, workdir)
  c.objective = model_name
  c.model.attention = MODEL_ATTENTION[model_name]
  if has_base(config):
    c.init_from_hf = base_init_dir(config, workdir)
    # The HF export holds weights and config.json only; the vocabulary is the bundled one.
    # Its config.json names the tokenizer's mask id, so init_from_hf keeps the base's
    # trained special-token rows instead of resetting them.
    c.tokenizer_dir = c.tokenizer_dir or tokenizer_lib.TINY_TOKENIZER_DIR
  return c


def _budget(t, steps: int, learning_rate: float) -> dict:
  return {"steps": steps, "global_batch_size": int(t.global_batch_size),
          "seq_len": int(t.data.seq_len), "tokens": steps * int(t.global_batch_size)
          * int(t.data.seq_len), "seed": int(t.seed), "learning_rate": float(learning_rate),
          "model": {k: v for k, v in t.model.to_dict().items() if v is not None}}


def base_budget(config) -> dict | None:
  """The stage-1 budget (for a shipped base: its folder and checksum), or None."""
  if not has_base(config):
    return None
  if config.base.get("pretrained", ""):
    folder = config.base.pretrained
    return {"pretrained": folder, "sha256": check_pretrained_base(folder)}
  return _budget(config.train, int(config.base.num_train_steps), config.base.learning_rate)


def train_budget(config) -> dict:
  """Each model's budget; it names the base it starts from, so a new base retrains them."""
  t = config.train
  budget = _budget(t, int(t.num_train_steps), t.optimizer.learning_rate)
  budget["base"] = base_budget(config)
  return budget


def _read_json(path: str):
  try:
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  except (OSError, json.JSONDecodeError):
    return None


def _train_stage(name: str, train_cfg, budget: dict, model_dir: str, log,
                 ready: Callable[[], bool] = lambda: True, restart: bool = False
                 ) -> tuple[dict, bool]:
  """Trains (or resumes, or skips) one model; (its marker {budget, step, seconds}, trained).

  `restart` (or a finished run of another budget) discards model_dir first: its
  checkpoints belong to other settings or to an older base, never to resume from.
  """
  marker_path = os.path.join(model_dir, TRAIN_MARKER)
  marker = _read_json(marker_path)
  final = os.path.join(model_dir, loop.FINAL_MODEL_DIR)
  if (not restart and marker and marker.get("budget") == budget
      and checkpoint.is_model_dir(final) and ready()):
    log(f"[reproduce] {name}: already trained ({marker['step']} steps), skipped")
    return marker, False
  if os.path.isdir(model_dir) and (restart or (marker and marker.get("budget") != budget)):
    log(f"[reproduce] {name}: discarding {model_dir} (another budget or an older base)")
    shutil.rmtree(model_dir)
  start = "fine-tuning from the base" if train_cfg.init_from_hf else "training"
  log(f"[reproduce] {start} {name}: {budget['steps']} steps x {budget['global_batch_size']} "
      f"rows x {budget['seq_len']} tokens")
  t0 = time.perf_counter()
  result = loop.train_and_evaluate(train_cfg, model_dir)
  seconds = time.perf_counter() - t0
  marker = {"budget": budget, "step": int(result.step), "seconds": seconds,
            "final_loss": result.last_metrics.get("loss"),
            "num_params": result.model_config.num_params(),
            "finished": datetime.datetime.now().isoformat(timespec="seconds")}
  fileio.write_json_atomic(marker_path, marker)
  return marker, True


def train_base(config, workdir: str, log=print) -> tuple[dict | None, bool]:
  """Stage 1: trains (or resumes, or skips) the causal ARM base; (marker or None, trained)."""
  budget = base_budget(config)
  if budget is None:
    return None, False
  if "pretrained" in budget:
    log(f"[reproduce] base: the shipped pretrained base {budget['pretrained']} "
        f"(sha256 {budget['sha256'][:12]}...)")
    return {"budget": budget}, False
  hf_config = os.path.join(base_hf_dir(workdir), "config.json")
  return _train_stage(BASE_MODEL, base_train_config(config, workdir), budget,
                      os.path.join(workdir, MODELS_DIR, BASE_MODEL), log,
                      ready=lambda: os.path.isfile(hf_config))


def train_models(config, workdir: str, log=print, restart: bool = False) -> dict[str, dict]:
  """Stage 2 (or the only stage): each of config.models; {name: marker}.

  `restart`: the base was (re)trained in this run, so any earlier model state
  started from another base and is discarded.
  """
  budget = train_budget(config)
  return {name: _train_stage(name, train_config(config, name, workdir), budget,
                             os.path.join(workdir, MODELS_DIR, name), log, restart=restart)[0]
          for name in config.models}


# ---------------------------------------------------------------------------
# Evaluation.


def machine() -> dict:
  try:
    cpus = len(os.sched_getaffinity(0))
  except AttributeError:
    cpus = os.cpu_count()
  return {"platform": platform.platform(), "processor": platform.machine(), "cpus": cpus,
          "jax": jax.__version__, "backend": jax.default_backend(),
          "python": platform.python_version()}


def _machine_line(m: Mapping) -> str:
  return (f"{m['platform']} ({m['processor']}), {m['cpus']} CPU core(s), jax {m['jax']} "
          f"({m['backend']}), Python {m['python']}")


class _Models:
  """Loads each trained model once, on first use."""

  def __init__(self, workdir: str):
    self.workdir = workdir
    self._loaded = {}

  def get(self, name: str):
    if name not in self._loaded:
      self._loaded[name] = checkpoint.load_model(
          os.path.join(self.workdir, MODELS_DIR, name, loop.FINAL_MODEL_DIR))
    return self._loaded[name]


def _cached_or_run(path: str, key: dict, run: Callable[[], dict], log) -> dict:
  cached = _read_json(path)
  if cached and cached.get("key") == key:
    log(f"[reproduce] {os.path.basename(path)}: cached, skipped")
    return cached
  t0 = time.perf_counter()
  result = run()
  result["key"] = key
  result["seconds"] = time.perf_counter() - t0
  result["measured"] = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
  fileio.write_json_atomic(path, result)
  return result


def evaluate_rows(config, workdir: str, row_configs: Mapping[str, Mapping[str, DecodeConfig]],
                  trained: Mapping[str, dict], models: _Models, tokenizer, log=print) -> dict:
  """{row: result or {"unavailable": reason}}; results cached in W/results."""
  problems = evaluate.read_problems(config.eval.data, tokenizer, per_task=config.eval.per_task)
  # The width needs only the model config (a JSON file): cached rows load no weights.
  model_config = checkpoint.read_model_config(os.path.join(
      workdir, MODELS_DIR, ROWS[next(iter(row_configs))].model, loop.FINAL_MODEL_DIR))
  width = evaluate.prompt_width(problems, model_config, config.decode.gen_length,
                                config.eval.prompt_bucket)
  here = machine()
  results = {}
  for name, configs in row_configs.items():
    row = ROWS[name]
    reason = row_unavailable(row)
    if reason:
      log(f"[reproduce] {name}: unavailable ({reason})")
      results[name] = {"unavailable": reason}
      continue
    key = {"row": name, "decode": {t: dataclasses.asdict(c) for t, c in configs.items()},
           "data": os.path.abspath(config.eval.data), "per_task": config.eval.per_task,
           "speed_per_task": config.eval.speed_per_task,
           "speed_repeats": config.eval.speed_repeats, "batch_size": config.eval.batch_size,
           "width": width, "model": trained[row.model], "machine": here,
           "seed": config.seed}
    log(f"[reproduce] evaluating {name}: {row.description}")

    def run(row=row, configs=configs, name=name):
      _, model = models.get(row.model)
      return evaluate.evaluate(model, tokenizer, problems, dict(configs),
                               batch_size=config.eval.batch_size,
                               speed_per_task=config.eval.speed_per_task,
                               speed_repeats=config.eval.speed_repeats, width=width,
                               seed=config.seed, progress=config.progress_bar, desc=name)

    results[name] = _cached_or_run(os.path.join(workdir, RESULTS_DIR, f"{name}.json"), key, run,
                                   log)
  return results


# ---------------------------------------------------------------------------
# Decode settings chosen on the validation split (the paper's Table 5 picks
# them per benchmark; never on the test split).

SELECT_DIR = "select"


def select_enabled(config) -> bool:
  return bool(config.get("select", {}).get("enabled", False))


def select_settings(config, workdir: str, trained: Mapping[str, dict], models: _Models,
                    tokenizer, log=print) -> dict[str, dict]:
  """{task: {slot_size, block_size, slot_threshold, token_threshold}} for ReFusion.

  Coordinate search on the validation split: each parameter of SWEEP_PARAMS
  in turn takes every value of `config.sweep_grid` with the others at the
  settings chosen so far, and each task keeps the value with the highest
  validation accuracy, ties going to the higher tokens per forward. Accuracy
  only (batched), no timing; every evaluation is cached in W/results/select.
  """
  problems = evaluate.read_problems(config.select.data, tokenizer,
                                    per_task=config.select.per_task)
  model_config = checkpoint.read_model_config(
      os.path.join(workdir, MODELS_DIR, "refusion", loop.FINAL_MODEL_DIR))
  width = evaluate.prompt_width(problems, model_config, config.decode.gen_length,
                                config.eval.prompt_bucket)
  chosen = {t: {k: config.decode.tasks[t][k] for k in
                ("slot_size", "block_size", "slot_threshold", "token_threshold")}
            for t in tasks_lib.TASKS}
  here = machine()
  for param in SWEEP_PARAMS:
    per_value = {}
    for value in tuple(config.sweep_grid[param]):
      configs = {t: DecodeConfig(method="refusion", gen_length=config.decode.gen_length,
                                 **{**chosen[t], param: value}) for t in tasks_lib.TASKS}
      key = {"select": param, "value": value,
             "decode": {t: dataclasses.asdict(c) for t, c in configs.items()},
             "data": os.path.abspath(config.select.data), "per_task": config.select.per_task,
             "width": width, "model": trained["refusion"], "machine": here,
             "seed": config.seed, "batch_size": config.eval.batch_size}
      log(f"[reproduce] choosing on the validation split: {param}={value}")

      def run(configs=configs, param=param, value=value):
        return evaluate.evaluate(models.get("refusion")[1], tokenizer, problems, dict(configs),
                                 batch_size=config.eval.batch_size, speed_per_task=0,
                                 width=width, seed=config.seed, progress=config.progress_bar,
                                 desc=f"valid {param}={value}")

      path = os.path.join(workdir, RESULTS_DIR, SELECT_DIR, f"{param}={value}.json")
      per_value[value] = _cached_or_run(path, key, run, log)["per_task"]
    for t in tasks_lib.TASKS:
      chosen[t][param] = max(per_value, key=lambda v, t=t: (per_value[v][t]["accuracy"],
                                                            per_value[v][t]["tokens_per_forward"]))
  return chosen


def with_task_settings(config, chosen: Mapping[str, Mapping]) -> ml_collections.ConfigDict:
  """A copy of `config` whose decode.tasks are `chosen`."""
  c = copy.deepcopy(config)
  with c.unlocked():
    for t, settings in chosen.items():
      for k, v in settings.items():
        c.decode.tasks[t][k] = v
  return c


# ---------------------------------------------------------------------------
# Sweep (the paper's Figure 4).


def sweep_configs(config) -> dict[tuple[str, float], dict[str, DecodeConfig]]:
  """{(param, value): {task: DecodeConfig}}: each parameter varied alone at the task settings."""
  points = {}
  for param in SWEEP_PARAMS:
    values = tuple(config.sweep_grid[param])
    if not values:
      raise ValueError(f"config.sweep_grid.{param} is empty")
    for value in values:
      configs = {}
      for task in tasks_lib.TASKS:
        try:
          configs[task] = _refusion_config(config, task).replace(**{param: value})
        except (TypeError, ValueError) as e:
          raise ValueError(f"config.sweep_grid.{param}={value!r} (task {task!r}): {e}") from None
      points[(param, value)] = configs
  return points


def run_sweep(config, workdir: str, trained: Mapping[str, dict], models: _Models, tokenizer,
              log=print) -> dict:
  """Evaluates every sweep point on a subset; writes sweep.png and sweep.md."""
  points = sweep_configs(config)
  per_task = config.sweep_grid.per_task
  problems = evaluate.read_problems(config.eval.data, tokenizer, per_task=per_task)
  model_config = checkpoint.read_model_config(
      os.path.join(workdir, MODELS_DIR, "refusion", loop.FINAL_MODEL_DIR))
  width = evaluate.prompt_width(problems, model_config, config.decode.gen_length,
                                config.eval.prompt_bucket)
  here = machine()
  results = {}
  for i, ((param, value), configs) in enumerate(points.items()):
    key = {"param": param, "value": value,
           "decode": {t: dataclasses.asdict(c) for t, c in configs.items()},
           "data": os.path.abspath(config.eval.data), "per_task": per_task, "width": width,
           "model": trained["refusion"], "machine": here, "seed": config.seed,
           "speed_repeats": config.eval.speed_repeats}
    log(f"[reproduce] sweep {i + 1}/{len(points)}: {param}={value}")

    def run(configs=configs, param=param, value=value):
      return evaluate.evaluate(models.get("refusion")[1], tokenizer, problems, dict(configs),
                               batch_size=config.eval.batch_size, speed_per_task=per_task,
                               speed_repeats=config.eval.speed_repeats, width=width,
                               seed=config.seed, progress=config.progress_bar,
                               desc=f"{param}={value}")

    path = os.path.join(workdir, RESULTS_DIR, SWEEP_DIR, f"{param}={value}.json")
    results[(param, value)] = _cached_or_run(path, key, run, log)
  write_sweep_plot(results, os.path.join(workdir, SWEEP_PLOT_FILE))
  lines = ["# ReFusion sweep (the paper's Figure 4 in miniature)", "",
           f"Each parameter varied alone, the others at each task's setting; {per_task} "
           "problems per task, batch-1 speed.", "",
           "| parameter | value | accuracy | tokens/s | tokens/forward |", "|---|---|---|---|---|"]
  for (param, value), r in results.items():
    a = r["average"]
    lines.append(f"| {param} | {value} | {a['accuracy']:.1f} | {_fmt(a['tokens_per_sec'])} | "
                 f"{a['tokens_per_forward']:.2f} |")
  fileio.write_text_atomic(os.path.join(workdir, SWEEP_TABLE_FILE), "\n".join(lines) + "\n")
  return results


def write_sweep_plot(results: Mapping[tuple[str, float], dict], path: str) -> None:
  import matplotlib  # local: plotting is the last step
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(1, len(SWEEP_PARAMS), figsize=(4.2 * len(SWEEP_PARAMS), 3.4))
  for ax, param in zip(np.atleast_1d(axes), SWEEP_PARAMS):
    pts = sorted((v, r["average"]) for (p, v), r in results.items() if p == param)
    xs = [v for v, _ in pts]
    ax.plot(xs, [a["accuracy"] for _, a in pts], "o-", color="tab:blue")
    ax.set_xlabel(param)
    ax.set_ylabel("accuracy (%)", color="tab:blue")
    ax.set_ylim(-3, 103)  # a fixed scale: a flat line must not look like a trend
    twin = ax.twinx()
    twin.plot(xs, [a["tokens_per_sec"] or 0.0 for _, a in pts], "s--", color="tab:red")
    twin.set_ylabel("tokens / s (batch 1)", color="tab:red")
    twin.set_ylim(bottom=0)
    ax.set_title(f"ReFusion vs {param}")
  fig.tight_layout()
  _save_figure(fig, path)
  plt.close(fig)


# ---------------------------------------------------------------------------
# Report.


def _fmt(value, digits: int = 1) -> str:
  return "n/a" if value is None or not math.isfinite(value) else f"{value:.{digits}f}"


def _save_figure(fig, path: str) -> None:
  tmp = f"{path}.tmp{os.getpid()}.png"
  fig.savefig(tmp, dpi=120)
  os.replace(tmp, path)


def _avg(result: dict, field: str):
  return None if "unavailable" in result else result["average"][field]


def targets(results: Mapping[str, dict]) -> list[tuple[str, str, bool | None]]:
  """(target, measured, met) for the TARGETS.md figures this run can check."""
  def ratio(a, b, field="tokens_per_sec"):
    x, y = results.get(a), results.get(b)
    if not x or not y or _avg(x, field) is None or _avg(y, field) in (None, 0):
      return None
    return _avg(x, field) / _avg(y, field)

  def gap(a, b):
    x, y = results.get(a), results.get(b)
    if not x or not y or "unavailable" in x or "unavailable" in y:
      return None
    return _avg(y, "accuracy") - _avg(x, "accuracy")

  out = []
  r, g = ratio("ReFusion", "ARM-AR"), gap("ReFusion", "ARM-AR")
  out.append(("ReFusion >= 3x ARM tokens/s at <= 2 points lower accuracy",
              f"{_fmt(r, 2)}x, {_fmt(g, 1)} points lower",
              None if r is None or g is None else (r >= 3.0 and g <= 2.0)))
  for mdm_row in ("MDM-LLaDA", "MDM-FastdLLM"):
    r = ratio("ReFusion", mdm_row)
    out.append((f"ReFusion >= 20x {mdm_row} tokens/s", f"{_fmt(r, 2)}x",
                None if r is None else r >= 20.0))
  tpf = _avg(results["ReFusion"], "tokens_per_forward") if "ReFusion" in results else None
  out.append(("ReFusion tokens per forward >= 4", _fmt(tpf, 2),
              None if tpf is None else tpf >= 4.0))
  r, g = ratio("ReFusion", "ReFusion-recompute-KV"), gap("ReFusion", "ReFusion-recompute-KV")
  out.append(("KV reuse faster than recomputation at <= 0.5 point cost",
              f"{_fmt(r, 2)}x, {_fmt(g, 1)} points lower",
              None if r is None or g is None else (r > 1.0 and g <= 0.5)))
  return out


def render_table(config, results: Mapping[str, dict], trained: Mapping[str, dict],
                 when: str, here: Mapping, base: Mapping | None = None) -> str:
  """The markdown report; `base` is the stage-1 marker (None: models trained from scratch)."""
  task_names = list(tasks_lib.TASKS)
  header = "| Decoder | " + " | ".join(task_names) + " | Avg |"
  rule = "|---" * (len(task_names) + 2) + "|"
  budget = next(iter(trained.values()))["budget"]
  params = next(iter(trained.values())).get("num_params")
  any_result = next((r for r in results.values() if "unavailable" not in r), None)
  n_acc = {t: m["n"] for t, m in any_result["per_task"].items()} if any_result else {}
  n_speed = {t: m["speed_n"] for t, m in any_result["per_task"].items()} if any_result else {}
  measured = [r["measured"] for r in results.values() if "measured" in r]
  names = ", ".join(trained)
  if base and "pretrained" in base["budget"]:
    b = base["budget"]
    start = [f"- Base (shared: all of {names} start from this one model): the shipped "
             f"pretrained causal ARM {b['pretrained']} (configs/base_tiny.py, "
             f"sha256 {b['sha256'][:12]}...)"]
    how = f"fine-tuned from the base, peak lr {budget.get('learning_rate', float('nan')):g}"
  elif base:
    b = base["budget"]
    start = [f"- Base (stage 1, shared: all of {names} start from this one model): causal "
             f"ARM, {b['steps']} steps x {b['global_batch_size']} rows x {b['seq_len']} "
             f"tokens = {b['tokens']:,} tokens, peak lr {b['learning_rate']:g}; wall "
             f"{base['seconds']:.0f}s"]
    how = f"fine-tuned from the base, peak lr {budget.get('learning_rate', float('nan')):g}"
  else:
    start, how = [], "from scratch"
  lines = [
      "# ReFusion in miniature: accuracy (%) / tokens per second", "",
      f"- Date: {when}" + (f" (results measured {min(measured)} to {max(measured)})"
                           if measured else ""),
      f"- Machine: {_machine_line(here)}",
      *start,
      f"- Training (each of {names}, {how}): {budget['steps']} steps x "
      f"{budget['global_batch_size']} rows x {budget['seq_len']} tokens = "
      f"{budget['tokens']:,} tokens; {params:,} parameters; wall "
      + ", ".join(f"{n} {m['seconds']:.0f}s" for n, m in trained.items()),
      "- Held-out problems per task (accuracy, batched decode): "
      + ", ".join(f"{t} {n}" for t, n in n_acc.items()),
      f"- Speed: first {max(n_speed.values()) if n_speed else 0} problems per task decoded "
      f"at batch 1, greedy, compile excluded, fastest of {config.eval.speed_repeats} "
      "decodes per problem; tokens counted up to and including EOS; "
      f"gen_length {config.decode.gen_length}",
      "- ReFusion settings per task (k, b, tau_s, tau_t), "
      + ("chosen on the validation split "
         f"({os.path.basename(config.select.data)}; each of {', '.join(SWEEP_PARAMS)} in turn "
         "over config.sweep_grid, best accuracy, ties to more tokens per forward): "
         if select_enabled(config) else "as configured: ")
      + "; ".join(f"{t} {d.slot_size}, {d.block_size}, {d.slot_threshold:g}, "
                  f"{d.token_threshold:g}" for t, d in
                  ((t, config.decode.tasks[t]) for t in task_names)),
      "", header, rule]
  notes = []
  for name, r in results.items():
    if "unavailable" in r:
      lines.append(f"| {name} | " + " | ".join("n/a" for _ in task_names) + " | n/a |")
      notes.append(f"- {name}: {r['unavailable']}")
      continue
    cells = [f"{r['per_task'][t]['accuracy']:.1f} / {_fmt(r['per_task'][t]['tokens_per_sec'])}"
             for t in task_names]
    a = r["average"]
    cells.append(f"**{a['accuracy']:.1f} / {_fmt(a['tokens_per_sec'])}**")
    lines.append(f"| {name} | " + " | ".join(cells) + " |")
  lines += ["", "## Tokens per forward pass (every pass counted)", "", header, rule]
  for name, r in results.items():
    if "unavailable" in r:
      lines.append(f"| {name} | " + " | ".join("n/a" for _ in task_names) + " | n/a |")
      continue
    cells = [f"{r['per_task'][t]['tokens_per_forward']:.2f}" for t in task_names]
    cells.append(f"**{r['average']['tokens_per_forward']:.2f}**")
    lines.append(f"| {name} | " + " | ".join(cells) + " |")

  lines += ["", "## The paper's TPF (per answer, mean over plan steps of tokens / passes "
            "in the step) / engine tokens per second "
            f"({config.eval.batch_size} rows, continuous batching)", "", header, rule]
  for name, r in results.items():
    if "unavailable" in r:
      lines.append(f"| {name} | " + " | ".join("n/a" for _ in task_names) + " | n/a |")
      continue
    cells = [f"{r['per_task'][t]['tpf_paper']:.2f} / "
             f"{_fmt(r['per_task'][t].get('engine_tokens_per_sec'))}" for t in task_names]
    engine = [r["per_task"][t].get("engine_tokens_per_sec") for t in task_names]
    mean_engine = (sum(engine) / len(engine)) if all(e is not None for e in engine) else None
    cells.append(f"**{r['average']['tpf_paper']:.2f} / {_fmt(mean_engine)}**")
    lines.append(f"| {name} | " + " | ".join(cells) + " |")

  ref = results.get(REFERENCE_ROW)
  if ref and "unavailable" not in ref:
    lines += ["", f"## Relative to {REFERENCE_ROW} (averages over tasks)", "",
              "| Decoder | accuracy - ARM (points) | tokens/s / ARM |", "|---|---|---|"]
    for name, r in results.items():
      if "unavailable" in r:
        lines.append(f"| {name} | n/a | n/a |")
        continue
      d = r["average"]["accuracy"] - ref["average"]["accuracy"]
      tps, ref_tps = r["average"]["tokens_per_sec"], ref["average"]["tokens_per_sec"]
      speed = tps / ref_tps if tps is not None and ref_tps else None
      lines.append(f"| {name} | {d:+.1f} | {_fmt(speed, 2)}x |")

  lines += ["", "## Targets (TARGETS.md)", "", "| Target | Measured | Met |", "|---|---|---|"]
  for target, measured, met in targets(results):
    lines.append(f"| {target} | {measured} | {'n/a' if met is None else 'yes' if met else 'no'} |")
  lines += ["", f"MDM decode settings: block {config.decode.mdm_block_size}, LLaDA "
            f"{config.decode.mdm_tokens_per_step} token(s)/step, Fast-dLLM threshold "
            f"{config.decode.mdm_threshold}."]
  if notes:
    lines += ["", "Unavailable rows:"] + notes
  return "\n".join(lines) + "\n"


def write_speed_accuracy_plot(results: Mapping[str, dict], path: str) -> None:
  """Accuracy vs tokens/s relative to ARM, one point per decoder (the paper's Figure 1)."""
  import matplotlib  # local: plotting is the last step
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  import matplotlib.ticker  # pylint: disable=unused-import

  ref = results.get(REFERENCE_ROW)
  ref_tps = _avg(ref, "tokens_per_sec") if ref else None
  fig, ax = plt.subplots(figsize=(7.2, 4.6))
  markers = "os^Dv<>P"
  for i, (name, r) in enumerate(results.items()):
    tps = _avg(r, "tokens_per_sec")
    if tps is None:
      continue
    x = tps / ref_tps if ref_tps else tps
    ax.scatter([x], [r["average"]["accuracy"]], s=70, marker=markers[i % len(markers)],
               label=f"{name} ({x:.2f}x, {r['average']['accuracy']:.1f}%)" if ref_tps
               else name)
  ax.set_xscale("log")
  times = matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}x")
  ax.xaxis.set_major_formatter(times)
  ax.xaxis.set_minor_formatter(times)
  ax.set_ylim(-3, 103)
  ax.set_xlabel(f"tokens / s relative to {REFERENCE_ROW} (batch 1, log scale)"
                if ref_tps else "tokens / s (batch 1, log scale)")
  ax.set_ylabel("average accuracy (%)")
  ax.legend(fontsize=8, loc="best")
  ax.set_title("Speed vs accuracy on the miniature task suite")
  ax.grid(True, which="both", alpha=0.3)
  fig.tight_layout()
  _save_figure(fig, path)
  plt.close(fig)


# ---------------------------------------------------------------------------
# The whole pipeline.


def run(config, workdir: str, log=print) -> dict:
  """Trains, evaluates, writes table.md and speed_accuracy.png; returns the results."""
  if not workdir:
    raise ValueError("--workdir is required")
  workdir = os.path.abspath(workdir)
  row_configs = validate(config)
  os.makedirs(workdir, exist_ok=True)
  t0 = time.perf_counter()
  base, new_base = train_base(config, workdir, log)
  trained = train_models(config, workdir, log, restart=new_base)
  train_seconds = time.perf_counter() - t0
  tokenizer = train_settings.load_tokenizer(config.train)
  models = _Models(workdir)
  chosen = None
  if select_enabled(config):
    chosen = select_settings(config, workdir, trained, models, tokenizer, log)
    config = with_task_settings(config, chosen)
    row_configs = validate(config)
  results = evaluate_rows(config, workdir, row_configs, trained, models, tokenizer, log)
  when = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
  table = render_table(config, results, trained, when, machine(), base)
  fileio.write_text_atomic(os.path.join(workdir, TABLE_FILE), table)
  write_speed_accuracy_plot(results, os.path.join(workdir, PLOT_FILE))
  sweep = None
  if config.sweep:
    sweep = run_sweep(config, workdir, trained, models, tokenizer, log)
  log(table)
  log(f"[reproduce] wrote {os.path.join(workdir, TABLE_FILE)} and "
      f"{os.path.join(workdir, PLOT_FILE)}" + (" and the sweep" if sweep else "")
      + f" (training phase {train_seconds:.0f}s, total {time.perf_counter() - t0:.0f}s)")
  return {"results": results, "trained": trained, "base": base, "table": table,
          "sweep": sweep, "chosen": chosen}


def main(argv) -> dict:
  """Parses `argv` (program name first: --config=FILE --workdir=W [--config.x=y]) and runs."""
  from absl import flags, logging  # pylint: disable=import-outside-toplevel
  from ml_collections import config_flags  # pylint: disable=import-outside-toplevel

  # Own FlagValues: refusion_jax.train already defines a global --config.
  fv = flags.FlagValues()
  config_flag = config_flags.DEFINE_config_file("config", None, "Reproduction config file.",
                                                flag_values=fv, lock_config=True,
                                                sys_argv=list(argv))
  workdir = flags.DEFINE_string("workdir", None, "Models, results, table.md and plots.",
                                flag_values=fv)
  rest = fv(list(argv))
  if len(rest) > 1:
    raise ValueError(f"unexpected arguments: {rest[1:]}")
  if config_flag.value is None:
    raise ValueError("--config=configs/repro_tiny.py is required")
  if not workdir.value:
    raise ValueError("--workdir is required")
  # Orbax logs every save at INFO; warnings still show.
  logging.set_verbosity(logging.WARNING)
  return run(config_flag.value, workdir.value)


if __name__ == "__main__":
  try:
    main(sys.argv)
  except (ValueError, FileNotFoundError) as _e:
    print(f"refusion_jax.reproduce: error: {_e}", file=sys.stderr)
    sys.exit(2)
