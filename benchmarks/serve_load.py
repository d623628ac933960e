"""The server's own overhead: load on the OpenAI-compatible server beside the same
engine loop without HTTP, and the offline engine.

For each model and decoding method the server runs as its own process (`python -m
refusion_jax.serve`, `--rows` rows, prompt width and decode shape as below) and
this process plays 1, 16 and 64 concurrent streaming clients (asyncio, one
keep-alive connection each), every client taking the next of the level's prompts
until none is left (`--requests_per_client` x clients, or `--prompts`). Beside
them, the same closed loop without HTTP (`closed_loop`: the server's engine loop,
its `Scheduler`, in this process, each client submitting its next prompt from
within the delivery of its last response, the clients started `--loop_stagger`
engine turns apart as the server's fall out of step). **server / loop** is what
the server adds over its own engine loop under the same clients (the serving
target: at least 0.90x); the offline engine (`decode.engine.Engine`, the same
prompts, width, prefill widths, decode settings and rows, no closed loop: a freed
row is refilled before the next pass) is shown for scale, with the passes each
side ran over the offline engine's (above 1 where rows sat idle between a
response and the next request). Per level: throughput (completion tokens / wall
time), time to first token and request latency (p50 / p99), the CPU cores used by
the client, the server's HTTP process and its engine process, and whether every
response's tokens equal the offline engine's. Server, loop and offline runs
alternate `--repeats` times per level (medians; each ratio the median of
back-to-back pairs). The clients speak HTTP/1.1 over asyncio streams directly
(`Connection`): on a small CPU host a general client library spends enough CPU
to slow the server it shares the cores with.

  python benchmarks/serve_load.py                       # the main job's models when present
  python benchmarks/serve_load.py --model_dir DIR --methods refusion,ar
  python benchmarks/serve_load.py --ignore_eos --gen_length 64 --block_size 32

Models: `--model_dir` for every method in `--methods` when given; else the
main job's model of each method (runs/repro_tiny/models/{refusion,arm,mdm}/
final_model) when all of them exist, else the bundled base
(refusion_jax/assets/base_tiny). Prompts: the chat-templated queries of
`--task_prompts`, sent as token ids (both sides decode identical ids).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from refusion_jax import runtime  # noqa: E402
from refusion_jax.decode.settings import MATMUL_PRECISIONS  # noqa: E402  (no JAX import)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAIN_JOB = {"refusion": "runs/repro_tiny/models/refusion/final_model",
            "mdm": "runs/repro_tiny/models/mdm/final_model",
            "ar": "runs/repro_tiny/models/arm/final_model"}


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--model_dir", default="",
                 help="model for every method in --methods (default: the main job's models "
                      "when present, else the bundled base, refusion_jax/assets/base_tiny)")
  p.add_argument("--methods", default="refusion,ar")
  p.add_argument("--clients", default="1,16,64", help="concurrency levels")
  p.add_argument("--requests_per_client", type=int, default=16,
                 help="requests per level: this many per client (so that the timed window "
                      "is long beside a request's latency, also on a GPU)")
  p.add_argument("--prompts", type=int, default=0,
                 help="requests per level, the same at every level (0: --requests_per_client "
                      "x clients)")
  p.add_argument("--rows", type=int, default=16, help="server, loop and offline rows")
  p.add_argument("--task_prompts", default="refusion_jax/assets/data/tiny_test.jsonl")
  p.add_argument("--gen_length", type=int, default=24)
  p.add_argument("--slot_size", type=int, default=4)
  p.add_argument("--block_size", type=int, default=24)
  p.add_argument("--slot_threshold", type=float, default=0.5)
  p.add_argument("--token_threshold", type=float, default=0.1)
  p.add_argument("--ignore_eos", action="store_true",
                 help="EOS ends nothing: every answer is gen_length tokens, on both sides (a load "
                      "of fixed answer lengths, as vLLM's --ignore-eos; decode.ignore_eos)")
  p.add_argument("--kv_chunk", type=int, default=None,
                 help="decode.kv_chunk on both sides: KV entries attention reads at a time, up "
                      "to the longest row's live part (0: the whole buffer; default: per "
                      "platform)")
  p.add_argument("--matmul_precision", default=None, choices=MATMUL_PRECISIONS,
                 help="decode.matmul_precision on both sides (default: per platform, "
                      "'highest' on GPUs)")
  p.add_argument("--chunk_passes", type=int, default=4, help="the server's --config.chunk_passes")
  p.add_argument("--row_counts", default="auto", help="the server's --config.row_counts")
  p.add_argument("--server_flags", default="",
                 help="more server flags, space-separated (e.g. --config.chunk_passes=2)")
  p.add_argument("--no_stream", action="store_true", help="clients ask for whole responses")
  p.add_argument("--loop_stagger", type=int, default=1,
                 help="the in-process loop's clients start this many engine turns apart (0: "
                      "all at once; with fixed answer lengths they then stay in lockstep, "
                      "which the server's clients do not)")
  p.add_argument("--compile_cache", default="auto",
                 help="JAX's persistent compilation cache, shared by this process and the "
                      "server's, so the server loads the programs the in-process loop "
                      "compiled instead of compiling them again: a folder (kept), 'auto' (a "
                      "temporary folder removed at the end; the one JAX already uses when "
                      "set, as by JAX_COMPILATION_CACHE_DIR) or '' (none)")
  p.add_argument("--repeats", type=int, default=3,
                 help="server / loop / offline runs alternated per level (medians reported)")
  args = p.parse_args(argv)
  try:
    args.clients = [int(x) for x in args.clients.split(",") if x.strip()]
  except ValueError:
    p.error(f"--clients must be comma-separated ints, got {args.clients!r}")
  if not args.clients or min(args.clients) < 1:
    p.error("--clients must be positive")
  if args.prompts < 0 or args.requests_per_client < 1 or args.rows < 1 or args.repeats < 1:
    p.error("--requests_per_client, --rows and --repeats must be >= 1, --prompts >= 0")
  if args.loop_stagger < 0:
    p.error(f"--loop_stagger must be >= 0 (engine turns), got {args.loop_stagger}")
  args.methods = parse_methods(p, args.methods)
  args.cache_dir = None  # the folder --compile_cache names, once `main` has made it
  return args


def parse_methods(p: argparse.ArgumentParser, text: str) -> list[str]:
  """`--methods`: comma-separated methods with a main-job model (`p.error` otherwise)."""
  methods = [m for m in text.split(",") if m]
  unknown = sorted(set(methods) - set(MAIN_JOB))
  if unknown or not methods:
    p.error(f"--methods: {unknown or 'none given'}; choose from refusion, ar, mdm")
  return methods


def models_for(model_dir: str, methods: list[str]) -> list[tuple[str, str]]:
  """(method, model folder) pairs: `model_dir` for every method when given, else the
  main job's models when all are present, else the bundled base."""
  if model_dir:
    return [(m, model_dir) for m in methods]
  if all(os.path.isdir(os.path.join(REPO, MAIN_JOB[m])) for m in methods):
    return [(m, os.path.join(REPO, MAIN_JOB[m])) for m in methods]
  return [(m, os.path.join(REPO, "refusion_jax/assets/base_tiny")) for m in methods]


