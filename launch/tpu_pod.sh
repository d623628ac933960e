#!/usr/bin/env bash
# Cloud TPU VM slices (one host or a multi-host pod): create one, copy the committed
# tree to every worker, train / evaluate / sample on all workers, read a run's log,
# delete the slice.
#
#   bash launch/tpu_pod.sh SUBCOMMAND --tpu=NAME --zone=ZONE [--project=P] [--dry-run] \
#       [subcommand flags] [-- extra arguments]
#
#   create  [--accelerator-type=v4-8] [--runtime-version=V] [--spot] [-- gcloud flags]
#           `gcloud compute tpus tpu-vm create`. V defaults by TPU generation, to the
#           versions Google lists for JAX: v6e-* v2-alpha-tpuv6e, v5p-* v2-alpha-tpuv5,
#           v5litepod-* v2-alpha-tpuv5-lite, anything else (v4 and older)
#           tpu-ubuntu2204-base.
#   setup   Copies `git archive HEAD` (committed files only: no .venv, no runs) to
#           ~/refusion_jax on every worker, replacing the previous tree but keeping its
#           .venv and logs/; installs python3.11 with apt when the image has no
#           Python >= 3.11 with venv (Ubuntu 22.04 images ship 3.10); builds .venv with
#           jax[tpu] (launch/setup_env.sh --accelerator=tpu). Rerun it after a commit.
#   train   --workdir=gs://BUCKET/run --accelerator-type=T [--config=configs/qwen3_8b_refusion.py]
#           [--detach] [--skip-fit-check]
#           First, here and without a TPU, the fit check: `python -m refusion_jax.aot
#           --program=train --topology=T --config=C` (with the --config.* arguments after
#           --) compiles the train step for the slice T (the type it was created with, e.g.
#           v5p-128) and stops unless it fits in HBM (needs this tree's .venv with libtpu:
#           launch/setup_env.sh --accelerator=tpu); --skip-fit-check skips it. Then
#           python -m refusion_jax.train --config=C --workdir=W --config.distributed=true
#           A spot / preemptible slice that is preempted: every worker gets SIGTERM, JAX's
#           preemption service agrees on one step, training saves a checkpoint of it in W
#           and exits with status 75. Resume by recreating the slice and rerunning the same
#           three commands (create, setup, and train with the same --workdir and config):
#           the run continues from that checkpoint, bit-identically (a workdir on gs:// or
#           another disk that outlives the slice).
#   eval    --benchmark=B --model-dir=DIR --output-dir=OUT [--detach]
#           python -m refusion_jax.evaluate --config=configs/eval/B.py
#             --config.model_dir=DIR --config.output_dir=OUT --config.distributed=true
#           B: mmlu_pro, arc_c, gsm8k, math, gpqa, humaneval or mbpp.
#   sample  --model-dir=DIR [--config=configs/sample.py] [--detach]
#           python -m refusion_jax.sample --config=C --config.model_dir=DIR
#   logs    [--worker=0] [--lines=200] [--follow]
#           The last `--lines` lines of the newest train/eval/sample log of one worker
#           (--worker=all: every worker); --follow keeps printing as it grows.
#   delete  `gcloud compute tpus tpu-vm delete --quiet`.
#
# train, eval and sample run on every worker at once (a multi-host slice runs one
# program on all its hosts; train and eval add --config.distributed=true and
# jax.distributed discovers the pod by itself). They use the tree and .venv that
# `setup` left and copy nothing: commit, then rerun setup, to run changed code; without
# a setup they stop, naming it. Their folders are paths on each worker, relative ones
# from ~/refusion_jax (keep models outside it: setup replaces it). Arguments after `--`
# are appended to their python command (to gcloud's for create), e.g.
# `-- --config.num_train_steps=10`. Their output goes to the terminal and to
# ~/refusion_jax/logs/SUBCOMMAND-UTCTIME.log on each worker (logs/last.log links the
# newest); --detach starts them under nohup and returns at once (watch with
# `logs --follow`). --dry-run prints the commands, one per line, shell-quoted, instead
# of running them. -h / --help prints this text.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=launch/lib.sh
source "$root/launch/lib.sh"  # benchmarks, usage, die, quote, quote_all, run (--dry-run), only_for
subcommands="create setup train eval sample logs delete"

