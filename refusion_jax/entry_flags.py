"""What the command-line entry points share: their flags and their one error path.

Every entry point (train, sample, evaluate, convert, reproduce) runs through
`run_program`: a bad setting or input ends as one line on stderr,

  refusion_jax.train: error: config.data.seq_len must be an int >= 2, got 1

and exit status 2, with no traceback. That covers flag parsing (an unknown
flag, an unknown config field with the nearest known name suggested, a value
of the wrong type, a config file that cannot be read), `InputError` raised
anywhere, and the exception types an entry point lists as its users' errors.
Everything else is an internal error and keeps its traceback.

`--config=configs/NAME.py` reads the working directory's file when there is one (a
checkout), else the installed package's copy of configs/ (`refusion_jax.packaged`), so
the README's commands also work after `pip install`, from any folder.
"""

from __future__ import annotations

import contextlib
import difflib
import os
import re
import sys
from typing import Callable, Sequence

from absl import app, flags, logging
from ml_collections import config_dict, config_flags

from refusion_jax import packaged, runtime
from refusion_jax.checks import InputError

__all__ = ["InputError", "define_config_and_workdir", "config_value", "parse_flags", "run_program",
           "errors_reported", "fail"]


def define_config_and_workdir(config_help: str, workdir_help: str):
  """`--config` (an ml_collections config file, locked) and `--workdir`, both required.

  Call it only when the module runs as a program, so entry points can be
  imported beside each other (train, sample, reproduce) without clashing flags.
  """
  config = config_flags.DEFINE_config_file("config", None, config_help, lock_config=True)
  workdir = flags.DEFINE_string("workdir", None, workdir_help)
  flags.mark_flags_as_required(["config", "workdir"])
  return config, workdir


def config_value(argv: Sequence[str], config_flag, config_file: str):
  """The value of a required `--config` flag (`config_file` names it in the error), after
  refusing positional arguments; absl logging drops to WARNING unless --verbosity is
  given (orbax logs every save and restore at INFO)."""
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if config_flag.value is None:
    raise app.UsageError(f"--config={config_file} is required")
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)
  return config_flag.value


def fail(program: str, message) -> None:
  """Prints `program: error: message` to stderr and exits with status 2.

  The message is one line, except where it lists several problems (each data-file
  problem on its own indented line below the first).
  """
  print(f"{program}: error: {str(message).strip()}", file=sys.stderr, flush=True)
  sys.exit(2)


def _config_flags(fv: flags.FlagValues) -> list[str]:
  # ml_collections' config-file and config-dict flags parse to "config object"s.
  return [name for name in fv if fv[name].flag_type() == "config object"]


def _nearest(name: str, candidates: Sequence[str]) -> str:
  close = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.5)
  return f" (did you mean {close[0]!r}?)" if close else ""


def _paths(node, prefix: str = "") -> list[str]:
  """Every field's dotted path below `node` (groups included)."""
  out = []
  if isinstance(node, (config_dict.ConfigDict, dict)):
    for key in node.keys():
      path = f"{prefix}{key}"
      out.append(path)
      out += _paths(node[key], path + ".")
  return out


def _suggestion(name: str, node) -> str:
  """The field `name` likely meant below `node`: the one field of that name in a nested
  group (`--config.temperature`: 'decode.temperature'), else the closest name here."""
  nested = [p for p in _paths(node) if p.rsplit(".", 1)[-1] == name and "." in p]
  if len(nested) == 1:
    return f" (did you mean {nested[0]!r}?)"
  return _nearest(name, list(node.keys()))


def _field_problem(config, flag_name: str, path: str) -> str | None:
  """Why `--flag_name.path` names no field of `config`, or None when it does."""
  node, walked = config, flag_name
  for part in path.split("."):
    if isinstance(node, (config_dict.ConfigDict, dict)):
      keys = list(node.keys())
      if part not in keys:
        return f"--{flag_name}.{path}: {walked} has no field {part!r}{_suggestion(part, node)}"
      node = node[part]
    elif isinstance(node, (list, tuple)) and part.isdigit():
      if int(part) >= len(node):
        return f"--{flag_name}.{path}: {walked} has only {len(node)} entries"
      node = node[int(part)]
    else:
      return (f"--{flag_name}.{path}: {walked} is a value ({type(node).__name__}), not a group "
              "of fields")
    walked = f"{walked}.{part}"
  return None


def _config_spec(flag_name: str, argv: Sequence[str]) -> str | None:
  """The last `--flag_name=SPEC` of argv (a config file, optionally `:argument`)."""
  spec = None
  for arg in argv:
    m = re.match(rf"^--?{re.escape(flag_name)}=(.*)$", arg)
    if m:
      spec = m.group(1)
  return spec