def _pct(xs, q):
  xs = sorted(xs)
  return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else float("nan")


def mismatch(got: list[list[int]], want: list[list[int]]) -> tuple[int, int | None]:
  """(how many responses differ from `want`'s, the earliest token position at which one
  differs; None when none does). A response of another length differs where the shorter
  one ends."""
  if len(got) != len(want):
    raise ValueError(f"{len(got)} responses against {len(want)}")
  first = None
  bad = 0
  for g, w in zip(got, want):
    if g == w:
      continue
    bad += 1
    at = next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), min(len(g), len(w)))
    first = at if first is None else min(first, at)
  return bad, first


def _mismatch_text(server, loop, n: int) -> str:
  """The table's cell: "yes", or how many of the n responses differ on each side."""
  if not server[0] and not loop[0]:
    return "yes"
  return "NO: " + ", ".join(f"{side} {k} of {n}" + (f" (from token {at})" if k else "")
                            for side, (k, at) in (("server", server), ("loop", loop)))


def summary(rows_out: list[dict]) -> list[str]:
  """The lines printed under the table: the server's overhead over its engine loop
  against the target (at most 10%)."""
  if not rows_out:
    return []
  worst = min(rows_out, key=lambda r: r["server_loop_ratio"])
  return ["", "server / its engine loop without HTTP (target >= 0.90x): "
          + ", ".join(f"{r['method']} {r['clients']} clients {r['server_loop_ratio']:.2f}x"
                      for r in rows_out)
          + f"; lowest {worst['server_loop_ratio']:.2f}x ({worst['method']}, "
          f"{worst['clients']} clients)"]


