"""The engine in a process of its own (`--config.engine=process`).

The HTTP side and the engine loop are both Python: in one process they share
one interpreter lock, so every microsecond spent parsing a request or sending
an event is one the engine thread cannot spend dispatching the next pass (and
the reverse). Where a pass is short (a GPU), that, not the decoder, bounds the
server. Here the `Scheduler` runs in a child process (spawned: JAX and the
model live only there) and the server process talks to it over two pipes:

- server -> engine: `submit` (a job's prompt, bucket, knobs, key and limits),
  `cancel`, `hold`, `stop`;
- engine -> server: at start-up `ready` (the model config, buckets, width) or
  `failed` (the error, raised again by `start`); then one message per engine
  turn with that turn's events (`progress`, `slots`, `done`, `error` per job)
  and the engine's counters (forward passes, cancelled rows, busy rows,
  requests taken off the queue, the last decoder error) when they changed; a
  turn with no event that changed only the pass count sends nothing unless
  `PASSES_EVERY_S` has gone by (the next message carries it).

`EngineProcess` has the `Scheduler` interface the app uses (submit, cancel,
hold, busy_rows, queue_depth, error, buckets, ...); the bounded queue is
counted on the server side, so a full queue answers 429 without a round trip.
Started in an event loop (the app's lifespan), it reads the engine's pipe on
that loop, which then makes every delivery itself: no reader thread to hand each
event over to the loop, and no interpreter lock passed between them. Messages
go over the pipes with the standard pickler. If the engine process dies, every
request in flight gets an error, /health reports it, and new requests are
refused.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import pickle
import signal
import threading
import time
from typing import Any, Callable

import ml_collections
import numpy as np

from refusion_jax.serve.scheduler import Bucket, Capacity, EngineDown, Job, QueueFull

log = logging.getLogger("refusion_jax.serve")


def _put(conn, msg) -> None:
  """Sends `msg` over a pipe: the standard pickler, not multiprocessing's (which
  builds a pickler with its own reducers for every message)."""
  conn.send_bytes(pickle.dumps(msg, pickle.HIGHEST_PROTOCOL))


def _get(conn):
  return pickle.loads(conn.recv_bytes())


# The pass count alone goes to the server at most this often (/metrics).
PASSES_EVERY_S = 0.05


class EngineFailed(RuntimeError):
  """The engine process could not start (the error it raised, by name and message)."""


class _Tally:
  """The engine's metrics as plain numbers (the Scheduler's `metrics` in the child)."""

  class _Counter:
    def __init__(self):
      self.value = 0

    def inc(self, n=1):
      self.value += n

    def set(self, v):
      self.value = v

  def __init__(self):
    self.forward_passes = self._Counter()
    self.cancelled_rows = self._Counter()
    self.busy_rows = self._Counter()
    self.queue_depth = self._Counter()


def _child(make_scheduler: Callable, c_dict: dict, commands, events) -> None:
  """The engine process: builds the scheduler (`make_scheduler(config, metrics=...)`),
  then serves commands until `stop`."""
  # Signals go to the server process, which stops this one when it is done draining.
  signal.signal(signal.SIGINT, signal.SIG_IGN)
  signal.signal(signal.SIGTERM, signal.SIG_IGN)
  send_lock = threading.Lock()

  def send(msg) -> None:
    with send_lock:
      _put(events, msg)

  tally = _Tally()
  outbox: list = []
  jobs: dict[int, Job] = {}
  submitted = [0]
  last: list = [None]
  last_sent = [0.0]
  try:
    c = ml_collections.ConfigDict(c_dict)
    sched = make_scheduler(c, metrics=tally)
    sched.capacity = None  # the server process counts the bounded queue
  except Exception as e:  # pylint: disable=broad-except
    send(("failed", type(e).__name__, str(e)))
    return

  def after_turn() -> None:
    # Runs on the engine thread only (every delivery is made there). A turn with no
    # event whose only change is the pass count sends nothing until PASSES_EVERY_S
    # has gone by, unless no row is busy: a message wakes the server process, which
    # on a small CPU takes time from the passes.
    counters = (tally.forward_passes.value, tally.cancelled_rows.value, tally.busy_rows.value,
                submitted[0] - sched.queue_depth(), sched.error)
    if not outbox:
      if counters == last[0]:
        return
      if (last[0] is not None and counters[1:] == last[0][1:] and counters[2]
          and time.monotonic() - last_sent[0] < PASSES_EVERY_S):
        return
    batch, outbox[:] = list(outbox), []
    last[0] = counters
    last_sent[0] = time.monotonic()
    send(("turn", batch, counters))

  sched.after_turn = after_turn
  send(("ready", {"model_config": sched.model_config, "buckets": sched.buckets,
                  "default_config": sched.default_config, "width": sched.width,
                  "rows": sched.rows, "row_counts": sched.row_counts,
                  "default_knobs": {b: sched.default_knobs(b) for b in sched.buckets}}))
  sched.start()

  def deliverer(key: int):
    def deliver(kind: str, payload: Any) -> None:
      outbox.append((key, kind, payload))
      if kind in ("done", "error"):
        jobs.pop(key, None)
    return deliver

  try:
    while True:
      try:
        msg = _get(commands)
      except (EOFError, OSError):  # the server process is gone
        break
      op = msg[0]
      if op == "submit":
        _, key, prompt, bucket, knobs, rng2, max_tokens, watch, slots = msg
        job = Job(prompt=prompt, bucket=bucket, knobs=knobs, rng2=np.array(rng2, np.uint32),
                  max_tokens=max_tokens,
                  watch=watch, slots=slots, deliver=deliverer(key))
        jobs[key] = job
        submitted[0] += 1
        try:
          sched.submit(job)
        except QueueFull as e:
          submitted[0] -= 1
          jobs.pop(key, None)
          send(("turn", [(key, "error", str(e))], None))
      elif op == "cancel":
        job = jobs.pop(msg[1], None)
        if job is not None:
          sched.cancel(job)
      elif op == "hold":
        sched.hold(msg[1])
      elif op == "stop":
        break
  finally:
    sched.stop()


class EngineProcess:
  """A `Scheduler` run in a child process (module docstring), as the app sees it."""

  def __init__(self, c: ml_collections.ConfigDict, *, make_scheduler: Callable,
               metrics: Any = None, start_timeout_s: float = 3600.0):
    """`make_scheduler(config, metrics=...)` builds the `Scheduler` in the child
    (`serve.make_scheduler`); a module-level function, which the spawned child imports
    by name."""
    self.metrics = metrics
    self.capacity = Capacity(c.rows, c.max_queue)
    ctx = multiprocessing.get_context("spawn")
    cmd_recv, self._commands = ctx.Pipe(duplex=False)
    self._events, evt_send = ctx.Pipe(duplex=False)
    self._proc = ctx.Process(target=_child,
                             args=(make_scheduler, c.to_dict(), cmd_recv, evt_send),
                             name="refusion-engine", daemon=True)
    self._proc.start()
    cmd_recv.close()
    evt_send.close()
    self._lock = threading.Lock()  # the command pipe and the job tables
    self._jobs: dict[int, Job] = {}
    self._keys: dict[Job, int] = {}
    self._ids = itertools.count()
    self._submitted = 0
    self._dequeued = 0
    self._busy = 0
    self._passes = 0
    self._cancelled = 0
    self._engine_error: str | None = None
    self._died: str | None = None
    self._stopping = False
    if not self._events.poll(start_timeout_s):
      self._proc.kill()
      raise EngineFailed(f"the engine process did not start within {start_timeout_s:.0f} s")
    try:
      msg = _get(self._events)
    except EOFError:
      self._proc.join(5)
      raise EngineFailed(f"the engine process exited while starting (exit code "
                         f"{self._proc.exitcode})") from None
    if msg[0] == "failed":
      self._proc.join(30)
      raise _reraise(msg[1], msg[2])
    info = msg[1]
    self.model_config = info["model_config"]
    self.buckets: list[Bucket] = info["buckets"]
    self.default_config = info["default_config"]
    self.width, self.rows, self.row_counts = info["width"], info["rows"], info["row_counts"]
    self._default_knobs = info["default_knobs"]
    self._reader: threading.Thread | None = None
    self._loop: asyncio.AbstractEventLoop | None = None
    self._closed = False  # the event pipe has reached its end
    self._exit_seen = False  # `_exited` has run

  # --- the Scheduler interface ------------------------------------------------------------

  @property
  def error(self) -> str | None:
    return self._died or self._engine_error

  def default_knobs(self, bucket: Bucket) -> tuple:
    return self._default_knobs[bucket]

  def queue_depth(self) -> int:
    return self._submitted - self._dequeued

  def busy_rows(self) -> int:
    return self._busy

  @property
  def forward_passes(self) -> int:
    """Forward passes the engine has reported so far (current once no row is busy)."""
    return self._passes

  def _send(self, msg) -> None:
    try:
      _put(self._commands, msg)
    except (OSError, ValueError):  # the engine process is gone; the reader reports it
      pass

  def submit(self, job: Job) -> None:
    with self._lock:
      if self._stopping:
        raise QueueFull("the server is shutting down")
      if self._died:
        raise EngineDown(self._died)
      self.capacity.take(job)
      key = next(self._ids)
      self._jobs[key], self._keys[job] = job, key
      self._submitted += 1
      self._send(("submit", key, list(job.prompt), job.bucket, job.knobs,
                  [int(x) for x in job.rng2],
                  job.max_tokens, job.watch, job.slots))
    self._gauge()

  def cancel(self, job: Job) -> None:
    job.cancelled = True
    self.capacity.release(job)
    with self._lock:
      key = self._keys.pop(job, None)
      if key is None:
        return
      self._jobs.pop(key, None)
      self._send(("cancel", key))

  def hold(self, on: bool) -> None:
    with self._lock:
      self._send(("hold", bool(on)))

  @property
  def delivers_in_loop(self) -> bool:
    """True once `start` ran in an event loop: every `deliver` is then called on that
    loop's thread (the app hands events over without `call_soon_threadsafe`)."""
    return self._loop is not None

  def start(self) -> None:
    """Starts reading the engine's events: in the running event loop when there is one
    (its thread then makes every delivery, with no thread hand-over per event), else
    on a thread of its own."""
    try:
      self._loop = asyncio.get_running_loop()
    except RuntimeError:
      self._loop = None
    if self._loop is not None:
      self._loop.add_reader(self._events.fileno(), self._readable)
      return
    self._reader = threading.Thread(target=self._read, name="refusion-engine-events",
                                    daemon=True)
    self._reader.start()

  def stop(self, timeout: float = 10.0) -> None:
    """Stops the engine process; requests still queued or running get an error."""
    with self._lock:
      self._stopping = True
      self._send(("stop",))
    if self._loop is not None and not self._closed:
      # Called on the loop's thread, which is the reader: read while the engine
      # drains (it must not block on a full pipe), then whatever it sent last.
      self._loop.remove_reader(self._events.fileno())
      deadline = time.monotonic() + timeout
      while not self._closed and self._proc.is_alive() and time.monotonic() < deadline:
        if self._events.poll(0.05):
          self._take()
      while not self._closed and self._events.poll(0):
        self._take()
    self._proc.join(timeout)
    if self._proc.is_alive():
      self._proc.kill()
      self._proc.join(5)
    if self._reader is not None:
      self._reader.join(timeout)
    else:
      self._exited()

  # --- reading the engine's events ---------------------------------------------------------

  def _gauge(self) -> None:
    if self.metrics is not None:
      self.metrics.queue_depth.set(self.queue_depth())
      self.metrics.busy_rows.set(self._busy)

  def _count(self, counters) -> None:
    passes, cancelled, busy, dequeued, error = counters
    if self.metrics is not None:
      self.metrics.forward_passes.inc(passes - self._passes)
      self.metrics.cancelled_rows.inc(cancelled - self._cancelled)
    self._passes, self._cancelled, self._busy = passes, cancelled, busy
    self._dequeued, self._engine_error = dequeued, error
    self._gauge()

  def _handle(self, msg) -> None:
    _, batch, counters = msg
    if counters is not None:
      self._count(counters)
    for key, kind, payload in batch:
      with self._lock:
        job = self._jobs.get(key)
        if job is not None and kind in ("done", "error"):
          del self._jobs[key]
          self._keys.pop(job, None)
          self.capacity.release(job)
      if job is not None:
        try:
          job.deliver(kind, payload)
        except Exception:  # pylint: disable=broad-except
          log.exception("delivering a %s event failed", kind)

  def _take(self) -> None:
    """Reads and handles one message; at the pipe's end, the engine's exit."""
    try:
      msg = _get(self._events)
    except (EOFError, OSError):
      self._closed = True
      if self._loop is not None:
        self._loop.remove_reader(self._events.fileno())
        if not self._stopping:  # else `stop` reports it once the process is joined
          # The process is reaped off the loop's thread; its requests' errors are
          # delivered back on it.
          self._loop.run_in_executor(None, self._proc.join, 5).add_done_callback(
              lambda _: self._exited())
      return
    self._handle(msg)

  def _readable(self) -> None:
    """The event loop's reader: every message the pipe holds now."""
    while not self._closed and self._events.poll(0):
      self._take()

  def _read(self) -> None:
    """The reader thread (no event loop): until the pipe's end."""
    while not self._closed:
      self._take()
    self._proc.join(5)
    self._exited()

  def _exited(self) -> None:
    """The engine process has exited: every request in flight gets an error (once)."""
    with self._lock:
      if self._exit_seen:
        return
      self._exit_seen = True
      if not self._stopping:
        self._died = f"the engine process exited (exit code {self._proc.exitcode})"
        log.error("%s", self._died)
      left, self._jobs, self._keys = list(self._jobs.values()), {}, {}
      self._dequeued, self._busy = self._submitted, 0
    for job in left:
      self.capacity.release(job)
      try:
        job.deliver("error", self._died or "the server shut down before this request finished")
      except Exception:  # pylint: disable=broad-except
        log.exception("delivering an error event failed")
    self._gauge()


def _reraise(name: str, message: str) -> Exception:
  """The engine process's start-up error as the server process raises it (user errors
  keep their type, so the entry point reports them as such)."""
  kinds = {"ValueError": ValueError, "FileNotFoundError": FileNotFoundError,
           "TypeError": TypeError}
  return kinds.get(name, EngineFailed)(message if name in kinds else f"{name}: {message}")
