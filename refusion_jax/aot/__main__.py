"""`python -m refusion_jax.aot`: the command line (see the package's docstring)."""

from __future__ import annotations

import json
import sys

from absl import app, flags
from ml_collections import config_flags

from refusion_jax import config as config_lib
from refusion_jax import entry_flags, sharding, tpu
from refusion_jax.aot import decode as decode_check
from refusion_jax.aot import rl as rl_check
from refusion_jax.aot import train as train_check
from refusion_jax.aot.estimates import PAPER_SAMPLE_TOKENS, DoesNotFit
from refusion_jax.aot.report import finish, not_fitting_report, render
from refusion_jax.config import DECODE_PROGRAMS
from refusion_jax.decode.settings import DecodeConfig

DEFAULT_WIDTHS = (1, 2, 4, 8, 16, 32, 64, 128)
EXIT_BAD_INPUT, EXIT_DOES_NOT_FIT = 2, 3


def define_flags():
  """The tool's flags (defined only when run as a program, as the other entry points do)."""
  return dict(
      config=config_flags.DEFINE_config_file(
          "config", None, "Training config (train) or sampling config (decode, its "
          "`decode` fields; configs/sample.py).", lock_config=True),
      program=flags.DEFINE_enum("program", None, ["train", "decode", "rl"], "What to compile "
                                "(rl: the RL policy step of an RL config)."),
      topology=flags.DEFINE_string("topology", None, "Cloud TPU accelerator type (v5p-128, "
                                   "v4-256, v5litepod-256, v6e-256) or libtpu topology."),
      num_slices=flags.DEFINE_integer("num_slices", 1, "Slices of --topology (multislice)."),
      model=flags.DEFINE_string("model", None, "decode: preset name (" + ", ".join(
          sorted(config_lib.PRESETS)) + ") or a model folder (its config.json only)."),
      batch=flags.DEFINE_integer("batch", 8, "decode: rows."),
      prompt_len=flags.DEFINE_integer("prompt_len", 128, "decode: prompt width."),
      mesh=flags.DEFINE_string("mesh", "1,1,-1", "decode: data,fsdp,tensor sizes (-1: the rest)."),
      scan_layers=flags.DEFINE_bool("scan_layers", None, "decode: layer layout (default: the "
                                    "model's; the config's scan_layers when it sets one)."),
      pass_widths=flags.DEFINE_string("pass_widths", ",".join(map(str, DEFAULT_WIDTHS)),
                                      "decode: widths of the per-pass table ('' = only the "
                                      "method's widest pass)."),
      decode_programs=flags.DEFINE_string("decode_programs", ",".join(DECODE_PROGRAMS),
                                          "decode: which programs to compile."),
      sample_tokens=flags.DEFINE_integer(
          "sample_tokens", PAPER_SAMPLE_TOKENS, "train: mean tokens per sample (the paper's "
          "1.22B / 3.7M) for samples per step and the paper's run, packed as the config packs."),
      sample_data=flags.DEFINE_string("sample_data", "", "train: a JSON/JSONL data file whose "
                                      "samples (tokenized with the config's tokenizer) replace "
                                      "--sample_tokens' distribution."),
  )


def _ints(text: str, name: str) -> list[int]:
  try:
    values = [int(t) for t in text.split(",") if t.strip()]
  except ValueError:
    raise ValueError(f"--{name}={text!r}: expected comma-separated ints") from None
  return values


def run(f: dict) -> tuple[dict, int]:
  """Runs the check the flags ask for; returns the report and the exit status."""
  config = f["config"].value
  if f["program"].value is None:
    raise ValueError("--program=train, --program=decode or --program=rl is required")
  if f["topology"].value is None:
    raise ValueError("--topology is required (e.g. v5p-128, v5litepod-8)")
  if config is None:
    raise ValueError("--config is required (a training config for train, configs/sample.py "
                     "for decode)")
  tpu_slice = tpu.parse_slice(f["topology"].value, f["num_slices"].value)
  kind = f["program"].value
  if kind == "train" and f["sample_tokens"].value < 1:
    raise ValueError(f"--sample_tokens must be >= 1, got {f['sample_tokens'].value}")
  try:
    if kind == "train":
      report = train_check.check_train(config, tpu_slice)
    elif kind == "rl":
      report = rl_check.check_rl(config, tpu_slice)
    else:
      report = _run_decode(f, config, tpu_slice)
  except DoesNotFit as e:
    partial = {"global_batch": config.global_batch_size, "seq_len": config.data.seq_len,
               "estimated_mfu": None} if kind == "train" else (
                   {} if kind == "rl" else {"per_pass": []})
    return not_fitting_report(kind, tpu_slice, e, partial), EXIT_DOES_NOT_FIT
  report = finish(dict(report, kind=kind), tpu_slice)
  if kind == "train":
    report.update(train_check.paper_run(config, report, f["sample_tokens"].value,
                            f["sample_data"].value or None))
  return report, 0 if report["fits"] else EXIT_DOES_NOT_FIT


def _run_decode(f: dict, config, tpu_slice: tpu.Slice) -> dict:
  if f["model"].value is None:
    raise ValueError("--model is required with --program=decode (a preset such as qwen3_8b, "
                     "or a model folder)")
  if "decode" not in config:
    raise ValueError("--config has no `decode` fields; use configs/sample.py")
  for name in ("batch", "prompt_len"):
    if f[name].value < 1:
      raise ValueError(f"--{name} must be a positive int, got {f[name].value}")
  widths = _ints(f["pass_widths"].value, "pass_widths")
  if any(w < 1 for w in widths):
    raise ValueError(f"--pass_widths must be positive, got {widths}")
  mesh = _ints(f["mesh"].value, "mesh")
  if len(mesh) != 3:
    raise ValueError(f"--mesh={f['mesh'].value!r}: expected data,fsdp,tensor (e.g. 1,1,-1)")
  programs = [p.strip() for p in f["decode_programs"].value.split(",") if p.strip()]
  unknown = [p for p in programs if p not in DECODE_PROGRAMS]
  if unknown or not programs:
    raise ValueError(f"--decode_programs: {unknown or 'none'}; choose from "
                     f"{list(DECODE_PROGRAMS)}")
  try:
    decode_config = DecodeConfig(**config.decode.to_dict())
  except (TypeError, ValueError) as e:
    raise ValueError(f"--config.decode: {e}") from None
  decode_config.require_compiled("aot")  # a host-side search has no program to compile
  scan = f["scan_layers"].value
  if scan is None:
    scan = config.get("scan_layers")
  return decode_check.check_decode(decode_config, tpu_slice, model=f["model"].value,
                      batch=f["batch"].value, prompt_len=f["prompt_len"].value,
                      mesh_sizes=dict(zip(sharding.MESH_AXES, mesh)), widths=widths,
                      programs=programs, scan_layers=scan)


PROGRAM = "refusion_jax.aot"


def parse_flags(argv):
  """absl's parsing through the one error path of every entry point (entry_flags):
  a bad flag or --config override is one line, exit status 2."""
  with entry_flags.errors_reported(PROGRAM):
    return entry_flags.parse_flags(argv)


def main(argv, f):
  with entry_flags.errors_reported(PROGRAM, (ValueError, TypeError, FileNotFoundError)):
    if len(argv) > 1:
      raise entry_flags.InputError(f"unexpected arguments {argv[1:]}")
    report, status = run(f)
  print(render(report))
  print(json.dumps(report))
  sys.stdout.flush()
  sys.exit(status)


if __name__ == "__main__":
  _flags = define_flags()
  app.run(lambda argv: main(argv, _flags), flags_parser=parse_flags)