def load_prompts(path: str, n: int, tokenizer) -> list[list[int]]:
  """The chat-templated queries of the first `n` lines of `path` (a JSONL file with a
  "query" per line), as token ids; a file of fewer lines is gone through again."""
  out = []
  with open(path, encoding="utf-8") as f:
    for line in f:
      if line.strip():
        out.append(tokenizer.encode_prompt(json.loads(line)["query"]))
      if len(out) == n:
        break
  if not out:
    raise ValueError(f"--task_prompts {path}: no prompts in it")
  have = len(out)
  while len(out) < n:  # a short file: its prompts again, in order
    out.append(out[len(out) % have])
  return out


def offline_engine(model, dc, prompts, rows: int, width: int, admit_widths=()):
  """The engine with `rows` rows, prefilling at the narrowest of `admit_widths` (and
  `width`) that holds an admission's prompts, every program it calls on `prompts`
  compiled."""
  from refusion_jax.decode import engine  # pylint: disable=import-outside-toplevel
  eng = engine.Decoder(model, dc).engine(rows, width=width, admit_widths=admit_widths)
  eng.run(prompts)
  return eng


def offline(eng, prompts) -> tuple[float, list[list[int]], int, float]:
  """(tokens/s, tokens per prompt, forward passes, mean passes of a request's own decode
  (its row's NFE)) of one timed run."""
  run = eng.run(prompts)
  tokens = [r.tokens for r in run.results]
  return (sum(len(t) for t in tokens) / run.seconds, tokens, run.passes,
          statistics.mean(r.counters["nfe_b"] for r in run.results))


def server_fields(model_dir, method, args, width) -> dict:
  """The fields of configs/serve.py that this benchmark sets, by dotted name: the
  server's command line (`start_server`) and the in-process loop's config
  (`serve_config`) both come from here."""
  slot, block = ((args.gen_length, args.gen_length) if method == "ar"
                 else (args.slot_size, args.block_size))
  return {"model_dir": model_dir, "rows": args.rows, "max_prompt_len": width,
          "max_queue": max(args.clients) * 2, "chunk_passes": args.chunk_passes,
          "row_counts": args.row_counts,
          "decode.method": method, "decode.gen_length": args.gen_length,
          "decode.slot_size": slot, "decode.block_size": block,
          "decode.slot_threshold": args.slot_threshold,
          "decode.token_threshold": args.token_threshold, "decode.ignore_eos": args.ignore_eos,
          **({} if args.kv_chunk is None else {"decode.kv_chunk": args.kv_chunk}),
          **({} if args.matmul_precision is None
             else {"decode.matmul_precision": args.matmul_precision}),
          **({"compile_cache_dir": args.cache_dir} if args.cache_dir else {})}


def serve_config(model_dir, method, args, width):
  """configs/serve.py as the server's command line sets it: `server_fields`, then
  `--server_flags` (each --config.FIELD=VALUE, cast to its field's type)."""
  from configs import serve as serve_configs  # pylint: disable=import-outside-toplevel
  c = serve_configs.get_config()

  def put(dotted: str, value):
    *path, name = dotted.split(".")
    node = c
    for part in path:
      node = node[part]
    node[name] = value

  for name, value in server_fields(model_dir, method, args, width).items():
    put(name, value)
  for flag in args.server_flags.split():
    m = re.fullmatch(r"--config\.([\w.]+)=(.*)", flag)
    if not m:
      raise ValueError(f"--server_flags: {flag!r} is not --config.FIELD=VALUE")
    old, value = c[m.group(1)], m.group(2)  # a ConfigDict reads dotted names (not writes)
    put(m.group(1), value.lower() in ("1", "true") if isinstance(old, bool)
        else type(old)(value) if old is not None
        else value.lower() == "true" if value.lower() in ("true", "false") else value)
  return c


