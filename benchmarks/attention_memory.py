"""Per-chip scratch memory of a training step's loss and gradients: einsum vs splash attention.

Compiles (for a Cloud TPU slice, without a TPU: libtpu's topology description)
the gradient of the ReFusion loss of a model with the preset's layer shapes,
once with `attention_impl="xla"` and once with "splash", for each sequence
length, and prints XLA's memory_analysis() per chip. Layers are scanned, so
the depth barely changes the compile time; `--layers` sets how many.

  python benchmarks/attention_memory.py --preset=qwen3_0_6b --layers=2 --seqs=2048,4096
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from refusion_jax import config as config_lib  # noqa: E402
from refusion_jax import objective, sharding  # noqa: E402
from refusion_jax.attention_kernels import SPLASH_BLOCK  # noqa: E402
from refusion_jax.model import Transformer  # noqa: E402

GIB = 2**30


def _ints(text: str) -> list[int]:
  try:
    return [int(x) for x in text.split(",") if x]
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--preset", default="qwen3_0_6b", choices=sorted(config_lib.PRESETS),
                      help="layer shapes (heads, widths, vocabulary)")
  parser.add_argument("--layers", type=int, default=2, help="decoder layers (scanned)")
  parser.add_argument("--topology", default="v5e:2x2", help="TPU topology name, e.g. v5p:2x2x1")
  parser.add_argument("--rows_per_chip", type=int, default=1, help="batch rows per chip (fsdp)")
  parser.add_argument("--seqs", type=_ints, default=[1024, 2048, 4096],
                      help="comma-separated sequence lengths (multiples of 128)")
  parser.add_argument("--remat", default="full", choices=config_lib.REMAT_POLICIES)
  args = parser.parse_args(argv)
  if args.layers <= 0 or args.rows_per_chip <= 0:
    parser.error("--layers and --rows_per_chip must be > 0")
  bad = [s for s in args.seqs if s <= 0 or s % SPLASH_BLOCK]
  if bad or not args.seqs:
    parser.error(f"--seqs must be positive multiples of {SPLASH_BLOCK}, got {args.seqs}")
  return args


def compile_step(model_config, mesh, rows: int, seq: int):
  """The compiled gradient of the ReFusion loss on `rows` x `seq` tokens, and its seconds."""
  rules = sharding.ShardingRules()
  graphdef, abstract = nnx.split(nnx.eval_shape(
      lambda: Transformer(model_config, rngs=nnx.Rngs(0))))
  state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                       abstract, sharding.state_shardings(abstract, mesh, rules))
  per_row = sharding.data_sharding(mesh, rules, 1)
  batch = {"tokens": jax.ShapeDtypeStruct((rows, seq), jnp.int32,
                                          sharding=sharding.data_sharding(mesh, rules)),
           "prompt_len": jax.ShapeDtypeStruct((rows,), jnp.int32, sharding=per_row),
           "response_len": jax.ShapeDtypeStruct((rows,), jnp.int32, sharding=per_row)}
  mask_id = model_config.mask_token_id or 0
  pad_id = model_config.pad_token_id or 0

  def step(state, batch):
    with sharding.use_mesh(mesh, rules):
      def loss(m):
        return objective.loss_fn(m, batch, jax.random.key(0), objective="refusion",
                                 mask_id=mask_id, pad_id=pad_id, loss_chunk=512)[0]
      return nnx.value_and_grad(loss)(nnx.merge(graphdef, state))

  start = time.perf_counter()
  compiled = jax.jit(step).lower(state, batch).compile()
  return compiled, time.perf_counter() - start


def main(argv=None) -> list[dict]:
  args = parse_args(argv)
  from jax.experimental import topologies  # pylint: disable=import-outside-toplevel
  devices = topologies.get_topology_desc(platform="tpu", topology_name=args.topology).devices
  mesh = sharding.make_mesh(data=1, fsdp=-1, tensor=1, devices=devices)
  rows = args.rows_per_chip * len(devices)
  rows_out = []
  print(f"{args.preset} shapes, {args.layers} scanned layers, remat={args.remat}, bf16, "
        f"{args.topology} ({len(devices)} chips, fsdp), {args.rows_per_chip} row(s) per chip, "
        "loss_chunk=512")
  print("| seq | impl | temp GiB/chip | args GiB/chip | compile s |")
  print("|---|---|---|---|---|")
  for seq in args.seqs:
    for impl in ("xla", "splash"):
      model_config = config_lib.get_preset(
          args.preset, num_layers=args.layers, scan_layers=True, remat=args.remat,
          dtype="bfloat16", max_position_embeddings=max(seq, 1024), attention_impl=impl,
          mask_token_id=0, pad_token_id=0)
      compiled, seconds = compile_step(model_config, mesh, rows, seq)
      memory = compiled.memory_analysis()
      row = {"seq": seq, "impl": impl, "temp_bytes": int(memory.temp_size_in_bytes),
             "argument_bytes": int(memory.argument_size_in_bytes), "compile_s": seconds}
      rows_out.append(row)
      print(f"| {seq} | {impl} | {row['temp_bytes'] / GIB:.3f} | "
            f"{row['argument_bytes'] / GIB:.3f} | {seconds:.1f} |", flush=True)
  return rows_out


if __name__ == "__main__":
  main()
