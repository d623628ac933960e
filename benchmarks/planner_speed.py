"""Which slots to draft, under lossless decoding: tokens per forward at identical answers.

Under `decode.verify='lossless'` a planner chooses which masked slots of the window a
pass drafts; no choice changes an answer, only the passes. This decodes every problem
greedily with each planner and prints tokens per forward per task and over all answers,
and how many answers differ from the first row's (none may):

* the threshold rule at each `--thresholds` tau_s (0: every slot; 1: only the leftmost
  one with a mask);
* the selection policy (`decode.planner='policy'`) with each `--plan_weights` file
  (OUT/plan_weights.json of configs/planner_lossless.py: trained for speed by
  refusion_jax.rl), chosen above one half;
* the planner that knows the answer (`lossless.answer_plan`: it keeps exactly the masks
  whose pick is the answer's token, so no pass checks a wrong masked draft): what perfect
  knowledge of which drafts fail is worth. It is not a bound: a wrong draft, fed, still
  drafts the indices after it by its slot's causal picks, which may pass after the
  correction, so withholding it can cost passes.
* with `--search`, a planner that searches: at each pass it tries every choice of the
  window's slots and keeps the one whose exact continuation (every later pass drafting
  every slot) takes the fewest passes, the threshold rule's where none beats it. What
  a search whose value is the verifier's acceptance (MCTS's) can find one pass deep;
  never worse than the threshold rule at tau_s 0, at 2^S decodes per pass.

  python benchmarks/planner_speed.py --model runs/repro_tiny/models/refusion_bl/final_model \\
      --plan_weights OUT/plan_weights.json
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from configs.common import TINY_VALID  # noqa: E402
from refusion_jax import evaluate, loading, runtime  # noqa: E402
from refusion_jax.decode import compiled, engine, lossless  # noqa: E402
from refusion_jax.decode import program as program_lib  # noqa: E402
from refusion_jax.decode.settings import DecodeConfig  # noqa: E402


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--model", default="refusion_tiny", help="a model folder or shipped name")
  p.add_argument("--problems", default=TINY_VALID, help="JSONL of {'query', ...} problems")
  p.add_argument("--per_task", type=int, default=0, help="problems per task (0 = all)")
  p.add_argument("--gen_length", type=int, default=24)
  p.add_argument("--block_size", type=int, default=8, help="the lossless window")
  p.add_argument("--slot_size", type=int, default=4)
  p.add_argument("--thresholds", default="0,0.5,0.9,1", help="tau_s of the threshold rows")
  p.add_argument("--plan_weights", default="", help="comma-separated plan_weights.json files")
  p.add_argument("--rows", type=int, default=16, help="rows decoded at once")
  p.add_argument("--search", action="store_true", help="add the searching planner's row")
  a = p.parse_args(argv)
  a.model = loading.model_arg(p, a.model, "--model")
  a.thresholds = [float(x) for x in a.thresholds.split(",") if x]
  a.plan_weights = [x for x in a.plan_weights.split(",") if x]
  for path in a.plan_weights:
    if not os.path.isfile(path):
      p.error(f"--plan_weights: {path!r} is not a file")
  if not a.thresholds:
    p.error("--thresholds names no tau_s")
  return a


def read_weights(path: str) -> tuple:
  with open(path, encoding="utf-8") as f:
    data = json.load(f)
  if not isinstance(data, dict) or "plan_weights" not in data:
    raise ValueError(f"{path}: expected refusion_jax.rl's plan_weights.json "
                     "({'features', 'plan_weights'})")
  return tuple(float(x) for x in data["plan_weights"])


@functools.partial(jax.jit, static_argnames=("graphdef", "spec"))
def _answer_planned(graphdef, params, ids_bp, lens_b, answers_bg, knobs, spec):
  """Lossless decoding of a batch with `lossless.answer_plan` (the AR decoder's loop)."""
  model = compiled.merge(graphdef, params)
  b, p = ids_bp.shape
  plan = lossless.answer_plan(answers_bg)
  rows = jnp.arange(b)
  with program_lib.precision(spec):
    st = lossless.init(model, spec, b, p)
    keys = program_lib.prompt_keys(jnp.zeros((2,), jnp.uint32), rows)
    st = lossless.admit(model, spec, st, ids_bp, lens_b, rows, keys, knobs, plan=plan)
    st = jax.lax.while_loop(lambda s: (s.rows.phase_b >= program_lib.FIRST_PHASE).any(),
                            lambda s: lossless.step(model, spec, s, knobs, plan=plan), st)
  return lossless.output(spec, st, knobs)


def answer_planned(decoder: engine.Decoder, prompts, answers, rows: int):
  """`[(tokens, passes)]` of each prompt under the planner that knows `answers`."""
  out, g = [], decoder.config.gen_length
  pad = decoder.knobs.pad_id
  for start in range(0, len(prompts), rows):
    part = prompts[start:start + rows]
    n = len(part)
    width = max(len(x) for x in part)
    ids = np.full((rows, width), pad, np.int32)
    lens = np.ones((rows,), np.int32)
    want = np.full((rows, g), pad, np.int32)
    for i, (x, ans) in enumerate(zip(part, answers[start:start + rows])):
      ids[i, :len(x)], lens[i] = x, len(x)
      want[i, :len(ans)] = ans
    ids[n:] = ids[0]  # filler rows: a copy of the first prompt
    lens[n:] = lens[0]
    want[n:] = want[0]
    res = _answer_planned(decoder.static, decoder.flat, jnp.asarray(ids), jnp.asarray(lens),
                          jnp.asarray(want), decoder.knobs, spec=decoder.spec_for(rows))
    toks, length = np.asarray(res.tokens_bg), np.asarray(res.length_b)
    nfe = np.asarray(res.counters.nfe_b())
    out += [(list(toks[i, :length[i]]), float(nfe[i])) for i in range(n)]
  return out


def _forced_plan(forced_bs):
  """A `plan` choosing the slots `forced_bs` [B, S] of the window (`lossless.plan_slots`)."""
  def plan(spec, mask_w, idx_w, p_w, pick_w, final_b, key_b2, step_b, knobs):
    del pick_w, key_b2, step_b, knobs
    _, _, in_ws = lossless.plan_features(spec, mask_w, idx_w, p_w, final_b)
    return mask_w & (in_ws & forced_bs[:, None, :]).any(-1), None
  return plan


@functools.partial(jax.jit, static_argnames=("graphdef", "spec"))
def _admit(graphdef, params, ids_bp, lens_b, knobs, spec):
  model = compiled.merge(graphdef, params)
  b, p = ids_bp.shape
  rows = jnp.arange(b)
  with program_lib.precision(spec):
    st = lossless.init(model, spec, b, p)
    keys = program_lib.prompt_keys(jnp.zeros((2,), jnp.uint32), rows)
    return lossless.admit(model, spec, st, ids_bp, lens_b, rows, keys, knobs)


@functools.partial(jax.jit, static_argnames=("graphdef", "spec", "finish"))
def _step(graphdef, params, st, forced_bs, knobs, spec, finish: bool):
  """One pass with the slots `forced_bs`; `finish`: then every pass to the end with every
  slot drafted, returning each row's passes."""
  model = compiled.merge(graphdef, params)
  with program_lib.precision(spec):
    st = lossless.step(model, spec, st, knobs, plan=_forced_plan(forced_bs))
    if not finish:
      return st
    st = jax.lax.while_loop(lambda s: (s.rows.phase_b >= program_lib.FIRST_PHASE).any(),
                            lambda s: lossless.step(model, spec, s, knobs), st)
  return st.rows.counters.nfe_b()


def searched(decoder: engine.Decoder, prompts, rows: int):
  """`[(tokens, passes)]` of each prompt under the searching planner (module docstring)."""
  spec, knobs = decoder.spec_for(rows), decoder.knobs
  n_slots = lossless.plan_slots(spec)
  choices = np.array([[(c >> s) & 1 for s in range(n_slots)] for c in range(2 ** n_slots)],
                     bool)
  every = len(choices) - 1
  out = []
  for start in range(0, len(prompts), rows):
    part = prompts[start:start + rows]
    width = max(len(x) for x in part)
    ids = np.full((rows, width), decoder.knobs.pad_id, np.int32)
    lens = np.ones((rows,), np.int32)
    for i, x in enumerate(part):
      ids[i, :len(x)], lens[i] = x, len(x)
    ids[len(part):], lens[len(part):] = ids[0], lens[0]
    st = _admit(decoder.static, decoder.flat, jnp.asarray(ids), jnp.asarray(lens), knobs,
                spec=spec)
    while (np.asarray(st.rows.phase_b) >= program_lib.FIRST_PHASE).any():
      passes = np.stack([np.asarray(_step(decoder.static, decoder.flat, st, jnp.asarray(
          np.broadcast_to(c, (rows, n_slots))), knobs, spec=spec, finish=True))
                         for c in choices])  # [choices, rows]
      best = np.where(passes.min(0) < passes[every], passes.argmin(0), every)
      st = _step(decoder.static, decoder.flat, st, jnp.asarray(choices[best]), knobs,
                 spec=spec, finish=False)
    res = lossless.output(spec, st, knobs)
    toks, length = np.asarray(res.tokens_bg), np.asarray(res.length_b)
    nfe = np.asarray(res.counters.nfe_b())
    out += [(list(toks[i, :length[i]]), float(nfe[i])) for i in range(len(part))]
  return out


def main(argv=None) -> dict:
  runtime.start_up()
  a = parse_args(argv)
  config, model = loading.load_model(a.model, flag="--model")
  tokenizer = loading.load_tokenizer(a.model, config)
  problems = evaluate.read_problems(a.problems, tokenizer, per_task=a.per_task)
  prompts = [list(p.prompt_ids) for p in problems]
  base = dict(method="refusion", gen_length=a.gen_length, slot_size=a.slot_size,
              block_size=a.block_size, verify="lossless")
  runs = {}
  for tau in a.thresholds:
    dc = DecodeConfig(**base, slot_threshold=tau)
    res = engine.Decoder(model, dc).engine(a.rows).run(prompts).results
    runs[f"threshold tau_s {tau:g}"] = [(list(r.tokens), r.counters["nfe_b"]) for r in res]
  for path in a.plan_weights:
    dc = DecodeConfig(**base, planner="policy", plan_weights=read_weights(path))
    res = engine.Decoder(model, dc).engine(a.rows).run(prompts).results
    runs[f"policy {path}"] = [(list(r.tokens), r.counters["nfe_b"]) for r in res]
  first = next(iter(runs.values()))
  dc = DecodeConfig(**base, slot_threshold=0.0)
  decoder = engine.Decoder(model, dc)
  runs["knows the answer"] = answer_planned(decoder, prompts, [t for t, _ in first], a.rows)
  if a.search:
    runs["search, one pass deep"] = searched(decoder, prompts, a.rows)
  tasks = sorted({p.task for p in problems})

  def tpf(res, idx):
    return sum(len(res[i][0]) for i in idx) / max(sum(res[i][1] for i in idx), 1)

  report = {}
  print(f"{len(problems)} problems, lossless window {a.block_size}, slot {a.slot_size}, "
        "greedy")
  print("| planner | answers differing from the first | " + " | ".join(tasks)
        + " | all: tokens / forward | vs the first |")
  print("|---|---|" + "---|" * len(tasks) + "---|---|")
  base_tpf = tpf(first, range(len(problems)))
  for name, res in runs.items():
    differ = sum(t != f for (t, _), (f, _) in zip(res, first))
    per = {t: tpf(res, [i for i, p in enumerate(problems) if p.task == t]) for t in tasks}
    all_ = tpf(res, range(len(problems)))
    report[name] = {"differ": differ, "per_task": per, "tpf": all_}
    print(f"| {name} | {differ} | " + " | ".join(f"{per[t]:.2f}" for t in tasks)
          + f" | {all_:.2f} | {all_ / base_tpf - 1:+.1%} |")
  return report


if __name__ == "__main__":
  main()
