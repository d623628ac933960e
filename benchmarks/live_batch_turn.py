"""One turn of the server's engine loop, timed in its parts: an admission, a run, a read.

The server (`refusion_jax.serve`) drives a `LiveBatch` one short run at a time
and reads every row after each, so what a run's dispatch and a read cost
bound how fast it can turn. Per method this prints:

- how long `LiveBatch.run(1)` takes to return, and in how many trials the
  device was still working on that pass when it did (0: the dispatch returned
  only once the pass ran, so a run dispatched ahead of a read overlaps
  nothing; on a CPU it returns at once);
- what one pass costs, from its dispatch until it has run, beside what an
  admission costs (one prompt into one free row, and a prompt into every row):
  a server whose returning clients come back out of step admits about once per
  pass, where an offline engine with a full queue refills rows that finish
  together in one admission;
- what a read costs once the pass is done: as `LiveBatch.read` does it (every
  field packed in one array, which right after a run the run program itself
  packed: one device-to-host copy, no program) and one copy per field, as the
  engine read before (the same values; checked each trial).

A second table times one turn of a closed loop whose client came back: a prompt
admitted into a freed row, `run(1)` and the read, as the server does it by
default (an admission program, then a run program) and with `fuse_admission`
(one program that admits and runs), on twin batches whose reads are compared
every trial (the table counts the trials where they are equal). Where a
dispatch waits for its passes (a GPU), each program of a turn costs the host a
dispatch that overlaps no pass.

A third table times the dispatch alone (the call's return, not the program's
end) of a one-prompt admission and of a trivial program, after a gap of each
kind, each kind's calls back to back: none (the same call just waited for), a
1 ms and a 10 ms sleep, and a pass (`run(1)`, waited for, read). On a CPU an
admission after a thread slept through a pass dispatches more slowly
(docs/RESULTS.md, "Where the loop's engine thread spends a run call").

  python benchmarks/live_batch_turn.py          # the main job's models when present
  python benchmarks/live_batch_turn.py --model_dir DIR --methods refusion
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks import serve_load  # noqa: E402
from refusion_jax import sample  # noqa: E402
from refusion_jax.config import MATMUL_PRECISIONS, DecodeConfig  # noqa: E402
from refusion_jax.decode import engine  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAIN_JOB = {"refusion": "runs/repro_tiny/models/refusion/final_model",
            "ar": "runs/repro_tiny/models/arm/final_model"}
BASE = "refusion_jax/assets/base_tiny"


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--model_dir", default="",
                 help="model for every method (default: the main job's models when present, "
                      f"else the bundled base, {BASE})")
  p.add_argument("--methods", default="refusion,ar")
  p.add_argument("--rows", type=int, default=16)
  p.add_argument("--prompt_len", type=int, default=12)
  p.add_argument("--gen_length", type=int, default=24)
  p.add_argument("--slot_size", type=int, default=4)
  p.add_argument("--trials", type=int, default=40, help="timed turns (after 5 untimed)")
  p.add_argument("--matmul_precision", default=None, choices=MATMUL_PRECISIONS,
                 help="decode.matmul_precision (default: per platform, 'highest' on GPUs)")
  args = p.parse_args(argv)
  for name in ("rows", "prompt_len", "gen_length", "slot_size", "trials"):
    if getattr(args, name) < 1:
      p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
  args.methods = serve_load.parse_methods(p, args.methods)
  return args


@functools.partial(jax.jit, static_argnames=("spec",))
def _per_field(state, knobs, spec):
  """The read's values as separate arrays (one device-to-host copy each)."""
  out = engine.program(spec.method).output(spec, state, knobs)
  return out, out.counters.nfe_b(), state.rows.phase_b, state.passes


def _read_per_field(batch):
  arrays = _per_field(batch.state, batch.knobs, spec=batch.decoder.spec)
  leaves = jax.tree.leaves(arrays)
  for leaf in leaves:
    leaf.copy_to_host_async()
  return jax.device_get(arrays), len(leaves)


def _busy(tree) -> bool:
  return not all(leaf.is_ready() for leaf in jax.tree.leaves(tree))


GAPS = ("none", "sleep 1 ms", "sleep 10 ms", "a pass")


