"""The server's engine loop under closed-loop clients: running ahead of its reads or
not, and running ahead with its programs called from a thread of their own.

While a row is free the server's engine (`refusion_jax.serve.scheduler`) hands
control back after every pass. Run ahead (`--config.run_ahead=true`), it
dispatches the next pass before reading the last one's rows and handing them
out, so that the device works meanwhile; a freed row then sits out that pass.
Not run ahead, it reads, hands the results over, admits what came in and only
then dispatches, so that a client that comes straight back joins the next pass.
Which pays depends on whether a dispatch returns before its passes have run
(CPUs, TPUs) or only after (GPUs: the host reads each loop condition). With
`--config.dispatch_thread` the programs are called from a thread of their own,
so that running ahead overlaps the host's work with the passes there too.

Per method this runs the offline engine and the in-process closed loop of
`serve_load.py` (the server's `Scheduler` and clients that submit their next
prompt from within the delivery of their last response; no HTTP) run ahead,
not run ahead, and run ahead on a dispatch thread, on the same prompts,
alternated, and prints throughput, forward passes and admission calls.
`--dispatch_waits` makes every call of a run program of the loop return only
once its passes have run, as a GPU's does (on whichever thread makes it), to
see on a CPU what the settings do there (the offline engine is left as it is:
it reads right after each dispatch anyway). `--loop_stagger 0` starts
the clients together, as the offline engine fills its rows: then only what
lies between a response and the next request differs from the offline engine.

A second table shows where the loop's engine thread spends its time, per run
call: in `LiveBatch.run` (on a GPU its passes, since the dispatch returns only
once they have run), in reads (on a CPU, the wait for the passes), in admission
calls, holding for a returning client, and the rest: the turn's own Python and
deliveries, which on a GPU no pass overlaps.

  python benchmarks/closed_loop_turns.py                   # main job's models when present
  python benchmarks/closed_loop_turns.py --dispatch_waits --methods refusion
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import serve_load  # noqa: E402  (no JAX import)


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--model_dir", default="",
                 help="model for every method (default: the main job's models when present, "
                      "else the bundled base, refusion_jax/assets/base_tiny)")
  p.add_argument("--methods", default="refusion,ar")
  p.add_argument("--clients", type=int, default=16)
  p.add_argument("--requests_per_client", type=int, default=16)
  p.add_argument("--rows", type=int, default=16)
  p.add_argument("--gen_length", type=int, default=24)
  p.add_argument("--row_counts", default="",
                 help="the loop's --config.row_counts (default none: passes over every row, "
                      "as on an accelerator)")
  p.add_argument("--loop_stagger", type=int, default=1,
                 help="the loop's clients start this many engine turns apart (0: all at "
                      "once, as the offline engine's rows do; serve_load.py's --loop_stagger)")
  p.add_argument("--dispatch_waits", action="store_true",
                 help="every run of the loop returns only once its passes have run (a GPU's "
                      "dispatch)")
  p.add_argument("--matmul_precision", default=None, choices=serve_load.MATMUL_PRECISIONS,
                 help="decode.matmul_precision on both sides (default: per platform, "
                      "'highest' on GPUs)")
  p.add_argument("--server_flags", default="",
                 help="more settings of the loop's scheduler, as the server takes them: "
                      "'--config.FIELD=VALUE ...' (serve_load.py's --server_flags)")
  p.add_argument("--repeats", type=int, default=3)
  args = p.parse_args(argv)
  for name in ("clients", "requests_per_client", "rows", "gen_length", "repeats"):
    if getattr(args, name) < 1:
      p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
  if args.loop_stagger < 0:
    p.error(f"--loop_stagger must be >= 0 (engine turns), got {args.loop_stagger}")
  args.methods = serve_load.parse_methods(p, args.methods)
  return args


RUN_PROGRAMS = ("_live_run", "_live_run_rows", "_live_admit_run")


class _Waiting:
  """A program whose call returns only once its outputs are ready (a GPU's loop)."""

  def __init__(self, fn):
    self._fn = fn

  def __call__(self, *a, **k):
    import jax  # pylint: disable=import-outside-toplevel
    return jax.block_until_ready(self._fn(*a, **k))

  def __getattr__(self, name):  # `__wrapped__`, `_cache_size`: the program's own
    return getattr(self._fn, name)


def _waiting_runs(engine_module):
  """Makes every call of `LiveBatch`'s run programs wait for its passes; returns the undo."""
  real = {name: getattr(engine_module, name) for name in RUN_PROGRAMS}
  for name, fn in real.items():
    setattr(engine_module, name, _Waiting(fn))
  return lambda: [setattr(engine_module, name, fn) for name, fn in real.items()]


LOOPS = (("ahead", "run ahead", {"run_ahead": True, "dispatch_thread": False}),
         ("not_ahead", "not run ahead", {"run_ahead": False, "dispatch_thread": False}),
         ("thread", "run ahead, dispatch thread", {"run_ahead": True, "dispatch_thread": True}))


class _EngineClock:
  """Where the engine thread's time goes: patches `LiveBatch.run`, `LiveBatch.admit`,
  `PendingRead.__call__` and `Scheduler._await_return` to add up the seconds the
  engine thread spends in each (other threads are not counted) and the calls;
  `reset` starts over, `undo` restores the methods. The rest of a run's wall time is
  the engine thread's own work (the turn's Python, deliveries and dispatches of
  nothing else) and any wait for a request while no row is busy."""

  PARTS = ("run", "read", "admit", "hold")

  def __init__(self, live_batch_cls, pending_read_cls, scheduler_cls):
    self.seconds, self.calls = {}, {}
    self.reset()
    self._undo = []
    for cls, name, part in ((live_batch_cls, "run", "run"), (live_batch_cls, "admit", "admit"),
                            (pending_read_cls, "__call__", "read"),
                            (scheduler_cls, "_await_return", "hold")):
      fn = getattr(cls, name)

      def timed(*a, _fn=fn, _part=part, **k):
        if threading.current_thread().name != "refusion-engine":
          return _fn(*a, **k)
        t = time.perf_counter()
        try:
          return _fn(*a, **k)
        finally:
          self.seconds[_part] += time.perf_counter() - t
          self.calls[_part] += 1
      setattr(cls, name, timed)
      self._undo.append((cls, name, fn))

  def reset(self) -> None:
    self.seconds = dict.fromkeys(self.PARTS, 0.0)
    self.calls = dict.fromkeys(self.PARTS, 0)

  def per_run(self, wall: float) -> dict:
    """Milliseconds per run call in each part, and in the rest of `wall`."""
    n = max(self.calls["run"], 1)
    out = {part: 1e3 * self.seconds[part] / n for part in self.PARTS}
    out["rest"] = 1e3 * (wall - sum(self.seconds.values())) / n
    out["run_calls"] = self.calls["run"]
    return out

  def undo(self) -> None:
    for cls, name, fn in reversed(self._undo):
      setattr(cls, name, fn)


def _admissions(sched) -> int:
  return sum(lane.admissions for lane in list(sched._lanes.values()))  # pylint: disable=protected-access


def measure(method: str, model_dir: str, args, clock: _EngineClock) -> dict:
  from refusion_jax import sample, serve  # pylint: disable=import-outside-toplevel
  from refusion_jax.config import DecodeConfig  # pylint: disable=import-outside-toplevel
  model_config, model = sample.load_model(model_dir)
  tok = serve_load.tokenizer_for(model_dir)
  sl = serve_load.parse_args([f"--methods={method}", f"--clients={args.clients}",
                              f"--rows={args.rows}", f"--gen_length={args.gen_length}",
                              f"--block_size={args.gen_length}",
                              f"--row_counts={args.row_counts}", "--compile_cache=",
                              f"--loop_stagger={args.loop_stagger}",
                              f"--server_flags={args.server_flags}"]
                             + ([f"--matmul_precision={args.matmul_precision}"]
                                if args.matmul_precision else []))
  prompts = serve_load.load_prompts(os.path.join(serve_load.REPO, sl.task_prompts),
                                    args.requests_per_client * args.clients, tok)
  width = -(-max(len(p) for p in prompts) // 16) * 16
  slot = args.gen_length if method == "ar" else sl.slot_size
  dc = DecodeConfig(method=method, gen_length=args.gen_length, slot_size=slot,
                    block_size=args.gen_length, slot_threshold=sl.slot_threshold,
                    token_threshold=sl.token_threshold, matmul_precision=args.matmul_precision)
  dc.check_fits(model_config, width)
  config = serve_load.serve_config(model_dir, method, sl, width)
  eng = serve_load.offline_engine(model, dc, prompts, args.rows, width,
                                  serve.parse_admit_widths(config.admit_widths, width))
  loops = {}
  for name, _, settings in LOOPS:
    config.update(settings)
    loops[name] = serve.make_scheduler(config)
    loops[name].start()
  runs: dict = {"offline": [], **{name: [] for name, _, _ in LOOPS}}
  try:
    for _ in range(args.repeats):
      run = eng.run(prompts)
      want = [r.tokens for r in run.results]
      runs["offline"].append((sum(len(t) for t in want) / run.seconds, run.passes,
                              run.admissions))
      for name, sched in loops.items():
        before = _admissions(sched)
        wall, tokens, passes = serve_load.closed_loop(sched, prompts, args.clients, sl,
                                                      on_start=clock.reset)
        if tokens != want:
          raise AssertionError(f"{method}: the loop ({name}) decoded other tokens "
                               " than the offline engine")
        runs[name].append((sum(len(t) for t in tokens) / wall, passes,
                            _admissions(sched) - before, clock.per_run(wall)))
  finally:
    for sched in loops.values():
      sched.stop()
  out = {"method": method}
  for name, got in runs.items():
    out[name] = {"tok_s": statistics.median(r[0] for r in got),
                 "passes": statistics.median(r[1] for r in got),
                 "admissions": statistics.median(r[2] for r in got)}
    if name != "offline":
      out[name]["ms_per_run"] = {k: statistics.median(r[3][k] for r in got) for k in got[0][3]}
  return out


def main(argv=None) -> list[dict]:
  args = parse_args(argv)
  import jax  # pylint: disable=import-outside-toplevel
  from refusion_jax.decode import engine  # pylint: disable=import-outside-toplevel
  models = serve_load.models_for(args.model_dir, args.methods)
  device = jax.devices()[0]
  print(f"device: {device.platform} ({device.device_kind}); {args.rows} rows, {args.clients} "
        f"closed-loop clients {args.loop_stagger} turn(s) apart, "
        f"{args.requests_per_client * args.clients} requests, gen "
        f"{args.gen_length}, row_counts {args.row_counts!r}"
        + ("" if args.matmul_precision is None else f", matmul_precision {args.matmul_precision}")
        + (f", {args.server_flags}" if args.server_flags else "")
        + "; the loop's dispatch "
        + ("made to wait for its passes (as on a GPU)" if args.dispatch_waits
           else "as this device does it")
        + f"; medians of {args.repeats} alternated runs")
  print("\n| method | loop | tok/s | / offline | passes | admission calls |")
  print("|---|---|---|---|---|---|")
  from refusion_jax.serve import scheduler  # pylint: disable=import-outside-toplevel
  undo = _waiting_runs(engine) if args.dispatch_waits else (lambda: None)
  clock = _EngineClock(engine.LiveBatch, engine.PendingRead, scheduler.Scheduler)
  rows = []
  try:
    for method, model_dir in models:
      r = measure(method, model_dir, args, clock)
      rows.append(r)
      off = r["offline"]
      for name, label in [("offline", "offline engine")] + [(n, l) for n, l, _ in LOOPS]:
        x = r[name]
        print(f"| {method} | {label} | {x['tok_s']:,.0f} | {x['tok_s'] / off['tok_s']:.2f}x "
              f"| {x['passes']:.0f} | {x['admissions']:.0f} |", flush=True)
  finally:
    clock.undo()
    undo()
  print("\nThe loop's engine thread, ms per run call (medians): in `LiveBatch.run` (on a GPU, "
        "or with --dispatch_waits, the passes), in reads (on a CPU, the wait for the passes), "
        "in admission calls, holding for a returning client (run ahead only), the rest (the "
        "turn's own Python and deliveries)")
  print("\n| method | loop | run calls | run | reads | admissions | hold | the rest |")
  print("|---|---|---|---|---|---|---|---|")
  for r in rows:
    for name, label, _ in LOOPS:
      t = r[name]["ms_per_run"]
      print(f"| {r['method']} | {label} | {t['run_calls']:.0f} | {t['run']:.2f} | {t['read']:.2f} "
            f"| {t['admit']:.2f} | {t['hold']:.2f} | {t['rest']:.2f} |")
  return rows


if __name__ == "__main__":
  main()
