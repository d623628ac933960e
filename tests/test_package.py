"""The package: pyproject.toml is the one list of requirements (requirements*.txt say the
same), and a wheel built from the checkout works outside it.

The wheel test builds the wheel from a copy of the package's files (setuptools builds in
the tree it is given; nothing lands in the checkout), installs it with --no-deps into a
fresh venv whose only view of the project's dependencies is a .pth line naming this venv's
site-packages (no source tree on its path), and from an empty working directory decodes a
prompt with the shipped base and runs the smoke reproduction, the README's way:
`python -m refusion_jax.sample --config=configs/sample.py --config.model_dir=base_tiny ...`.
"""

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from refusion_jax import loading, packaged
from refusion_jax import tasks as tasks_lib
from refusion_jax.repro import pipeline, scoring

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SKIP = ("__pycache__",)


def _pyproject() -> dict:
  with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
    return tomllib.load(f)


def _key(line: str) -> tuple:
  """A requirement as (name, extras, specifiers, marker), spelling-independent."""
  r = Requirement(line)
  return (canonicalize_name(r.name), tuple(sorted(canonicalize_name(e) for e in r.extras)),
          tuple(sorted(str(s) for s in r.specifier)), str(r.marker or ""))


def _file_requirements(name: str) -> list[tuple]:
  with open(os.path.join(REPO, name), encoding="utf-8") as f:
    lines = [line.split("#", 1)[0].strip() for line in f]
  return [_key(line) for line in lines if line]


def _keys(lines) -> list[tuple]:
  return [_key(line) for line in lines]


def test_requirements_files_say_what_pyproject_says():
  project = _pyproject()["project"]
  extras = project["optional-dependencies"]
  assert set(extras) == {"tpu", "cuda", "eval", "serve", "test"}
  expected = {
      "requirements.txt": _keys(project["dependencies"] + extras["eval"] + extras["serve"]),
      "requirements-test.txt": _keys(extras["test"]),
      "requirements-tpu.txt": _keys(extras["tpu"]),
  }
  for name, want in expected.items():
    got = _file_requirements(name)
    assert len(set(got)) == len(got), f"{name} names a requirement twice"
    missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
    assert not missing and not extra, (
        f"{name} and pyproject.toml differ (change both together): only in pyproject.toml "
        f"{missing}, only in {name} {extra}")
  # One requirement per package across the runtime and extras (no two versions of one pin).
  names = [k[0] for k in _keys(project["dependencies"] + extras["eval"] + extras["serve"]
                               + extras["test"])]
  assert len(set(names)) == len(names)
  assert _key("jax[cuda12]>=0.7.0") in _keys(extras["cuda"])


def test_version_and_entry_point_are_declared_once():
  import refusion_jax  # pylint: disable=import-outside-toplevel
  project = _pyproject()
  assert "version" in project["project"]["dynamic"]
  assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr":
                                                                 "refusion_jax.__version__"}
  assert refusion_jax.__version__.count(".") == 2
  assert project["project"]["entry-points"]["lm_eval.models"] == {
      "refusion_jax": "refusion_jax.lmeval.model:RefusionLM"}
  with open(os.path.join(REPO, "refusion_jax", "lmeval", "model.py"), encoding="utf-8") as f:
    assert '@register_model("refusion_jax")\nclass RefusionLM(' in f.read()


def test_packaged_names_resolve_only_when_the_working_directory_lacks_them(tmp_path,
                                                                          monkeypatch):
  monkeypatch.chdir(tmp_path)
  assert loading.resolve("base_tiny") == packaged.BASE_TINY_DIR
  assert os.path.isfile(os.path.join(packaged.BASE_TINY_DIR, "model.safetensors"))
  assert loading.resolve("elsewhere") == "elsewhere"
  (tmp_path / "base_tiny").mkdir()
  assert loading.resolve("base_tiny") == "base_tiny"  # a folder of that name wins
  # Without a packaged copy (a checkout run in place) nothing moves.
  monkeypatch.setattr(packaged, "configs_dir", lambda: None)
  assert packaged.config_file("configs/sample.py") == "configs/sample.py"
  # With a packaged copy: configs/NAME.py is read there unless the working directory has it.
  monkeypatch.setattr(packaged, "configs_dir", lambda: os.path.join(REPO, "configs"))
  assert packaged.config_file("configs/sample.py") == os.path.join(REPO, "configs", "sample.py")
  assert packaged.config_file("./configs/eval/gsm8k.py") == os.path.join(
      REPO, "configs", "eval", "gsm8k.py")
  assert packaged.config_file("configs/nope.py") == "configs/nope.py"
  assert packaged.config_file("other/sample.py") == "other/sample.py"
  (tmp_path / "configs").mkdir()
  (tmp_path / "configs" / "sample.py").write_text("")
  assert packaged.config_file("configs/sample.py") == "configs/sample.py"


