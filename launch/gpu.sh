#!/usr/bin/env bash
# Trains, evaluates or samples on the GPUs of one host (all local GPUs form the mesh).
#
#   bash launch/gpu.sh [train] --workdir=DIR [--config=configs/qwen3_0_6b_refusion.py] \
#       [--cuda=cuda12|cuda13] [--dry-run] [-- --config.field=value ...]
#   bash launch/gpu.sh eval --benchmark=B --model-dir=DIR --output-dir=OUT \
#       [--cuda=cuda12|cuda13] [--dry-run] [-- --config.field=value ...]
#   bash launch/gpu.sh sample --model-dir=DIR [--config=configs/sample.py] \
#       [--cuda=cuda12|cuda13] [--dry-run] [-- --config.prompt=... ...]
#
# Each builds (or reuses) .venv with jax[cuda] (launch/setup_env.sh --accelerator=CUDA,
# default cuda12), then runs in the repository root
#   train:  python -m refusion_jax.train --config=C --workdir=DIR (train is the default
#           subcommand: `bash launch/gpu.sh --workdir=DIR` trains);
#   eval:   python -m refusion_jax.evaluate --config=configs/eval/B.py
#           --config.model_dir=DIR --config.output_dir=OUT, B one of mmlu_pro, arc_c,
#           gsm8k, math, gpqa, humaneval, mbpp (results.json goes to OUT);
#   sample: python -m refusion_jax.sample --config=C --config.model_dir=DIR;
# with the arguments after `--` appended. For several GPU hosts, run the same command
# on each host with JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID set
# and add `-- --config.distributed=true`. --dry-run prints the commands, one per line,
# shell-quoted, instead of running them. -h / --help prints this text.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=launch/lib.sh
source "$root/launch/lib.sh"  # benchmarks, usage, die, quote, quote_all, run (--dry-run), only_for
subcommands="train eval sample"

sub="train"
if [ $# -gt 0 ]; then
  case "$1" in
    -h|--help) usage; exit 0 ;;
    -*) ;;  # no subcommand: train
    train|eval|sample) sub="$1"; shift ;;
    *) die "unknown subcommand '$1' (one of: $subcommands)" ;;
  esac
fi

config="" workdir="" benchmark="" model_dir="" output_dir="" cuda="cuda12" dry=0
extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    --config=*) only_for --config train sample; config="${1#*=}" ;;
    --workdir=*) only_for --workdir train; workdir="${1#*=}" ;;
    --benchmark=*) only_for --benchmark eval; benchmark="${1#*=}" ;;
    --model-dir=*) only_for --model-dir eval sample; model_dir="${1#*=}" ;;
    --output-dir=*) only_for --output-dir eval; output_dir="${1#*=}" ;;
    --cuda=*) cuda="${1#*=}" ;;
    --dry-run) dry=1 ;;
    --) shift; extra=("$@"); break ;;
    *) die "unknown argument $1 for '$sub'" ;;
  esac
  shift
done
case "$cuda" in
  cuda12|cuda13) ;;
  *) die "--cuda must be cuda12 or cuda13, got $cuda" ;;
esac
check_config() {
  local path
  case "$1" in /*) path="$1" ;; *) path="$root/$1" ;; esac
  [ -f "$path" ] || die "config $1 does not exist (give it relative to the repository root)"
}
case "$sub" in
  train)
    [ -n "$workdir" ] || die "--workdir=DIR is required"
    config="${config:-configs/qwen3_0_6b_refusion.py}"
    check_config "$config"
    command=(-m refusion_jax.train --config="$config" --workdir="$workdir") ;;
  eval)
    [ -n "$benchmark" ] || die "eval: --benchmark=NAME is required (one of: $benchmarks)"
    case " $benchmarks " in
      *" $benchmark "*) ;;
      *) die "eval: unknown benchmark '$benchmark' (one of: $benchmarks)" ;;
    esac
    [ -n "$model_dir" ] || die "eval: --model-dir=DIR is required"
    [ -n "$output_dir" ] || die "eval: --output-dir=DIR is required (results.json goes there)"
    command=(-m refusion_jax.evaluate --config="configs/eval/$benchmark.py"
             --config.model_dir="$model_dir" --config.output_dir="$output_dir") ;;
  sample)
    [ -n "$model_dir" ] || die "sample: --model-dir=DIR is required"
    config="${config:-configs/sample.py}"
    check_config "$config"
    command=(-m refusion_jax.sample --config="$config" --config.model_dir="$model_dir") ;;
esac

cd "$root"
run bash launch/setup_env.sh --accelerator="$cuda"
# XLA's latency-hiding scheduler overlaps FSDP all-gathers with compute on GPUs.
export XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_latency_hiding_scheduler=true"
run .venv/bin/python "${command[@]}" ${extra[@]+"${extra[@]}"}
