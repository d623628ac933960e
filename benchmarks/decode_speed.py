"""Decode speed of ReFusion, AR, MDM and BD3-LM side by side, in one process, same model size.

Every batch size decodes the same prompts (as many as the largest batch), a
batch at a time, so the ratios compare identical work. For every method and
batch size: tokens/s (generated tokens counted up to and including EOS,
divided by the summed wall time of the jitted decode calls, each the median
of --repeats; compilation is excluded by an untimed warm-up call), tokens per forward (tokens / NFE, every
pass counted), forward passes per row, and the memory of the compiled decode
program (XLA's buffer assignment: parameters + prompts + outputs + peak
temporaries, i.e. what the device must hold while the program runs; on a GPU
the allocator's `peak_bytes_in_use` is printed as well).

  python benchmarks/decode_speed.py                        # random tiny models
  python benchmarks/decode_speed.py --refusion_dir R --ar_dir A --mdm_dir M
  python benchmarks/decode_speed.py --preset qwen3_0_6b --memory_only   # any machine
  python benchmarks/decode_speed.py --preset qwen3_0_6b --prompt_len 256 --gen_length 256 \
      --engine_prompts 0 --no_fixed_cost --batch_sizes 1,4    # a GPU: ~5 min, mostly compiles

`--memory_only` compiles each decode program from shapes alone (no weights are
created, nothing runs) and prints its buffer assignment beside AR's: the
memory comparison of a full-size model on a machine that could not hold it.

Random models say nothing about accuracy, and their near-uniform predictions
rarely pass ReFusion's thresholds or produce EOS: only trained models give
meaningful tokens-per-forward figures.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from refusion_jax import config as config_lib  # noqa: E402
from refusion_jax import loading, runtime  # noqa: E402
from refusion_jax.decode import compiled as compiled_lib  # noqa: E402
from refusion_jax.decode import engine  # noqa: E402
from refusion_jax.decode.settings import DecodeConfig
from refusion_jax.model import Transformer  # noqa: E402

METHODS = ("refusion", "ar", "mdm", "bd3lm")
# The release's tiny test model (2 layers, d=64, 4 query / 2 KV heads, vocab 256).
PRESETS = {"release_tiny": dict(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2,
                                head_dim=16, mlp_dim=128, vocab_size=256, tie_embeddings=False),
           # Qwen3-0.6B's shapes (random weights), bf16: for accelerators.
           "qwen3_0_6b": dict(num_layers=28, hidden_size=1024, num_heads=16, num_kv_heads=8,
                              head_dim=128, mlp_dim=3072, vocab_size=151936,
                              tie_embeddings=True, max_position_embeddings=4096,
                              dtype="bfloat16", param_dtype="bfloat16")}


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--model_dir", default="",
                      help="one model folder for refusion, ar and bd3lm (unless set apart below)")
  parser.add_argument("--refusion_dir", default="", help="model folder for method refusion")
  parser.add_argument("--ar_dir", default="", help="model folder for method ar")
  parser.add_argument("--mdm_dir", default="", help="bidirectional model folder for mdm")
  parser.add_argument("--bd3lm_dir", default="",
                      help="causal BD3-LM model folder for bd3lm (default: --model_dir)")
  parser.add_argument("--methods", default="refusion,ar,mdm", help="comma-separated")
  parser.add_argument("--batch_sizes", default="1,4,16,64", help="comma-separated")
  parser.add_argument("--preset", default="", choices=["", *PRESETS],
                      help="random model of a named shape (default: config.tiny())")
  parser.add_argument("--dtype", default="", choices=["", "float32", "bfloat16"],
                      help="compute and parameter dtype of a random model (default: the "
                           "preset's). A CPU runs bf16 dots in float32 copies of their "
                           "operands, so compare memory on a CPU in float32")
  parser.add_argument("--task_prompts", default="",
                      help="JSONL of the task suite ({\"query\": ...}); prompts are its queries, "
                           "chat-templated with the bundled tiny tokenizer, instead of random ids")
  parser.add_argument("--engine_prompts", type=int, default=4,
                      help="engine run per batch size > 1: this many prompts per row (0: none)")
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
  parser.add_argument("--no_fixed_cost", action="store_true",
                      help="skip the fixed cost of a call (it compiles each method's engine "
                           "program once more: minutes for a full-size model)")
  parser.add_argument("--memory_only", action="store_true",
                      help="only compile each program from shapes (no weights, no decoding) "
                           "and print its memory (with --preset: no model is materialised)")
  args = parser.parse_args(argv)
  args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
  for m in args.methods:
    if m not in METHODS:
      parser.error(f"--methods: unknown method {m!r}; choose from {sorted(METHODS)}")
  try:
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b.strip()]
  except ValueError:
    parser.error(f"--batch_sizes must be comma-separated ints, got {args.batch_sizes!r}")
  if not args.batch_sizes or min(args.batch_sizes) <= 0:
    parser.error(f"--batch_sizes must be positive ints, got {args.batch_sizes}")
  if any(max(args.batch_sizes) % b for b in args.batch_sizes):
    parser.error(f"--batch_sizes: each must divide the largest (every size decodes the same "
                 f"{max(args.batch_sizes)} prompts), got {args.batch_sizes}")
  for name in ("prompt_len", "gen_length", "repeats"):
    if getattr(args, name) <= 0:
      parser.error(f"--{name} must be > 0, got {getattr(args, name)}")
  for name in ("model_dir", "refusion_dir", "ar_dir", "mdm_dir", "bd3lm_dir"):
    # a shipped model's name, or a folder
    setattr(args, name, loading.model_arg(parser, getattr(args, name), f"--{name}"))
  return args


def load_models(args):
  """`{method: model}`; random `config.tiny()` models (one causal, one bidirectional) by default
  (abstract, shapes only, with --memory_only)."""
  models = {}
  shared = {}
  for method in args.methods:
    flag = f"--{method}_dir" if getattr(args, f"{method}_dir") else "--model_dir"
    folder = getattr(args, f"{method}_dir") or (args.model_dir if method != "mdm" else "")
    if folder:
      if folder not in shared:
        shared[folder] = loading.load_model(folder, flag=flag)[1]
      models[method] = shared[folder]
    else:
      attention = "bidirectional" if method == "mdm" else "causal"
      if attention not in shared:
        shape = dict(PRESETS.get(args.preset, {}))
        if args.dtype:
          shape.update(dtype=args.dtype, param_dtype=args.dtype)
        config = config_lib.tiny(attention=attention, **shape)
        make = lambda c=config: Transformer(c, rngs=nnx.Rngs(args.seed))  # noqa: E731
        shared[attention] = nnx.eval_shape(make) if args.memory_only else make()
      models[method] = shared[attention]
  return models


_TASK_PROMPTS: list = []


def make_prompts(config, batch: int, width: int, seed: int):
  if _TASK_PROMPTS:  # task queries, in file order from a seed-dependent start, cycled
    start = seed % len(_TASK_PROMPTS)
    chosen = [_TASK_PROMPTS[(start + i) % len(_TASK_PROMPTS)] for i in range(batch)]
    ids_bp = np.zeros((batch, width), np.int32)
    for b, ids in enumerate(chosen):
      if len(ids) > width:
        raise ValueError(f"a task prompt has {len(ids)} tokens; raise --prompt_len")
      ids_bp[b, :len(ids)] = ids
    return ids_bp, np.asarray([len(ids) for ids in chosen], np.int32)
  rng = np.random.default_rng(seed)
  specials = {config.mask_token_id, config.eos_token_id, config.bos_token_id,
              config.pad_token_id}
  ordinary = np.array([t for t in range(config.vocab_size) if t not in specials])
  lens_b = rng.integers(max(1, width // 2), width + 1, size=batch).astype(np.int32)
  ids_bp = np.zeros((batch, width), np.int32)
  for b in range(batch):
    ids_bp[b, :lens_b[b]] = rng.choice(ordinary, size=lens_b[b])
  return ids_bp, lens_b


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


def _decode_config(method, args):
  return DecodeConfig(
      method=method, gen_length=args.gen_length, slot_size=args.slot_size,
      block_size=args.block_size, slot_threshold=args.slot_threshold,
      token_threshold=args.token_threshold, mdm_tokens_per_step=args.mdm_tokens_per_step,
      mdm_threshold=args.mdm_threshold)


def fixed_cost_ms(decoder, repeats: int = 50) -> float:
  """Wall time of one call of the decode loop that runs no pass (dispatch, launch, sync)."""
  d = decoder
  spec = d.spec_for(1)
  state = compiled_lib.init(d.graphdef, d.params, spec=spec, rows=1, width=8,  # pylint: disable=protected-access
                              place=d.place)
  stop = jax.numpy.bool_(False)
  run = functools.partial(compiled_lib.run, spec=spec, place=d.place)  # pylint: disable=protected-access
  state = jax.block_until_ready(run(d.graphdef, d.params, state, d.knobs, stop))
  times = []
  for _ in range(repeats):
    t = time.perf_counter()
    state = jax.block_until_ready(run(d.graphdef, d.params, state, d.knobs, stop))
    times.append(time.perf_counter() - t)
  return 1e3 * statistics.median(times)


def compiled_memory(decoder, batch: int, prompt_len: int):
  """(XLA's memory analysis, compile seconds) of the decode program of `batch` rows,
  compiled from shapes only (the decoder's parameters may be abstract)."""
  shape = jax.ShapeDtypeStruct
  t = time.perf_counter()
  lowered = compiled_lib.generate.lower(  # pylint: disable=protected-access
      decoder.graphdef, decoder.params, shape((batch, prompt_len), np.int32),
      shape((batch,), np.int32), shape((2,), np.uint32), decoder.knobs,
      spec=decoder.spec_for(batch))
  memory = lowered.compile().memory_analysis()
  return memory, time.perf_counter() - t


def memory_table(models, args) -> list[dict]:
  """--memory_only: every method's program memory per batch size, and its ratio to AR's."""
  rows = []
  for batch in args.batch_sizes:
    for method in args.methods:
      decoder = engine.Decoder(models[method], _decode_config(method, args))
      memory, compile_s = compiled_memory(decoder, batch, args.prompt_len)
      rows.append({"method": method, "batch": batch, "compile_s": compile_s,
                   "program_mb": program_bytes(memory) / 2**20,
                   "temp_mb": memory.temp_size_in_bytes / 2**20})
      print(f"  compiled {method} batch {batch} ({compile_s:.1f}s)", file=sys.stderr, flush=True)
  ar = {r["batch"]: r["program_mb"] for r in rows if r["method"] == "ar"}
  print(f"{'method':9s}{'batch':>6s}{'prog MB':>11s}{'temp MB':>11s}{'vs ar':>8s}{'compile':>9s}")
  for r in rows:
    ratio = f"{r['program_mb'] / ar[r['batch']]:.2f}x" if r["batch"] in ar else "-"
    print(f"{r['method']:9s}{r['batch']:>6d}{r['program_mb']:>11.1f}{r['temp_mb']:>11.1f}"
          f"{ratio:>8s}{r['compile_s']:>9.1f}")
  print("\nprog MB: XLA buffer assignment of the compiled decode program (parameters, prompts, "
        "outputs and peak temporaries, KV cache included); temp MB: its temporaries.")
  return rows


def bench_one(method, model, batch, args):
  dc = _decode_config(method, args)
  decoder = engine.Decoder(model, dc)
  # Identical work at every batch size: the same prompts (as many as the largest
  # batch), decoded `batch` at a time, one `generate` call per chunk.
  n_prompts = max(args.batch_sizes)
  all_ids, all_lens = make_prompts(model.config, n_prompts, args.prompt_len, args.seed)
  chunks = [(all_ids[i:i + batch], all_lens[i:i + batch]) for i in range(0, n_prompts, batch)]
  rng = jax.random.PRNGKey(args.seed)
  memory, compile_s = compiled_memory(decoder, batch, args.prompt_len)
  jax.block_until_ready(decoder.generate(*chunks[0], rng))  # warm-up
  seconds, tokens, nfe, passes = 0.0, 0, 0, 0
  for ids_bp, lens_b in chunks:
    times = []
    for _ in range(args.repeats):
      t = time.perf_counter()
      out, state = jax.block_until_ready(decoder.generate(ids_bp, lens_b, rng, with_state=True))
      times.append(time.perf_counter() - t)
    seconds += statistics.median(times)
    tokens += int(np.asarray(out.counters.tokens_b).sum())
    nfe += int(np.asarray(out.counters.nfe_b()).sum())
    passes += int(state.passes)
  row = {
      "method": method, "batch": batch, "seconds": seconds, "compile_s": compile_s,
      "tokens": tokens, "tok_s": tokens / seconds, "tpf": tokens / max(nfe, 1),
      "nfe_row": nfe / n_prompts, "loop_passes": passes / len(chunks),
      "pass_ms": 1e3 * seconds / max(passes, 1),
      "program_mb": program_bytes(memory) / 2**20,
      "device_peak_mb": (device_peak() or 0) / 2**20,
  }
  if args.engine_prompts and batch > 1:
    n = args.engine_prompts * batch
    ids_np, lens_np = make_prompts(model.config, n, args.prompt_len, args.seed + 1000 + batch)
    prompts = [list(ids_np[i, :lens_np[i]]) for i in range(n)]
    eng = decoder.engine(batch, width=args.prompt_len)
    eng.warm_up()
    eng.run(prompts, rng)  # first-call costs (host-side staging of new shapes) untimed
    runs = sorted((eng.run(prompts, rng) for _ in range(args.repeats)), key=lambda r: r.seconds)
    run = runs[len(runs) // 2]
    own = sum(r.counters["nfe_b"] for r in run.results)
    row.update(engine_tok_s=sum(len(r.tokens) for r in run.results) / run.seconds,
               engine_pass_ratio=run.passes / (own / batch), engine_prompts=n)
  return row


def main(argv=None) -> list[dict]:
  runtime.start_up()  # the entry points' start-up: no libtpu errors where no TPU is
  args = parse_args(argv)
  models = load_models(args)
  if args.task_prompts:
    from refusion_jax import evaluate, tokenizer  # pylint: disable=import-outside-toplevel
    tok = tokenizer.Tokenizer.tiny()
    problems = evaluate.read_problems(args.task_prompts, tok)
    rs = np.random.default_rng(args.seed)
    _TASK_PROMPTS.extend(list(problems[i].prompt_ids) for i in rs.permutation(len(problems)))
  device = jax.devices()[0]
  print(f"device: {device.platform} ({device.device_kind}), {jax.device_count()} device(s)")
  for method, model in models.items():
    c = model.config
    params = sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    print(f"{method:8s}: {c.num_layers} layers, d={c.hidden_size}, vocab {c.vocab_size}, "
          f"{c.attention}, {params / 1e6:.2f}M params")
  print(f"prompt width {args.prompt_len}, gen_length {args.gen_length}, slot {args.slot_size}, "
        f"block {args.block_size}, tau_s {args.slot_threshold}, tau_t {args.token_threshold}, "
        f"mdm {args.mdm_tokens_per_step}/step"
        + (f", mdm threshold {args.mdm_threshold}" if args.mdm_threshold is not None else "")
        + ("; compiled from shapes only\n" if args.memory_only else
           f"; median of {args.repeats} timed calls after a warm-up compile\n"))
  if args.memory_only:
    return memory_table(models, args)
  rows = []
  for batch in args.batch_sizes:
    for method in args.methods:
      row = bench_one(method, models[method], batch, args)
      rows.append(row)
      print(f"  done {method} batch {batch} (compile {row['compile_s']:.1f}s): "
            f"{row['tok_s']:.1f} tok/s, {row['pass_ms']:.3f} ms/pass, {row['loop_passes']:.1f} "
            f"passes/call, prog {row['program_mb']:.1f} MB", file=sys.stderr, flush=True)
  gpu = any(r["device_peak_mb"] for r in rows)
  header = (f"{'method':9s}{'batch':>6s}{'tokens':>8s}{'tok/s':>11s}{'tok/fwd':>9s}"
            f"{'NFE/row':>9s}{'passes':>8s}{'ms/pass':>9s}{'sec':>9s}{'compile':>9s}"
            f"{'prog MB':>9s}{'eng tok/s':>11s}{'eng pass':>9s}" + (f"{'peak MB':>9s}" if gpu else ""))
  print(header)
  print("-" * len(header))
  for r in rows:
    eng = (f"{r['engine_tok_s']:>11.1f}{r['engine_pass_ratio']:>9.2f}" if "engine_tok_s" in r
           else f"{'-':>11s}{'-':>9s}")
    print(f"{r['method']:9s}{r['batch']:>6d}{r['tokens']:>8d}{r['tok_s']:>11.1f}{r['tpf']:>9.2f}"
          f"{r['nfe_row']:>9.1f}{r['loop_passes']:>8.1f}{r['pass_ms']:>9.3f}{r['seconds']:>9.3f}"
          f"{r['compile_s']:>9.1f}{r['program_mb']:>9.1f}{eng}"
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
    first = by.get((method, args.batch_sizes[0]))
    for batch in args.batch_sizes[1:]:
      last = by.get((method, batch))
      if first and last:
        print(f"{method}: batch {batch} / batch {first['batch']} tokens/s = "
              f"{last['tok_s'] / first['tok_s']:.2f}x")
  for method in ([] if args.no_fixed_cost else args.methods):
    print(f"{method}: fixed cost of a call (dispatch + launch + sync, no pass) "
          f"{fixed_cost_ms(engine.Decoder(models[method], _decode_config(method, args))):.3f} ms")
  print("\nprog MB: XLA buffer assignment of the compiled decode program (parameters, prompts, "
        "outputs and peak temporaries, KV cache included). passes: forward passes of the batch "
        "(loop iterations) per call; ms/pass = sec / all calls' passes. eng tok/s: the continuous-batching engine "
        f"with as many rows as the batch, {args.engine_prompts} prompts per row, median "
        f"of {args.repeats} runs after a warm-up run; eng pass = its passes / (sum of each prompt's own passes / rows).")
  return rows


if __name__ == "__main__":
  main()