[ $# -gt 0 ] || die "missing subcommand (one of: $subcommands); --help prints the usage"
case "$1" in -h|--help) usage; exit 0 ;; esac
sub="$1"
case " $subcommands " in
  *" $sub "*) shift ;;
  *)
    case "$sub" in
      -*) die "missing subcommand before $sub (one of: $subcommands)" ;;
      *) die "unknown subcommand '$sub' (one of: $subcommands)" ;;
    esac ;;
esac

tpu="" zone="" project="" dry=0 detach=0
accelerator_type="v4-8" accelerator_given=0 runtime_version="" spot=0 skip_fit=0
config="" workdir="" benchmark="" model_dir="" output_dir=""
worker="0" lines="200" follow=0
extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    --tpu=*) tpu="${1#*=}" ;;
    --zone=*) zone="${1#*=}" ;;
    --project=*) project="${1#*=}" ;;
    --dry-run) dry=1 ;;
    --accelerator-type=*)
      only_for --accelerator-type create train; accelerator_type="${1#*=}"; accelerator_given=1 ;;
    --skip-fit-check) only_for --skip-fit-check train; skip_fit=1 ;;
    --runtime-version=*) only_for --runtime-version create; runtime_version="${1#*=}" ;;
    --spot) only_for --spot create; spot=1 ;;
    --config=*) only_for --config train sample; config="${1#*=}" ;;
    --workdir=*) only_for --workdir train; workdir="${1#*=}" ;;
    --benchmark=*) only_for --benchmark eval; benchmark="${1#*=}" ;;
    --model-dir=*) only_for --model-dir eval sample; model_dir="${1#*=}" ;;
    --output-dir=*) only_for --output-dir eval; output_dir="${1#*=}" ;;
    --detach) only_for --detach train eval sample; detach=1 ;;
    --worker=*) only_for --worker logs; worker="${1#*=}" ;;
    --lines=*) only_for --lines logs; lines="${1#*=}" ;;
    --follow) only_for --follow logs; follow=1 ;;
    --)
      case "$sub" in
        create|train|eval|sample) ;;
        *) die "'$sub' takes no arguments after --" ;;
      esac
      shift
      extra=("$@")
      break ;;
    *) die "unknown argument $1 for '$sub'" ;;
  esac
  shift
done

name_pattern='^[a-z0-9]([-a-z0-9]*[a-z0-9])?$'
[ -n "$tpu" ] || die "--tpu=NAME is required"
[[ $tpu =~ $name_pattern ]] \
  || die "--tpu=$tpu: a TPU name is lowercase letters, digits and hyphens"
[ -n "$zone" ] || die "--zone=ZONE is required"
[[ $zone =~ $name_pattern ]] \
  || die "--zone=$zone: a zone is lowercase letters, digits and hyphens (e.g. us-east5-a)"

