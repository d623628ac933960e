"""Cost of one forward pass against the KV buffer, by chunk width.

Every decoder here is a loop of forward passes against a static KV buffer:
AR feeds 1 token per pass, ReFusion feeds a whole block (its plan,
verification and infill passes), MDM re-runs the whole sequence. Whether
ReFusion's tokens per forward turn into tokens per second depends on how a
pass's cost grows with its width: on an accelerator at batch 1 a pass is
bound by reading the weights, so a 32-token pass costs about what a 1-token
pass costs; on a CPU the arithmetic dominates and the cost grows with the
width. This script measures that curve on the machine it runs on.

Each width is timed inside one compiled `lax.fori_loop` of `--passes`
forwards (no Python dispatch between passes), best of `--repeats` runs.

  python benchmarks/forward_cost.py                          # the repro_tiny model shape, random
  python benchmarks/forward_cost.py --model_dir W/models/refusion/final_model
  python benchmarks/forward_cost.py --model_dir refusion_tiny        # the shipped model
  python benchmarks/forward_cost.py --preset release_tiny --batch 16   # the release's tiny shape
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from refusion_jax import config as config_lib  # noqa: E402
from refusion_jax import loading, runtime  # noqa: E402
from refusion_jax import masks  # noqa: E402
from refusion_jax.decode import common  # noqa: E402
from refusion_jax.model import Transformer  # noqa: E402
from benchmarks.decode_speed import PRESETS  # noqa: E402


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--model_dir", default="", help="model folder (refusion_jax or HF) or a "
                      "shipped model's name ('' = a random model of the repro_tiny shape: 4 "
                      "layers, d=128)")
  parser.add_argument("--preset", default="", choices=["", *PRESETS],
                      help="random model of a named shape (benchmarks/decode_speed.py's "
                           "presets) instead of the repro_tiny shape")
  parser.add_argument("--widths", default="1,2,4,8,16,24,32", help="chunk widths, comma-separated")
  parser.add_argument("--batch", type=int, default=1, help="rows per pass")
  parser.add_argument("--context", type=int, default=40, help="live cache entries per row")
  parser.add_argument("--passes", type=int, default=200, help="forwards per timed loop")
  parser.add_argument("--repeats", type=int, default=3, help="timed loops; the fastest counts")
  args = parser.parse_args(argv)
  try:
    widths = [int(w) for w in args.widths.split(",")]
  except ValueError:
    parser.error(f"--widths must be comma-separated ints, got {args.widths!r}")
  if not widths or min(widths) < 1:
    parser.error(f"--widths must be positive, got {args.widths!r}")
  for name in ("batch", "context", "passes", "repeats"):
    if getattr(args, name) < 1:
      parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
  if args.preset and args.model_dir:
    parser.error("--preset and --model_dir exclude each other")
  args.model_dir = loading.model_arg(parser, args.model_dir)  # a shipped name, or a folder
  args.widths = widths
  return args


def load(model_dir: str, preset: str = ""):
  if model_dir:
    _, model = loading.load_model(model_dir, flag="--model_dir")
    return model
  config = config_lib.tiny(**PRESETS[preset]) if preset else config_lib.tiny(num_layers=4)
  return Transformer(config, rngs=nnx.Rngs(0))


def time_width(model, width: int, batch: int, context: int, passes: int,
               repeats: int) -> float:
  """Seconds per forward pass of a `[batch, width]` chunk against `context` cached entries."""
  config = model.config
  if context + width > config.max_position_embeddings:
    raise ValueError(f"--context {context} + width {width} exceeds the model's "
                     f"max_position_embeddings={config.max_position_embeddings}")
  graphdef, state = common.split_model(model)

  @jax.jit
  def loop(state, cache):
    m = common.merge_model(graphdef, state)
    ids_bt = jnp.zeros((batch, width), jnp.int32)
    positions_bt = jnp.broadcast_to(context + jnp.arange(width, dtype=jnp.int32), (batch, width))
    mask_btt = jnp.broadcast_to(masks.causal_tt(width), (batch, width, width))

    def body(_, acc):
      # The carried sum feeds the next pass's ids so XLA cannot hoist the pass out.
      ids = ids_bt + (acc > 1e30).astype(jnp.int32)
      logits_btv, _, _ = m.forward_chunk(ids, positions_bt, cache, mask_btt)
      return acc + logits_btv[0, -1, 0].astype(jnp.float32)

    return jax.lax.fori_loop(0, passes, body, jnp.float32(0))

  cache = common.init_cache(config, batch, context + width)
  cache = cache.replace(length_b=jnp.full((batch,), context, jnp.int32))
  jax.block_until_ready(loop(state, cache))  # compile
  best = float("inf")
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(loop(state, cache))
    best = min(best, time.perf_counter() - t0)
  return best / passes


def main(argv=None) -> list[dict]:
  runtime.start_up()  # the entry points' start-up: no libtpu errors where no TPU is
  args = parse_args(argv)
  model = load(args.model_dir, args.preset)
  c = model.config
  print(f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}); model: "
        f"{c.num_layers} layers, d={c.hidden_size}, vocab {c.vocab_size}; batch {args.batch}, "
        f"{args.context} cached entries; best of {args.repeats} x {args.passes} passes")
  rows = []
  for width in args.widths:
    seconds = time_width(model, width, args.batch, args.context, args.passes, args.repeats)
    rows.append({"width": width, "ms_per_pass": 1e3 * seconds})
  base = rows[0]["ms_per_pass"]
  print(f"| chunk width | ms / pass | vs width {args.widths[0]} | ms / token fed |")
  print("|---|---|---|---|")
  for r in rows:
    print(f"| {r['width']} | {r['ms_per_pass']:.3f} | {r['ms_per_pass'] / base:.2f}x | "
          f"{r['ms_per_pass'] / r['width']:.3f} |")
  return rows


if __name__ == "__main__":
  main()
