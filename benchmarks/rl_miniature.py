"""ReFusion + RL in the miniature: GRPO from the fine-tuned model, then both decoded alike.

First the headroom: the starting model's rollouts (`--group_size` samples of each of
`--headroom_per_task` training problems per task, at the rollout temperature): per
task the mean reward, pass@G, and the share of groups whose rewards are all equal
(GRPO's advantage is zero there: no signal). Then trains `configs/rl_tiny.py`
(overrides below; `--train_policy` model, selector or both) from `--model_dir` on the
training split's exact-match rewards, and evaluates the starting model and the trained
one with the same greedy ReFusion decode (the threshold planner, or the learnt selection
policy; and left to right) on the validation and test splits. Prints per-task
accuracy and tokens per forward, and the reward curve (mean reward of the rollouts per
`--curve_every` steps).

  python benchmarks/rl_miniature.py --model_dir W/models/refusion/final_model \\
      --workdir /tmp/rl_mini --steps 150 --learning_rate 2e-5

`--lossless`: rollouts from the lossless sampler (configs/rl_lossless.py: the model's AR
samples, window `--block_size`, every slot drafted at `--slot_threshold 0`), and both
models evaluated by greedy lossless decoding (the AR answer) at the same settings.

  python benchmarks/rl_miniature.py --lossless --block_size 8 --slot_threshold 0 \\
      --model_dir W/models/refusion_bl/final_model --workdir /tmp/rl_lossless
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from configs import rl_tiny  # noqa: E402
from configs.common import TINY_TEST, TINY_VALID  # noqa: E402
from refusion_jax import evaluate, loading, runtime  # noqa: E402
from refusion_jax.decode.settings import DecodeConfig  # noqa: E402
from refusion_jax.rl import trainer  # noqa: E402
from refusion_jax.tokenizer import Tokenizer  # noqa: E402


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--model_dir", required=True, help="the miniature's ReFusion model folder (or "
                 "a shipped model's name)")
  p.add_argument("--workdir", required=True, help="RL output folder (resumed when it exists)")
  p.add_argument("--steps", type=int, default=150)
  p.add_argument("--learning_rate", type=float, default=2e-5)
  p.add_argument("--beta", type=float, default=0.04)
  p.add_argument("--temperature", type=float, default=1.0, help="rollout temperature")
  p.add_argument("--group_size", type=int, default=8)
  p.add_argument("--prompts_per_step", type=int, default=8)
  p.add_argument("--speed_weight", type=float, default=0.0)
  p.add_argument("--slot_size", type=int, default=4, help="rollouts' (and evaluation's) k")
  p.add_argument("--block_size", type=int, default=24)
  p.add_argument("--eval_decode_from", default="",
                 help="a results JSON of the main job (W/results/ReFusion.json): its per-task "
                      "decode settings for the parallel rows instead of the rollouts'")
  p.add_argument("--slot_threshold", type=float, default=0.9)
  p.add_argument("--token_threshold", type=float, default=0.4)
  p.add_argument("--per_task", type=int, default=0, help="problems per task evaluated (0: all)")
  p.add_argument("--curve_every", type=int, default=10)
  p.add_argument("--splits", default="valid,test")
  p.add_argument("--train_policy", default="model", choices=["model", "selector", "both"])
  p.add_argument("--lossless", action="store_true", help="rollouts and evaluation by "
                 "lossless decoding (decode.verify='lossless')")
  p.add_argument("--headroom_per_task", type=int, default=30,
                 help="training problems per task whose rollouts measure the headroom (0: skip)")
  args = p.parse_args(argv)
  args.model_dir = loading.model_arg(p, args.model_dir)  # a shipped model's name, or a folder
  return args


def _eval(model_dir, data, dc, per_task):
  tok = Tokenizer.tiny()
  _, model = loading.load_model(model_dir, flag="--model_dir")
  problems = evaluate.read_problems(data, tok, per_task=per_task)
  return evaluate.evaluate(model, tok, problems, dc, batch_size=16, speed_per_task=0,
                           progress=False)


def headroom(a, c):
  """Per task: mean reward, pass@G and the share of all-equal groups of the start model's
  rollouts, decoded as the trainer's first step decodes them."""
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel

  from refusion_jax import tasks  # pylint: disable=import-outside-toplevel
  from refusion_jax.decode import engine  # pylint: disable=import-outside-toplevel
  tok = Tokenizer.tiny()
  _, model = loading.load_model(a.model_dir, flag="--model_dir")
  problems = evaluate.read_problems(c.train_file, tok, per_task=a.headroom_per_task)
  dc = trainer.decode_config_of(c)
  prompts = [list(p.prompt_ids) for p in problems for _ in range(a.group_size)]
  run = engine.Decoder(model, dc, method="refusion").engine(16).run(
      prompts, rng=jax.random.key(c.seed))
  ok = np.asarray([tasks.score(p.query, tok.decode(r.tokens, skip_special_tokens=True))
                   for p, r in zip([p for p in problems for _ in range(a.group_size)],
                                   run.results)], np.float32).reshape(len(problems), -1)
  print(f"\nheadroom: the start model's rollouts ({a.group_size} per problem, temperature "
        f"{dc.temperature}, {a.headroom_per_task} training problems per task)")
  print("| task | mean reward | pass@G | groups all equal (no signal) |")
  print("|---|---|---|---|")
  out = {}
  for task in sorted({p.task for p in problems}):
    rows = ok[[i for i, p in enumerate(problems) if p.task == task]]
    flat = float((rows.min(1) == rows.max(1)).mean())
    out[task] = {"mean": float(rows.mean()), "pass_at_g": float(rows.max(1).mean()),
                 "all_equal": flat}
    print(f"| {task} | {rows.mean():.2f} | {rows.max(1).mean():.2f} | {flat:.2f} |")
  return out


