#!/usr/bin/env bash
# Trains the shipped miniature base (configs/base_tiny.py) and exports it to
# refusion_jax/assets/base_tiny in HF layout with a SHA-256 checksum.
#
#   bash launch/train_base.sh [--workdir=runs/base_tiny] [--dry-run] [-- --config.x=y ...]
#
# Steps: the base corpus (scripts/make_tiny_data.py --base_out), training with
# resume (rerun after an interruption), the HF export, the copy into the
# package with model.safetensors.sha256 and the training log (metrics.jsonl). --dry-run prints the commands.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
# shellcheck source=launch/lib.sh
source "$root/launch/lib.sh"  # workdir_args, run (--dry-run), die
workdir_args "runs/base_tiny" "$@"
if [ "$dry" = 0 ]; then
  bash launch/setup_env.sh >/dev/null
fi
assets="refusion_jax/assets/base_tiny"
run .venv/bin/python scripts/make_tiny_data.py --base_out="$workdir/base_train.jsonl"
run .venv/bin/python -m refusion_jax.train --config=configs/base_tiny.py --workdir="$workdir" \
  --config.data.train_files="('$workdir/base_train.jsonl',)" \
  --config.export_hf_dir="$workdir/hf" ${extra[@]+"${extra[@]}"}
run rm -rf "$assets"
run mkdir -p "$assets"
run cp "$workdir/hf/config.json" "$workdir/hf/model.safetensors" "$workdir/metrics.jsonl" "$assets/"
run sh -c "cd $assets && sha256sum model.safetensors > model.safetensors.sha256"
