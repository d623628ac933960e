#!/usr/bin/env bash
# Trains the shipped ReFusion model (configs/refusion_tiny.py: the miniature's ReFusion
# fine-tune of the shipped base, boundary label on), exports it to
# refusion_jax/assets/refusion_tiny in HF layout with a SHA-256 checksum, and prints its
# accuracy on the held-out split with sample's default decode settings and with verified
# infill.
#
#   bash launch/train_refusion_tiny.sh [--workdir=runs/refusion_tiny] [--dry-run] [-- --config.x=y ...]
#
# Rerun after an interruption: training resumes. --dry-run prints the commands.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
# shellcheck source=launch/lib.sh
source "$root/launch/lib.sh"  # workdir_args, run (--dry-run), die
workdir_args "runs/refusion_tiny" "$@"
if [ "$dry" = 0 ]; then
  bash launch/setup_env.sh >/dev/null
fi
assets="refusion_jax/assets/refusion_tiny"
run .venv/bin/python -m refusion_jax.train --config=configs/refusion_tiny.py --workdir="$workdir" \
  --config.export_hf_dir="$workdir/hf" ${extra[@]+"${extra[@]}"}
run rm -rf "$assets"
run mkdir -p "$assets"
run cp "$workdir/hf/config.json" "$workdir/hf/model.safetensors" "$workdir/metrics.jsonl" "$assets/"
run sh -c "cd $assets && sha256sum model.safetensors > model.safetensors.sha256"
# Held-out accuracy (the test split, 210 problems): sample's default decode settings
# (configs/sample.py), then with verified infill (this model learnt the slot boundary).
for verify in off correct; do
  run .venv/bin/python -m refusion_jax.evaluate --config=configs/eval/synthetic.py \
    --config.model_dir="$assets" --config.speed_per_task=0 --config.decode.verify="$verify"
done
