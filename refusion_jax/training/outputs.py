"""What a training run writes, and the guard that keeps its HF export from deleting anything.

A run owns `W/checkpoints`, `W/final_model`, `W/tensorboard`, `W/metrics.jsonl`
and its TFDS build folder. `config.export_hf_dir` is written last and replaces
the folder it names, so it is checked twice (before any work and again just
before the export): it may be a new or empty folder, or an earlier export of
this same run (recognised by the marker file the export carries); anything
else (a folder holding other files, a file, the workdir, a folder that
contains the workdir, or a place inside the run's own folders) is refused.
"""

from __future__ import annotations

import json
import os
import re

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
CHECKPOINT_DIR = "checkpoints"
FINAL_MODEL_DIR = "final_model"
TFDS_DIR = "tfds"  # default build folder of the data, inside the workdir
EXPORT_MARKER = "refusion_export.json"  # written into every HF export of a training run
# The files an export writes (hf.save plus the marker); a folder holding anything else is not
# only an export, whatever its marker says.
_EXPORT_FILE = re.compile(r"config\.json|model\.safetensors|model\.safetensors\.index\.json"
                          r"|model-\d{5}-of-\d{5}\.safetensors|" + re.escape(EXPORT_MARKER))


def _real(path: str) -> str:
  return os.path.realpath(os.path.abspath(os.fspath(path)))


def _inside(path: str, folder: str) -> bool:
  """`path` is `folder` or lies below it (both already real paths)."""
  return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def export_marker(workdir: str) -> dict[str, str]:
  """The marker file's {name: text} for an export of the run in `workdir`."""
  return {EXPORT_MARKER: json.dumps({"workdir": _real(workdir)}, indent=1) + "\n"}


def _marker_workdir(folder: str) -> str | None:
  try:
    with open(os.path.join(folder, EXPORT_MARKER), encoding="utf-8") as f:
      value = json.load(f)
  except (OSError, ValueError):
    return None
  return value.get("workdir") if isinstance(value, dict) else None


def check_export_dir(export_dir: str, workdir: str, tfds_dir: str = "") -> None:
  """Raises ValueError naming `config.export_hf_dir` unless exporting there loses nothing.

  Args:
    export_dir: config.export_hf_dir ("" = no export; nothing to check).
    workdir: the run's workdir (need not exist yet).
    tfds_dir: config.data.tfds_dir ("" = the default inside the workdir).
  """
  if not export_dir:
    return
  field = f"config.export_hf_dir={export_dir!r}"
  export = _real(export_dir)
  work = _real(workdir)
  if _inside(work, export):
    what = "is the workdir" if export == work else f"contains the workdir {workdir!r}"
    raise ValueError(f"{field} {what}; the export replaces that folder, which would delete the "
                     "run's checkpoints, model and metrics. Export to a new or empty folder")
  owned = [os.path.join(work, name) for name in (CHECKPOINT_DIR, FINAL_MODEL_DIR,
                                                 TENSORBOARD_DIR, METRICS_FILE, TFDS_DIR)]
  if tfds_dir:
    owned.append(_real(tfds_dir))
  for folder in owned:
    if _inside(export, folder) or _inside(folder, export):
      raise ValueError(f"{field} overlaps {folder!r}, which the run itself writes; export to "
                       "a folder of its own")
  if os.path.lexists(export) and not os.path.isdir(export):
    raise ValueError(f"{field} exists and is not a folder")
  if not os.path.isdir(export) or not os.listdir(export):
    return
  names = sorted(os.listdir(export))
  others = [n for n in names if not _EXPORT_FILE.fullmatch(n)
            or not os.path.isfile(os.path.join(export, n))]
  if _marker_workdir(export) == work and not others:
    return  # an earlier export of this run: replacing it loses nothing
  why = (f"{others[:3]} are not export files" if others else
         f"it has no {EXPORT_MARKER} naming workdir {workdir!r}")
  raise ValueError(f"{field} is a folder that holds files this run did not write ({why}); "
                   "the export would replace them. Export to a new or empty folder, or move "
                   "those files away first")


def check_workdir(workdir: str) -> None:
  """Raises ValueError unless `workdir` is (or can become) a writable folder of the run.

  Checks the path and its nearest existing parent only: nothing is created here.
  """
  path = os.path.abspath(workdir)
  if os.path.lexists(path) and not os.path.isdir(path):
    raise ValueError(f"--workdir={workdir!r} exists and is not a folder")
  existing = path
  while not os.path.exists(existing):
    parent = os.path.dirname(existing)
    if os.path.lexists(existing) or parent == existing:
      break  # a dangling link, or the root
    existing = parent
  if not os.path.isdir(existing):
    raise ValueError(f"--workdir={workdir!r}: {existing!r} is not a folder")
  if not os.access(existing, os.W_OK | os.X_OK):
    raise ValueError(f"--workdir={workdir!r}: {existing!r} is not writable")
  for name in (CHECKPOINT_DIR, FINAL_MODEL_DIR, TENSORBOARD_DIR):
    inner = os.path.join(path, name)
    if os.path.lexists(inner) and not os.path.isdir(inner):
      raise ValueError(f"--workdir={workdir!r}: {inner!r} is a file, where the run keeps "
                       f"its {name} folder")
  metrics = os.path.join(path, METRICS_FILE)
  if os.path.isdir(metrics):
    raise ValueError(f"--workdir={workdir!r}: {metrics!r} is a folder, where the run writes "
                     "its metrics file")
