"""The one training loop: restore, step, log, checkpoint, stop.

Every trainer (`training.supervised`, `distill`, `rl.trainer`) is a `Task`: its
state (`{"params", "opt_state"}`), its step (which draws its own batch or
rollouts) and what a resume must match. `run_loop(task, options)` does the rest,
the same way for all of them:

* **restore**: the newest intact checkpoint in `W/checkpoints` (one damaged, with a
  missing or truncated file or unreadable JSON, is named in a warning, moved to
  `<step>.damaged` and the next older one tried); its meta must match the task's
  (`check_resume`), else the run stops naming the setting;
* **checkpoints**: one format (`checkpoint.TrainCheckpointer`, orbax, written under a
  temporary name and renamed): the state, a JSON meta with the step, and the data
  iterator's position when the task reads one (the others draw their batches from
  (seed, step)); every `save_every` steps, at the last step and when stopped;
* **stops**: SIGTERM (a preemption notice) and SIGINT (Ctrl-C) finish the step in
  progress, save it, wait until it is on disk and raise `Stopped`, whose exit status
  is 75 (`EXIT_PREEMPTED`, EX_TEMPFAIL) for SIGTERM and 130 (`EXIT_INTERRUPTED`, the
  shell's status of a Ctrl-C) for SIGINT. Either way the same command resumes from
  it, bit-identically. A second Ctrl-C stops at once (KeyboardInterrupt), without a
  checkpoint. A task may abandon a step when the stop comes in it (`StepAbandoned`,
  before it changed anything): the state before the step is saved instead. With
  several processes, JAX's preemption service passes SIGTERM to all of them and
  picks one step (`multihost_utils.reached_preemption_sync_point`); Ctrl-C keeps its
  default there;
* **metrics**: `W/metrics.jsonl` and the progress bar (`training.metrics`); a run
  resumed from step N drops the lines after N first, so every step is logged once;
* **non-finite numbers**: a NaN or infinite loss or gradient norm stops the run
  (`NonFiniteLossError`) without saving that step.

Entry points wrap their work in `stops_reported(program)`: a stop is one line on
stderr and its exit status.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import math
import os
import signal
import sys
import threading
from typing import Any, Callable, Mapping, NoReturn

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from refusion_jax import checkpoint, runtime, sharding
from refusion_jax.checks import InputError
from refusion_jax.config import ModelConfig
from refusion_jax.training.metrics import MetricsWriter
from refusion_jax.training.outputs import CHECKPOINT_DIR

EXIT_PREEMPTED = 75  # SIGTERM: checkpoint on disk; run the same command again to resume
EXIT_INTERRUPTED = 130  # Ctrl-C (128 + SIGINT): checkpoint on disk, resumable the same way
# Metrics every step reports that must stay finite.
FINITE_METRICS = {"loss": "loss", "grad_norm": "gradient"}


class NonFiniteLossError(FloatingPointError):
  """Training produced a NaN/inf loss or gradient; nothing of that step was saved."""


class Stopped(Exception):
  """SIGTERM or Ctrl-C stopped training at a step boundary; its checkpoint is complete."""

  def __init__(self, step: int, directory: str, signum: int | None):
    interrupted = signum == signal.SIGINT
    what = "interrupted (Ctrl-C)" if interrupted else "preempted"
    super().__init__(f"{what}: checkpoint of step {step} saved in {directory}; run the same "
                     "command again to resume from it")
    self.step = step
    self.exit_status = EXIT_INTERRUPTED if interrupted else EXIT_PREEMPTED


class StepAbandoned(Exception):
  """Raised by a task's step that saw a stop request before it changed its state."""


