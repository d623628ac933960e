#!/usr/bin/env bash
# Sets up .venv (requirements + test packages) and runs the test suite on the
# CPU (tests/conftest.py provides 8 virtual devices for the sharding tests).
# Usage: bash launch/test.sh [pytest args...]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$(bash "$root/launch/setup_env.sh" --test | tail -n 1)"
cd "$root"
export JAX_PLATFORMS=cpu
# Tests that compile for a TPU topology in a subprocess each load libtpu.
export ALLOW_MULTIPLE_LIBTPU_LOAD=1
exec "$venv/bin/python" -m pytest tests -q "$@"
