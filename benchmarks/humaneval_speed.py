"""HumanEval as the paper runs it, through small models: speed and the paper's statistics.

Each (model, method, engine rows) row runs the full benchmark pipeline
(`refusion_jax.lmeval.run`: lm-eval's humaneval_instruct_noprefix task, the
chat template, the release's answer handling, every program scored in the
sandbox) and reports what `results.json` holds: pass@1, tokens (up to EOS),
decode seconds, tokens/s, tokens per forward (every pass counted), the
paper's TPF and the wall time of the whole run (task loading, compiles and
scoring included).

  python benchmarks/humaneval_speed.py \\
      --refusion_dir runs/repro_tiny/models/refusion/final_model \\
      --ar_dir runs/repro_tiny/models/arm/final_model [--limit 164] [--rows 1,16]

Decoding settings are Table 5's HumanEval row (gen 512, slot 32, block 128,
tau_s 0.9, tau_t 0.4) unless overridden. The miniature's models were trained
on arithmetic-like tasks, so their pass@1 is ~0: the point is the speed and
the statistics, measured side by side in one process.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from refusion_jax import loading, runtime  # noqa: E402
from refusion_jax.lmeval import run as run_lib  # noqa: E402


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--refusion_dir", default="", help="model folder decoded with method refusion")
  p.add_argument("--ar_dir", default="", help="model folder decoded with method ar")
  p.add_argument("--rows", default="1,16", help="engine rows (batch sizes), comma-separated")
  p.add_argument("--limit", type=int, default=164, help="first N problems")
  p.add_argument("--gen_length", type=int, default=512)
  p.add_argument("--slot_size", type=int, default=32)
  p.add_argument("--block_size", type=int, default=128)
  p.add_argument("--enable_thinking", default="false", choices=["true", "false"],
                 help="chat template argument (the miniature's models were trained without)")
  p.add_argument("--output_dir", default="", help="keep each row's results here ('' = temp)")
  p.add_argument("--sandbox_allow_network", action="store_true",
                 help="run programs without a network namespace (accepting the risk)")
  p.add_argument("--sandbox_allow_no_namespaces", action="store_true",
                 help="run programs with resource limits only where user namespaces are "
                 "disabled (accepting the risk)")
  args = p.parse_args(argv)
  if not args.refusion_dir and not args.ar_dir:
    p.error("give --refusion_dir and/or --ar_dir")
  for name in ("refusion_dir", "ar_dir"):  # a shipped model's name, or a folder
    setattr(args, name, loading.model_arg(p, getattr(args, name), f"--{name}"))
  try:
    args.rows = [int(r) for r in args.rows.split(",")]
  except ValueError:
    p.error(f"--rows must be comma-separated ints, got {args.rows!r}")
  if any(r < 1 for r in args.rows) or args.limit < 1:
    p.error("--rows and --limit must be positive")
  return args


def _config(args, model_dir: str, method: str, rows: int, output_dir: str):
  spec = importlib.util.spec_from_file_location(
      "humaneval_config", os.path.join(REPO, "configs", "eval", "humaneval.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  c = module.get_config()
  c.model_dir, c.output_dir, c.limit, c.batch_size = model_dir, output_dir, args.limit, rows
  c.enable_thinking = args.enable_thinking == "true"
  c.sandbox_allow_network = args.sandbox_allow_network
  c.sandbox_allow_no_namespaces = args.sandbox_allow_no_namespaces
  c.decode.method = method
  c.decode.gen_length, c.decode.slot_size = args.gen_length, args.slot_size
  c.decode.block_size = args.block_size
  return c


def table(rows: list[dict]) -> str:
  head = ("| model | method | rows | samples | pass@1 | tokens | decode s | tokens/s | "
          "tokens/forward | TPF (paper) | wall s |")
  lines = [head, "|" + "---|" * 11]
  for r in rows:
    lines.append(
        f"| {r['model']} | {r['method']} | {r['rows']} | {r['samples']} | {r['accuracy']:.2f} | "
        f"{r['tokens']} | {r['seconds']:.2f} | {r['tokens_per_second']:.1f} | "
        f"{r['tokens_per_forward']:.2f} | {r['tpf_paper']:.2f} | {r['wall']:.1f} |")
  return "\n".join(lines)


def main(argv=None) -> list[dict]:
  runtime.start_up()  # the entry points' start-up: no libtpu errors where no TPU is
  args = parse_args(argv)
  out_root = args.output_dir or tempfile.mkdtemp(prefix="humaneval_speed_")
  runs = [(d, m) for d, m in ((args.refusion_dir, "refusion"), (args.ar_dir, "ar")) if d]
  rows = []
  for model_dir, method in runs:
    for n in args.rows:
      out = os.path.join(out_root, f"{method}_rows{n}")
      t0 = time.perf_counter()
      result = run_lib.run(_config(args, model_dir, method, n, out))
      rows.append({**result, "rows": n, "wall": time.perf_counter() - t0})
  print(table(rows))
  return rows


if __name__ == "__main__":
  main()