def admit_then_run(d: engine.Decoder, rows: int, width: int, prompts, trials: int) -> dict:
  """Median ms of a turn (a prompt into a freed row, `run(1)`, the read) as two programs
  and as one (`LiveBatch(fuse_admission=True)`), on twin batches, and in how many
  trials their reads were equal."""
  two, one = (engine.LiveBatch(d, rows, width, fuse_admission=fuse) for fuse in (False, True))
  two.warm_up()
  one.warm_up()
  keys = np.zeros((rows, 2), np.uint32)
  for b in (two, one):
    b.admit(prompts, list(range(rows)), keys)
  jax.block_until_ready((two.state, one.state))
  times = {"two": [], "one": []}

  def turn_of(batch, r, p):
    batch.free([r])
    batch.admit([p], [r], keys[:1])
    batch.run(1, stop_on_done=False)
    return batch.read()

  equal = 0  # trials whose reads are equal (a GPU's reduced-precision products may differ)
  for trial in range(trials + 3):
    r, p = trial % rows, prompts[(trial + 1) % rows]
    snaps = {}
    for name in (("two", "one") if trial % 2 else ("one", "two")):
      jax.block_until_ready((two.state, one.state))
      t0 = time.perf_counter()
      snaps[name] = turn_of(two if name == "two" else one, r, p)
      if trial >= 3:
        times[name].append((time.perf_counter() - t0) * 1e3)
    a, b = snaps["two"], snaps["one"]
    equal += a.passes == b.passes and all(
        np.array_equal(getattr(a, f), getattr(b, f))
        for f in ("tokens_bg", "commit_step_bg", "length_b", "phase_b", "nfe_b"))
  return {**{k: statistics.median(v) for k, v in times.items()}, "equal": equal,
          "trials": trials + 3}


@jax.jit
def _trivial(x):
  return x + 1


def after_gaps(batch: engine.LiveBatch, prompt: list[int], trials: int) -> dict:
  """Median ms a one-prompt admission's and a trivial program's dispatch take to
  return after each gap in `GAPS` (`prompt` into row 0, the others as they are)."""
  def gap(kind):
    if kind == "sleep 1 ms":
      time.sleep(0.001)
    elif kind == "sleep 10 ms":
      time.sleep(0.01)
    elif kind == "a pass":
      batch.run(1, stop_on_done=False)
      jax.block_until_ready(batch.state)
      batch.read()
  one = np.ones((4,), np.int32)
  jax.block_until_ready(_trivial(one))
  key = np.zeros((1, 2), np.uint32)
  times = {}
  for kind in GAPS:  # each kind in a block of its own: "none" is the same call back to back
    for what in ("admit", "trivial"):
      ts = times[(kind, what)] = []
      for trial in range(trials + 2):
        jax.block_until_ready(batch.state)
        gap(kind)
        if what == "admit":
          batch.free([0])
          t0 = time.perf_counter()
          batch.admit([prompt], [0], key)
        else:
          t0 = time.perf_counter()
          out = _trivial(one)
        t1 = time.perf_counter()
        jax.block_until_ready(batch.state if what == "admit" else out)
        if trial >= 2:
          ts.append((t1 - t0) * 1e3)
  return {f"{what}_after_{kind}": statistics.median(v) for (kind, what), v in times.items()}


