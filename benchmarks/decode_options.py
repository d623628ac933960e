"""What ReFusion's "Past the paper" options cost, side by side with the release's decoder.

One model, one set of prompts, one set of settings; each decoder (the release's,
verified infill "correct" and "exact", re-masking, and verification with
re-masking) decodes every prompt at batch 1 (`generate`, one prompt a call) and
through the engine at `--rows` rows. The decoders take turns within each repeat
(the order rotates), so a slow spell of the machine falls on all of them.

For each: accuracy (with a task file and a trained model), tokens per forward
(tokens / NFE, every pass counted), passes per answer split by kind (plan, global
verification, draft, verify, of which refresh, re-check), corrected and re-masked
tokens per answer, milliseconds per pass (the cost of a pass with its bookkeeping:
the options add elementwise work on the block, no model work), and batch-1 and
engine tokens/s, each also as a ratio to the release's decoder.

  python benchmarks/decode_options.py --model_dir W/models/refusion_bl/final_model \\
      --task_prompts refusion_jax/assets/data/tiny_test.jsonl --settings_json W/results/ReFusion-BL-verify.json
  python benchmarks/decode_options.py            # a random tiny model: costs only

`--settings_json` takes per-task decode settings from a reproduction's result
file (its "decode" field); otherwise every prompt decodes at the flags' settings.
"""

from __future__ import annotations

import argparse
import json
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

# name -> DecodeConfig changes on top of the settings.
OPTIONS = {
    "release": {},
    "verify-correct": {"verify": "correct"},
    "verify-exact": {"verify": "exact"},
    "remask": {"remask": True},
    "verify+remask": {"verify": "correct", "remask": True},
}
KINDS = ("plan_b", "global_verify_b", "draft_b", "verify_b", "refresh_b", "recheck_b",
         "recompute_b", "ar_b")


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--model_dir", default="", help="a ReFusion model folder (default: a random "
                 "tiny model: costs only, no accuracy)")
  p.add_argument("--task_prompts", default="", help="JSONL task file: its queries are the "
                 "prompts and its answers score accuracy (the bundled tiny tokenizer)")
  p.add_argument("--settings_json", default="", help="a reproduction result file whose "
                 "'decode' field holds per-task settings")
  p.add_argument("--options", default=",".join(OPTIONS), help="comma-separated, of "
                 + ", ".join(OPTIONS))
  p.add_argument("--boundary_check", default="true", choices=["true", "false"],
                 help="with verification: check slot-first tokens too (a model trained "
                      "with train.boundary_label)")
  p.add_argument("--remask_threshold", type=float, default=0.5)
  p.add_argument("--prompts", type=int, default=70, help="prompts (random model: random ids)")
  p.add_argument("--rows", type=int, default=16, help="engine rows")
  p.add_argument("--prompt_len", type=int, default=48, help="padded prompt width")
  p.add_argument("--gen_length", type=int, default=24)
  p.add_argument("--slot_size", type=int, default=4)
  p.add_argument("--block_size", type=int, default=24)
  p.add_argument("--slot_threshold", type=float, default=0.7)
  p.add_argument("--token_threshold", type=float, default=0.4)
  p.add_argument("--repeats", type=int, default=3, help="rounds; each decoder's median counts")
  p.add_argument("--seed", type=int, default=0)
  args = p.parse_args(argv)
  args.options = [o.strip() for o in args.options.split(",") if o.strip()]
  for o in args.options:
    if o not in OPTIONS:
      p.error(f"--options: unknown {o!r}; choose from {list(OPTIONS)}")
  args.model_dir = loading.model_arg(p, args.model_dir)  # a shipped model's name, or a folder
  for name in ("task_prompts", "settings_json"):
    if getattr(args, name) and not os.path.isfile(getattr(args, name)):
      p.error(f"--{name}={getattr(args, name)!r} is not a file")
  if args.repeats < 1 or args.prompts < 1 or args.rows < 1:
    p.error("--repeats, --prompts and --rows must be >= 1")
  return args


