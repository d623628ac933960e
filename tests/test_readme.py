"""The README's commands name flags, fields and files that exist.

Every `bash` block of README.md is read as commands (continuation lines joined,
comments dropped); for each that runs a program of this repository
(`python -m refusion_jax.X`, a benchmark script), every `--config=FILE` must be a
config file, every `--config.a.b=value` a field of that config, and every other
flag one the program defines. A `--config.a.b` written in the prose must be a field
of some config file. Nothing is run: the programs' flags are read from their
sources (absl's `flags.DEFINE_*`, argparse's `add_argument`).
"""

import functools
import glob
import importlib.util
import os
import re
import shlex

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(REPO, "README.md")
# Flags absl itself defines for every program.
ABSL_FLAGS = {"help", "helpfull", "helpshort", "verbosity", "v", "logtostderr",
              "alsologtostderr", "log_dir", "flagfile", "only_check_args"}


def _blocks(text: str) -> list[str]:
  return re.findall(r"```bash\n(.*?)```", text, re.S)


def _commands(block: str) -> list[str]:
  """The block's commands: continuation lines joined, comments and blank lines gone."""
  out, pending = [], ""
  for line in block.splitlines():
    line = re.sub(r"(^|\s)#.*$", "", line).rstrip()
    if line.endswith("\\"):
      pending += line[:-1] + " "
      continue
    line = (pending + line).strip()
    pending = ""
    if line:
      out.append(line)
  return out


def _program(tokens: list[str]) -> tuple[str, list[str]] | None:
  """(the program's source files, its arguments) of a command running one of ours."""
  for i, tok in enumerate(tokens):
    if tok == "-m" and i + 1 < len(tokens) and tokens[i + 1].startswith("refusion_jax"):
      module = tokens[i + 1]
      spec = importlib.util.find_spec(module)
      origin = spec.origin
      if os.path.basename(origin) in ("__init__.py", "__main__.py"):
        files = glob.glob(os.path.join(os.path.dirname(origin), "*.py"))
      else:
        files = [origin]
      return tuple(sorted(files)), tokens[i + 2:]
    if re.fullmatch(r"benchmarks/\w+\.py", tok):
      return (os.path.join(REPO, tok),), tokens[i + 1:]
  return None


@functools.lru_cache(maxsize=None)
def _defined_flags(files: tuple[str, ...]) -> frozenset:
  names = set(ABSL_FLAGS)
  sources = list(files) + [os.path.join(REPO, "refusion_jax", "entry_flags.py")]
  for path in sources:
    text = open(path, encoding="utf-8").read()
    names |= set(re.findall(r"DEFINE_\w+\(\s*\"(\w+)\"", text))
    names |= set(re.findall(r"DEFINE_\w+\(\s*\n?\s*\"(\w+)\"", text))
    names |= {n.replace("-", "_") for n in re.findall(r"add_argument\(\s*\"--([\w-]+)\"", text)}
  return frozenset(names)


@functools.lru_cache(maxsize=None)
def _config(path: str):
  spec = importlib.util.spec_from_file_location("readme_config", os.path.join(REPO, path))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def _has_field(config, dotted: str) -> bool:
  node = config
  for part in dotted.split("."):
    try:
      node = node[part]
    except (KeyError, TypeError, AttributeError):
      return False
  return True


def _readme_commands():
  text = open(README, encoding="utf-8").read()
  for block in _blocks(text):
    for command in _commands(block):
      yield command


def _checked_commands():
  out = []
  for command in _readme_commands():
    # Shell variables of the README's loops stand for a config's name.
    tokens = shlex.split(command.replace("$b", "gsm8k").replace("$tpu", ""))
    found = _program(tokens)
    if found:
      out.append((command, found))
  return out


def test_the_readme_runs_our_programs():
  commands = _checked_commands()
  assert len(commands) >= 20  # sample, train, serve, evaluate, aot, rl, convert, benchmarks
  assert any("refusion_jax.sample" in c for c, _ in commands)


@pytest.mark.parametrize("command, found", _checked_commands(),
                         ids=lambda x: x[:60] if isinstance(x, str) else "")
def test_each_readme_command_names_flags_that_exist(command, found):
  files, args = found
  flags = _defined_flags(files)
  config = None
  for arg in args:
    if not arg.startswith("--"):
      continue
    name, _, value = arg[2:].partition("=")
    if name == "config":
      assert os.path.isfile(os.path.join(REPO, value)), f"{command}: no config file {value}"
      config = _config(value)
    elif name.startswith("config."):
      assert config is not None, f"{command}: --{name} before --config"
      assert _has_field(config, name[len("config."):]), f"{command}: no field --{name}"
    else:
      bare = name[2:] if name.startswith("no") and name[2:] in flags else name
      assert bare in flags, f"{command}: the program defines no flag --{name}"


def test_config_fields_the_prose_names_exist():
  text = open(README, encoding="utf-8").read()
  configs = [_config(os.path.relpath(p, REPO)) for p in
             sorted(glob.glob(os.path.join(REPO, "configs", "**", "*.py"), recursive=True))
             if not p.endswith("common.py")]
  named = set(re.findall(r"--config\.([\w.]+)", text)) - {"field"}  # "--config.field=value"
  missing = sorted(n for n in named if not any(_has_field(c, n) for c in configs))
  assert not missing, f"README names config fields no config has: {missing}"