def loop_job(prompt, bucket, knobs, args, deliver):
  """A request as the server's HTTP side would submit it for this benchmark's clients
  (greedy, key 0, the bucket's whole gen_length, progress watched when streaming)."""
  import numpy as np  # pylint: disable=import-outside-toplevel

  from refusion_jax.serve.scheduler import Job  # pylint: disable=import-outside-toplevel
  return Job(prompt=list(prompt), bucket=bucket, knobs=knobs, rng2=np.zeros((2,), np.uint32),
             max_tokens=args.gen_length, watch=not args.no_stream, slots=False,
             deliver=deliver)


def closed_loop(scheduler, prompts, clients: int, args,
                on_start=None) -> tuple[float, list, float]:
  """The server's engine loop (`Scheduler`, in this process) under `clients` closed-loop
  clients that take no time: each submits its next prompt from within the delivery of
  its last response, with no HTTP between. (wall seconds, tokens per prompt, passes).

  The server and this differ only in what lies between a response and the next
  request (HTTP, the client, the engine process's pipe); the offline engine also
  has no closed loop (a freed row is refilled before the next pass).

  Client c sends its first prompt after `c * args.loop_stagger` engine turns (the
  scheduler's `after_turn`): started together, clients whose answers all take the
  same passes (`--ignore_eos`) finish in the same pass and are admitted in one call
  for good, where the server's clients, out of step after their first responses,
  come back at different passes. `on_start` (optional) is called just before the
  timed requests start, after the warm-up."""
  import threading  # pylint: disable=import-outside-toplevel
  bucket = scheduler.buckets[0]
  knobs = scheduler.default_knobs(bucket)
  lock, finished = threading.Lock(), threading.Event()
  starts: list = []  # (turns to wait, submit) for clients not started yet
  after_turn = scheduler.after_turn

  def turn():  # the engine thread, after each turn
    with lock:
      due = [s for s in starts if s[0] <= 1]
      starts[:] = [(k - 1, f) for k, f in starts if k > 1]
    for _, start in due:
      start()
    after_turn()
  scheduler.after_turn = turn

  def run(todo: list, timed: bool) -> tuple[float, dict]:
    results: dict[int, list[int]] = {}
    errors: list = []
    total = len(todo)

    def submit():
      with lock:
        if not todo:
          return
        i, prompt = todo.pop(0)

      def deliver(kind, payload):
        if kind == "error":
          errors.append(payload)
          finished.set()
        elif kind == "done":
          results[i] = payload.tokens
          if len(results) == total:
            finished.set()
          submit()
      scheduler.submit(loop_job(prompt, bucket, knobs, args, deliver))

    finished.clear()
    if timed and on_start is not None:
      on_start()
    t0 = time.perf_counter()
    with lock:
      starts.extend((c * args.loop_stagger, submit)
                    for c in range(1, min(clients, total)) if args.loop_stagger)
    for _ in range(1 if args.loop_stagger else min(clients, total)):
      submit()
    if not finished.wait(600):
      raise RuntimeError(f"closed loop: {len(results)} of {total} requests done after 600 s")
    if errors:
      raise RuntimeError(f"closed loop: {errors[0]}")
    return time.perf_counter() - t0, results

  def passes() -> int:
    return sum(lane.passes for lane in list(scheduler._lanes.values()))  # pylint: disable=protected-access

  try:
    run([(i, prompts[0]) for i in range(clients)], False)  # each client's first request: warm-up
    before = passes()
    wall, results = run(list(enumerate(prompts)), True)
  finally:
    scheduler.after_turn = after_turn
  return wall, [results[i] for i in range(len(prompts))], passes() - before


def cpu_seconds(pid: int | None = None) -> float:
  """User + system CPU seconds of a process so far (this one when pid is None)."""
  if pid is None:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime
  try:
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
      fields = f.read().rsplit(")", 1)[1].split()
  except OSError:
    return float("nan")
  return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def server_pids(proc: subprocess.Popen) -> tuple[int, int | None]:
  """(HTTP process, engine process or None): the server and its child, if any."""
  try:
    with open(f"/proc/{proc.pid}/task/{proc.pid}/children", encoding="ascii") as f:
      kids = [int(x) for x in f.read().split()]
  except OSError:
    kids = []
  # The engine process is the spawned child that runs the model (the only one besides
  # multiprocessing's resource tracker, which uses next to no CPU).
  kids.sort(key=cpu_seconds)
  return proc.pid, (kids[-1] if kids else None)


