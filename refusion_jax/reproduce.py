"""The paper's main comparison in miniature, in one command.

  python -m refusion_jax.reproduce --config=configs/repro_tiny.py --workdir=W \\
      [--config.sweep=true] [--config.field=value ...]

Trains (or reuses) the base and the ARM, MDM and ReFusion models, scores
every decoder row and writes `W/table.md` and `W/speed_accuracy.png`; a rerun
resumes and skips finished work. `refusion_jax.repro` holds the rest:
`settings` (rows, decode settings, checks), `stages` (training), `scoring`
(cached evaluations, the validation search, the sweep), `report` (table and
plots) and `pipeline` (`run`, the order of it all).
"""

from __future__ import annotations

from absl import app

from refusion_jax import entry_flags
from refusion_jax.repro import pipeline


def define_flags():
  """--config and --workdir (defined only when run as a program)."""
  return entry_flags.define_config_and_workdir(
      "Reproduction config file.", "Models, results, table.md and plots.")


def main(argv, config_flag, workdir_flag):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  # Imported once the flags parsed: a mistyped flag or config field is reported at once.
  pipeline.run(config_flag.value, workdir_flag.value)


if __name__ == "__main__":
  _config_flag, _workdir_flag = define_flags()
  # A bad setting, named by its field: one error line and exit status 2, no traceback.
  entry_flags.run_program(lambda argv: main(argv, _config_flag, _workdir_flag),
                          "refusion_jax.reproduce", user_errors=(ValueError, FileNotFoundError))
