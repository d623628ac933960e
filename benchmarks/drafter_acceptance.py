"""A model's drafts against a drafter's, under lossless decoding: same answers, fewer passes?

Decodes every problem losslessly (`decode.verify='lossless'`) with each model given,
greedy, batched through the engine, and prints per task and over all answers: tokens
per forward, and the drafts' acceptance: of the drafts a pass checked, the share that
passed (a pass makes final its pick and the drafts that matched before the first that
failed, so accepted = tokens - passes, and each pass that corrected a draft failed one:
share = accepted / (accepted + corrected)). The first model is the reference: every
other model's answers must be its answers token for token (a draft head trained by
refusion_jax.drafter changes no answer); the script says how many differ.

  python benchmarks/drafter_acceptance.py --models W/models/refusion_bl/final_model,OUT/final_model
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


from configs.common import TINY_VALID  # noqa: E402
from refusion_jax import evaluate, loading, runtime  # noqa: E402
from refusion_jax.decode import engine  # noqa: E402
from refusion_jax.decode.settings import DecodeConfig  # noqa: E402


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--models", required=True, help="comma-separated model folders or shipped "
                 "names; the first is the reference")
  p.add_argument("--problems", default=TINY_VALID, help="JSONL of {'query', ...} problems")
  p.add_argument("--per_task", type=int, default=0, help="problems per task (0 = all)")
  p.add_argument("--gen_length", type=int, default=24)
  p.add_argument("--block_size", type=int, default=8, help="the lossless window")
  p.add_argument("--slot_size", type=int, default=4)
  p.add_argument("--slot_threshold", type=float, default=0.0)
  p.add_argument("--rows", type=int, default=16, help="engine rows")
  args = p.parse_args(argv)
  args.models = [loading.model_arg(p, m, "--models") for m in args.models.split(",") if m]
  if not args.models:
    p.error("--models names no model")
  return args


def decode(model_dir: str, problems, dc: DecodeConfig, rows: int):
  _, model = loading.load_model(model_dir, flag="--models")
  out = engine.Decoder(model, dc).engine(rows).run([list(p.prompt_ids) for p in problems])
  return out.results


def summary(results, idx) -> dict:
  tokens = sum(len(results[i].tokens) for i in idx)
  passes = sum(results[i].counters["nfe_b"] for i in idx)
  corrected = sum(results[i].counters["corrected_b"] for i in idx)
  accepted = tokens - passes
  return {"tpf": tokens / max(passes, 1), "accepted_per_pass": accepted / max(passes, 1),
          "acceptance": accepted / max(accepted + corrected, 1)}


def main(argv=None) -> dict:
  runtime.start_up()
  a = parse_args(argv)
  config, _ = loading.load_model(a.models[0], flag="--models")
  tokenizer = loading.load_tokenizer(a.models[0], config)
  problems = evaluate.read_problems(a.problems, tokenizer, per_task=a.per_task)
  dc = DecodeConfig(method="refusion", gen_length=a.gen_length, slot_size=a.slot_size,
                    block_size=a.block_size, slot_threshold=a.slot_threshold,
                    verify="lossless")
  runs = {m: decode(m, problems, dc, a.rows) for m in a.models}
  ref = runs[a.models[0]]
  tasks = sorted({p.task for p in problems})
  report = {}
  print(f"{len(problems)} problems, lossless window {a.block_size}, slot {a.slot_size}, "
        f"tau_s {a.slot_threshold:g}, greedy")
  print("| model | answers differing from the first | " + " | ".join(tasks)
        + " | all: tokens / forward | accepted drafts / pass | drafts passing |")
  print("|---|---|" + "---|" * len(tasks) + "---|---|---|")
  for m, res in runs.items():
    differ = sum(list(r.tokens) != list(x.tokens) for r, x in zip(res, ref))
    per = {t: summary(res, [i for i, p in enumerate(problems) if p.task == t]) for t in tasks}
    all_ = summary(res, range(len(problems)))
    report[m] = {"differ": differ, "per_task": per, "all": all_}
    print(f"| {m} | {differ} | " + " | ".join(f"{per[t]['tpf']:.2f}" for t in tasks)
          + f" | {all_['tpf']:.2f} | {all_['accepted_per_pass']:.2f} | "
          f"{all_['acceptance']:.1%} |")
  return report


if __name__ == "__main__":
  main()