def turn(model_dir: str, method: str, args) -> dict:
  _, model = sample.load_model(model_dir)
  g = args.gen_length
  dc = DecodeConfig(method=method, gen_length=g, slot_size=g if method == "ar" else args.slot_size,
                    block_size=g, slot_threshold=0.5, token_threshold=0.1,
                    matmul_precision=args.matmul_precision)
  batch = engine.LiveBatch(engine.Decoder(model, dc), args.rows, args.prompt_len)
  batch.warm_up()
  vocab = model.config.vocab_size
  rows = list(range(args.rows))
  times = {"run": [], "pass": [], "admit_one": [], "admit_all": [], "packed": [],
           "per_field": []}
  busy = 0
  for trial in range(args.trials + 5):
    batch.free(rows)
    prompts = [[(7 + 13 * (i + trial)) % (vocab - 2) + 1] * args.prompt_len for i in rows]
    jax.block_until_ready(batch.state)
    a0 = time.perf_counter()
    batch.admit(prompts, rows, np.zeros((args.rows, 2), np.uint32))
    jax.block_until_ready(batch.state)
    a1 = time.perf_counter()
    batch.free([0])
    batch.admit(prompts[:1], [0], np.zeros((1, 2), np.uint32))
    jax.block_until_ready(batch.state)
    a2 = time.perf_counter()
    t0 = time.perf_counter()
    batch.run(1, stop_on_done=False)
    t1 = time.perf_counter()
    still = _busy(batch.state)
    jax.block_until_ready(batch.state)
    t2 = time.perf_counter()
    snap = batch.read()
    t3 = time.perf_counter()
    (out, nfe, phase, passes), copies = _read_per_field(batch)
    t4 = time.perf_counter()
    if not ((out.tokens_bg == snap.tokens_bg).all() and (nfe == snap.nfe_b).all()
            and (phase == snap.phase_b).all() and int(passes) == snap.passes):
      raise AssertionError(f"{method}: the packed read differs from the per-field one")
    if trial >= 5:
      busy += still
      times["run"].append((t1 - t0) * 1e3)
      times["pass"].append((t2 - t0) * 1e3)
      times["admit_all"].append((a1 - a0) * 1e3)
      times["admit_one"].append((a2 - a1) * 1e3)
      times["packed"].append((t3 - t2) * 1e3)
      times["per_field"].append((t4 - t3) * 1e3)
  med = {k: statistics.median(v) for k, v in times.items()}
  fused = admit_then_run(batch.decoder, args.rows, args.prompt_len, prompts, args.trials)
  gaps = after_gaps(batch, prompts[0], args.trials)
  return {**gaps, "turn_two_programs_ms": fused["two"], "turn_one_program_ms": fused["one"],
          "turn_reads_equal": f"{fused['equal']}/{fused['trials']}",
          "method": method, "run_ms": med["run"], "busy": busy, "trials": args.trials,
          "pass_ms": med["pass"], "admit_one_ms": med["admit_one"],
          "admit_all_ms": med["admit_all"],
          "packed_ms": med["packed"], "per_field_ms": med["per_field"], "copies": copies}


def main(argv=None) -> list[dict]:
  args = parse_args(argv)
  if args.model_dir:
    models = [(m, args.model_dir) for m in args.methods]
  elif all(os.path.isdir(os.path.join(REPO, d)) for d in MAIN_JOB.values()):
    models = [(m, os.path.join(REPO, MAIN_JOB.get(m, MAIN_JOB["refusion"])))
              for m in args.methods]
  else:
    models = [(m, os.path.join(REPO, BASE)) for m in args.methods]
  device = jax.devices()[0]
  print(f"device: {device.platform} ({device.device_kind}); {args.rows} rows, prompts of "
        f"{args.prompt_len}, gen {args.gen_length}"
        + ("" if args.matmul_precision is None else f", matmul_precision {args.matmul_precision}")
        + f"; medians of {args.trials} turns")
  print("\n| method | run(1) returns after (ms) | device still busy then | one pass, done (ms) "
        "| admission of 1 prompt, done (ms) | of a prompt per row (ms) | 1-prompt admission / "
        "pass | read, packed (ms) | read, one copy per field (ms) | per field / packed |")
  print("|---|---|---|---|---|---|---|---|---|---|")
  rows = []
  for method, model_dir in models:
    r = turn(model_dir, method, args)
    rows.append(r)
    print(f"| {method} | {r['run_ms']:.2f} | {r['busy']}/{r['trials']} | {r['pass_ms']:.2f} "
          f"| {r['admit_one_ms']:.2f} | {r['admit_all_ms']:.2f} "
          f"| {r['admit_one_ms'] / r['pass_ms']:.2f}x | {r['packed_ms']:.3f} "
          f"| {r['per_field_ms']:.3f} ({r['copies']} copies) | "
          f"{r['per_field_ms'] / r['packed_ms']:.2f}x |", flush=True)
  print("\nA returning client's turn (a prompt into a freed row, run(1), the read), ms:\n")
  print("| method | admission, then run: two programs | one program (fuse_admission) | one / two "
        "| trials whose reads are equal |")
  print("|---|---|---|---|---|")
  for r in rows:
    print(f"| {r['method']} | {r['turn_two_programs_ms']:.3f} | {r['turn_one_program_ms']:.3f} "
          f"| {r['turn_one_program_ms'] / r['turn_two_programs_ms']:.2f}x "
          f"| {r['turn_reads_equal']} |")
  print("\nDispatch alone (ms until the call returns), after a gap of each kind:\n")
  print("| method | program | " + " | ".join(f"after {g}" for g in GAPS) + " |")
  print("|---|---|" + "---|" * len(GAPS))
  for r in rows:
    for what, name in (("admit", "admission of 1 prompt"), ("trivial", "x + 1")):
      print(f"| {r['method']} | {name} | "
            + " | ".join(f"{r[f'{what}_after_{g}']:.3f}" for g in GAPS) + " |")
  return rows


if __name__ == "__main__":
  main()