def main(argv=None):
  runtime.start_up()  # the entry points' start-up: no libtpu errors where no TPU is
  a = parse_args(argv)
  c = rl_tiny.get_config()
  c.model_dir, c.output_dir, c.steps = a.model_dir, a.workdir, a.steps
  c.learning_rate, c.beta, c.decode.temperature = a.learning_rate, a.beta, a.temperature
  c.group_size, c.prompts_per_step, c.speed_weight = a.group_size, a.prompts_per_step, a.speed_weight
  c.decode.slot_threshold, c.decode.token_threshold = a.slot_threshold, a.token_threshold
  c.decode.slot_size, c.decode.block_size = a.slot_size, a.block_size
  c.micro_batch = min(16, a.group_size * a.prompts_per_step)
  c.save_every = max(1, a.steps // 3)
  c.train_policy = a.train_policy
  if a.lossless:
    c.decode.verify = "lossless"
  room = headroom(a, c) if a.headroom_per_task else None
  result = trainer.run(c)
  lines = [json.loads(x) for x in open(os.path.join(a.workdir, "metrics.jsonl"),
                                       encoding="utf-8")]
  print("\nreward curve (rollouts at the training temperature; mean per "
        f"{a.curve_every} steps)")
  entropy = "token_entropy" if "token_entropy" in lines[0] else "plan_entropy"
  print(f"| steps | reward | accuracy | tokens/forward | KL | {entropy.replace('_', ' ')} |")
  print("|---|---|---|---|---|---|")
  for i in range(0, len(lines), a.curve_every):
    part = lines[i:i + a.curve_every]
    mean = lambda k: sum(x[k] for x in part) / len(part)  # noqa: E731
    print(f"| {part[0]['step']}-{part[-1]['step']} | {mean('reward_mean'):.3f} | "
          f"{mean('accuracy'):.3f} | {mean('tokens_per_forward'):.2f} | {mean('kl'):.4f} | "
          f"{mean(entropy):.3f} |")
  base = dict(gen_length=c.decode.gen_length, slot_size=c.decode.slot_size,
              block_size=c.decode.block_size, slot_threshold=a.slot_threshold,
              token_threshold=a.token_threshold)
  parallel = DecodeConfig(**base, verify="lossless" if a.lossless else "off")
  if a.eval_decode_from:
    with open(a.eval_decode_from, encoding="utf-8") as f:
      parallel = {t: DecodeConfig(**v) for t, v in json.load(f)["decode"].items()}
  rows = ({"lossless": parallel} if a.lossless else
          {"parallel": parallel, "left_to_right": DecodeConfig(**base, left_to_right=True)})
  learnt = {}
  if "plan_weights" in result:
    w = tuple(result["plan_weights"])
    learnt["policy"] = ({t: d.replace(planner="policy", plan_weights=w)
                         for t, d in parallel.items()} if isinstance(parallel, dict)
                        else parallel.replace(planner="policy", plan_weights=w))
  report = {"rl": result, "curve": lines, "eval": {}, "headroom": room}
  splits = {"valid": TINY_VALID, "test": TINY_TEST}
  for split in a.splits.split(","):
    print(f"\n{split}: greedy decode, the same settings for both models")
    print("| model | decode | accuracy | tokens/forward | per task |")
    print("|---|---|---|---|---|")
    for name, path in (("start", a.model_dir), ("rl", result["final_model"] or a.model_dir)):
      for row, dc in (rows if name == "start" else dict(rows, **learnt)).items():
        r = _eval(path, splits[split], dc, a.per_task)
        report["eval"][f"{split}/{name}/{row}"] = {"average": r["average"], "per_task": {
            t: {k: m[k] for k in ("accuracy", "tokens_per_forward")}
            for t, m in r["per_task"].items()}}
        per = ", ".join(f"{t} {m['accuracy']:.0f}" for t, m in r["per_task"].items())
        print(f"| {name} | {row} | {r['average']['accuracy']:.1f} | "
              f"{r['average']['tokens_per_forward']:.2f} | {per} |")
  with open(os.path.join(a.workdir, "rl_miniature.json"), "w", encoding="utf-8") as f:
    json.dump(report, f, indent=1)


if __name__ == "__main__":
  main()
