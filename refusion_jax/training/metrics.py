"""What a training run reports: `W/metrics.jsonl`, TensorBoard scalars and the progress bar.

One writer serves every trainer (supervised, distillation, RL). Only process 0
writes. A run that resumes from step N first drops the lines logged after N
(and a line cut short by a kill): the steps it does again are logged again, so
every step has exactly one line.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import sys
from typing import Any, Mapping

import tqdm

from refusion_jax.training.outputs import METRICS_FILE, TENSORBOARD_DIR


def _plain(value) -> int | float:
  # Counts stay ints in the JSON line; everything else (device scalars too) is a float.
  if isinstance(value, numbers.Integral) and not isinstance(value, bool):
    return int(value)
  return float(value)


def drop_lines_after(path: str, step: int) -> None:
  """Keeps the lines of `path` whose step is at most `step`; unreadable lines go too."""
  if not os.path.exists(path):
    return
  kept = []
  with open(path, encoding="utf-8") as f:
    for line in f:
      try:
        record = json.loads(line)
      except json.JSONDecodeError:
        continue
      if isinstance(record, dict) and record.get("step", math.inf) <= step:
        kept.append(json.dumps(record) + "\n")
  tmp = path + ".tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    f.writelines(kept)
  os.replace(tmp, path)


class MetricsWriter:
  """`W/metrics.jsonl` (one JSON object per logged step), optional TensorBoard events in
  `W/tensorboard`, and a progress bar on stderr."""

  def __init__(self, workdir: str, *, resume_step: int, total_steps: int, label: str,
               enabled: bool = True, tensorboard: bool = False, progress: bool = False):
    self.path = os.path.join(workdir, METRICS_FILE)
    self._file = self._tb = self._bar = None
    if not enabled:
      return
    drop_lines_after(self.path, resume_step)
    self._file = open(self.path, "a", encoding="utf-8")
    if tensorboard:
      from tensorboardX import SummaryWriter  # heavy-ish; only a run that asks needs it
      self._tb = SummaryWriter(os.path.join(workdir, TENSORBOARD_DIR))
    if progress:
      self._bar = tqdm.tqdm(total=total_steps, initial=resume_step, desc=label, unit="step",
                            file=sys.stderr)

  def log(self, step: int, metrics: Mapping[str, Any]) -> None:
    """One line `{"step": step, **metrics}`."""
    if self._file is None:
      return
    record = {"step": int(step)}
    record.update({k: _plain(v) for k, v in metrics.items()})
    self._file.write(json.dumps(record) + "\n")
    self._file.flush()
    if self._tb is not None:
      for k, v in metrics.items():
        self._tb.add_scalar(k, float(v), int(step))

  def advance(self, postfix: Mapping[str, Any]) -> None:
    """The bar moves one step and shows `postfix` (a few of the step's numbers)."""
    if self._bar is not None:
      self._bar.update(1)
      self._bar.set_postfix(postfix, refresh=False)

  def close(self) -> None:
    for handle in (self._bar, self._file, self._tb):
      if handle is not None:
        handle.close()
    self._file = self._tb = self._bar = None
