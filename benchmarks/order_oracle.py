"""How much can ReFusion's slot order matter? Every order of every problem, scored.

For each problem, `refusion_jax.decode.order_oracle` decodes the answer in every
order of its slots (a slot's first token planned from its own masks, the rest
autoregressive: the left-to-right ablation's fill, only the order changes) and scores
each answer. Per task: the accuracy of the position order (= `decode.left_to_right`),
of the best order (some order answers correctly: what a perfect planner with this fill
reaches), the mean over orders (a planner choosing at random), the worst order, and
the distinct answers per problem.

  python benchmarks/order_oracle.py --model_dir W/models/refusion/final_model \\
      --task_prompts refusion_jax/assets/data/tiny_test.jsonl --per_task 10 --slot_size 8
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from refusion_jax import evaluate, loading, runtime  # noqa: E402
from refusion_jax import tasks as tasks_lib  # noqa: E402
from refusion_jax.decode import order_oracle  # noqa: E402
from refusion_jax.tokenizer import Tokenizer  # noqa: E402


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--model_dir", required=True, help="a ReFusion model folder (refusion_jax or "
                 "HF) or a shipped model's name")
  p.add_argument("--task_prompts", required=True, help="JSONL task file (the bundled tiny "
                 "tokenizer): its queries are decoded, its answers score")
  p.add_argument("--per_task", type=int, default=10, help="problems per task")
  p.add_argument("--gen_length", type=int, default=24)
  p.add_argument("--slot_size", type=int, default=8, help="gen_length / slot_size slots: "
                 f"at most {order_oracle.MAX_SLOTS}")
  args = p.parse_args(argv)
  args.model_dir = loading.model_arg(p, args.model_dir)  # a shipped model's name, or a folder
  if not os.path.isfile(args.task_prompts):
    p.error(f"--task_prompts={args.task_prompts!r} is not a file")
  if args.per_task < 1:
    p.error("--per_task must be >= 1")
  n, rest = divmod(args.gen_length, args.slot_size)
  if rest or not 1 <= n <= order_oracle.MAX_SLOTS:
    p.error(f"--gen_length / --slot_size must be a whole number of slots from 1 to "
            f"{order_oracle.MAX_SLOTS}")
  return args


def main(argv=None):
  runtime.start_up()  # the entry points' start-up: no libtpu errors where no TPU is
  args = parse_args(argv)
  _, model = loading.load_model(args.model_dir, flag="--model_dir")
  tok = Tokenizer.tiny()
  problems = evaluate.read_problems(args.task_prompts, tok, per_task=args.per_task)
  n = args.gen_length // args.slot_size
  print(f"model: {args.model_dir}; {len(problems)} problems; {n} slots of {args.slot_size}: "
        f"{math.factorial(n)} orders each", flush=True)
  rows: dict[str, list] = {}
  t0 = time.perf_counter()
  for pr in problems:
    results = order_oracle.all_orders(model, pr.prompt_ids, gen_length=args.gen_length,
                                      slot_size=args.slot_size)
    score = lambda t, q=pr.query: tasks_lib.score(q, tok.decode(list(t),  # noqa: E731
                                                                 skip_special_tokens=True))
    rows.setdefault(pr.task, []).append(order_oracle.summarize(results, score))
  print(f"decoded in {time.perf_counter() - t0:.0f}s\n")
  print("| task | problems | left to right | best order | mean over orders | worst order "
        "| distinct answers per problem |")
  print("|---|---|---|---|---|---|---|")
  out = {}
  every = [s for ss in rows.values() for s in ss]
  for task, ss in list(rows.items()) + [("all", every)]:
    k = len(ss)
    r = dict(problems=k, ltr=100.0 * sum(s.left_to_right for s in ss) / k,
             best=100.0 * sum(s.correct > 0 for s in ss) / k,
             mean=100.0 * sum(s.correct / s.orders for s in ss) / k,
             worst=100.0 * sum(s.correct == s.orders for s in ss) / k,
             distinct=sum(s.distinct_answers for s in ss) / k)
    out[task] = r
    print(f"| {task} | {k} | {r['ltr']:.1f} | {r['best']:.1f} | {r['mean']:.1f} | "
          f"{r['worst']:.1f} | {r['distinct']:.2f} |")
  return out


if __name__ == "__main__":
  main()