# A config given relative to the repository root must be committed: setup copies HEAD.
check_config() {
  [ -f "$root/$1" ] || die "config $1 does not exist (give it relative to the repository root)"
  git -C "$root" cat-file -e "HEAD:$1" 2>/dev/null \
    || die "config $1 is not committed; setup copies only HEAD to the workers" \
           "(commit it, rerun setup)"
}
case "$sub" in
  create)
    [ -n "$accelerator_type" ] || die "--accelerator-type must not be empty (e.g. v4-8, v5p-8)"
    if [ -z "$runtime_version" ]; then
      case "$accelerator_type" in
        v6e-*) runtime_version="v2-alpha-tpuv6e" ;;
        v5p-*) runtime_version="v2-alpha-tpuv5" ;;
        v5litepod-*) runtime_version="v2-alpha-tpuv5-lite" ;;
        *) runtime_version="tpu-ubuntu2204-base" ;;
      esac
    fi ;;
  train)
    [ -n "$workdir" ] || die "train: --workdir is required (a gs:// path on pods)"
    config="${config:-configs/qwen3_8b_refusion.py}"
    check_config "$config"
    if [ "$skip_fit" = 0 ] && [ "$accelerator_given" = 0 ]; then
      die "train: --accelerator-type=TYPE (the slice's, e.g. v5p-128) is required for the" \
          "fit check; or pass --skip-fit-check"
    fi
    [ -n "$accelerator_type" ] || die "--accelerator-type must not be empty (e.g. v4-8, v5p-8)" ;;
  eval)
    [ -n "$benchmark" ] || die "eval: --benchmark=NAME is required (one of: $benchmarks)"
    case " $benchmarks " in
      *" $benchmark "*) ;;
      *) die "eval: unknown benchmark '$benchmark' (one of: $benchmarks)" ;;
    esac
    [ -n "$model_dir" ] || die "eval: --model-dir=DIR is required (a folder every worker can read)"
    [ -n "$output_dir" ] || die "eval: --output-dir=DIR is required (results.json goes there)" ;;
  sample)
    [ -n "$model_dir" ] \
      || die "sample: --model-dir=DIR is required (a folder every worker can read)"
    config="${config:-configs/sample.py}"
    check_config "$config" ;;
  logs)
    [[ $worker =~ ^([0-9]+|all)$ ]] || die "logs: --worker=$worker must be a worker number or all"
    [[ $lines =~ ^[1-9][0-9]*$ ]] || die "logs: --lines=$lines must be a positive integer" ;;
esac


gcloud_tpu=(gcloud compute tpus tpu-vm)
where=(--zone="$zone")
[ -n "$project" ] && where+=(--project="$project")

# job NAME ARG...: the command line a worker runs for train/eval/sample: ARG... in
# ~/refusion_jax, its output in logs/NAME-UTCTIME.log (and on the terminal unless
# --detach). The remote command lines here and below are single-quoted on purpose:
# their $(...), $log, $py and ~ are for the worker's shell to expand.
# shellcheck disable=SC2016,SC2088
job() {
  local name="$1" cmd ready start
  shift
  cmd="$(quote_all "$@")"
  ready='cd ~/refusion_jax 2>/dev/null && test -x .venv/bin/python || { echo "$(hostname): '
  ready+='~/refusion_jax/.venv is missing; run launch/tpu_pod.sh setup first" >&2; exit 1; }'
  start='mkdir -p logs && log="logs/'"$name"'-$(date -u +%Y%m%d-%H%M%S).log"'
  start+=' && ln -sfn "${log#logs/}" logs/last.log'
  if [ "$detach" = 1 ]; then
    printf '%s; %s && { nohup %s >"$log" 2>&1 </dev/null & } && %s' "$ready" "$start" "$cmd" \
      'echo "$(hostname): '"$name"' started (pid $!), log ~/refusion_jax/$log"'
  else
    printf '%s; %s && set -o pipefail && %s 2>&1 | tee "$log"' "$ready" "$start" "$cmd"
  fi
}
python=.venv/bin/python

# fit_check: compiles the train step for the slice here, without a TPU (refusion_jax.aot,
# with the --config.* arguments after --), and stops unless it fits the chips' HBM.
fit_check() {
  local a overrides=() status=0
  for a in ${extra[@]+"${extra[@]}"}; do
    case "$a" in
      --config.distributed=*) ;;
      --config.*) overrides+=("$a") ;;
    esac
  done
  local check=("$python" -m refusion_jax.aot --program=train --topology="$accelerator_type"
               --config="$config" ${overrides[@]+"${overrides[@]}"})
  if [ "$dry" = 1 ]; then
    run "${check[@]}"
    return
  fi
  [ -x "$root/$python" ] || die "the fit check needs $root/.venv with libtpu" \
    "(bash launch/setup_env.sh --accelerator=tpu); or pass --skip-fit-check"
  (cd "$root" && "${check[@]}") || status=$?
  case "$status" in
    0) ;;
    3) echo "$(basename "$0"): the train step does not fit $accelerator_type (above); not" \
            "starting it (--skip-fit-check starts it anyway)" >&2
       exit 3 ;;
    *) echo "$(basename "$0"): the fit check failed (exit status $status); not starting" \
            "the run (--skip-fit-check starts it anyway)" >&2
       exit "$status" ;;
  esac
}