class StopNotice:
  """Whether the run should stop at this step boundary, and which signal asked.

  One process: SIGTERM and SIGINT set a flag; a step reads it mid-way through
  `requested`, the loop after each step through `reached`. Several processes: the
  preemption service's sync point decides (it must be reached by every process at
  every step); SIGINT is left alone, since one process's Ctrl-C cannot pick a step
  for the others.
  """

  _NAMES = {signal.SIGTERM: "SIGTERM", signal.SIGINT: "Ctrl-C"}

  def __init__(self):
    self.signum: int | None = None
    self._previous: dict[int, Any] = {}
    self._multi = jax.process_count() > 1
    if not self._multi and threading.current_thread() is threading.main_thread():
      for signum in self._NAMES:
        self._previous[signum] = signal.signal(signum, self._on_signal)

  def _on_signal(self, signum, frame):  # pylint: disable=unused-argument
    if self.signum is not None:
      if signum == signal.SIGINT:
        raise KeyboardInterrupt("stopped at once, without a checkpoint")
      return
    self.signum = signum
    again = " (Ctrl-C again: stop at once, without it)" if signum == signal.SIGINT else ""
    runtime.note("train", "%s: saving a checkpoint after this step, then stopping%s",
                    self._NAMES[signum], again)

  @property
  def requested(self) -> bool:
    """A signal came (this process only; for a step deciding to abandon itself)."""
    return self.signum is not None

  def reached(self, step: int) -> bool:
    """Whether to stop after `step` (a collective with several processes)."""
    if self._multi:
      if multihost_utils.reached_preemption_sync_point(step):
        self.signum = signal.SIGTERM
    return self.signum is not None

  def close(self) -> None:
    for signum, previous in self._previous.items():
      signal.signal(signum, previous)
    self._previous = {}


class Task(abc.ABC):
  """A trainer as the loop sees it.

  The state is a pytree `{"params": ..., "opt_state": ...}` of arrays placed where
  the step wants them. `meta()` holds JSON values a resumed run must match (a
  `model_config` entry is compared field by field, `check_resume`).
  """

  label: str = "train"  # the progress bar's name
  total_steps: int = 0
  # A grain iterator whose position every checkpoint keeps, or None: the task draws its
  # batches from (seed, step).
  data_iterator: Any = None

  @abc.abstractmethod
  def meta(self) -> dict:
    """What the checkpoints are written with and a resume must match."""

  @abc.abstractmethod
  def abstract_state(self) -> Any:
    """The state's `jax.ShapeDtypeStruct`s, each with the sharding to restore it into."""

  @abc.abstractmethod
  def init_state(self) -> Any:
    """The state of a run with no checkpoint."""

  @abc.abstractmethod
  def step(self, state, step: int, stop: StopNotice) -> tuple[Any, Mapping[str, float]]:
    """Update `step` (0-based): `(new state, host metrics)`; the metrics hold a `loss`
    and a `grad_norm`. May raise `StepAbandoned` if `stop.requested` before it drew a
    batch or changed anything."""

  def postfix(self, metrics: Mapping[str, float]) -> dict:
    """The progress bar's numbers for a step."""
    return {"loss": f"{metrics['loss']:.4f}"}

  def evaluate(self, state, done: int) -> dict:  # pylint: disable=unused-argument
    """Metrics logged on a line of their own after step `done` is saved ({}: none)."""
    return {}


@dataclasses.dataclass(frozen=True)
class LoopOptions:
  workdir: str  # W: checkpoints/, metrics.jsonl (and tensorboard/ when asked)
  save_every: int  # steps between checkpoints; the last step and a stop save too
  max_to_keep: int = 2
  async_save: bool = False  # saves run beside the next steps
  log_every: int = 1  # steps between metrics lines (the last step is always logged)
  progress: bool = True
  tensorboard: bool = False


@dataclasses.dataclass
class LoopResult:
  start: int  # the step the run started (or resumed) at
  step: int  # steps done, in this run and before it
  state: Any  # the final state
  metrics: dict  # the last step's metrics in this run ({} when it ran none)


@dataclasses.dataclass(frozen=True)
class Placement:
  """Where a trainer's arrays live: a (data, fsdp, tensor) mesh with its logical-axis
  rules, or, with no mesh, JAX's default device."""

  mesh: Mesh | None = None
  rules: sharding.ShardingRules = dataclasses.field(default_factory=sharding.ShardingRules)

  def shard_model(self, model) -> None:
    """Moves every variable of `model` onto the mesh by its logical axes (in place)."""
    if self.mesh is None:
      return
    state = nnx.state(model)
    nnx.update(model, jax.device_put(state, sharding.state_shardings(state, self.mesh,
                                                                     self.rules)))

  def jit(self, fn: Callable, **jit_kwargs) -> Callable:
    """`fn` jitted, traced and run under the mesh's activation constraints."""
    jitted = jax.jit(fn, **jit_kwargs)

    def call(*args):
      with sharding.use_mesh(self.mesh, self.rules):
        return jitted(*args)

    return call


