# Shared by the launch scripts (sourced, not run): shell quoting and --dry-run.
# shellcheck shell=bash

# The paper's benchmarks (configs/eval/<name>.py), for `eval --benchmark=`.
# shellcheck disable=SC2034  # used by the scripts that source this file
benchmarks="mmlu_pro arc_c gsm8k math gpqa humaneval mbpp"

# usage: the calling script's leading comment block.
usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }

# die MESSAGE...: the message, prefixed with the script's name, and exit status 2.
die() { echo "$(basename "$0"): $*" >&2; exit 2; }

# quote ARG: ARG as one shell word, written exactly as Python's shlex.quote writes it.
quote() {
  local s="$1" safe='^[A-Za-z0-9_@%+=:,./-]+$'
  if [ -z "$s" ]; then
    printf "''"
  elif [[ $s =~ $safe ]]; then
    printf '%s' "$s"
  else
    printf "'%s'" "${s//\'/\'\"\'\"\'}"
  fi
}

# quote_all ARG...: the arguments as one command line.
quote_all() {
  local a sep=""
  for a in "$@"; do printf '%s' "$sep"; quote "$a"; sep=" "; done
}

# run CMD...: runs CMD, or with dry=1 prints it (one line, shell-quoted).
run() {
  if [ "${dry:-0}" = 1 ]; then quote_all "$@"; echo; else "$@"; fi
}

# workdir_args DEFAULT_WORKDIR ARG...: a training script's arguments (--workdir=DIR,
# --dry-run, then -- and the trainer's own flags) into the caller's workdir, dry and extra.
workdir_args() {
  # shellcheck disable=SC2034  # workdir, dry, extra: the caller's
  workdir="$1" dry=0 extra=()
  shift
  while [ $# -gt 0 ]; do
    case "$1" in
      --workdir=*) workdir="${1#*=}" ;;
      --dry-run) dry=1 ;;
      --) shift; extra=("$@"); break ;;
      *) die "unknown argument $1" ;;
    esac
    shift
  done
}

# only_for FLAG SUBCOMMAND...: FLAG belongs to these subcommands; any other stops here
# (uses the caller's $sub and die).
only_for() {
  local flag="$1" s
  shift
  # shellcheck disable=SC2154  # sub: the caller's subcommand
  for s in "$@"; do [ "$s" = "$sub" ] && return 0; done
  die "$flag is not a flag of '$sub' (it belongs to: $*)"
}