def _with_packaged_configs(fv: flags.FlagValues, argv: Sequence[str]) -> list[str]:
  """`argv` with each config file that is not in the working directory but in the
  installed package (`--config=configs/NAME.py`, `packaged.config_file`) given by its
  path there; `import configs` then imports the package's copy (its files import each
  other so). A config file of one's own that imports `configs` gets the package's copy
  too when no other is importable."""
  argv = list(argv)
  found = False
  for flag_name in _config_flags(fv):
    spec = _config_spec(flag_name, argv)
    if spec is None:
      continue
    path, colon, arg = spec.partition(":")
    resolved = packaged.config_file(path)
    if resolved == path:
      continue
    found = True
    pattern = re.compile(rf"^(--?{re.escape(flag_name)}=)")
    last = max(i for i, a in enumerate(argv) if pattern.match(a))  # the one that counts
    argv[last] = pattern.match(argv[last]).group(1) + resolved + colon + arg
  if any(_config_spec(name, argv) is not None for name in _config_flags(fv)):
    packaged.use_packaged_configs(force=found)
  return argv


def _unreadable_config(fv: flags.FlagValues, argv: Sequence[str]) -> str | None:
  """`--config=FILE: ...` for the first config file of argv that does not exist."""
  for flag_name in _config_flags(fv):
    spec = _config_spec(flag_name, argv)
    if spec is not None and not os.path.isfile(spec.split(":", 1)[0]):
      return f"--{flag_name}={spec}: no such config file"
  return None


def _unknown_field(fv: flags.FlagValues, argv: Sequence[str]) -> str | None:
  """The first `--config.x.y` override in `argv` naming no field, said with a suggestion."""
  for flag_name in _config_flags(fv):
    spec = _config_spec(flag_name, argv)
    if spec is None:
      continue
    try:
      config = fv[flag_name].parser.parse(spec)
      config.keys()  # a config file that cannot be read raises here
    except Exception:  # pylint: disable=broad-except
      return None  # reported by the caller from the original error
    for arg in argv:
      m = re.match(rf"^--?(?:no)?{re.escape(flag_name)}\.([^=]+)", arg)
      if m:
        problem = _field_problem(config, flag_name, m.group(1))
        if problem:
          return problem
  return None


def parse_flags(argv: Sequence[str], fv: flags.FlagValues | None = None) -> list[str]:
  """`fv(argv)` (default: absl's FLAGS), raising InputError for any bad flag.

  Also loads each config file given, so an unreadable one is reported here.
  """
  fv = flags.FLAGS if fv is None else fv
  given = list(argv)  # errors name a config file as it was given
  argv = _with_packaged_configs(fv, given)
  missing = _unreadable_config(fv, argv)
  if missing:
    raise InputError(missing)
  try:
    rest = fv(argv)
  except (flags.Error, KeyError, AttributeError, TypeError, ValueError, OSError,
          SyntaxError) as e:
    message = _unknown_field(fv, argv)
    if message is None:
      lines = [line.strip() for line in str(e).strip().strip("'\"").splitlines() if line.strip()]
      message = "; ".join(lines) or repr(e)
      if isinstance(e, KeyError) and lines:
        message = lines[0]
      elif isinstance(e, SyntaxError) or str(e).startswith("Error whilst parsing config file"):
        # ml_collections puts the config's traceback in the message: its last line says why.
        message = f"a config file given could not be loaded ({type(e).__name__}: {lines[-1]})"
    raise InputError(message) from None
  for flag_name in _config_flags(fv):
    try:
      fv[flag_name].value.keys()  # an unreadable file parses to a value that raises on use
    except OSError as e:
      raise InputError(f"--{flag_name}={_config_spec(flag_name, given)}: cannot read the config "
                       f"file ({' '.join(str(e).split())})") from None
    except AttributeError:
      pass  # None (not given; the entry point says what it needs)
  return rest


def _compile_cache_dir(fv) -> str | None:
  """The `compile_cache_dir` of the entry point's config, or None where it has none."""
  for flag_name in _config_flags(fv):
    value = fv[flag_name].value
    if value is not None and "compile_cache_dir" in value:
      return value.compile_cache_dir
  return None


@contextlib.contextmanager
def errors_reported(program: str, user_errors: tuple[type[BaseException], ...] = ()):
  """Turns InputError (and `user_errors`) raised inside into `fail(program, ...)`."""
  try:
    yield
  except (InputError, app.UsageError) + tuple(user_errors) as e:
    fail(program, e)


def run_program(main: Callable[[list[str]], object], program: str,
                user_errors: tuple[type[BaseException], ...] = ()) -> None:
  """`absl.app.run(main)` with the one error path of the module docstring.

  Args:
    main: the entry point's main(argv).
    program: the name its errors start with ("refusion_jax.train").
    user_errors: exception types besides InputError that `main` raises only
      for bad settings or inputs (an entry point whose work is mostly checking
      its inputs lists ValueError here; training does not).
  """
  def parser(argv):
    with errors_reported(program):
      return parse_flags(argv)

  def wrapped(argv):
    with errors_reported(program, (ValueError,)):
      # No libtpu start-up errors where no TPU is; the config's compile_cache_dir, where
      # it has one, kept and loaded by one rule (runtime.use_compile_cache).
      runtime.start_up(_compile_cache_dir(flags.FLAGS))
    with errors_reported(program, user_errors):
      return main(argv)

  app.run(wrapped, flags_parser=parser)
