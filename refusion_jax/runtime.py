"""What an entry point or a benchmark sets up in its process before JAX starts a backend.

`start_up` is that, called first: the quiet probe below, and the compilation cache
where the caller keeps one. Every entry point calls it (through
`entry_flags.run_program`, `evaluate` and `lmeval`), and so does every benchmark that
runs JAX in its own process, except those that compile for a TPU topology as `aot`
does (`aot_fit`, `attention_memory`); `first_sample` and `decode_commits` run no JAX
themselves (the first runs `sample`, the second workers that import each revision's
own tree).

**No TPU probe where no TPU is.** JAX starts its TPU backend whenever libtpu
is installed (`requirements-tpu.txt` installs it everywhere, for `aot`): on a
machine without a TPU, libtpu then prints its initialisation errors ("Failed
to find host bounds for accelerator type", "unexpected worker hostname", a
source location trace) before JAX falls back to the CPU. `quiet_tpu_probe`
looks for accelerators the way JAX's own checks do before it starts anything
(a Google PCI device, `/dev/accel*` or `/dev/vfio/N` for a TPU; `/dev/nvidia*`,
`/dev/dxg` or `/dev/kfd` for a GPU) and, when the machine has none, sets
`jax_platforms` to "cpu" (what JAX would fall back to), for this process and
the ones it starts (JAX_PLATFORMS). A TPU VM or a GPU
machine is left as it is, as is any process where JAX_PLATFORMS (or
JAX_FORCE_TPU_INIT) is set. `aot` never calls it: it loads libtpu to compile.

**A persistent compilation cache.** `compile_cache_dir` (sample, evaluate,
reproduce, serve): "auto" (the default) keeps compiled programs in
`$JAX_COMPILATION_CACHE_DIR` when that is set, else under the user's cache
folder (`$XDG_CACHE_HOME/refusion_jax/jax`, `~/.cache/refusion_jax/jax`); a
folder keeps them there; "" keeps none. A second run of the same shapes loads
its programs instead of compiling them. Every program is kept, however quickly
it compiled.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import sys
from typing import Sequence

import jax
import tqdm
from absl import logging as absl_logging

AUTO = "auto"
_QUIET = False  # quiet_libraries' decision
_GOOGLE_PCI_VENDOR = "0x1ae0"


def _has_tpu() -> bool:
  for vendor in glob.glob("/sys/bus/pci/devices/*/vendor"):
    try:
      with open(vendor, encoding="ascii") as f:
        if f.read().strip() == _GOOGLE_PCI_VENDOR:
          return True
    except OSError:
      continue
  return bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"))


def _has_gpu() -> bool:
  return any(os.path.exists(d) for d in ("/dev/nvidia0", "/dev/nvidiactl", "/dev/dxg",
                                        "/dev/kfd"))


def quiet_tpu_probe() -> bool:
  """Sets `jax_platforms` to "cpu" when libtpu is installed and this machine has no
  accelerator (module docstring); returns whether it did. Call it before anything
  asks JAX for a device."""
  if os.environ.get("JAX_PLATFORMS") or "JAX_FORCE_TPU_INIT" in os.environ:
    return False
  try:
    installed = importlib.util.find_spec("libtpu") is not None
  except (ImportError, ValueError):
    installed = False
  if not installed or _has_tpu() or _has_gpu():
    return False
  if jax.config.jax_platforms:
    return False
  jax.config.update("jax_platforms", "cpu")
  # The processes this one starts (the server's engine process, evaluation workers)
  # look no further either.
  os.environ["JAX_PLATFORMS"] = "cpu"
  return True


def start_up(compile_cache_dir: str | None = None) -> None:
  """The process's start-up, before anything asks JAX for a device: `quiet_tpu_probe`,
  `quiet_libraries`, and with `compile_cache_dir` ("auto", "" or a folder) that setting
  checked and used (`check_compile_cache`, `use_compile_cache`); None leaves JAX's own
  cache setting."""
  if compile_cache_dir is not None:
    check_compile_cache(compile_cache_dir)
  quiet_tpu_probe()
  quiet_libraries()
  if compile_cache_dir is not None:
    use_compile_cache(compile_cache_dir)


def quiet_libraries(argv: Sequence[str] | None = None) -> bool:
  """Turns the libraries' log lines off (orbax's and TFDS's INFO and WARNING lines through
  absl; TFDS's progress bars and messages, `libraries_quiet()` tells data/build.py) unless
  the command line asks for them with `--verbosity` (or `-v`); returns whether it did.
  What this project says goes through `note`."""
  global _QUIET
  argv = sys.argv if argv is None else argv
  _QUIET = not any(a.startswith(("--verbosity", "-v=")) or a == "-v" for a in argv[1:])
  if _QUIET:
    absl_logging.set_verbosity(absl_logging.ERROR)
  return _QUIET


def libraries_quiet() -> bool:
  """Whether `quiet_libraries` turned the libraries' output off in this process."""
  return _QUIET


def note(program: str, message: str, *args) -> None:
  """One line for the user on stderr, `[program] message` (`message % args` with args),
  above any progress bar."""
  tqdm.tqdm.write(f"[{program}] {message % args if args else message}", file=sys.stderr)


def sample_command(model_dir: str, *flags: str) -> str:
  """The command that decodes a prompt with the model in `model_dir` (and `flags`), for
  the line a training run ends on."""
  return " ".join(["python -m refusion_jax.sample --config=configs/sample.py",
                   f"--config.model_dir={model_dir}", *flags, "--config.prompt=..."])


def default_cache_dir() -> str:
  """Where "auto" keeps compiled programs."""
  if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    return os.environ["JAX_COMPILATION_CACHE_DIR"]
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(base, "refusion_jax", "jax")


def check_compile_cache(folder, flag: str = "--config.compile_cache_dir") -> None:
  """`folder`: "auto", "" or a folder that is (or can be made) a directory."""
  if not isinstance(folder, str):
    raise ValueError(f"{flag} must be a folder path, \"auto\" or \"\" (none), got {folder!r}")
  if folder == AUTO:
    folder = default_cache_dir()
  if folder and os.path.exists(folder) and not os.path.isdir(folder):
    raise ValueError(f"{flag}={folder!r} is a file, not a folder")
  if folder and not os.path.isdir(folder):
    parent = os.path.dirname(os.path.abspath(folder))
    while not os.path.exists(parent):
      parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
      raise ValueError(f"{flag}={folder!r} cannot be made: {parent!r} is not a folder this "
                       "process may write to")


def use_compile_cache(folder: str) -> str:
  """Keeps every program this process compiles in `folder` ("auto": `default_cache_dir`)
  and loads those found there instead of compiling them; "" turns JAX's cache off.
  Call it before the process compiles anything: JAX opens its cache once. Returns
  the folder used ("" for none)."""
  if folder == AUTO:
    folder = default_cache_dir()
  if not folder:
    jax.config.update("jax_enable_compilation_cache", False)
    return ""
  os.makedirs(folder, exist_ok=True)
  jax.config.update("jax_enable_compilation_cache", True)
  jax.config.update("jax_compilation_cache_dir", folder)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  return folder
