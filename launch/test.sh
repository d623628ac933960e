#!/usr/bin/env bash
# Sets up .venv (requirements + test packages) and runs the test suite on the
# CPU (tests/conftest.py provides 8 virtual devices for the sharding tests and a
# cache of compiled programs for the run), one pytest-xdist worker per core, at most
# 4, each taking whole test files (their module fixtures are built once).
# Usage: bash launch/test.sh [pytest args...]   (-n 0: one process)
#        bash launch/test.sh tests/test_serve.py [-k NAME]   (those tests only)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$(bash "$root/launch/setup_env.sh" --test | tail -n 1)"
cd "$root"
export JAX_PLATFORMS=cpu
# Tests that compile for a TPU topology in a subprocess each load libtpu.
export ALLOW_MULTIPLE_LIBTPU_LOAD=1
cores="$(nproc 2>/dev/null || echo 1)"
workers=$(( cores < 4 ? cores : 4 ))
# Test files, folders or ids (path::name) among the arguments run on their own; else
# all of tests/.
targets=(tests)
for arg in "$@"; do
  case "$arg" in -*) continue ;; esac
  if [ -e "${arg%%::*}" ]; then targets=(); break; fi
done
exec "$venv/bin/python" -m pytest "${targets[@]}" -q -n "$workers" --dist loadfile "$@"
