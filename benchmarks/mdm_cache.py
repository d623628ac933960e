"""Fast-dLLM's approximate KV caches against the MDM decoder without one, side by side.

One model, one set of prompts, one selection rule (Fast-dLLM's threshold, default 0.9,
or its factor rule); each decoder (no cache, the prefix cache, the dual cache, and any
`--refresh` variants) decodes every prompt at batch 1 (`generate`, one prompt a call)
and through the engine at `--rows` rows. The decoders take turns within each repeat
(the order rotates), so a slow spell of the machine falls on all of them.

For each: accuracy (with a task file and a trained model), tokens per forward, passes
per answer and of them full passes, the answers and tokens identical to the no-cache
decoder's (the caches are approximate: bidirectional attention makes every position's
K/V depend on the whole canvas), milliseconds per pass, and batch-1 and engine tokens/s,
each also as a ratio to the no-cache decoder's.

  python benchmarks/mdm_cache.py --model_dir W/models/mdm/final_model \\
      --task_prompts refusion_jax/assets/data/tiny_test.jsonl --block_size 8
  python benchmarks/mdm_cache.py --prompt_len 512 --gen_length 64   # random model: costs
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from refusion_jax import config as config_lib  # noqa: E402
from refusion_jax import evaluate, loading, runtime  # noqa: E402
from refusion_jax import tasks as tasks_lib  # noqa: E402
from refusion_jax.decode import engine  # noqa: E402
from refusion_jax.decode.settings import DecodeConfig
from refusion_jax.model import Transformer  # noqa: E402
from refusion_jax.tokenizer import Tokenizer  # noqa: E402


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--model_dir", default="", help="a bidirectional model folder (refusion_jax "
                 "or HF: LLaDA, Dream); default: a random config.tiny() model made "
                 "bidirectional: costs and agreement only")
  p.add_argument("--task_prompts", default="", help="JSONL task file: its queries are the "
                 "prompts and its answers score accuracy (the bundled tiny tokenizer)")
  p.add_argument("--caches", default="none,prefix,dual",
                 help="comma-separated, of none, prefix, dual")
  p.add_argument("--refresh", default="", help="comma-separated refresh intervals: each "
                 "adds a dual-cache decoder with a full pass every N steps of a block")
  p.add_argument("--threshold", type=float, default=0.9, help="Fast-dLLM's tau")
  p.add_argument("--factor", type=float, default=None, help="the factor rule's f "
                 "(instead of the threshold)")
  p.add_argument("--prompts", type=int, default=32, help="prompts (random model: random ids)")
  p.add_argument("--rows", type=int, default=8, help="engine rows")
  p.add_argument("--prompt_len", type=int, default=256, help="padded prompt width (random "
                 "prompts: half to all of it)")
  p.add_argument("--gen_length", type=int, default=64)
  p.add_argument("--block_size", type=int, default=16)
  p.add_argument("--repeats", type=int, default=3, help="rounds; each decoder's median counts")
  p.add_argument("--seed", type=int, default=0)
  args = p.parse_args(argv)
  args.caches = [c.strip() for c in args.caches.split(",") if c.strip()]
  for c in args.caches:
    if c not in ("none", "prefix", "dual"):
      p.error(f"--caches: unknown {c!r}; choose from none, prefix, dual")
  if "none" not in args.caches:
    args.caches.insert(0, "none")  # the reference
  try:
    args.refresh = [int(r) for r in args.refresh.split(",") if r.strip()]
  except ValueError:
    p.error(f"--refresh={args.refresh!r}: comma-separated ints")
  if any(r < 1 for r in args.refresh):
    p.error("--refresh intervals must be >= 1")
  args.model_dir = loading.model_arg(p, args.model_dir)  # a shipped model's name, or a folder
  if args.task_prompts and not os.path.isfile(args.task_prompts):
    p.error(f"--task_prompts={args.task_prompts!r} is not a file")
  if args.repeats < 1 or args.prompts < 1 or args.rows < 1:
    p.error("--repeats, --prompts and --rows must be >= 1")
  return args


def _model(args):
  if args.model_dir:
    return loading.load_model(args.model_dir, flag="--model_dir")[1]
  model = Transformer(config_lib.tiny(attention="bidirectional",
                                max_position_embeddings=args.prompt_len + args.gen_length),
                rngs=nnx.Rngs(args.seed))
  # Scaled-up random weights give peaked, varied predictions (std 0.02 is near uniform).
  nnx.update(model, jax.tree.map(lambda x: x * 3.0, nnx.state(model, nnx.Param)))
  return model


def _problems(args, model_config):
  """[(prompt ids, query or None)] and the tokenizer (None for random prompts)."""
  if args.task_prompts:
    tok = Tokenizer.tiny()
    problems = evaluate.read_problems(args.task_prompts, tok)[:args.prompts]
    return [(list(pr.prompt_ids), pr.query) for pr in problems], tok
  rng = np.random.default_rng(args.seed)
  specials = {model_config.mask_token_id, model_config.eos_token_id,
              model_config.bos_token_id, model_config.pad_token_id}
  ordinary = np.array([t for t in range(model_config.vocab_size) if t not in specials])
  return [([int(x) for x in rng.choice(ordinary, size=int(rng.integers(
      max(1, args.prompt_len // 2), args.prompt_len + 1)))], None)
          for _ in range(args.prompts)], None


def main(argv=None):
  runtime.start_up()  # the entry points' start-up: no libtpu errors where no TPU is
  args = parse_args(argv)
  model = _model(args)
  problems, tok = _problems(args, model.config)
  width = max(args.prompt_len, max(len(p) for p, _ in problems))
  rule = (dict(mdm_factor=args.factor) if args.factor is not None
          else dict(mdm_threshold=args.threshold))
  base = DecodeConfig(method="mdm", gen_length=args.gen_length,
                                 slot_size=args.block_size, block_size=args.block_size, **rule)
  variants = {c: dict(mdm_cache=None if c == "none" else c) for c in args.caches}
  variants.update({f"dual/refresh {r}": dict(mdm_cache="dual", mdm_cache_refresh=r)
                   for r in args.refresh})
  names = list(variants)
  decoders = {n: engine.Decoder(model, base.replace(**v)) for n, v in variants.items()}
  engines = {n: d.engine(args.rows, width=width) for n, d in decoders.items()}
  rng = jax.random.key(args.seed)

  def batch1(name):
    seconds, results = 0.0, []
    for p, _ in problems:
      ids = np.zeros((1, width), np.int32)
      ids[0, :len(p)] = p
      t0 = time.perf_counter()
      out = jax.block_until_ready(decoders[name].generate(ids, np.asarray([len(p)], np.int32),
                                                          rng))
      seconds += time.perf_counter() - t0
      results.append(jax.device_get(out))
    return seconds, results

  def engine_run(name):
    t0 = time.perf_counter()
    engines[name].run([p for p, _ in problems], rng)
    return time.perf_counter() - t0

  print(f"model: {args.model_dir or 'random config.tiny() (bidirectional)'}; "
        f"{len(problems)} prompts of up to {width} tokens; {base}", flush=True)
  t0 = time.perf_counter()
  for name in names:  # compiles (untimed)
    batch1(name)
    engines[name].warm_up()
  print(f"compiled and warmed up in {time.perf_counter() - t0:.0f}s", flush=True)
  times1 = {n: [] for n in names}
  times_e = {n: [] for n in names}
  outputs = {}
  for rep in range(args.repeats):
    for name in names[rep % len(names):] + names[:rep % len(names)]:
      s, res = batch1(name)
      times1[name].append(s)
      outputs[name] = res
      times_e[name].append(engine_run(name))

  def answer(r):
    return [int(x) for x in r.tokens_bg[0, :int(r.length_b[0])]]

  reference = [answer(r) for r in outputs["none"]]
  rows = []
  for name in names:
    res = outputs[name]
    answers = [answer(r) for r in res]
    tokens = sum(len(a) for a in answers)
    nfe = sum(float(r.counters.nfe_b()[0]) for r in res)
    fulls = sum(float(r.counters.refresh_b[0]) for r in res)
    same = sum(a == b for a, b in zip(answers, reference))
    agree = sum(sum(x == y for x, y in zip(a, b)) for a, b in zip(answers, reference))
    acc = None
    if tok is not None:
      acc = 100.0 * sum(bool(tasks_lib.score(q, tok.decode(a, skip_special_tokens=True)))
                        for (_, q), a in zip(problems, answers)) / len(problems)
    s1, se = statistics.median(times1[name]), statistics.median(times_e[name])
    rows.append(dict(name=name, acc=acc, tpf=tokens / nfe, nfe=nfe / len(problems),
                     fulls=fulls / len(problems), same=100.0 * same / len(problems),
                     agree=100.0 * agree / max(1, sum(len(b) for b in reference)),
                     ms_pass=1000 * s1 / nfe, tps1=tokens / s1, tpse=tokens / se))
  ref = rows[0]
  print(f"\n| decoder | accuracy | tokens/forward | passes/answer (full) | answers = no cache "
        f"| tokens = no cache | ms per pass (batch 1) | batch-1 tok/s | engine tok/s "
        f"({args.rows} rows) |")
  print("|---|---|---|---|---|---|---|---|---|")
  for r in rows:
    acc = "n/a" if r["acc"] is None else f"{r['acc']:.1f}"
    print(f"| {r['name']} | {acc} | {r['tpf']:.2f} | {r['nfe']:.2f} ({r['fulls']:.2f}) | "
          f"{r['same']:.1f}% | {r['agree']:.1f}% | {r['ms_pass']:.2f} "
          f"({r['ms_pass'] / ref['ms_pass']:.2f}x) | {r['tps1']:.0f} "
          f"({r['tps1'] / ref['tps1']:.2f}x) | {r['tpse']:.0f} ({r['tpse'] / ref['tpse']:.2f}x) |")
  return rows


if __name__ == "__main__":
  main()