def abstract_of(tree) -> Any:
  """Each array of `tree` as a `jax.ShapeDtypeStruct` keeping its sharding."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                      tree)


# Model fields a resumed run may change: how the same parameters are computed, not what
# they are (a remat policy or an attention kernel can be chosen per machine).
_RESUMABLE_MODEL_FIELDS = ("remat", "attention_impl")


def check_resume(saved: Mapping[str, Any], wanted: Mapping[str, Any], where: str) -> None:
  """Raises InputError naming the first setting of `wanted` that `saved` (a checkpoint's
  meta, read from `where`) holds with another value; keys it lacks are not compared."""
  for key, value in wanted.items():
    if key not in saved:
      continue
    if key == "model_config":
      _check_resume_model(saved[key], value, where)
    elif saved[key] != value:
      raise InputError(f"{where} was written with {key}={saved[key]!r} but the config now "
                       f"gives {value!r}; start in a new folder or restore the old setting")


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
            if name == "scan_layers" else "start in a new folder or restore the old setting")
    raise InputError(f"{where} was written with model.{name}={saved.get(name)!r} but the config "
                     f"now gives {value!r}; {hint}")


def _first_line(error: BaseException, limit: int = 300) -> str:
  """The root cause of `error` on one line (orbax wraps TensorStore's precise message)."""
  seen = set()
  while id(error) not in seen and (error.__cause__ or error.__context__) is not None:
    seen.add(id(error))
    error = error.__cause__ or error.__context__
  text = " ".join(str(error).split()) or type(error).__name__
  text = f"{type(error).__name__}: {text}"
  return text if len(text) <= limit else text[:limit] + " ..."


def _try_restore(ckpt: checkpoint.TrainCheckpointer, step: int, task: Task, meta: dict,
                 abstract) -> tuple[Any, str | None]:
  """`(state, None)` of checkpoint `step`, or `(None, what is wrong with it)`."""
  problem = ckpt.damage(step)
  if problem is not None:
    return None, problem
  try:
    saved_meta = ckpt.read_meta(step)
  except Exception as e:  # pylint: disable=broad-except
    return None, f"its meta item cannot be read ({_first_line(e)})"
  check_resume(saved_meta, meta, os.path.join(ckpt.directory, str(step)))
  try:
    return ckpt.restore(step, abstract, task.data_iterator)[0], None
  except Exception as e:  # pylint: disable=broad-except
    return None, f"it cannot be restored ({_first_line(e)})"


def restore_newest_intact(ckpt: checkpoint.TrainCheckpointer, task: Task, is_chief: bool):
  """`(step, state)` of the newest checkpoint that reads back whole, or None when there is none.

  A checkpoint that cannot be read is named with what is wrong in a warning and moved
  aside to `<step>.damaged` (by the chief), so that it is neither retried nor confused
  with the step saved again later; the next older one is tried. A checkpoint written
  with other settings is not damage: it stops the run (`check_resume`). When
  checkpoints exist but none is intact, an InputError names each and what is wrong.
  """
  meta, abstract = task.meta(), task.abstract_state()
  skipped, found = [], None
  for step in sorted(ckpt.all_steps(), reverse=True):
    state, problem = _try_restore(ckpt, step, task, meta, abstract)
    if problem is None:
      found = step, state
      break
    where = os.path.join(ckpt.directory, str(step))
    moved = ckpt.move_aside(step) if is_chief else f"{where}.damaged by process 0"
    runtime.note("train", "checkpoint %s is damaged and was skipped: %s; moved to %s", where,
                    problem, moved)
    skipped.append(f"{where}: {problem} (moved to {moved})")
  if jax.process_count() > 1:
    # The processes must resume from one step: the oldest any of them could read (each
    # reads its own data-iterator file). The others then see process 0's renames.
    mine = -1 if found is None else found[0]
    agreed = int(np.min(multihost_utils.process_allgather(np.asarray([mine]))))
    ckpt.reload()
    if agreed != mine:
      found = None if agreed < 0 else (agreed, ckpt.restore(agreed, abstract,
                                                            task.data_iterator)[0])
      skipped.append(f"step {mine} is unreadable on another process")
  if found is None and skipped:
    raise InputError("no intact checkpoint to resume from in " + ckpt.directory + ": "
                     + "; ".join(skipped) + ". Restore a checkpoint or use a new workdir")
  if found is not None and skipped:
    runtime.note("train", "resuming from %s, the newest intact checkpoint",
                    os.path.join(ckpt.directory, str(found[0])))
  return found


def _check_finite(metrics: Mapping[str, float], step: int,
                  ckpt: checkpoint.TrainCheckpointer) -> None:
  bad = [k for k in FINITE_METRICS if k in metrics and not math.isfinite(metrics[k])]
  if not bad:
    return
  ckpt.wait()  # pending saves of good states complete; this state is never saved
  values = ", ".join(f"{k}={metrics[k]}" for k in FINITE_METRICS if k in metrics)
  raise NonFiniteLossError(
      f"non-finite training {FINITE_METRICS[bad[0]]} at step {step + 1} (update {step} -> "
      f"{step + 1}): {values}; training stopped, the last good checkpoint is step "
      f"{ckpt.latest_step()} in {ckpt.directory}")


def _stop_at(step: int, ckpt: checkpoint.TrainCheckpointer, stop: StopNotice) -> NoReturn:
  ckpt.wait()  # the checkpoint is complete on disk before the process goes away
  raise Stopped(step, ckpt.directory, stop.signum)


def _run_steps(task: Task, options: LoopOptions, ckpt, writer: MetricsWriter, stop: StopNotice,
               start: int, state, saved: int | None):
  """Steps `start` .. `task.total_steps - 1`; `saved`: the step already on disk, if any."""
  meta, total, metrics = task.meta(), task.total_steps, {}
  for step in range(start, total):
    try:
      state, metrics = task.step(state, step, stop)
    except StepAbandoned:
      if saved != step:
        ckpt.save(step, state, task.data_iterator, meta)
      _stop_at(step, ckpt, stop)
    done = step + 1
    _check_finite(metrics, step, ckpt)
    if done % options.log_every == 0 or done == total:
      writer.log(done, metrics)
    writer.advance(task.postfix(metrics))
    stopping = stop.reached(done)
    if done % options.save_every == 0 or done == total or stopping:
      ckpt.save(done, state, task.data_iterator, meta)
      saved = done
    if stopping and done < total:
      _stop_at(done, ckpt, stop)
    extra = task.evaluate(state, done)
    if extra:
      writer.log(done, extra)
  return state, metrics


def run_loop(task: Task, options: LoopOptions) -> LoopResult:
  """Trains `task` to `task.total_steps`, resuming from `options.workdir`; see the module doc."""
  is_chief = jax.process_index() == 0
  ckpt = checkpoint.TrainCheckpointer(
      os.path.join(options.workdir, CHECKPOINT_DIR), max_to_keep=options.max_to_keep,
      async_save=options.async_save, with_data=task.data_iterator is not None)
  writer = stop = None
  try:
    resumed = restore_newest_intact(ckpt, task, is_chief)
    if resumed is None:
      start, state = 0, task.init_state()
    else:
      start, state = resumed
      runtime.note("train", "resumed from %s", os.path.join(ckpt.directory, str(start)))
    writer = MetricsWriter(options.workdir, resume_step=start, total_steps=task.total_steps,
                           label=task.label, enabled=is_chief, tensorboard=options.tensorboard,
                           progress=options.progress and is_chief)
    stop = StopNotice()
    state, metrics = _run_steps(task, options, ckpt, writer, stop, start, state,
                                saved=None if resumed is None else start)
    ckpt.wait()
    return LoopResult(start=start, step=max(start, task.total_steps), state=state,
                      metrics=dict(metrics))
  finally:
    if stop is not None:
      stop.close()
    ckpt.close()
    if writer is not None:
      writer.close()


@contextlib.contextmanager
def stops_reported(program: str):
  """An entry point's clean stops: `Stopped` becomes one line on stderr and its exit
  status (75 or 130); a non-finite loss one line and status 1, without a traceback."""
  try:
    yield
  except Stopped as e:
    print(f"{program}: {e}", file=sys.stderr, flush=True)
    raise SystemExit(e.exit_status) from None
  except NonFiniteLossError as e:
    raise SystemExit(f"{program}: {e}") from None
