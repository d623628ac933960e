"""ReFusion + MCTS in the miniature: the searched slot order beside the fixed ones.

Every row decodes with the same fill (a slot's first token from a plan pass over its own
masks, the rest left to right: the order oracle's and `decode.left_to_right`'s), only
the order differs: left to right (the position order), the most confident slot first
(`planner='mcts'` with budget 1: the root's prior), and MCTS with `--budgets`
simulations per plan step (PUCT `--c`, `--batch` simulations a forward). Per task:
exact match on the test split; tokens per forward counts the fill's passes and the
search's batched forwards, each one forward; search rows are the simulations run.
`benchmarks/order_oracle.py` gives the same fill's best and mean over every order.

  python benchmarks/mcts_planner.py --model_dir W/models/refusion/final_model \\
      --slot_size 8 --budgets 1,8
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from configs.common import TINY_TEST  # noqa: E402
from refusion_jax import evaluate, loading, runtime  # noqa: E402
from refusion_jax.decode.settings import DecodeConfig  # noqa: E402
from refusion_jax.tokenizer import Tokenizer  # noqa: E402


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--model_dir", required=True)
  p.add_argument("--data", default=TINY_TEST)
  p.add_argument("--per_task", type=int, default=0, help="problems per task (0: all)")
  p.add_argument("--gen_length", type=int, default=24)
  p.add_argument("--slot_size", type=int, default=8)
  p.add_argument("--budgets", default="1,8", help="MCTS simulations per plan step")
  p.add_argument("--c", type=float, default=1.0, help="PUCT exploration")
  p.add_argument("--batch", type=int, default=8, help="simulations per batched forward")
  args = p.parse_args(argv)
  args.model_dir = loading.model_arg(p, args.model_dir)  # a shipped model's name, or a folder
  return args


def main(argv=None):
  runtime.start_up()  # the entry points' start-up: no libtpu errors where no TPU is
  a = parse_args(argv)
  tok = Tokenizer.tiny()
  _, model = loading.load_model(a.model_dir, flag="--model_dir")
  problems = evaluate.read_problems(a.data, tok, per_task=a.per_task)
  base = dict(gen_length=a.gen_length, slot_size=a.slot_size, block_size=a.gen_length)
  rows = {"left to right": DecodeConfig(**base, left_to_right=True)}
  for b in (int(x) for x in a.budgets.split(",")):
    name = "most confident first (budget 1)" if b == 1 else f"MCTS, budget {b}, c {a.c}"
    rows[name] = DecodeConfig(**base, planner="mcts", mcts_budget=b, mcts_c=a.c,
                              mcts_batch=a.batch)
  print(f"{len(problems)} problems, {a.gen_length} tokens in slots of {a.slot_size}")
  print("| order | accuracy | tokens/forward | search rows / answer | seconds | per task |")
  print("|---|---|---|---|---|---|")
  for name, dc in rows.items():
    t0 = time.perf_counter()
    r = evaluate.evaluate(model, tok, problems, dc, batch_size=16, speed_per_task=0,
                          progress=False)
    seconds = time.perf_counter() - t0
    search = [s.get("search_rows", 0) for s in r["samples"]]
    per = ", ".join(f"{t} {m['accuracy']:.0f}" for t, m in r["per_task"].items())
    print(f"| {name} | {r['average']['accuracy']:.1f} | "
          f"{r['average']['tokens_per_forward']:.2f} | "
          f"{sum(search) / len(search):.1f} | {seconds:.0f} | {per} |", flush=True)


if __name__ == "__main__":
  main()
