"""Lossless decoding against AR on this machine: measured, and the most it could be.

Lossless decoding (`decode.verify='lossless'`) returns AR's answer in fewer,
wider passes. Whether that is faster in wall-clock depends on what a wider
pass costs on the machine: on an accelerator at small batch a pass reads the
weights and costs about the same at width 1 and 16; on a CPU the arithmetic
grows with the width. This script measures, in one run, on the same prompts:

1. the bare forward pass (`forward_cost.time_width`) at width 1 and at each
   window, at `--rows` rows;
2. for AR and each window: tokens per pass, and tokens/s of the whole decode
   (prefill included) run as one compiled loop over the prompts, `--rows` at a
   time (no Python dispatch between calls: the decoders' own cost);
3. the **ceiling** of each window: tokens per pass x cost(width 1) / cost(window),
   the speed against AR of a lossless decoder whose passes cost their bare
   forward and no more, prefill left out. A ceiling below 1.00x means no
   implementation of the mode can beat AR at that window on this machine.

  python benchmarks/lossless_speed.py                      # refusion_tiny, batch 1
  python benchmarks/lossless_speed.py --rows 16            # 16 rows a pass (the engine's)
  python benchmarks/lossless_speed.py --model_dir W/models/refusion/final_model
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.forward_cost import time_width  # noqa: E402
from configs.common import TINY_TEST  # noqa: E402
from refusion_jax import evaluate, loading, runtime  # noqa: E402
from refusion_jax.decode import compiled, engine  # noqa: E402
from refusion_jax.decode.settings import DecodeConfig  # noqa: E402


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--model_dir", default="refusion_tiny",
                      help="model folder (refusion_jax or HF) or a shipped model's name")
  parser.add_argument("--problems", default=TINY_TEST, help="JSONL of {'query', ...} problems")
  parser.add_argument("--per_task", type=int, default=8, help="problems per task (0 = all)")
  parser.add_argument("--windows", default="4,8,16", help="lossless windows (block_size)")
  parser.add_argument("--slot_size", type=int, default=4)
  parser.add_argument("--slot_threshold", type=float, default=0.0)
  parser.add_argument("--gen_length", type=int, default=32)
  parser.add_argument("--rows", type=int, default=1, help="prompts decoded together")
  parser.add_argument("--repeats", type=int, default=3, help="timed runs; the fastest counts")
  args = parser.parse_args(argv)
  try:
    args.windows = [int(w) for w in args.windows.split(",")]
  except ValueError:
    parser.error(f"--windows must be comma-separated ints, got {args.windows!r}")
  for name in ("rows", "repeats", "gen_length", "slot_size"):
    if getattr(args, name) < 1:
      parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
  if not args.windows or min(args.windows) < 1:
    parser.error(f"--windows must be positive, got {args.windows}")
  args.model_dir = loading.model_arg(parser, args.model_dir)
  return args


def decode_all(decoder, ids_np, lens_np, rows: int, repeats: int) -> dict:
  """Every prompt decoded `rows` at a time inside one compiled loop: seconds (fastest of
  `repeats`), tokens and passes summed over the prompts."""
  n = ids_np.shape[0] // rows * rows
  ids = jnp.asarray(ids_np[:n].reshape(n // rows, rows, -1))
  lens = jnp.asarray(lens_np[:n].reshape(n // rows, rows))
  spec = decoder.spec_for(rows)

  @functools.partial(jax.jit, static_argnames=("graphdef", "spec"))
  def run(graphdef, params, ids, lens, knobs, spec):
    def body(i, acc):
      out, _ = compiled.generate.__wrapped__(graphdef, params, ids[i], lens[i],
                                             jnp.zeros(2, jnp.uint32), knobs, spec)
      return acc + jnp.stack([out.length_b.sum(), out.counters.nfe_b().sum()])
    return jax.lax.fori_loop(0, ids.shape[0], body, jnp.zeros(2, jnp.int32))

  call = lambda: run(decoder.static, decoder.flat, ids, lens, decoder.knobs, spec)
  tokens, passes = (int(x) for x in jax.block_until_ready(call()))
  best = float("inf")
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(call())
    best = min(best, time.perf_counter() - t0)
  return {"seconds": best, "tokens": tokens, "passes": passes}


def main(argv=None) -> list[dict]:
  runtime.start_up()
  args = parse_args(argv)
  config, model = loading.load_model(args.model_dir, flag="--model_dir")
  tokenizer = loading.load_tokenizer(args.model_dir, config)
  problems = evaluate.read_problems(args.problems, tokenizer, per_task=args.per_task)
  if len(problems) < args.rows:
    raise SystemExit(f"--rows {args.rows} needs at least that many problems, got "
                     f"{len(problems)}")
  width = max(len(p.prompt_ids) for p in problems)
  ids = np.zeros((len(problems), width), np.int32)
  for i, p in enumerate(problems):
    ids[i, :len(p.prompt_ids)] = p.prompt_ids
  lens = np.array([len(p.prompt_ids) for p in problems], np.int32)
  context = int(lens.mean()) + args.gen_length // 2
  print(f"device: {jax.devices()[0].device_kind}; {len(problems)} problems, {args.rows} "
        f"row(s) a pass, gen_length {args.gen_length}; bare passes against {context} "
        f"cached entries")

  bare = {w: 1e3 * time_width(model, w, args.rows, context, 200, args.repeats)
          for w in sorted({1, *args.windows})}
  configs = {"ar": (1, DecodeConfig(method="ar", gen_length=args.gen_length))}
  for w in args.windows:
    configs[f"lossless, window {w}"] = (w, DecodeConfig(
        method="refusion", gen_length=args.gen_length, slot_size=min(args.slot_size, w),
        block_size=w, slot_threshold=args.slot_threshold, verify="lossless"))
  rows = []
  for name, (w, dc) in configs.items():
    r = decode_all(engine.Decoder(model, dc), ids, lens, args.rows, args.repeats)
    r.update(name=name, width=w, tok_s=r["tokens"] / r["seconds"],
             tpf=r["tokens"] / r["passes"], bare_ms=bare[w])
    rows.append(r)
  ar = rows[0]
  print("| decoder | bare pass (ms) | tokens / pass | tokens/s | x AR | ceiling x AR |")
  print("|---|---|---|---|---|---|")
  for r in rows:
    r["x_ar"] = r["tok_s"] / ar["tok_s"]
    r["ceiling"] = r["tpf"] * bare[1] / r["bare_ms"]
    print(f"| {r['name']} | {r['bare_ms']:.3f} | {r['tpf']:.2f} | {r['tok_s']:.0f} | "
          f"{r['x_ar']:.2f}x | {r['ceiling']:.2f}x |")
  return rows


if __name__ == "__main__":
  main()