def server_passes(url) -> float:
  """The server's forward passes so far (its /metrics)."""
  # The standard library's client: the benchmark runs in the environment that
  # launch/setup_env.sh builds without --test (no httpx there).
  with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
    text = r.read().decode()
  return float(re.search(r"^refusion_engine_passes_total (\S+)$", text, re.M).group(1))


def server_command(model_dir, method, args, width) -> list[str]:
  """The server's command line: `server_fields`, then `--server_flags` (the last of a
  field wins)."""
  return ([sys.executable, "-m", "refusion_jax.serve", "--config=configs/serve.py",
           "--config.port=0", "--config.model_name=m"]
          + [f"--config.{name}={value}"
             for name, value in server_fields(model_dir, method, args, width).items()]
          + args.server_flags.split())


def start_server(model_dir, method, args, width) -> tuple[subprocess.Popen, str]:
  cmd = server_command(model_dir, method, args, width)
  proc = subprocess.Popen(cmd, cwd=REPO, stderr=subprocess.PIPE, text=True)
  while True:
    line = proc.stderr.readline()
    if not line and proc.poll() is not None:
      raise RuntimeError(f"the server exited with {proc.returncode}")
    if line.startswith("[serve] compiled"):  # the server's start-up, beside the loop's
      print("[server process] " + line[len("[serve] "):].rstrip(), file=sys.stderr, flush=True)
    m = re.search(r"listening on (http://\S+)", line)
    if m:
      return proc, m.group(1)


class Connection:
  """One keep-alive HTTP/1.1 connection that posts JSON and reads the reply (a body of
  `Content-Length` bytes or chunked, e.g. a server-sent event stream)."""

  def __init__(self, url: str):
    m = re.match(r"http://([^/:]+):(\d+)", url)
    self.host, self.port = m.group(1), int(m.group(2))
    self.reader = self.writer = None

  async def post(self, path: str, body: dict):
    """Sends the request; yields the body's bytes as they come."""
    if self.writer is None:
      self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
    data = json.dumps(body).encode()
    self.writer.write(f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
                      f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n"
                      "\r\n".encode() + data)
    status = await self.reader.readline()
    if not status.startswith(b"HTTP/1.1 200"):
      raise RuntimeError(f"the server answered {status.decode().strip()!r}")
    headers = {}
    while (line := await self.reader.readline()) not in (b"\r\n", b""):
      k, _, v = line.decode().partition(":")
      headers[k.strip().lower()] = v.strip()
    if "content-length" in headers:
      yield await self.reader.readexactly(int(headers["content-length"]))
    else:
      while (size := int((await self.reader.readline()).strip(), 16)):
        yield await self.reader.readexactly(size)
        await self.reader.readexactly(2)
      await self.reader.readexactly(2)
    if headers.get("connection") == "close":
      self.close()

  def close(self):
    if self.writer is not None:
      self.writer.close()
      self.reader = self.writer = None


async def _one(conn: Connection, prompt, args, out):
  body = {"model": "m", "prompt": prompt, "max_tokens": args.gen_length,
          "stream": not args.no_stream}
  t0 = time.perf_counter()
  first = None
  tokens = None
  if args.no_stream:
    data = b"".join([part async for part in conn.post("/v1/completions", body)])
    tokens = json.loads(data)["choices"][0]["token_ids"]
  else:
    pending = b""
    async for part in conn.post("/v1/completions", body):
      pending += part
      *events, pending = pending.split(b"\n\n")
      for event in events:
        if not event.startswith(b"data: {"):
          continue
        choice = json.loads(event[6:])["choices"][0]
        if first is None and choice["text"]:
          first = time.perf_counter() - t0
        if choice["finish_reason"] is not None:
          tokens = choice["token_ids"]
  latency = time.perf_counter() - t0
  out.append((latency, first if first is not None else latency, tokens))


