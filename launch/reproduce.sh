#!/usr/bin/env bash
# The project's main command: the paper's Table 1 and Figure 1 in miniature, on a CPU.
#
#   bash launch/reproduce.sh [--config=FILE] [--workdir=DIR] [--dry-run] [--config.field=value ...]
#
# Builds (or reuses) .venv with launch/setup_env.sh, then trains the causal ARM base of
# FILE (default configs/repro_tiny.py; configs/repro_long.py trains 4x longer),
# fine-tunes the ARM, MDM and ReFusion models from it and writes DIR/table.md and
# DIR/speed_accuracy.png (default DIR: runs/<FILE's name>). Rerunning resumes:
# finished training (the base included) and cached results are skipped. Every other
# argument (e.g. --config.sweep=true) goes to `python -m refusion_jax.reproduce`.
# --dry-run prints the commands instead of running them.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
config="configs/repro_tiny.py" workdir="" dry=0
extra=()
for arg in "$@"; do
  case "$arg" in
    --config=*) config="${arg#*=}" ;;
    --workdir=*) workdir="${arg#*=}" ;;
    --dry-run) dry=1 ;;
    *) extra+=("$arg") ;;
  esac
done
# FILE is relative to the repository root (the command runs there) or absolute.
case "$config" in /*) config_path="$config" ;; *) config_path="$root/$config" ;; esac
if [ ! -f "$config_path" ]; then
  echo "reproduce.sh: config $config does not exist (give it relative to the repository root)" >&2
  exit 2
fi
if [ -z "$workdir" ]; then
  name="$(basename "$config")"
  workdir="runs/${name%.py}"
fi
run() {
  if [ "$dry" = 1 ]; then printf '%q ' "$@"; echo; else "$@"; fi
}
cd "$root"
if [ "$dry" = 1 ]; then
  run bash launch/setup_env.sh
  python=".venv/bin/python"
else
  python="$(bash launch/setup_env.sh | tail -n 1)/bin/python"
fi
# The CPU is the device here; the reproduction's timings are CPU timings.
export JAX_PLATFORMS="${JAX_PLATFORMS:-cpu}"
run "$python" -m refusion_jax.reproduce --config="$config" --workdir="$workdir" \
  ${extra[@]+"${extra[@]}"}
