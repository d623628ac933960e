"""The engine thread: requests join the rows of live batches as rows free up.

A *bucket* is one compiled decode shape (method, gen_length, slot and block
size), built once at start-up. A *lane* is a `LiveBatch` of a bucket with one
set of knobs (thresholds, temperature, ignore_eos: traced, so a lane with new values reuses
the bucket's programs); requests with the knobs of a lane share its rows. At
most `max_lanes` lanes exist; an idle one gives way to a new combination.

The engine thread owns every lane. Each turn it takes the submitted jobs,
frees the rows of cancelled ones, admits waiting jobs into free rows (in
batches), runs each busy lane for a chunk of passes and reads what its rows
committed. It never waits on the HTTP side: results go out through each job's
`deliver` callback (the app's event loop takes them: with
`call_soon_threadsafe` from this thread, or from the engine process's pipe),
and text is made on the event loop, not here.

A lane runs without a pass bound (returning when a row is done, as the
offline engine does) unless one of its jobs watches progress (streaming, stop
strings, max_tokens below the bucket's gen_length), a row is free (a new
request must not wait for a whole decode), or other lanes are busy (fair
turns): then it hands control back every `chunk_passes` passes, and after
every pass while a row is free, so that a request arriving mid-run joins at the
next pass rather than after a whole chunk (a closed-loop client's next request
comes while the others' rows run). Waiting prompts are admitted at once into
free rows, in one call per turn. Chunking changes no token and no pass count
(`LiveBatch`). A watching job's progress goes out with its first text, then at
most every `chunk_passes` passes, also in the turns a free row shortens: those
are for admissions, and a report per pass per stream would cost the HTTP side
an event per token.

One order of a turn per device. Where a dispatch returns before its passes have
run (CPUs; TPUs, whose loops run on the device), a lane with a free row runs
ahead: the next pass is dispatched before the last one's rows are read and
handed over, so that the device works meanwhile; and a turn whose deliveries
freed rows holds that dispatch until a request comes in or the pass in flight
has run, whichever is first (a client whose response just went out often sends
its next request within that pass, and it then joins the next pass instead of
the one after). On a GPU the host reads a loop's condition, so a dispatch
returns only once its passes have run: there each turn reads first, hands the
results over, admits what came in and only then dispatches (`read_first`), so a
client that sends its next request at once joins the very next pass.

With `row_counts`, a lane's passes run over its rows in use only, padded to the
smallest of those counts that holds them (one more compiled program each):
where a pass costs in proportion to its rows (a CPU), the rows a closed-loop
client leaves idle between its requests then cost nothing. Tokens and pass
counts are unchanged.

With `admit_widths`, an admission prefills at the narrowest of those widths
(or the full prompt width) that holds its prompts: a short prompt does not pay
for a `max_prompt_len`-wide prefill.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import queue
import threading
import time
from typing import Any, Callable

import numpy as np

from refusion_jax.decode import engine as engine_lib
from refusion_jax.decode import live as live_lib
from refusion_jax.decode import program as program_lib
from refusion_jax.decode.settings import DecodeConfig

log = logging.getLogger("refusion_jax.serve")


@dataclasses.dataclass(frozen=True)
class Bucket:
  """One compiled decode shape."""

  method: str
  gen_length: int
  slot_size: int
  block_size: int

  @property
  def name(self) -> str:
    if self.method == "ar":
      return f"ar:{self.gen_length}"
    return f"{self.method}:{self.gen_length}:{self.slot_size}:{self.block_size}"

  def describe(self) -> dict:
    return {"method": self.method, "gen_length": self.gen_length, "slot_size": self.slot_size,
            "block_size": self.block_size}


def bucket_of(dc: DecodeConfig) -> Bucket:
  """A config's shape: a method without slots has the block for its slot, one without
  blocks (AR) the response."""
  block = dc.flat().get("block_size", dc.gen_length)
  return Bucket(dc.method, dc.gen_length, dc.flat().get("slot_size", block), block)


# What a request may set per job (protocol.Request), in a lane's knob tuple: a setting the
# bucket's method lacks is None there.
KNOBS = ("slot_threshold", "token_threshold", "temperature", "ignore_eos")


def parse_buckets(text: str, default: DecodeConfig) -> list[DecodeConfig]:
  """`method:gen_length[:slot_size:block_size]` entries, comma-separated, as decode
  configs: the default's shared settings, and its method's options for a bucket of the
  same method (another method's: its defaults, with the given shape); the default's own
  shape comes first."""
  out = [default]
  for entry in (e.strip() for e in text.split(",")):
    if not entry:
      continue
    parts = entry.split(":")
    try:
      if parts[0] == "ar" and len(parts) == 2:
        dc = default.replace(method="ar", gen_length=int(parts[1]))
      elif len(parts) == 4:
        dc = default.replace(method=parts[0], gen_length=int(parts[1]),
                             slot_size=int(parts[2]), block_size=int(parts[3]))
      else:
        raise ValueError("expected method:gen_length:slot_size:block_size (ar: ar:gen_length)")
    except ValueError as e:
      raise ValueError(f"--config.buckets entry {entry!r}: {e}") from None
    if bucket_of(dc) not in {bucket_of(d) for d in out}:
      out.append(dc)
  return out


class QueueFull(Exception):
  """The bounded queue is full (the server answers 429)."""


class EngineDown(Exception):
  """The engine cannot take requests any more (the server answers 503)."""


class Capacity:
  """The bounded queue, counted where requests come in: a request is refused only
  when every row of its lane (bucket and knobs) is taken and `max_queue` requests
  already wait for a row. Requests count from `take` until `release` (their last
  event, or their cancellation), whether or not the engine has picked them up yet:
  a burst of requests fills the free rows first, then the queue."""

  def __init__(self, rows: int, max_queue: int):
    self.rows, self.max_queue = rows, max_queue
    self._lanes: collections.Counter = collections.Counter()  # requests in, per lane key
    self._held: dict[Job, tuple] = {}
    self._lock = threading.Lock()

  def waiting(self) -> int:
    """Requests in beyond their lanes' rows: those that wait for a row."""
    return sum(max(0, n - self.rows) for n in self._lanes.values())

  def take(self, job: "Job") -> None:
    key = (job.bucket, job.knobs)
    with self._lock:
      if self._lanes[key] >= self.rows and self.waiting() >= self.max_queue:
        raise QueueFull(f"the queue is full (every row busy and {self.max_queue} requests "
                        "waiting for one)")
      self._lanes[key] += 1
      self._held[job] = key

  def release(self, job: "Job") -> None:
    with self._lock:
      key = self._held.pop(job, None)
      if key is not None:
        self._lanes[key] -= 1
        if not self._lanes[key]:
          del self._lanes[key]


@dataclasses.dataclass(eq=False)
class Job:
  """One request as the engine thread sees it."""

  prompt: list[int]
  bucket: Bucket
  knobs: tuple  # KNOBS: slot_threshold, token_threshold (None: not the method's),
  #   temperature, ignore_eos
  rng2: np.ndarray  # uint32[2], the request's key (prompt id 0 within it)
  max_tokens: int  # keep at most this many tokens
  watch: bool  # deliver the committed prefix as it grows (each "progress" its new tokens)
  slots: bool  # also deliver each newly committed run of positions
  # ("progress", (tokens committed since the last, passes)) | ("done", Done) | ("error", msg)
  deliver: Callable[[str, Any], None]
  cancelled: bool = False
  # Engine-thread bookkeeping.
  row: int = -1
  sent: int = 0  # committed prefix delivered so far
  sent_pass: int = 0  # the lane's pass count at the last progress delivered
  seen: np.ndarray | None = None  # positions reported to a `slots` job
  admission: int = 0  # the lane's admission call that prefilled it
  submitted: float = 0.0


@dataclasses.dataclass
class Done:
  tokens: list[int]  # up to and including EOS, at most max_tokens
  forward_passes: int  # the decoder's passes for this request (its own counter)
  truncated: bool  # max_tokens cut it before the decoder finished


class _Lane:
  def __init__(self, bucket: Bucket, knobs, batch: live_lib.LiveBatch):
    self.bucket, self.knobs, self.batch = bucket, knobs, batch
    self.jobs: list[Job | None] = [None] * batch.rows
    self.waiting: collections.deque[Job] = collections.deque()
    self.passes = 0
    self.admissions = 0  # admission calls so far
    self.inflight = False  # a run was dispatched and not yet read
    self.freed = 0  # rows freed by the last turn's deliveries (their clients may come back)

  def busy(self) -> int:
    return sum(j is not None for j in self.jobs)

  def rows_in_use(self) -> list[int]:
    """Rows holding a request (decoding, or done and not yet taken); the others are free."""
    return [r for r, j in enumerate(self.jobs) if j is not None]

  def idle(self) -> bool:
    return not self.busy() and not self.waiting


class Scheduler:
  """Runs the lanes on its own thread (module docstring)."""

  delivers_in_loop = False  # deliveries are made on the engine thread (see EngineProcess)

  def __init__(self, model, decode_configs: list[DecodeConfig], *, rows: int, width: int,
               max_queue: int, max_lanes: int, chunk_passes: int, metrics: Any = None,
               row_counts=(), admit_widths=(), read_first: bool | None = None,
               after_turn: Callable[[], None] | None = None):
    self.model = model
    self.decoders = {}
    for dc in decode_configs:
      self.decoders[bucket_of(dc)] = engine_lib.Decoder(model, dc)
    self.default_config = decode_configs[0]
    self.rows, self.width = rows, width
    self.max_lanes = max(max_lanes, len(self.decoders))
    # The bounded queue (None: counted by whoever submits, as the engine process's
    # server side does).
    self.capacity: Capacity | None = Capacity(rows, max_queue)
    self.chunk_passes = chunk_passes
    self.row_counts = tuple(row_counts)  # smaller passes compiled besides the full one
    self.admit_widths = tuple(admit_widths)  # narrower prefills compiled besides the width
    # The turn's order (module docstring): read first where a dispatch waits for its
    # passes (a GPU), else run ahead. None: by the model's platform.
    if read_first is None:
      read_first = next(iter(self.decoders.values())).platform == "gpu"
    self.read_first = bool(read_first)
    self.metrics = metrics
    # Called on the engine thread after each lane's deliveries and before it waits
    # (the engine process sends what the turn delivered from there).
    self.after_turn = after_turn or (lambda: None)
    self._lanes: dict[tuple, _Lane] = {}
    self._parked: collections.deque[Job] = collections.deque()  # no lane to be had yet
    self._lock = threading.Lock()
    self._wake = threading.Event()
    # A wait for returning clients is woken by a request, or by this thread's watcher
    # once the pass has run (no polling: on a CPU the engine shares its cores with
    # the pass); it looks again at least this often.
    self._return_poll_s = 0.05
    self._watch_q: queue.SimpleQueue = queue.SimpleQueue()
    self._watcher: threading.Thread | None = None
    self._inbox: list[Job] = []
    self._waiting = 0  # submitted, not yet admitted (the bounded queue)
    self._stop = False
    self._hold = threading.Event()  # set: the thread admits and runs nothing
    self._thread: threading.Thread | None = None
    self.error: str | None = None

  @property
  def buckets(self) -> list[Bucket]:
    return list(self.decoders)

  @property
  def model_config(self):
    return self.model.config

  def _knobs_for(self, bucket: Bucket, knobs):
    dc = self.decoders[bucket].config
    dc = dc.replace(**{k: v for k, v in zip(KNOBS, knobs) if k in dc.flat()})
    return program_lib.knobs_of(self.model.config, dc)

  def _batch(self, bucket: Bucket, knobs) -> live_lib.LiveBatch:
    """Fresh rows of `bucket` with these knob values (every lane's batch is made here)."""
    return live_lib.LiveBatch(self.decoders[bucket], self.rows, self.width,
                                self._knobs_for(bucket, knobs), row_counts=self.row_counts,
                                admit_widths=self.admit_widths)

  def default_knobs(self, bucket: Bucket) -> tuple[float | None, float | None, float, bool]:
    """The bucket's `KNOBS` (None for a setting its method lacks)."""
    flat = self.decoders[bucket].config.flat()
    return tuple(flat.get(k) for k in KNOBS)

  def warm_up(self, on_bucket: Callable[[int, Bucket, float], None] | None = None) -> None:
    """Compiles every program of every bucket; one lane per bucket stays ready.
    `on_bucket(i, bucket, seconds)` is called as each bucket is ready (progress)."""
    for i, bucket in enumerate(self.decoders):
      t = time.perf_counter()
      knobs = self.default_knobs(bucket)
      batch = self._batch(bucket, knobs)
      batch.warm_up()
      self._lanes[(bucket, knobs)] = _Lane(bucket, knobs, batch)
      if on_bucket is not None:
        on_bucket(i, bucket, time.perf_counter() - t)

  # --- called from other threads ----------------------------------------------------------

  def submit(self, job: Job) -> None:
    with self._lock:
      if self._stop:
        raise QueueFull("the server is shutting down")
      if self.capacity is not None:
        self.capacity.take(job)
      self._waiting += 1
      job.submitted = time.perf_counter()
      self._inbox.append(job)
    self._gauge()
    self._wake.set()

  def cancel(self, job: Job) -> None:
    job.cancelled = True
    if self.capacity is not None:
      self.capacity.release(job)
    self._wake.set()

  def queue_depth(self) -> int:
    return self._waiting

  def busy_rows(self) -> int:
    return sum(lane.busy() for lane in list(self._lanes.values()))

  def hold(self, on: bool) -> None:
    """Pauses (True) or resumes decoding: while held, jobs are still admitted into free
    rows (and cancelled ones freed), but no pass runs."""
    if on:
      self._hold.set()
    else:
      self._hold.clear()
    self._wake.set()

  def start(self) -> None:
    self._thread = threading.Thread(target=self._main, name="refusion-engine", daemon=True)
    self._thread.start()
    if not self.read_first:
      self._watcher = threading.Thread(target=self._watch, name="refusion-engine-watch",
                                       daemon=True)
      self._watcher.start()

  def stop(self, timeout: float = 10.0) -> None:
    """Stops the thread; jobs still queued or running get an error."""
    with self._lock:
      self._stop = True
    self._hold.clear()
    self._wake.set()
    if self._thread is not None:
      self._thread.join(timeout)
    if self._watcher is not None:
      self._watch_q.put(None)
      self._watcher.join(timeout)

  # --- the engine thread ------------------------------------------------------------------

  def _gauge(self) -> None:
    if self.metrics is not None:
      self.metrics.queue_depth.set(self._waiting)

  def _dequeued(self, n: int = 1) -> None:
    with self._lock:
      self._waiting -= n
    self._gauge()

  def _send(self, job: Job, kind: str, payload) -> None:
    if kind in ("done", "error") and self.capacity is not None:
      self.capacity.release(job)
    try:
      job.deliver(kind, payload)
    except Exception:  # pylint: disable=broad-except
      log.exception("delivering a %s event failed", kind)  # the loop is gone: nobody listens

  def _lane_for(self, job: Job) -> _Lane | None:
    key = (job.bucket, job.knobs)
    lane = self._lanes.get(key)
    if lane is not None:
      return lane
    if len(self._lanes) >= self.max_lanes:
      idle = [k for k, l in self._lanes.items() if l.idle()]
      if not idle:
        return None
      same = [k for k in idle if k[0] == job.bucket]
      old = self._lanes.pop((same or idle)[0])
      if old.bucket == job.bucket:  # same shapes: reuse the buffers with new knobs
        old.batch.knobs = self._knobs_for(job.bucket, job.knobs)
        old.knobs = job.knobs
        self._lanes[key] = old
        return old
    batch = self._batch(job.bucket, job.knobs)
    lane = self._lanes[key] = _Lane(job.bucket, job.knobs, batch)
    return lane

  def _route(self) -> None:
    with self._lock:
      inbox, self._inbox = self._inbox, []
    self._parked.extend(inbox)
    parked, self._parked = self._parked, collections.deque()
    for job in parked:
      if job.cancelled:
        self._dequeued()
        continue
      lane = self._lane_for(job)
      if lane is None:
        self._parked.append(job)
      else:
        lane.waiting.append(job)

  def _cancel_and_admit(self, lane: _Lane) -> None:
    gone = [r for r, j in enumerate(lane.jobs) if j is not None and j.cancelled]
    for r in gone:
      lane.jobs[r] = None
    lane.batch.free(gone)
    if self.metrics is not None and gone:
      self.metrics.cancelled_rows.inc(len(gone))
    kept = collections.deque(j for j in lane.waiting if not j.cancelled)
    if len(kept) < len(lane.waiting):
      self._dequeued(len(lane.waiting) - len(kept))
    lane.waiting = kept
    free = [r for r, j in enumerate(lane.jobs) if j is None]
    if free and lane.waiting:
      n = min(len(free), len(lane.waiting))
      take = [lane.waiting.popleft() for _ in range(n)]
      rows, free = free[:n], free[n:]
      lane.batch.admit([j.prompt for j in take], rows, np.stack([j.rng2 for j in take]))
      lane.admissions += 1
      for job, r in zip(take, rows):
        job.row = r
        job.admission = lane.admissions
        lane.jobs[r] = job
      self._dequeued(n)

  def _max_passes(self, lane: _Lane, busy_lanes: int) -> int | None:
    jobs = [j for j in lane.jobs if j is not None]
    if len(jobs) < len(lane.jobs):  # a request may arrive for the free row
      return 1
    if busy_lanes > 1 or lane.waiting or any(j.watch for j in jobs):
      return self.chunk_passes
    return None

  def _collect(self, lane: _Lane, snap: live_lib.Snapshot, admissions: int) -> list:
    """Takes a snapshot of the lane's rows (read after `admissions` admission calls:
    jobs admitted later are not in it yet) and frees finished rows; returns the
    deliveries to make (made after the next run is dispatched, so that they overlap it)."""
    if self.metrics is not None:
      self.metrics.forward_passes.inc(snap.passes - lane.passes)
    lane.passes = snap.passes
    prefix_b = snap.prefix_b()
    nfe_b = snap.nfe_b
    finished, out = [], []
    for r, job in enumerate(lane.jobs):
      if job is None or job.admission > admissions:
        continue
      done = snap.phase_b[r] == program_lib.DONE
      n = int(snap.length_b[r]) if done else int(prefix_b[r])
      if not done and n >= job.max_tokens:
        done = True
      if job.slots:
        out.append((self._send_slots, (job, snap, r, lane.bucket)))
      if done:
        keep = min(n, job.max_tokens)
        out.append((self._send, (job, "done", Done(
            tokens=snap.tokens_bg[r, :keep].tolist(), forward_passes=int(nfe_b[r]),
            truncated=keep < n or snap.phase_b[r] != program_lib.DONE))))
        lane.jobs[r] = None
        finished.append(r)
      elif (job.watch and n > job.sent
            and (job.sent == 0 or snap.passes - job.sent_pass >= self.chunk_passes)):
        # The first text at once, then at most every chunk_passes passes: also while a
        # row is free and the lane returns after every pass (for admissions). Only the
        # tokens committed since the last report: a committed token never changes.
        out.append((self._send, (job, "progress", (snap.tokens_bg[r, job.sent:n].tolist(),
                                                   int(nfe_b[r])))))
        job.sent, job.sent_pass = n, snap.passes
    lane.batch.free(finished)
    lane.freed = len(finished)
    return out

  def _hand_over(self, deliveries: list) -> None:
    """Makes a turn's deliveries (`_collect`'s), then `after_turn` (the engine process
    sends them from there)."""
    for fn, fn_args in deliveries:
      fn(*fn_args)
    self.after_turn()

  def _await_return(self, pending: live_lib.PendingRead) -> None:
    """Waits until a request comes in, or the pass in flight (which `pending` reads
    after) has run, whichever is first: a client whose response just went out may
    send its next request in that time, and it then joins the next pass instead of
    the one after (the device stays busy meanwhile)."""
    if pending.ready() or self._inbox:
      return
    self._watch_q.put(pending)
    while not (pending.ready() or self._inbox or self._stop or self._hold.is_set()):
      self._wake.wait(self._return_poll_s)
      self._wake.clear()

  def _watch(self) -> None:
    """The watcher thread: wakes the engine thread once each pending read it is
    handed can be taken (a read's wait releases the interpreter lock)."""
    while True:
      pending = self._watch_q.get()
      if pending is None:
        return
      try:
        pending.wait()
      except Exception:  # pylint: disable=broad-except
        pass  # the engine thread meets the error when it reads
      self._wake.set()

  def _send_slots(self, job: Job, snap: live_lib.Snapshot, r: int, bucket: Bucket) -> None:
    """Newly committed positions as runs within a slot: [(position, [token ids])]."""
    committed = snap.commit_step_bg[r] >= 0
    if job.seen is None:
      job.seen = np.zeros_like(committed)
    new = np.flatnonzero(committed & ~job.seen)
    job.seen = job.seen | committed
    runs: list[tuple[int, list[int]]] = []
    for p in new.tolist():
      if runs and p == runs[-1][0] + len(runs[-1][1]) and p % bucket.slot_size:
        runs[-1][1].append(int(snap.tokens_bg[r, p]))
      else:
        runs.append((p, [int(snap.tokens_bg[r, p])]))
    if runs:
      self._send(job, "slots", runs)

  def _fail_all(self, message: str) -> None:
    for lane in self._lanes.values():
      for job in [j for j in lane.jobs if j is not None] + list(lane.waiting):
        self._send(job, "error", message)
      lane.jobs = [None] * lane.batch.rows
      n, lane.waiting = len(lane.waiting), collections.deque()
      self._dequeued(n)
    with self._lock:
      inbox, self._inbox = self._inbox, []
    for job in inbox + list(self._parked):
      self._send(job, "error", message)
    self._dequeued(len(inbox) + len(self._parked))
    self._parked = collections.deque()

  def _main(self) -> None:
    while True:
      self._wake.clear()
      if self._stop:
        self._fail_all("the server shut down before this request finished")
        self.after_turn()
        return
      try:
        self._route()
        # A lane's run in flight carries the read of its rows after it: taken before
        # this turn's admissions (which it does not show: `_collect` skips their rows),
        # it needs no program of its own.
        reads = {id(lane): (lane.batch.read_later(), lane.admissions)
                 for lane in self._lanes.values() if lane.inflight and lane.busy()}
        for lane in self._lanes.values():
          self._cancel_and_admit(lane)
        busy = [lane for lane in self._lanes.values() if lane.busy()]
        for lane in self._lanes.values():
          if not lane.busy():
            lane.freed = 0  # nobody left to come back mid-decode: a new run waits for none
        if self.metrics is not None:
          self.metrics.busy_rows.set(sum(lane.busy() for lane in busy))
        if not busy or self._hold.is_set():
          self.after_turn()
          self._wake.wait(0.05 if busy else 0.5)
          continue
        for lane in busy:
          if not lane.inflight:
            lane.batch.run(self._max_passes(lane, len(busy)), busy=lane.rows_in_use())
            lane.inflight = True
        for lane in busy:
          read, admissions = reads.get(id(lane)) or (lane.batch.read_later(), lane.admissions)
          go = lambda lane=lane: lane.busy() and not self._hold.is_set() and not self._stop
          ahead = not self.read_first and lane.busy() < len(lane.jobs) and go()
          if ahead:
            # A row is free: the next pass is dispatched behind the read, before
            # waiting for it, so the device runs it while this thread reads and
            # delivers (rows that finished sit out that pass, done, until freed);
            # requests that came in the meantime join it.
            if lane.freed and not lane.waiting:
              self._await_return(read)
            self._route()
            self._cancel_and_admit(lane)
            lane.batch.run(1, stop_on_done=False, busy=lane.rows_in_use())
          deliveries = self._collect(lane, read(), admissions)
          lane.inflight = ahead
          if not ahead:
            # Run ahead, the lane's next chunk is dispatched before the deliveries are
            # made, so the device works while this thread hands results over. Reading
            # first, they go out first: where a dispatch returns only once its passes
            # have run (a GPU), a client then gets its response a chunk sooner, and a
            # request it sends at once (or one that came meanwhile) joins the next one.
            if self.read_first:
              self._hand_over(deliveries)
            self._route()
            self._cancel_and_admit(lane)
            if go():
              lane.batch.run(self._max_passes(lane, len(busy)), busy=lane.rows_in_use())
              lane.inflight = True
          if not self.read_first:
            self._hand_over(deliveries)
      except Exception as e:  # pylint: disable=broad-except
        log.exception("engine thread failed")
        self.error = f"{type(e).__name__}: {e}"
        self._fail_all(f"the decoder failed: {self.error}")
        self.after_turn()
        for key, lane in list(self._lanes.items()):  # fresh buffers (the old ones may be donated)
          lane.batch = self._batch(lane.bucket, lane.knobs)
          lane.inflight = False
          self._lanes[key] = lane