async def load(url, prompts, clients: int, args, pids=(None, None)) -> tuple[float, list, float,
                                                                            tuple]:
  """(wall seconds, (latency, TTFT, tokens) per prompt, server passes, CPU cores used by
  this client, the server's HTTP process and its engine process) of one timed load."""
  todo = list(enumerate(prompts))
  results: dict[int, tuple] = {}

  async def worker(conn):
    while todo:
      i, prompt = todo.pop(0)
      out = []
      await _one(conn, prompt, args, out)
      results[i] = out[0]

  conns = [Connection(url) for _ in range(clients)]
  try:
    # Connections opened and a first request each (warm-up), then the timed load.
    await asyncio.gather(*(_one(c, prompts[0], args, []) for c in conns))
    before = server_passes(url)
    cpu0 = [cpu_seconds(), *(cpu_seconds(p) if p else float("nan") for p in pids)]
    t0 = time.perf_counter()
    await asyncio.gather(*(worker(c) for c in conns))
    wall = time.perf_counter() - t0
    cpu1 = [cpu_seconds(), *(cpu_seconds(p) if p else float("nan") for p in pids)]
    passes = server_passes(url) - before
  finally:
    for c in conns:
      c.close()
  return (wall, [results[i] for i in range(len(prompts))], passes,
          tuple((b - a) / wall for a, b in zip(cpu0, cpu1)))


@contextlib.contextmanager
def compile_cache(setting: str):
  """JAX's persistent compilation cache in `setting`'s folder (see --compile_cache) for
  this process, as the server's `--config.compile_cache_dir` sets it (every program
  kept, however quickly it compiled); JAX's settings are restored afterwards. Yields
  the folder, or None; `server_fields` hands it to the server."""
  import jax  # pylint: disable=import-outside-toplevel

  folder, made = setting, None
  if setting == "auto":
    folder = (os.environ.get("JAX_COMPILATION_CACHE_DIR") or jax.config.jax_compilation_cache_dir
              or None)
    if folder is None:
      folder = made = tempfile.mkdtemp(prefix="serve_load_cache_")
  if not folder:
    yield None
    return
  before = {k: getattr(jax.config, k) for k in (
      "jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
      "jax_persistent_cache_min_entry_size_bytes")}
  runtime.use_compile_cache(folder)
  try:
    yield folder
  finally:
    for k, v in before.items():
      jax.config.update(k, v)
    if made:
      shutil.rmtree(made, ignore_errors=True)


def main(argv=None) -> list[dict]:
  runtime.start_up()  # the entry points' start-up: no libtpu errors where no TPU is
  args = parse_args(argv)
  with compile_cache(args.compile_cache) as folder:
    args.cache_dir = folder
    return _main(args)


