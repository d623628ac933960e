"""Decode speed of ReFusion, AR and MDM side by side, in one process, same model size.

For every method and batch size: tokens/s (generated tokens counted up to and
including EOS, divided by the wall time of the jitted decode; compilation is
excluded by an untimed warm-up call), tokens per forward (tokens / NFE, every
pass counted), forward passes per row, and the memory of the compiled decode
program (XLA's buffer assignment: parameters + prompts + outputs + peak
temporaries, i.e. what the device must hold while the program runs; on a GPU
the allocator's `peak_bytes_in_use` is printed as well).

  python benchmarks/decode_speed.py                        # random tiny models
  python benchmarks/decode_speed.py --refusion_dir R --ar_dir A --mdm_dir M

Random models say nothing about accuracy, and their near-uniform predictions
rarely pass ReFusion's thresholds or produce EOS: only trained models give
meaningful tokens-per-forward figures.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from refusion_jax import checkpoint  # noqa: E402
from refusion_jax import config as config_lib  # noqa: E402
from refusion_jax.decode import autoregressive, mdm, refusion  # noqa: E402
from refusion_jax.model import Qwen3  # noqa: E402

MODULES = {"refusion": refusion, "ar": autoregressive, "mdm": mdm}


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--model_dir", default="",
                      help="one model folder for refusion and ar (unless set apart below)")
  parser.add_argument("--refusion_dir", default="", help="model folder for method refusion")
  parser.add_argument("--ar_dir", default="", help="model folder for method ar")
  parser.add_argument("--mdm_dir", default="", help="bidirectional model folder for mdm")
  parser.add_argument("--methods", default="refusion,ar,mdm", help="comma-separated")
  parser.add_argument("--batch_sizes", default="1,4,16,32", help="comma-separated")
  parser.add_argument("--prompt_len", type=int, default=32,
                      help="padded prompt width (rows get random lengths in [len/2, len])")
  parser.add_argument("--gen_length", type=int, default=64)
  parser.add_argument("--slot_size", type=int, default=8)
  parser.add_argument("--block_size", type=int, default=32)
  parser.add_argument("--slot_threshold", type=float, default=0.9)
  parser.add_argument("--token_threshold", type=float, default=0.4)
  parser.add_argument("--mdm_tokens_per_step", type=int, default=1)
  parser.add_argument("--mdm_threshold", type=float, default=None)
  parser.add_argument("--repeats", type=int, default=3, help="timed calls; the median is kept")
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args(argv)
  args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
  for m in args.methods:
    if m not in MODULES:
      parser.error(f"--methods: unknown method {m!r}; choose from {sorted(MODULES)}")
  try:
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b.strip()]
  except ValueError:
    parser.error(f"--batch_sizes must be comma-separated ints, got {args.batch_sizes!r}")
  if not args.batch_sizes or min(args.batch_sizes) <= 0:
    parser.error(f"--batch_sizes must be positive ints, got {args.batch_sizes}")
  for name in ("prompt_len", "gen_length", "repeats"):
    if getattr(args, name) <= 0:
      parser.error(f"--{name} must be > 0, got {getattr(args, name)}")
  for name in ("model_dir", "refusion_dir", "ar_dir", "mdm_dir"):
    path = getattr(args, name)
    if path and not os.path.isdir(path):
      parser.error(f"--{name}={path!r} does not exist")
  return args


def load_models(args):
  """`{method: model}`; random `config.tiny()` models (one causal, one bidirectional) by default."""
  models = {}
  shared = {}
  for method in args.methods:
    folder = getattr(args, f"{method}_dir") or (args.model_dir if method != "mdm" else "")
    if folder:
      if folder not in shared:
        if checkpoint.is_model_dir(folder):
          shared[folder] = checkpoint.load_model(folder)[1]
        else:
          from refusion_jax import hf  # pylint: disable=import-outside-toplevel
          shared[folder] = hf.load(folder)[1]
      models[method] = shared[folder]
    else:
      attention = "bidirectional" if method == "mdm" else "causal"
      if attention not in shared:
        shared[attention] = Qwen3(config_lib.tiny(attention=attention),
                                  rngs=nnx.Rngs(args.seed))
      models[method] = shared[attention]
  return models


def make_prompts(config, batch: int, width: int, seed: int):
  rng = np.random.default_rng(seed)
  specials = {config.mask_token_id, config.eos_token_id, config.bos_token_id,
              config.pad_token_id}
  ordinary = np.array([t for t in range(config.vocab_size) if t not in specials])
  lens_b = rng.integers(max(1, width // 2), width + 1, size=batch).astype(np.int32)
  ids_bp = np.zeros((batch, width), np.int32)
  for b in range(batch):
    ids_bp[b, :lens_b[b]] = rng.choice(ordinary, size=lens_b[b])
  return ids_bp, lens_b


@contextlib.contextmanager
def _capture_program(module, sink: list):
  """Records the compiled program's memory analysis of the next decode call.

  The decoders keep their jitted program in `module._decode_jit`; lowering it
  with the same arguments gives XLA's buffer assignment without running it.
  """
  jitted = module._decode_jit  # pylint: disable=protected-access

  class _Proxy:

    def __call__(self, *a, **kw):
      sink.append(jitted.lower(*a, **kw).compile().memory_analysis())
      return jitted(*a, **kw)

    def __getattr__(self, name):
      return getattr(jitted, name)

  module._decode_jit = _Proxy()  # pylint: disable=protected-access
  try:
    yield
  finally:
    module._decode_jit = jitted  # pylint: disable=protected-access


def program_bytes(stats) -> int:
  if stats is None:
    return 0
  peak = getattr(stats, "peak_memory_in_bytes", 0) or 0
  total = (stats.argument_size_in_bytes + stats.output_size_in_bytes
           + stats.temp_size_in_bytes - stats.alias_size_in_bytes)
  return max(peak, total)


def device_peak() -> int | None:
  stats = jax.devices()[0].memory_stats() or {}
  return stats.get("peak_bytes_in_use")


def bench_one(method, model, batch, args):
  dc = config_lib.DecodeConfig(
      method=method, gen_length=args.gen_length, slot_size=args.slot_size,
      block_size=args.block_size, slot_threshold=args.slot_threshold,
      token_threshold=args.token_threshold, mdm_tokens_per_step=args.mdm_tokens_per_step,
      mdm_threshold=args.mdm_threshold)
  module = MODULES[method]
  ids_bp, lens_b = make_prompts(model.config, batch, args.prompt_len, args.seed + batch)
  rng = jax.random.PRNGKey(args.seed)
  sink = []
  t = time.perf_counter()
  with _capture_program(module, sink):
    jax.block_until_ready(module.generate(model, ids_bp, lens_b, dc, rng))  # compile + warm-up
  compile_s = time.perf_counter() - t
  times = []
  for _ in range(args.repeats):
    t = time.perf_counter()
    out = jax.block_until_ready(module.generate(model, ids_bp, lens_b, dc, rng))
    times.append(time.perf_counter() - t)
  seconds = statistics.median(times)
  tokens = int(np.asarray(out.counters.tokens_b).sum())
  nfe_b = np.asarray(out.counters.nfe_b())
  return {
      "method": method, "batch": batch, "seconds": seconds, "compile_s": compile_s,
      "tokens": tokens, "tok_s": tokens / seconds, "tpf": tokens / max(int(nfe_b.sum()), 1),
      "nfe_row": float(nfe_b.mean()), "loop_passes": int(nfe_b.max()),
      "program_mb": program_bytes(sink[0] if sink else None) / 2**20,
      "device_peak_mb": (device_peak() or 0) / 2**20,
  }


def main(argv=None):
  args = parse_args(argv)
  models = load_models(args)
  device = jax.devices()[0]
  print(f"device: {device.platform} ({device.device_kind}), {jax.device_count()} device(s)")
  for method, model in models.items():
    c = model.config
    params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    print(f"{method:8s}: {c.num_layers} layers, d={c.hidden_size}, vocab {c.vocab_size}, "
          f"{c.attention}, {params / 1e6:.2f}M params")
  print(f"prompt width {args.prompt_len}, gen_length {args.gen_length}, slot {args.slot_size}, "
        f"block {args.block_size}, tau_s {args.slot_threshold}, tau_t {args.token_threshold}, "
        f"mdm {args.mdm_tokens_per_step}/step"
        + (f", mdm threshold {args.mdm_threshold}" if args.mdm_threshold is not None else "")
        + f"; median of {args.repeats} timed calls after a warm-up compile\n")
  rows = []
  for batch in args.batch_sizes:
    for method in args.methods:
      row = bench_one(method, models[method], batch, args)
      rows.append(row)
      print(f"  done {method} batch {batch} (compile {row['compile_s']:.1f}s)", file=sys.stderr,
            flush=True)
  gpu = any(r["device_peak_mb"] for r in rows)
  header = (f"{'method':9s}{'batch':>6s}{'tokens':>8s}{'tok/s':>11s}{'tok/fwd':>9s}"
            f"{'NFE/row':>9s}{'passes':>8s}{'sec':>9s}{'prog MB':>9s}"
            + (f"{'peak MB':>9s}" if gpu else ""))
  print(header)
  print("-" * len(header))
  for r in rows:
    print(f"{r['method']:9s}{r['batch']:>6d}{r['tokens']:>8d}{r['tok_s']:>11.1f}{r['tpf']:>9.2f}"
          f"{r['nfe_row']:>9.1f}{r['loop_passes']:>8d}{r['seconds']:>9.3f}{r['program_mb']:>9.1f}"
          + (f"{r['device_peak_mb']:>9.1f}" if gpu else ""))
  by = {(r["method"], r["batch"]): r for r in rows}
  print()
  for batch in args.batch_sizes:
    ref = by.get(("refusion", batch))
    for other in ("ar", "mdm"):
      if ref and (other, batch) in by:
        o = by[(other, batch)]
        print(f"batch {batch}: refusion / {other} tokens/s = {ref['tok_s'] / o['tok_s']:.2f}x, "
              f"memory = {ref['program_mb'] / o['program_mb']:.2f}x")
  for method in args.methods:
    first, last = by.get((method, args.batch_sizes[0])), by.get((method, args.batch_sizes[-1]))
    if first and last and first is not last:
      print(f"{method}: batch {last['batch']} / batch {first['batch']} tokens/s = "
            f"{last['tok_s'] / first['tok_s']:.2f}x")
  print("\nprog MB: XLA buffer assignment of the compiled decode program (parameters, prompts, "
        "outputs and peak temporaries, KV cache included).")


if __name__ == "__main__":
  main()
