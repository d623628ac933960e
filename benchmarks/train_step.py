"""Times one jitted train step: ReFusion's hybrid objective vs plain ARM.

Both steps run forward + backward + an optax AdamW update with donated
parameters and optimizer state, on the same model shapes and the same
batches, side by side in one process. TARGETS.md: hybrid <= 1.15x ARM.

  python benchmarks/train_step.py --layers 4 --d_model 128 --batch 16 --seq 256
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from refusion_jax import config as config_lib  # noqa: E402
from refusion_jax import objective as objective_lib  # noqa: E402
from refusion_jax import runtime  # noqa: E402
from refusion_jax.model import Transformer  # noqa: E402

TARGET_RATIO = 1.15


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--layers", type=int, default=4, help="decoder layers")
  parser.add_argument("--d_model", type=int, default=128, help="hidden size")
  parser.add_argument("--batch", type=int, default=16, help="examples per step")
  parser.add_argument("--seq", type=int, default=256, help="tokens per example (padded)")
  parser.add_argument("--steps", type=int, default=20, help="timed steps per objective")
  parser.add_argument("--warmup", type=int, default=2, help="untimed steps after compiling")
  parser.add_argument("--vocab", type=int, default=512, help="vocabulary size")
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args(argv)
  for name in ("layers", "d_model", "batch", "seq", "steps", "vocab"):
    if getattr(args, name) <= 0:
      parser.error(f"--{name} must be > 0, got {getattr(args, name)}")
  if args.warmup < 0:
    parser.error(f"--warmup must be >= 0, got {args.warmup}")
  if args.d_model % 32:
    parser.error(f"--d_model must be a multiple of 32 (head_dim 32), got {args.d_model}")
  if args.seq < 8:
    parser.error(f"--seq must be >= 8, got {args.seq}")
  return args


def make_config(args) -> config_lib.ModelConfig:
  heads = args.d_model // 32
  return config_lib.tiny(
      num_layers=args.layers, hidden_size=args.d_model, num_heads=heads,
      num_kv_heads=max(1, heads // 2) if heads % 2 == 0 else heads, head_dim=32,
      mlp_dim=3 * args.d_model, vocab_size=args.vocab,
      max_position_embeddings=max(1024, args.seq))


def make_batches(args, config, count: int):
  """Random chat-like batches: prompts of 1/8-1/2 of the row, response up to the end."""
  rng = np.random.default_rng(args.seed)
  batches = []
  for _ in range(count):
    tokens = np.full((args.batch, args.seq), config.pad_token_id, np.int32)
    prompt = rng.integers(max(1, args.seq // 8), args.seq // 2 + 1, args.batch).astype(np.int32)
    response = np.array([rng.integers(max(1, (args.seq - p) // 2), args.seq - p + 1)
                         for p in prompt], np.int32)
    for b in range(args.batch):
      tokens[b, :prompt[b] + response[b]] = rng.integers(4, config.vocab_size,
                                                         prompt[b] + response[b])
    objective_lib.check_batch({"tokens": tokens, "prompt_len": prompt, "response_len": response})
    batches.append({"tokens": jnp.asarray(tokens), "prompt_len": jnp.asarray(prompt),
                    "response_len": jnp.asarray(response)})
  return batches


def make_step(graphdef, tx, objective: str, config):
  def step(params, opt_state, batch, rng):
    def loss_of(p):
      return objective_lib.loss_fn(nnx.merge(graphdef, p), batch, rng, objective=objective,
                                   mask_id=config.mask_token_id, pad_id=config.pad_token_id)

    (loss, metrics), grads = jax.value_and_grad(loss_of, has_aux=True)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, metrics

  return jax.jit(step, donate_argnums=(0, 1))


def timed_step(state, batch, rng):
  """Runs one step to completion; returns (seconds, new state, loss)."""
  step, params, opt_state = state
  t0 = time.perf_counter()
  params, opt_state, metrics = step(params, opt_state, batch, rng)
  jax.block_until_ready((params, opt_state, metrics))
  return time.perf_counter() - t0, (step, params, opt_state), float(metrics["loss"])


def main(argv=None):
  runtime.start_up()  # the entry points' start-up: no libtpu errors where no TPU is
  args = parse_args(argv)
  config = make_config(args)
  batches = make_batches(args, config, count=4)
  tx = optax.adamw(1e-3, weight_decay=0.0)
  states, compile_s = {}, {}
  for objective in ("arm", "refusion"):
    model = Transformer(config, rngs=nnx.Rngs(args.seed))
    graphdef, params = nnx.split(model, nnx.Param)
    step = make_step(graphdef, tx, objective, config)
    opt_state = tx.init(params)
    t0 = time.perf_counter()
    params, opt_state, metrics = step(params, opt_state, batches[0], jax.random.key(0))
    jax.block_until_ready(metrics)
    compile_s[objective] = time.perf_counter() - t0
    for i in range(args.warmup):
      params, opt_state, metrics = step(params, opt_state, batches[i % len(batches)],
                                        jax.random.key(i + 1))
    jax.block_until_ready(metrics)
    states[objective] = (step, params, opt_state)

  # Steps alternate between the objectives (order flipped every round) and the
  # median is reported, so load from other processes hits both alike.
  times = {"arm": [], "refusion": []}
  rng = jax.random.key(args.seed + 1)
  for i in range(args.steps):
    rng, key = jax.random.split(rng)
    order = ("arm", "refusion") if i % 2 == 0 else ("refusion", "arm")
    for objective in order:
      seconds, states[objective], loss = timed_step(states[objective],
                                                    batches[i % len(batches)], key)
      if not np.isfinite(loss):
        raise RuntimeError(f"{objective}: non-finite loss {loss} at step {i}")
      times[objective].append(seconds)
  best = {k: float(np.median(v)) for k, v in times.items()}
  fastest = {k: float(np.min(v)) for k, v in times.items()}

  tokens = args.batch * args.seq
  print(f"device: {jax.devices()[0].device_kind} x{jax.device_count()}  "
        f"params: {config.num_params():,}  layers={args.layers} d_model={args.d_model} "
        f"batch={args.batch} seq={args.seq} steps={args.steps}")
  print("ms/step is the median over steps, (min) the fastest step")
  print(f"{'objective':<10} {'ms/step':>9} {'(min)':>9} {'tokens/s':>11} {'ratio':>7} "
        f"{'1st call s':>10}")
  for objective in ("arm", "refusion"):
    ms = 1e3 * best[objective]
    ratio = best[objective] / best["arm"]
    print(f"{objective:<10} {ms:9.2f} {1e3 * fastest[objective]:9.2f} "
          f"{tokens / best[objective]:11.0f} {ratio:7.3f} {compile_s[objective]:10.2f}")
  ratio = best["refusion"] / best["arm"]
  verdict = "meets" if ratio <= TARGET_RATIO else "misses"
  print(f"hybrid / ARM = {ratio:.3f} ({verdict} the <= {TARGET_RATIO} target)")
  return ratio


if __name__ == "__main__":
  main()