def _problems(args, model_config):
  """[(task, prompt ids, query or None)] and the tokenizer (None for random prompts)."""
  if args.task_prompts:
    tok = Tokenizer.tiny()
    problems = evaluate.read_problems(args.task_prompts, tok)
    # The first prompts of every task in turn, so that each task is represented.
    by_task = {}
    for pr in problems:
      by_task.setdefault(pr.task, []).append(pr)
    chosen = []
    while len(chosen) < min(args.prompts, len(problems)):
      for t in by_task:
        if by_task[t] and len(chosen) < args.prompts:
          chosen.append(by_task[t].pop(0))
    return [(pr.task, list(pr.prompt_ids), pr.query) for pr in chosen], tok
  rng = np.random.default_rng(args.seed)
  specials = {model_config.mask_token_id, model_config.eos_token_id,
              model_config.bos_token_id, model_config.pad_token_id}
  ordinary = np.array([t for t in range(model_config.vocab_size) if t not in specials])
  out = []
  for _ in range(args.prompts):
    n = int(rng.integers(max(1, args.prompt_len // 2), args.prompt_len + 1))
    out.append((None, [int(x) for x in rng.choice(ordinary, size=n)], None))
  return out, None


def _settings(args):
  """{task or None: DecodeConfig} of the release's decoder."""
  base = DecodeConfig(gen_length=args.gen_length, slot_size=args.slot_size,
                                 block_size=args.block_size,
                                 slot_threshold=args.slot_threshold,
                                 token_threshold=args.token_threshold)
  if not args.settings_json:
    return {None: base}
  with open(args.settings_json, encoding="utf-8") as f:
    decode = json.load(f)["decode"]
  fields = ("gen_length", "slot_size", "block_size", "slot_threshold", "token_threshold")
  return {t: base.replace(**{k: d[k] for k in fields}) for t, d in decode.items()}


def main(argv=None):
  runtime.start_up()  # the entry points' start-up: no libtpu errors where no TPU is
  args = parse_args(argv)
  if args.model_dir:
    model = loading.load_model(args.model_dir, flag="--model_dir")[1]
  else:
    model = Transformer(config_lib.tiny(), rngs=nnx.Rngs(args.seed))
  problems, tok = _problems(args, model.config)
  settings = _settings(args)
  width = max(args.prompt_len, max(len(p) for _, p, _ in problems))
  groups = {}
  for i, (task, _, _) in enumerate(problems):
    key = task if task in settings else None
    if key not in settings:
      key = next(iter(settings))
    groups.setdefault(key, []).append(i)
  extra = {"boundary_check": args.boundary_check == "true",
           "remask_threshold": args.remask_threshold}
  decoders = {name: {key: engine.Decoder(model, settings[key].replace(**OPTIONS[name], **extra))
                     for key in groups} for name in args.options}
  rng = jax.random.key(args.seed)

  def batch1(name):
    """One prompt a call: (seconds, results per prompt)."""
    seconds, results = 0.0, [None] * len(problems)
    for key, idx in groups.items():
      d = decoders[name][key]
      for i in idx:
        ids = np.zeros((1, width), np.int32)
        p = problems[i][1]
        ids[0, :len(p)] = p
        t0 = time.perf_counter()
        out = jax.block_until_ready(d.generate(ids, np.asarray([len(p)], np.int32), rng))
        seconds += time.perf_counter() - t0
        results[i] = jax.device_get(out)
    return seconds, results

  def engine_run(name):
    seconds = 0.0
    for key, idx in groups.items():
      e = engines[name][key]
      t0 = time.perf_counter()
      e.run([problems[i][1] for i in idx], rng)
      seconds += time.perf_counter() - t0
    return seconds

  print(f"model: {args.model_dir or 'random config.tiny()'}; {len(problems)} prompts; "
        f"settings: " + ("per task from " + args.settings_json if args.settings_json else
                         str(settings[None])), flush=True)
  engines = {name: {key: decoders[name][key].engine(args.rows, width=width) for key in groups}
             for name in args.options}
  t0 = time.perf_counter()
  for name in args.options:  # compiles (untimed)
    batch1(name)
    for key in groups:
      engines[name][key].warm_up()
  print(f"compiled and warmed up in {time.perf_counter() - t0:.0f}s", flush=True)
  times1 = {n: [] for n in args.options}
  times_e = {n: [] for n in args.options}
  outputs = {}
  for rep in range(args.repeats):
    order = args.options[rep % len(args.options):] + args.options[:rep % len(args.options)]
    for name in order:
      s, res = batch1(name)
      times1[name].append(s)
      outputs[name] = res
      times_e[name].append(engine_run(name))
  rows = []
  for name in args.options:
    res = outputs[name]
    tokens = sum(int(r.length_b[0]) for r in res)
    c = {k: sum(float(np.asarray(getattr(r.counters, k))[0]) for r in res) for k in KINDS}
    nfe = sum(float(r.counters.nfe_b()[0]) for r in res)
    corrected = sum(float(r.counters.corrected_b[0]) for r in res)
    remasked = sum(float(r.counters.remasked_tokens_b[0]) for r in res)
    acc = None
    if tok is not None:
      ok = sum(bool(tasks_lib.score(q, tok.decode([int(x) for x in r.tokens_bg[0, :int(r.length_b[0])]],
                                                   skip_special_tokens=True)))
               for (_, _, q), r in zip(problems, res))
      acc = 100.0 * ok / len(problems)
    s1, se = statistics.median(times1[name]), statistics.median(times_e[name])
    rows.append(dict(name=name, acc=acc, tpf=tokens / nfe, nfe=nfe / len(problems),
                     kinds={k: c[k] / len(problems) for k in KINDS},
                     corrected=corrected / len(problems), remasked=remasked / len(problems),
                     ms_pass=1000 * s1 / nfe, tps1=tokens / s1, tpse=tokens / se))
  ref = rows[0]
  print("\n| decoder | accuracy | tokens/forward | passes/answer (plan, gv, draft, verify "
        "[refresh], re-check) | corrected / re-masked per answer | ms per pass (batch 1) | "
        f"batch-1 tok/s | engine tok/s ({args.rows} rows) |")
  print("|---|---|---|---|---|---|---|---|")
  for r in rows:
    k = r["kinds"]
    acc = "n/a" if r["acc"] is None else f"{r['acc']:.1f}"
    print(f"| {r['name']} | {acc} | {r['tpf']:.2f} | {r['nfe']:.2f} ({k['plan_b']:.2f}, "
          f"{k['global_verify_b']:.2f}, {k['draft_b']:.2f}, {k['verify_b']:.2f} "
          f"[{k['refresh_b']:.2f}], {k['recheck_b']:.2f}) | {r['corrected']:.2f} / "
          f"{r['remasked']:.2f} | {r['ms_pass']:.3f} ({r['ms_pass'] / ref['ms_pass']:.2f}x) | "
          f"{r['tps1']:.0f} ({r['tps1'] / ref['tps1']:.2f}x) | {r['tpse']:.0f} "
          f"({r['tpse'] / ref['tpse']:.2f}x) |")
  return rows


if __name__ == "__main__":
  main()
