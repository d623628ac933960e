"""The reproduction's evaluations: the table's rows, the validation search, the sweep.

Every evaluation goes through `evaluate.evaluate` (accuracy batched, speed at
batch 1 with compilation excluded) and is cached as one JSON file under
`W/results` (written atomically). Its key names everything the result
depends on: the decode settings, the problems (file, count per task, padded
width), the trained model's marker, the machine and the seed, and what the
caller adds (batch size, speed settings). A rerun skips every result whose
key is unchanged, without loading a model.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import platform
import time
from typing import Callable, Mapping

import jax

from refusion_jax import checkpoint, evaluate, fileio
from refusion_jax import tasks as tasks_lib
from refusion_jax.decode.settings import DecodeConfig
from refusion_jax.repro import settings, stages

RESULTS_DIR = "results"
SELECT_DIR = "select"  # W/results/select: the validation search
SWEEP_DIR = "sweep"  # W/results/sweep: the sweep (the paper's Figure 4)


def machine() -> dict:
  """Where results are measured (part of every cache key, and of the report)."""
  try:
    cpus = len(os.sched_getaffinity(0))
  except AttributeError:
    cpus = os.cpu_count()
  return {"platform": platform.platform(), "processor": platform.machine(), "cpus": cpus,
          "jax": jax.__version__, "backend": jax.default_backend(),
          "python": platform.python_version()}


class TrainedModels:
  """Loads each trained model once, on first use."""

  def __init__(self, workdir: str):
    self.workdir = workdir
    self._loaded = {}

  def get(self, name: str):
    if name not in self._loaded:
      self._loaded[name] = checkpoint.load_model(stages.final_model_dir(self.workdir, name))
    return self._loaded[name][1]


@dataclasses.dataclass(frozen=True)
class _ProblemSet:
  data: str  # the JSONL file
  per_task: int  # first problems of each task (0 = all)
  problems: list
  width: int  # every prompt padded to it: one compiled program per decode config


def _problem_set(config, workdir: str, tokenizer, data: str, per_task: int,
                 model: str) -> _ProblemSet:
  problems = evaluate.read_problems(data, tokenizer, per_task=per_task)
  # The width needs only the model config (a JSON file): cached results load no weights.
  model_config = checkpoint.read_model_config(stages.final_model_dir(workdir, model))
  width = evaluate.prompt_width(problems, model_config, config.decode.gen_length,
                                config.eval.prompt_bucket)
  return _ProblemSet(data, per_task, problems, width)


def _decode_key(c: DecodeConfig) -> dict:
  """A decode config as a cache key holds it: its flat settings (a tuple as JSON holds
  it, a list)."""
  return {k: list(v) if isinstance(v, tuple) else v for k, v in c.flat().items()}


def _decode_of_key(d) -> DecodeConfig | None:
  """The decode config a cached key holds, read as the settings it means: a key written
  when every method's fields were kept (inert ones among them) or before a field existed
  (its default) reads as the same config (None: unreadable)."""
  try:
    return DecodeConfig.from_flat(d, lenient=True)
  except (TypeError, ValueError, AttributeError):
    return None


def same_key(cached: dict, key: dict) -> bool:
  """Whether a cached result's key is `key`: equal fields, decode configs equal as
  settings (`_decode_of_key`)."""
  if not isinstance(cached, dict) or set(cached) != set(key):
    return False
  if any(cached[k] != key[k] for k in key if k != "decode"):
    return False
  theirs, ours = cached["decode"], key["decode"]
  if not isinstance(theirs, dict) or set(theirs) != set(ours):
    return False
  return all(_decode_of_key(theirs[t]) == _decode_of_key(ours[t]) for t in ours)


def _key(config, problem_set: _ProblemSet, configs: Mapping[str, DecodeConfig],
         marker: dict, **fields) -> dict:
  return {**fields, "decode": {t: _decode_key(c) for t, c in configs.items()},
          "data": os.path.abspath(problem_set.data), "per_task": problem_set.per_task,
          "width": problem_set.width, "model": marker, "machine": machine(),
          "seed": config.seed}


def _evaluate(config, model, tokenizer, problem_set: _ProblemSet,
              configs: Mapping[str, DecodeConfig], desc: str, **speed) -> dict:
  return evaluate.evaluate(model, tokenizer, problem_set.problems, dict(configs),
                           batch_size=config.eval.batch_size, width=problem_set.width,
                           seed=config.seed, progress=config.progress_bar, desc=desc, **speed)


def _cached_or_run(path: str, key: dict, run: Callable[[], dict], log) -> dict:
  cached = fileio.read_json_or_none(path)
  if cached and same_key(cached.get("key"), key):
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
                  trained: Mapping[str, dict], models: TrainedModels, tokenizer,
                  log=print) -> dict:
  """{row: result} on the test split; cached in W/results."""
  first_model = settings.ROWS[next(iter(row_configs))].model
  test = _problem_set(config, workdir, tokenizer, config.eval.data, config.eval.per_task,
                      first_model)
  e = config.eval
  results = {}
  for name, configs in row_configs.items():
    row = settings.ROWS[name]
    key = _key(config, test, configs, trained[row.model], row=name,
               speed_per_task=e.speed_per_task, speed_repeats=e.speed_repeats,
               batch_size=e.batch_size)
    log(f"[reproduce] evaluating {name}: {row.description}")

    def run(row=row, configs=configs, name=name):
      return _evaluate(config, models.get(row.model), tokenizer, test, configs, name,
                       speed_per_task=e.speed_per_task, speed_repeats=e.speed_repeats)

    results[name] = _cached_or_run(os.path.join(workdir, RESULTS_DIR, f"{name}.json"), key, run,
                                   log)
    # A row's programs serve no other row: freed, so that one process holding every
    # row's compiled code does not run out of the memory maps the CPU compiler needs
    # (LLVM "Unable to allocate section memory" after ~15 rows). The compilation cache
    # on disk still holds them.
    jax.clear_caches()
  return results


def select_settings(config, workdir: str, trained: Mapping[str, dict], models: TrainedModels,
                    tokenizer, log=print, row: str = "ReFusion") -> dict[str, dict]:
  """{task: {slot_size, block_size, slot_threshold, token_threshold}} for ReFusion row `row`.

  The paper's Table 5 picks them per benchmark; here they are picked on the
  validation split, never on the test split, for the row's own model and options
  (`settings.ROWS[row]`). Coordinate search: each parameter of SWEEP_PARAMS in
  turn takes every value of `config.sweep_grid` with the others at the settings
  chosen so far, and each task keeps the value with the highest validation
  accuracy, ties going to the higher tokens per forward. Accuracy only (batched),
  no timing; every evaluation is cached in W/results/select (the "ReFusion" row's)
  or W/results/select/<row>.
  """
  spec = settings.ROWS[row]
  options = dict(spec.options)
  valid = _problem_set(config, workdir, tokenizer, config.select.data, config.select.per_task,
                       spec.model)
  chosen = {t: {k: config.decode.tasks[t][k] for k in settings.TASK_SETTINGS}
            for t in tasks_lib.TASKS}
  folder = os.path.join(workdir, RESULTS_DIR, SELECT_DIR)
  if row != "ReFusion":
    folder = os.path.join(folder, row)
  extra = {} if row == "ReFusion" else {"row": row}
  for param in settings.SWEEP_PARAMS:
    per_value = {}
    for value in tuple(config.sweep_grid[param]):
      configs = {t: settings.refusion_decode_config(config, t, **{**chosen[t], param: value},
                                                    **options)
                 for t in tasks_lib.TASKS}
      key = _key(config, valid, configs, trained[spec.model], select=param, value=value,
                 batch_size=config.eval.batch_size, **extra)
      log(f"[reproduce] choosing {row}'s settings on the validation split: {param}={value}")

      def run(configs=configs, param=param, value=value):
        return _evaluate(config, models.get(spec.model), tokenizer, valid, configs,
                         f"valid {row} {param}={value}", speed_per_task=0)

      path = os.path.join(folder, f"{param}={value}.json")
      per_value[value] = _cached_or_run(path, key, run, log)["per_task"]
    for t in tasks_lib.TASKS:
      chosen[t][param] = max(per_value, key=lambda v, t=t: (per_value[v][t]["accuracy"],
                                                            per_value[v][t]["tokens_per_forward"]))
  return chosen


def run_sweep(config, workdir: str, trained: Mapping[str, dict], models: TrainedModels,
              tokenizer, log=print) -> dict:
  """{(param, value): result} for every sweep point, on the first problems of each task."""
  points = settings.sweep_configs(config)
  per_task = config.sweep_grid.per_task
  subset = _problem_set(config, workdir, tokenizer, config.eval.data, per_task, "refusion")
  results = {}
  for i, ((param, value), configs) in enumerate(points.items()):
    key = _key(config, subset, configs, trained["refusion"], param=param, value=value,
               speed_repeats=config.eval.speed_repeats)
    log(f"[reproduce] sweep {i + 1}/{len(points)}: {param}={value}")

    def run(configs=configs, param=param, value=value):
      return _evaluate(config, models.get("refusion"), tokenizer, subset, configs,
                       f"{param}={value}", speed_per_task=per_task,
                       speed_repeats=config.eval.speed_repeats)

    path = os.path.join(workdir, RESULTS_DIR, SWEEP_DIR, f"{param}={value}.json")
    results[(param, value)] = _cached_or_run(path, key, run, log)
  return results
