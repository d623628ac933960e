"""Flags shared by the command-line entry points that run a config in a workdir."""

from __future__ import annotations

from absl import flags
from ml_collections import config_flags


def define_config_and_workdir(config_help: str, workdir_help: str):
  """`--config` (an ml_collections config file, locked) and `--workdir`, both required.

  Call it only when the module runs as a program, so entry points can be
  imported beside each other (train, sample, reproduce) without clashing flags.
  """
  config = config_flags.DEFINE_config_file("config", None, config_help, lock_config=True)
  workdir = flags.DEFINE_string("workdir", None, workdir_help)
  flags.mark_flags_as_required(["config", "workdir"])
  return config, workdir