def _main(args) -> list[dict]:
  import jax  # pylint: disable=import-outside-toplevel

  from refusion_jax import loading, serve  # pylint: disable=import-outside-toplevel
  from refusion_jax.decode.settings import DecodeConfig  # pylint: disable=import-outside-toplevel

  models = models_for(args.model_dir, args.methods)
  device = jax.devices()[0]
  print(f"device: {device.platform} ({device.device_kind}); rows {args.rows}; "
        + (f"{args.prompts} requests per level" if args.prompts else
           f"{args.requests_per_client} requests per client per level")
        + f"; gen {args.gen_length}, slot {args.slot_size}, "
        f"block {args.block_size}, tau_s {args.slot_threshold}, tau_t {args.token_threshold}"
        f"{', EOS ignored (every answer gen_length tokens)' if args.ignore_eos else ''}"
        f"{'' if args.kv_chunk is None else f', kv_chunk {args.kv_chunk}'}"
        + ("" if args.matmul_precision is None
           else f", matmul_precision {args.matmul_precision}") + "; "
        f"{'whole responses' if args.no_stream else 'streaming'}, chunk_passes "
        f"{args.chunk_passes}, row_counts {args.row_counts!r}"
        f"{', ' + args.server_flags if args.server_flags else ''}, {args.repeats} "
        "alternated repeats per level; "
        + ("compilation cache shared with the server" if args.cache_dir else
           "no compilation cache"))
  rows_out = []
  for method, model_dir in models:
    model_config, model = loading.load_model(model_dir, flag="--model_dir")
    tok = loading.load_tokenizer(model_dir, model_config, flag="--model_dir")
    most = args.prompts or args.requests_per_client * max(args.clients)
    all_prompts = load_prompts(os.path.join(REPO, args.task_prompts), most, tok)
    width = -(-max(len(p) for p in all_prompts) // 16) * 16
    slot, block = ((args.gen_length, args.gen_length) if method == "ar"
                   else (args.slot_size, args.block_size))
    dc = DecodeConfig(method=method, gen_length=args.gen_length, slot_size=slot,
                      block_size=block, slot_threshold=args.slot_threshold,
                      token_threshold=args.token_threshold, ignore_eos=args.ignore_eos,
                      kv_chunk=args.kv_chunk, matmul_precision=args.matmul_precision)
    dc.check_fits(model_config, width)
    config = serve_config(model_dir, method, args, width)
    widths = serve.parse_admit_widths(config.admit_widths, width)  # the server's prefill widths
    eng = offline_engine(model, dc, all_prompts, args.rows, width, widths)
    loop_sched = serve.make_scheduler(config)
    loop_sched.start()
    proc = None
    try:
      proc, url = start_server(model_dir, method, args, width)
      pids = server_pids(proc)
      for clients in args.clients:
        prompts = all_prompts[:args.prompts or args.requests_per_client * clients]
        # Server, loop and offline runs alternate, so that all see the same machine load.
        pairs, res = [], None
        for _ in range(args.repeats):
          off_tps, off_tokens, off_passes, per_request = offline(eng, prompts)
          loop_wall, loop_tokens, loop_passes = closed_loop(loop_sched, prompts, clients, args)
          wall, res, passes, cores = asyncio.run(load(url, prompts, clients, args, pids))
          tps = sum(len(t) for _, _, t in res) / wall
          loop_tps = sum(len(t) for t in loop_tokens) / loop_wall
          pairs.append((tps, off_tps, passes / off_passes, cores, loop_tps,
                        loop_passes / off_passes, mismatch(loop_tokens, off_tokens),
                        mismatch([t for _, _, t in res], off_tokens)))
        row = {"model": os.path.relpath(model_dir, REPO), "method": method, "clients": clients,
               "requests": len(prompts),
               "tok_s": statistics.median(p[0] for p in pairs),
               "offline_tok_s": statistics.median(p[1] for p in pairs),
               "ratio": statistics.median(p[0] / p[1] for p in pairs),
               "loop_tok_s": statistics.median(p[4] for p in pairs),
               "server_loop_ratio": statistics.median(p[0] / p[4] for p in pairs),
               "loop_pass_ratio": statistics.median(p[5] for p in pairs),
               "pass_ratio": statistics.median(p[2] for p in pairs),
               "cores": tuple(statistics.median(p[3][k] for p in pairs) for k in range(3)),
               "request_passes": per_request,
               "ttft_p50_ms": 1e3 * _pct([f for _, f, _ in res], 0.5),
               "lat_p50_ms": 1e3 * _pct([l for l, _, _ in res], 0.5),
               "lat_p99_ms": 1e3 * _pct([l for l, _, _ in res], 0.99),
               # (server, loop): each side's repeat with the most responses that differ
               "mismatch": tuple(max((p[k] for p in pairs), key=lambda m: m[0])
                                 for k in (7, 6))}
        rows_out.append(row)
        print(f"  {method} clients {clients}: {row['tok_s']:,.0f} tok/s "
              f"({row['server_loop_ratio']:.2f}x its engine loop)", file=sys.stderr, flush=True)
    finally:
      loop_sched.stop()
      if proc is not None:
        proc.send_signal(signal.SIGTERM)
        try:
          proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
          proc.kill()
  print(f"\n| model | method | clients | requests | server tok/s | loop tok/s | "
        f"server / loop | offline tok/s, {args.rows} rows | server / offline | "
        "passes / offline: server (loop) | passes / request | TTFT p50 ms | "
        "latency p50 / p99 ms | CPU cores: client / HTTP / engine | same tokens |")
  print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
  for r in rows_out:
    print(f"| {r['model']} | {r['method']} | {r['clients']} | {r['requests']} | "
          f"{r['tok_s']:,.0f} | {r['loop_tok_s']:,.0f} | **{r['server_loop_ratio']:.2f}x** | "
          f"{r['offline_tok_s']:,.0f} | {r['ratio']:.2f}x | "
          f"{r['pass_ratio']:.2f} ({r['loop_pass_ratio']:.2f}) | {r['request_passes']:.1f} | "
          f"{r['ttft_p50_ms']:.1f} | {r['lat_p50_ms']:.1f} / {r['lat_p99_ms']:.1f} | "
          + " / ".join("–" if c != c else f"{c:.2f}" for c in r["cores"])
          + f" | {_mismatch_text(*r['mismatch'], r['requests'])} |")
  for line in summary(rows_out):
    print(line)
  return rows_out


if __name__ == "__main__":
  main()