def _copy_sources(dest: str) -> None:
  """What the wheel is built from: pyproject.toml, the README and the package's folders."""
  os.makedirs(dest)
  for name in ("pyproject.toml", "README.md"):
    shutil.copy(os.path.join(REPO, name), dest)
  for name in ("refusion_jax", "configs"):
    shutil.copytree(os.path.join(REPO, name), os.path.join(dest, name),
                    ignore=shutil.ignore_patterns(*SKIP, "*.pyc"))


def _source_files() -> set[str]:
  """Every file of refusion_jax/ and configs/, as the wheel should name it."""
  files = set()
  for top, inside in (("refusion_jax", "refusion_jax"), ("configs", "refusion_jax/configs")):
    for dirpath, dirnames, filenames in os.walk(os.path.join(REPO, top)):
      dirnames[:] = [d for d in dirnames if d not in SKIP]
      rel = os.path.relpath(dirpath, os.path.join(REPO, top))
      for name in filenames:
        if not name.endswith(".pyc"):
          files.add(os.path.normpath(os.path.join(inside, rel, name)).replace(os.sep, "/"))
  return files


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
  """(venv python, wheel, env, empty working directory): the wheel built from the checkout
  and installed into a fresh venv."""
  root = tmp_path_factory.mktemp("package")
  src, dist, venv, cwd = (str(root / n) for n in ("src", "dist", "venv", "cwd"))
  _copy_sources(src)
  subprocess.run([sys.executable, "-m", "pip", "wheel", ".", "--no-deps",
                  "--no-build-isolation", "--disable-pip-version-check", "-q", "-w", dist],
                 cwd=src, check=True, capture_output=True, text=True, timeout=300)
  wheels = os.listdir(dist)
  assert len(wheels) == 1 and wheels[0].endswith("-py3-none-any.whl"), wheels
  wheel = os.path.join(dist, wheels[0])
  # A venv without pip (this venv's pip installs into it: --python) whose site-packages
  # sees this venv's packages through a .pth line, not through any .pth of theirs.
  subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True,
                 timeout=120)
  python = os.path.join(venv, "bin", "python")
  new_site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()"
                             "['purelib'])"], check=True, capture_output=True, text=True
                            ).stdout.strip()
  ours = {sysconfig.get_paths()[k] for k in ("purelib", "platlib")}
  with open(os.path.join(new_site, "_refusion_jax_test_deps.pth"), "w", encoding="utf-8") as f:
    f.write("".join(f"{p}\n" for p in sorted(ours)))
  subprocess.run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps",
                  "--disable-pip-version-check", "-q", wheel], check=True, capture_output=True,
                 text=True, timeout=300)
  os.makedirs(cwd)
  env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
  env["JAX_PLATFORMS"] = "cpu"
  return python, wheel, env, cwd


def _run(installed, *args, timeout=600):
  python, _, env, cwd = installed
  return subprocess.run([python, *args], cwd=cwd, env=env, capture_output=True, text=True,
                        timeout=timeout)


def test_wheel_carries_every_file_and_declares_its_requirements(installed):
  import zipfile  # pylint: disable=import-outside-toplevel
  python, wheel, _, _ = installed
  with zipfile.ZipFile(wheel) as z:
    names = {n for n in z.namelist() if ".dist-info/" not in n}
    metadata = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA")))
  # Every file of the package and of configs/ (as refusion_jax/configs), nothing else: a
  # new package folder or data file not listed in pyproject.toml fails here.
  source = _source_files()
  assert names == source, (f"not in the wheel: {sorted(source - names)}; "
                           f"not in the source: {sorted(names - source)}")
  assert not any(n.startswith("configs/") for n in names)  # no top-level `configs` installed
  # The installed wheel's requirements are pyproject.toml's, and this venv satisfies them.
  project = _pyproject()["project"]
  requires = [line.split(": ", 1)[1] for line in metadata.decode().splitlines()
              if line.startswith("Requires-Dist: ")]
  declared = list(project["dependencies"]) + [
      f'{line}; extra == "{extra}"' for extra, lines in project["optional-dependencies"].items()
      for line in lines]
  assert sorted(_keys(requires)) == sorted(_keys(declared))
  check = subprocess.run([sys.executable, "-m", "pip", "--python", python, "check",
                          "--disable-pip-version-check"], capture_output=True, text=True,
                         timeout=300)
  about_us = [line for line in check.stdout.splitlines()
              if canonicalize_name(line.split(" ", 1)[0]) == "refusion-jax"]
  assert not about_us, check.stdout
  for extra in ("eval", "serve", "test"):  # pip check reads no extras: these by hand
    for line in project["optional-dependencies"][extra]:
      r = Requirement(line)
      assert r.specifier.contains(importlib.metadata.version(r.name), prereleases=True), line


