"""What the package carries besides its code, and how command lines name it.

The package ships the tiny tokenizer, the bundled task data, a tiny pretrained Qwen3
base and the ReFusion model fine-tuned from it (`refusion_jax/assets/`), and an installed wheel (`pip install .`) also carries the
repository's `configs/` folder, as `refusion_jax/configs`. So the README's commands work
outside a checkout too:

  python -m refusion_jax.sample --config=configs/sample.py \\
      --config.model_dir=refusion_tiny --config.prompt="copy 4230"

- `--config=configs/NAME.py` (any entry point) reads `configs/NAME.py` in the working
  directory when it is there (a checkout: the files you edit), else the installed
  package's copy (`config_file`). The config files import each other as `configs.X`;
  with the package's copy, `configs` is the package's (`use_packaged_configs`).
- `--config.model_dir=base_tiny` (any model reference: `loading.resolve`) names the
  shipped base when the working directory has no folder of that name; its path is
  `BASE_TINY_DIR`. `refusion_tiny` names the shipped ReFusion model (`REFUSION_TINY_DIR`).
"""

from __future__ import annotations

import importlib.machinery
import importlib.metadata
import importlib.util
import json
import os
import sys
import urllib.parse
import urllib.request

ASSETS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets")
BASE_TINY_DIR = os.path.join(ASSETS_DIR, "base_tiny")  # the shipped pretrained base (HF layout)
# The shipped ReFusion model: the base fine-tuned with ReFusion's objective and the boundary
# label (configs/refusion_tiny.py, launch/train_refusion_tiny.sh; HF layout).
REFUSION_TINY_DIR = os.path.join(ASSETS_DIR, "refusion_tiny")
# Short names of the shipped model folders, for --config.model_dir.
SHIPPED_MODELS = {"base_tiny": BASE_TINY_DIR, "refusion_tiny": REFUSION_TINY_DIR}

_CONFIGS = "configs"  # the repository's config folder, and the package that holds it


def configs_dir() -> str | None:
  """The installed package's copy of `configs/`: refusion_jax/configs in a wheel, the
  checkout's configs/ in an editable install (`pip install -e .`); None for a checkout
  run in place (nothing installed)."""
  try:
    spec = importlib.util.find_spec(f"refusion_jax.{_CONFIGS}")
  except ImportError:
    spec = None
  if spec is not None and spec.submodule_search_locations:
    return list(spec.submodule_search_locations)[0]
  # setuptools' editable finder maps only packages with an __init__.py; pip records the
  # folder an editable install points at (PEP 610's direct_url.json).
  try:
    record = importlib.metadata.distribution("refusion_jax").read_text("direct_url.json")
    info = json.loads(record or "{}")
  except (importlib.metadata.PackageNotFoundError, ValueError):
    return None
  url = urllib.parse.urlparse(info.get("url", ""))
  if not info.get("dir_info", {}).get("editable") or url.scheme != "file":
    return None
  folder = os.path.join(urllib.request.url2pathname(url.path), _CONFIGS)
  return folder if os.path.isdir(folder) else None


def config_file(path: str) -> str:
  """`path` when it is a file; else, for `configs/...` (relative), the package's copy
  when there is one; else `path` (the caller reports that it does not exist)."""
  if not path or os.path.isfile(path) or os.path.isabs(path):
    return path
  parts = os.path.normpath(path).split(os.sep)
  if len(parts) < 2 or parts[0] != _CONFIGS:
    return path
  folder = configs_dir()
  if folder is None:
    return path
  packaged = os.path.join(folder, *parts[1:])
  return packaged if os.path.isfile(packaged) else path


def is_packaged_config(path: str) -> bool:
  """Whether `path` is a file of the package's copy of `configs/`."""
  folder = configs_dir()
  if folder is None:
    return False
  inside = os.path.relpath(os.path.realpath(path), os.path.realpath(folder))
  return not inside.startswith(os.pardir + os.sep) and inside != os.pardir


def use_packaged_configs(force: bool) -> None:
  """Makes `import configs` (how the config files reach each other) import the
  package's copy: always when `force` (the config file being loaded is that copy),
  else only when no `configs` is importable (a config file of one's own outside a
  checkout that does `from configs import common`). Nothing without a packaged copy."""
  current = sys.modules.get(_CONFIGS)
  if not force:
    if current is not None:
      return
    try:
      if importlib.util.find_spec(_CONFIGS) is not None:
        return
    except (ImportError, ValueError):
      pass
  folder = configs_dir()
  if folder is None:
    return
  if current is not None and [os.path.realpath(p) for p in getattr(current, "__path__", [])
                              ] == [os.path.realpath(folder)]:
    return
  for name in [n for n in sys.modules if n.startswith(_CONFIGS + ".")]:
    del sys.modules[name]  # another `configs`' modules must not answer for the package's
  spec = importlib.machinery.ModuleSpec(_CONFIGS, None, is_package=True)
  spec.submodule_search_locations = [folder]
  sys.modules[_CONFIGS] = importlib.util.module_from_spec(spec)
