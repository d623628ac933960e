"""Training entry point.

  python -m refusion_jax.train --config=configs/tiny_refusion.py --workdir=W \\
      [--config.field=value ...]

A bad setting or input (a config field, a data file, an output path, a damaged
checkpoint with no intact one to fall back to) is reported before any compile
as one `refusion_jax.train: error: ...` line, exit status 2.

Joins the multi-process runtime when `config.distributed` is set, then runs
`training.supervised.train_and_evaluate(config, W)`: checkpoints in `W/checkpoints`
(a rerun resumes bit-identically), metrics in `W/metrics.jsonl` and
`W/tensorboard`, the trained model in `W/final_model`.

Preemption: on SIGTERM (a spot / preemptible VM's notice; on a multi-process
run JAX's preemption service passes it to every process) training finishes
the step it is running, saves a checkpoint of it, waits until that is on disk
and exits with status 75 (`loop.EXIT_PREEMPTED`); Ctrl-C does the same and exits
with status 130 (`loop.EXIT_INTERRUPTED`; a second Ctrl-C stops at once). Run the
same command again (on a new machine, with the same workdir) to resume,
bit-identically. The package `refusion_jax.training` holds the rest: `settings`
(config checks), `trainer` (optimizer and the jitted steps), `supervised` (the
task), `loop` (the loop every trainer shares).
"""

from __future__ import annotations

from absl import app

from refusion_jax import distributed, entry_flags
from refusion_jax.training import loop, supervised


def define_flags():
  """--config and --workdir (defined only when run as a program)."""
  return entry_flags.define_config_and_workdir(
      "Training config file.", "Checkpoints, logs and the final model go here.")


def main(argv, config_flag, workdir_flag):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if config_flag.value.get("distributed", False):
    distributed.initialize()
  # A stop (checkpoint on disk, the same command resumes) or a non-finite loss (not a
  # bug in the code) is one line and its exit status, without a traceback.
  with loop.stops_reported("refusion_jax.train"):
    supervised.train_and_evaluate(config_flag.value, workdir_flag.value)


if __name__ == "__main__":
  _config_flag, _workdir_flag = define_flags()
  entry_flags.run_program(lambda argv: main(argv, _config_flag, _workdir_flag),
                          "refusion_jax.train")
