#!/usr/bin/env bash
# Trains on the GPUs of one host (all local GPUs form the mesh).
#
#   bash launch/gpu.sh [--config=configs/qwen3_0_6b_refusion.py] --workdir=DIR \
#       [--cuda=cuda12|cuda13] [--dry-run] [-- --config.field=value ...]
#
# For several GPU hosts, run the same command on each host with
# JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID set and add
# `-- --config.distributed=true`. --dry-run prints the commands instead of running them.
set -euo pipefail
config="configs/qwen3_0_6b_refusion.py" workdir="" cuda="cuda12" dry=0
extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    --config=*) config="${1#*=}" ;;
    --workdir=*) workdir="${1#*=}" ;;
    --cuda=*) cuda="${1#*=}" ;;
    --dry-run) dry=1 ;;
    --) shift; extra=("$@"); break ;;
    *) echo "gpu.sh: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
[ -n "$workdir" ] || { echo "gpu.sh: --workdir=DIR is required" >&2; exit 2; }
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
[ -f "$root/$config" ] || { echo "gpu.sh: config $config does not exist" >&2; exit 2; }
run() {
  if [ "$dry" = 1 ]; then printf '%q ' "$@"; echo; else "$@"; fi
}
cd "$root"
run bash launch/setup_env.sh --accelerator="$cuda"
# XLA's latency-hiding scheduler overlaps FSDP all-gathers with compute on GPUs.
export XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_latency_hiding_scheduler=true"
run .venv/bin/python -m refusion_jax.train --config="$config" --workdir="$workdir" ${extra[@]+"${extra[@]}"}
