"""A newcomer's first sample, run again and again: wall time with and without the cache.

Runs the README's first sample command (`python -m refusion_jax.sample
--config=configs/sample.py --config.model_dir=refusion_tiny --config.prompt="copy
4230"`) as a fresh process, `--runs` times with a persistent compilation cache in a
new empty folder (the first run compiles and fills it, the later ones load) and
`--runs` times with none (`--config.compile_cache_dir=`: every run compiles),
the two kinds taking turns. Prints each run's wall time, the answer, and the
median of each kind; checks every run answered the same.

  python benchmarks/first_sample.py [--runs 3] [--prompt "copy 4230"] [--model_dir refusion_tiny]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--runs", type=int, default=3, help="runs of each kind (>= 2)")
  p.add_argument("--prompt", default="copy 4230")
  p.add_argument("--model_dir", default="refusion_tiny")
  p.add_argument("--extra", default="", help="more --config.x=y flags, space-separated")
  args = p.parse_args(argv)
  if args.runs < 2:
    p.error(f"--runs must be >= 2 (the first run with the cache fills it), got {args.runs}")
  return args


def one_run(args, cache: str) -> tuple[float, str, str]:
  """(wall seconds, the answer's text, stderr) of one sample process."""
  env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
  cmd = [sys.executable, "-m", "refusion_jax.sample", "--config=configs/sample.py",
         f"--config.model_dir={args.model_dir}", f"--config.prompt={args.prompt}",
         f"--config.compile_cache_dir={cache}", *args.extra.split()]
  t0 = time.perf_counter()
  done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env, timeout=900)
  seconds = time.perf_counter() - t0
  if done.returncode != 0:
    raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
  return seconds, json.loads(done.stdout)[0]["text"], done.stderr


def main(argv=None) -> dict:
  args = parse_args(argv)
  folder = tempfile.mkdtemp(prefix="first_sample_cache_")
  times = {"cache": [], "none": []}
  answers = set()
  try:
    for i in range(args.runs):
      for kind, cache in (("cache", folder), ("none", "")):
        seconds, text, _ = one_run(args, cache)
        times[kind].append(seconds)
        answers.add(text)
        print(f"run {i + 1} {kind:5s}: {seconds:6.2f} s  answer {text!r}", flush=True)
  finally:
    shutil.rmtree(folder, ignore_errors=True)
  first, later = times["cache"][0], statistics.median(times["cache"][1:])
  none = statistics.median(times["none"])
  print(f"\n| run | wall s |\n|---|---|\n| first, empty cache (compiles, fills it) | {first:.2f} |"
        f"\n| later, cache filled (loads) | {later:.2f} (median of {args.runs - 1}) |"
        f"\n| no cache (compiles every time) | {none:.2f} (median of {args.runs}) |")
  if len(answers) != 1:
    raise RuntimeError(f"the runs answered differently: {sorted(answers)}")
  return {"first": first, "later": later, "none": none, "answer": answers.pop()}


if __name__ == "__main__":
  main()