# shellcheck disable=SC2016,SC2088
case "$sub" in
  create)
    create=("${gcloud_tpu[@]}" create "$tpu" "${where[@]}" --accelerator-type="$accelerator_type"
            --version="$runtime_version")
    [ "$spot" = 1 ] && create+=(--spot)
    run "${create[@]}" ${extra[@]+"${extra[@]}"} ;;
  setup)
    if [ -n "$(git -C "$root" status --porcelain --untracked-files=no)" ]; then
      echo "tpu_pod.sh: note: uncommitted changes are not copied (setup copies HEAD)" >&2
    fi
    tmp="$(mktemp -d)"
    trap 'rm -rf "$tmp"' EXIT
    archive="$tmp/refusion_jax.tar.gz"
      python_ready='{ py=python3.11; python3 -c "import sys; sys.exit(sys.version_info < (3, 11))"'
    python_ready+=' 2>/dev/null && py=python3; $py -c "import ensurepip" 2>/dev/null || {'
    python_ready+=' sudo apt-get update -qq && sudo env DEBIAN_FRONTEND=noninteractive'
    python_ready+=' apt-get install -y -qq $py $py-venv; }; }'
    unpack='mkdir -p ~/refusion_jax && cd ~/refusion_jax && find . -mindepth 1 -maxdepth 1'
    unpack+=' ! -name .venv ! -name logs -exec rm -rf {} + && tar -xzf ~/refusion_jax.tar.gz'
    unpack+=' && rm -f ~/refusion_jax.tar.gz'
    run git -C "$root" archive --format=tar.gz -o "$archive" HEAD
    run "${gcloud_tpu[@]}" scp "$archive" "$tpu:~/refusion_jax.tar.gz" "${where[@]}" --worker=all
    run "${gcloud_tpu[@]}" ssh "$tpu" "${where[@]}" --worker=all --command \
      "$unpack && $python_ready && PYTHON=\$py bash launch/setup_env.sh --accelerator=tpu" ;;
  train)
    [ "$skip_fit" = 1 ] || fit_check
    run "${gcloud_tpu[@]}" ssh "$tpu" "${where[@]}" --worker=all --command "$(job train \
      "$python" -m refusion_jax.train --config="$config" --workdir="$workdir" \
      --config.distributed=true ${extra[@]+"${extra[@]}"})" ;;
  eval)
    run "${gcloud_tpu[@]}" ssh "$tpu" "${where[@]}" --worker=all --command "$(job eval \
      "$python" -m refusion_jax.evaluate --config="configs/eval/$benchmark.py" \
      --config.model_dir="$model_dir" --config.output_dir="$output_dir" \
      --config.distributed=true ${extra[@]+"${extra[@]}"})" ;;
  sample)
    run "${gcloud_tpu[@]}" ssh "$tpu" "${where[@]}" --worker=all --command "$(job sample \
      "$python" -m refusion_jax.sample --config="$config" --config.model_dir="$model_dir" \
      ${extra[@]+"${extra[@]}"})" ;;
  logs)
    tail_flags="-n $lines"
    [ "$follow" = 1 ] && tail_flags="$tail_flags -F"
      show='cd ~/refusion_jax/logs 2>/dev/null && test -e last.log || { echo "$(hostname): no run'
    show+=' log yet (train, eval and sample write ~/refusion_jax/logs/)" >&2; exit 1; };'
    show+=' echo "==> $(hostname): ~/refusion_jax/logs/$(readlink last.log) <==";'
    show+=" tail $tail_flags last.log"
    run "${gcloud_tpu[@]}" ssh "$tpu" "${where[@]}" --worker="$worker" --command "$show" ;;
  delete)
    run "${gcloud_tpu[@]}" delete "$tpu" "${where[@]}" --quiet ;;
esac