def test_installed_package_imports_from_the_venv_and_registers_with_lm_eval(installed):
  python = installed[0]
  done = _run(installed, "-c", """
import importlib.metadata, json, os, sys
import refusion_jax
from refusion_jax import packaged
from refusion_jax.lmeval import benchmarks
(ep,) = importlib.metadata.entry_points(group="lm_eval.models", name="refusion_jax")
cls = ep.load()
from lm_eval.api import registry
from refusion_jax.lmeval.model import RefusionLM
print(json.dumps({
    "file": refusion_jax.__file__, "version": refusion_jax.__version__,
    "dist": importlib.metadata.version("refusion_jax"),
    "entry_point": cls is RefusionLM and registry.get_model("refusion_jax") is RefusionLM,
    "configs": packaged.configs_dir(), "base": packaged.BASE_TINY_DIR,
    "tasks": sorted(os.listdir(benchmarks.TASKS_DIR)),
    "path": [p for p in sys.path if os.path.isdir(os.path.join(p, "configs"))]}))
""", timeout=300)
  assert done.returncode == 0, done.stderr[-3000:]
  got = json.loads(done.stdout.strip().splitlines()[-1])
  venv = os.path.dirname(os.path.dirname(python))
  assert got["file"].startswith(venv + os.sep), got["file"]
  assert got["configs"].startswith(venv + os.sep) and got["base"].startswith(venv + os.sep)
  assert got["dist"] == got["version"]
  assert got["entry_point"] is True
  assert {"humaneval_instruct_noprefix.yaml", "mbpp_zeroshot.yaml"} <= set(got["tasks"])
  assert got["path"] == []  # no source tree (no top-level configs/) on the path
  # A config file that is nowhere is still one error line.
  done = _run(installed, "-m", "refusion_jax.sample", "--config=configs/nope.py",
              "--config.model_dir=base_tiny", "--config.prompt=x", timeout=300)
  assert done.returncode == 2
  assert done.stderr.strip() == ("refusion_jax.sample: error: --config=configs/nope.py: no such "
                                 "config file"), done.stderr[-3000:]
  # A config file of one's own imports the package's configs as `configs`, as in a checkout.
  own = os.path.join(installed[3], "own_sample.py")
  with open(own, "w", encoding="utf-8") as f:
    f.write("from configs import sample\n\ndef get_config():\n  return sample.get_config()\n")
  done = _run(installed, "-m", "refusion_jax.sample", f"--config={own}", timeout=300)
  assert done.returncode == 2
  assert done.stderr.strip() == ("refusion_jax.sample: error: --config.model_dir is required "
                                 "(a HF or refusion_jax model folder)"), done.stderr[-3000:]


@pytest.mark.parametrize("shipped, flags", [
    # The README's first sample: the shipped ReFusion model, the default method and settings.
    ("refusion_tiny", ()),
    # The shipped base (a causal ARM pretrained on the bundled tasks), decoded as one.
    ("base_tiny", ("--config.decode.method=ar", "--config.decode.gen_length=32")),
])
def test_installed_sample_decodes_with_a_shipped_model(installed, shipped, flags):
  cwd = installed[3]
  out = os.path.join(cwd, f"sample_{shipped}.json")
  done = _run(installed, "-m", "refusion_jax.sample", "--config=configs/sample.py",
              f"--config.model_dir={shipped}", "--config.prompt=copy 4230", *flags,
              f"--config.output_json={out}")
  assert done.returncode == 0, done.stderr[-3000:]
  venv = os.path.dirname(os.path.dirname(installed[0]))
  assert f"[sample] loaded {venv}{os.sep}" in done.stderr  # the wheel's copy
  with open(out, encoding="utf-8") as f:
    (result,) = json.load(f)
  assert result["text"] == "4230", result


def test_installed_smoke_reproduction(installed):
  workdir = os.path.join(installed[3], "repro")
  # Two models and their rows: the installed configs, assets and pipeline, not every row
  # (tests/test_reproduce.py runs them all).
  rows = ("ARM-AR", "ReFusion")
  done = _run(installed, "-m", "refusion_jax.reproduce", "--config=configs/repro_smoke.py",
              f"--workdir={workdir}", "--config.models=('arm', 'refusion')",
              f"--config.eval.rows={rows!r}")
  assert done.returncode == 0, done.stderr[-3000:]
  with open(os.path.join(workdir, pipeline.TABLE_FILE), encoding="utf-8") as f:
    assert "# ReFusion in miniature" in f.read()
  assert os.path.getsize(os.path.join(workdir, pipeline.PLOT_FILE)) > 0
  for row in rows:
    with open(os.path.join(workdir, scoring.RESULTS_DIR, f"{row}.json"), encoding="utf-8") as f:
      result = json.load(f)
    assert set(result["per_task"]) == set(tasks_lib.TASKS), row
    assert all(m["n"] == 2 for m in result["per_task"].values()), row
    assert 0.0 <= result["average"]["accuracy"] <= 100.0
