"""What an RL step costs per sample, beside a supervised step per sample (one process).

RL (`refusion_jax.rl`, GRPO): the engine's rollouts (sampled, recorded) + rewards + the
policy step (the replay forward and backward of every rollout, the reference forward,
the optimizer update), per rollout; the median over steps after `--warmup` (a step
that meets a new layout size compiles). Supervised: the ReFusion objective's jitted
train step (forward, backward, AdamW) on the same model, with as many training rows
per step as the RL step has rollouts, per row; the median over `--steps` steps, run
before and after the RL steps. The issue's target: RL at most ~3x supervised.

  python benchmarks/rl_step.py --model_dir W/models/refusion/final_model --steps 12
  python benchmarks/rl_step.py --model_dir W/models/refusion_bl/final_model --lossless

`--lossless`: the rollouts of configs/rl_lossless.py (the model's AR samples, scored by one
causal forward) instead of the release decoder's replayed record.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from configs import rl_lossless, rl_tiny  # noqa: E402
from configs.common import TINY_TRAIN  # noqa: E402
from refusion_jax import data, distill, loading, objective, runtime  # noqa: E402
from refusion_jax.rl import trainer  # noqa: E402
from refusion_jax.tokenizer import Tokenizer  # noqa: E402


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--model_dir", required=True, help="a ReFusion model folder (the miniature's)")
  p.add_argument("--steps", type=int, default=12, help="timed steps of each kind")
  p.add_argument("--warmup", type=int, default=3, help="RL steps not timed")
  p.add_argument("--prompts_per_step", type=int, default=8)
  p.add_argument("--group_size", type=int, default=8)
  p.add_argument("--seq_len", type=int, default=64, help="supervised rows' length")
  p.add_argument("--beta", type=float, default=0.04, help="KL weight (0: no reference forward)")
  p.add_argument("--lossless", action="store_true", help="lossless rollouts "
                 "(configs/rl_lossless.py)")
  args = p.parse_args(argv)
  args.model_dir = loading.model_arg(p, args.model_dir)  # a shipped model's name, or a folder
  return args


def supervised_times(model_dir, rows_per_step, seq_len, steps):
  config, model = loading.load_model(model_dir, flag="--model_dir")
  tok = Tokenizer.tiny()
  tokens, plens, _, _ = distill.encode_rows(list(data.iter_examples([TINY_TRAIN])), tok,
                                            seq_len, config.eos_token_id)
  # ReFusion's rows: the answer and its EOS are the response, the rest padding.
  rlens = np.asarray([int(np.argmax(row[p:] == config.eos_token_id)) + 1
                      for row, p in zip(tokens, plens)], np.int32)
  for i, (p, r) in enumerate(zip(plens, rlens)):
    tokens[i, p + r:] = config.pad_token_id
  graphdef, params = nnx.split(model, nnx.Param)
  tx = optax.adamw(1e-5)
  opt_state = tx.init(params)

  @jax.jit
  def step(params, opt_state, batch, rng):
    def loss_of(p):
      return objective.loss_fn(nnx.merge(graphdef, p), batch, rng, objective="refusion",
                               mask_id=config.mask_token_id, pad_id=config.pad_token_id)
    (_, metrics), grads = jax.value_and_grad(loss_of, has_aux=True)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, metrics

  out = []
  for i in range(steps + 1):
    pick = np.random.default_rng(i).choice(len(tokens), rows_per_step, replace=False)
    batch = {"tokens": jnp.asarray(tokens[pick]), "prompt_len": jnp.asarray(plens[pick]),
             "response_len": jnp.asarray(rlens[pick])}
    t0 = time.perf_counter()
    params, opt_state, metrics = step(params, opt_state, batch, jax.random.key(i))
    jax.block_until_ready(metrics)
    if i:  # the first one compiles
      out.append(time.perf_counter() - t0)
  return out


def main(argv=None):
  runtime.start_up()  # the entry points' start-up: no libtpu errors where no TPU is
  a = parse_args(argv)
  n = a.prompts_per_step * a.group_size
  sup = supervised_times(a.model_dir, n, a.seq_len, a.steps)
  with tempfile.TemporaryDirectory() as out:
    c = (rl_lossless if a.lossless else rl_tiny).get_config()
    c.model_dir, c.output_dir = a.model_dir, out
    c.steps, c.save_every = a.warmup + a.steps, 10 ** 6
    c.prompts_per_step, c.group_size = a.prompts_per_step, a.group_size
    c.micro_batch = n  # one policy-step program for the step's rollouts
    c.beta = a.beta
    trainer.run(c, progress=False)
    lines = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl"), encoding="utf-8")]
  sup += supervised_times(a.model_dir, n, a.seq_len, a.steps)
  lines = lines[a.warmup:]
  roll = float(np.median([x["rollout_s"] for x in lines])) / n
  upd = float(np.median([x["update_s"] for x in lines])) / n
  total = float(np.median([x["rollout_s"] + x["update_s"] for x in lines])) / n
  per_row = float(np.median(sup)) / n
  print(f"{n} samples a step; medians over {len(lines)} RL steps and {len(sup)} supervised "
        f"steps; jax {jax.__version__}, {jax.devices()[0].platform}")
  print("| step | ms per sample |")
  print("|---|---|")
  what = ("lossless, sampled + recorded", "causal fwd+bwd") if a.lossless else (
      "sampled + recorded", "replay fwd+bwd")
  print(f"| RL rollout (engine, {what[0]}) | {1e3 * roll:.2f} |")
  print(f"| RL policy step ({what[1]}, reference fwd, update) | {1e3 * upd:.2f} |")
  print(f"| RL total | {1e3 * total:.2f} |")
  print(f"| supervised ReFusion step (seq {a.seq_len}) | {1e3 * per_row:.2f} |")
  print(f"| ratio RL / supervised | {total / per_row:.2f}x |")
  print(f"mean tokens per forward of the rollouts: "
        f"{np.mean([x['tokens_per_forward'] for x in lines]):.2f}")


if __name__ == "__main__":
  main()
