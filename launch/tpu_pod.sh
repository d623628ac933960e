#!/usr/bin/env bash
# Trains on every worker of a Cloud TPU VM pod slice.
#
#   bash launch/tpu_pod.sh --tpu=NAME --zone=ZONE [--project=P] \
#       [--config=configs/qwen3_8b_refusion.py] --workdir=gs://BUCKET/run [--dry-run] \
#       [-- --config.field=value ...]
#
# The committed tree (git archive of HEAD: no .venv, no runs) is copied to
# ~/refusion_jax on every worker, its environment is
# built with jax[tpu], and `python -m refusion_jax.train` starts on all hosts at
# once (jax.distributed discovers the pod by itself). --dry-run prints the
# commands instead of running them.
set -euo pipefail
tpu="" zone="" project="" config="configs/qwen3_8b_refusion.py" workdir="" dry=0
extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    --tpu=*) tpu="${1#*=}" ;;
    --zone=*) zone="${1#*=}" ;;
    --project=*) project="${1#*=}" ;;
    --config=*) config="${1#*=}" ;;
    --workdir=*) workdir="${1#*=}" ;;
    --dry-run) dry=1 ;;
    --) shift; extra=("$@"); break ;;
    *) echo "tpu_pod.sh: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
[ -n "$tpu" ] || { echo "tpu_pod.sh: --tpu=NAME is required" >&2; exit 2; }
[ -n "$zone" ] || { echo "tpu_pod.sh: --zone=ZONE is required" >&2; exit 2; }
[ -n "$workdir" ] || { echo "tpu_pod.sh: --workdir is required (a gs:// path on pods)" >&2; exit 2; }
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
[ -f "$root/$config" ] || { echo "tpu_pod.sh: config $config does not exist" >&2; exit 2; }
gcloud_args=(--zone="$zone" --worker=all)
[ -n "$project" ] && gcloud_args+=(--project="$project")

remote="rm -rf ~/refusion_jax && mkdir -p ~/refusion_jax && tar -xzf ~/refusion_jax.tar.gz -C ~/refusion_jax && \
cd ~/refusion_jax && bash launch/setup_env.sh --accelerator=tpu >/dev/null && \
.venv/bin/python -m refusion_jax.train --config=$config --workdir=$workdir \
--config.distributed=true ${extra[*]:-}"

run() {
  if [ "$dry" = 1 ]; then printf '%q ' "$@"; echo; else "$@"; fi
}
archive="$(mktemp -d)/refusion_jax.tar.gz"
run git -C "$root" archive --format=tar.gz -o "$archive" HEAD
run gcloud compute tpus tpu-vm scp "$archive" "$tpu:~/refusion_jax.tar.gz" "${gcloud_args[@]}"
run gcloud compute tpus tpu-vm ssh "$tpu" "${gcloud_args[@]}" --command "$remote"
