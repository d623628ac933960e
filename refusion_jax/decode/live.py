"""Rows that prompts join and leave one by one, run a few passes at a time (the server's).

`LiveBatch` holds a fixed set of rows over one decoder (engine.py's `Decoder`); the
host admits prompts into free rows, runs bounded chunks of passes, reads what every
row has committed (one device-to-host copy, `PendingRead` without waiting) and frees
rows, while nothing recompiles after `warm_up`.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from typing import Sequence

import jax
import numpy as np

from refusion_jax.decode import compiled
from refusion_jax.decode import program as program_lib
from refusion_jax.decode.engine import Decoder
from refusion_jax.decode.program import Knobs


@dataclasses.dataclass
class Snapshot:
  """A `LiveBatch`'s rows as the host reads them between runs (numpy)."""

  tokens_bg: np.ndarray  # committed tokens within each row's text (pad elsewhere)
  commit_step_bg: np.ndarray  # the row's step that committed each position (-1: not yet)
  length_b: np.ndarray  # text length once done (up to and including EOS)
  phase_b: np.ndarray
  passes: int  # forward passes this batch has run
  nfe_b: np.ndarray  # each row's own forward passes (DecodeCounters.nfe_b)

  def prefix_b(self) -> np.ndarray:
    """Per row, how many leading positions are committed: text that can no longer
    change (a slot committed past a gap joins it once the gap is filled)."""
    committed = self.commit_step_bg >= 0
    return np.where(committed.all(-1), committed.shape[-1], np.argmin(committed, -1))


class PendingRead:
  """A dispatched read of every row (`LiveBatch.read_later`): calling it waits and
  gives the `Snapshot`; `ready()` says, without waiting, whether the passes it
  follows have run and it can be taken at once."""

  def __init__(self, packed, like, freed_b: np.ndarray | None = None):
    self._packed, self._like, self._freed_b = packed, like, freed_b

  def ready(self) -> bool:
    return self._packed.is_ready()

  def wait(self) -> None:
    """Blocks until `ready()` (without reading)."""
    self._packed.block_until_ready()

  def __call__(self) -> Snapshot:
    tokens, commit, length, nfe, phase, passes = compiled.unpack32(np.asarray(self._packed),
                                                           self._like)
    if self._freed_b is not None:  # freed since the last run: the next run frees them
      phase = np.where(self._freed_b, program_lib.FREE, phase).astype(phase.dtype)
    return Snapshot(tokens_bg=tokens, commit_step_bg=commit, length_b=length,
                    phase_b=phase, passes=int(passes), nfe_b=nfe)


class LiveBatch:
  """A fixed set of rows that prompts join and leave one by one, run in bounded
  chunks of passes, for callers that interleave decoding with other work (a server).

  `admit` prefills prompts into free rows; `run(max_passes)` runs at most that many
  passes (returning early when a row is done) and hands control back; `read` gives
  what every row has committed so far; `free` releases rows (finished or cancelled).
  Splitting a decode into chunks changes nothing: each pass advances every active
  row by its own state, so tokens and pass counts equal an uninterrupted decode,
  whatever the other rows hold. Every shape is fixed at construction, so after
  `warm_up` nothing compiles. `width` is the longest prompt; with `admit_widths`
  an admission prefills at the narrowest of them (or `width`) that holds its
  prompts, so short prompts do not pay for the widest (each width compiles one
  more admission program per admission size).
  """

  def __init__(self, decoder: Decoder, rows: int, width: int, knobs: Knobs | None = None,
               *, row_counts: Sequence[int] = (), admit_widths: Sequence[int] = ()):
    if not isinstance(rows, int) or isinstance(rows, bool) or rows < 1:
      raise ValueError(f"live batch rows must be a positive int, got {rows!r}")
    if not isinstance(width, int) or isinstance(width, bool) or width < 1:
      raise ValueError(f"live batch width must be a positive int, got {width!r}")
    bad = [n for n in row_counts if not isinstance(n, int) or isinstance(n, bool)
           or not 1 <= n <= rows]
    if bad:
      raise ValueError(f"live batch row_counts must be ints from 1 to rows={rows}, got {bad}")
    bad = [w for w in admit_widths if not isinstance(w, int) or isinstance(w, bool)
           or not 1 <= w <= width]
    if bad:
      raise ValueError(f"live batch admit_widths must be ints from 1 to width={width}, got {bad}")
    # Smaller passes compiled besides the full one: a run over the busy rows only.
    self.row_counts = sorted(set(row_counts) - {rows})
    self.runs_by_rows: collections.Counter = collections.Counter()  # run calls per row count
    # Narrower prefills compiled besides the full width: an admission pays for the
    # longest prompt it takes, not for the widest prompt the batch allows.
    self.admit_widths = sorted(set(admit_widths) | {width})
    self.admits_by_width: collections.Counter = collections.Counter()  # admit calls per width
    decoder.config.check_fits(decoder.model.config, width)
    self.decoder = decoder
    self.rows = rows
    self.width = width
    self.knobs = decoder.knobs if knobs is None else knobs
    d = decoder
    state = compiled.init(d.static, d.flat, spec=d.spec, rows=rows, width=width,
                         place=d.place)
    # Committed where the parameters are, as every later program's output is; an
    # uncommitted state would be a different cache entry of the first program it meets.
    leaves = jax.tree.leaves(d.params)
    if d.place is None and leaves and hasattr(leaves[0], "sharding"):
      state = jax.device_put(state, leaves[0].sharding)
    self._state = state
    # Rows freed since the last run: that run frees them first (no program of their
    # own); a read shows them free, an admission rewrites them.
    self._free_b = np.zeros((rows,), bool)
    # The last run's read of every row (packed), while nothing but frees came after it.
    self._after_run = None
    self._read_like = jax.eval_shape(functools.partial(compiled.read_tree, spec=d.spec), state,
                                     self.knobs)

  @property
  def state(self):
    """The rows' decode state on the device."""
    return self._state

  def admit_sizes(self) -> list[int]:
    """The admission batch sizes compiled (powers of two up to `rows`)."""
    sizes, a = [], 1
    while a < self.rows:
      sizes.append(a)
      a *= 2
    return sizes + [self.rows]

  def _admit_size(self, n: int) -> int:
    return min(s for s in self.admit_sizes() if s >= n)

  def admit_programs(self) -> list[tuple[int, int]]:
    """The admission programs compiled: (prompts, prefill width) pairs."""
    return [(a, w) for a in self.admit_sizes() for w in self.admit_widths]

  def admit(self, prompts: Sequence[Sequence[int]], rows: Sequence[int],
            rng_a2: np.ndarray, pids: Sequence[int] | None = None) -> None:
    """Prefills `prompts` into `rows` (which must be free); prompt j draws from
    `fold_in(rng_a2[j], pids[j])` (pids default to 0: each prompt its own seed)."""
    d, n = self.decoder, len(prompts)
    if n == 0:
      return
    if n > self.rows or len(rows) != n or len(rng_a2) != n:
      raise ValueError(f"admit: {n} prompts, {len(rows)} rows, {len(rng_a2)} keys "
                       f"(at most {self.rows} at a time)")
    for j, p in enumerate(prompts):
      if not 1 <= len(p) <= self.width:
        raise ValueError(f"admit: prompt {j} has {len(p)} tokens; the width is {self.width}")
    a = self._admit_size(n)
    w = min(x for x in self.admit_widths if x >= max(len(p) for p in prompts))
    self.admits_by_width[w] += 1
    ids_ap = np.zeros((a, w), np.int32)
    lens_a = np.ones((a,), np.int32)
    rows_a = np.full((a,), self.rows, np.int32)  # index `rows`: padding, dropped
    pids_a = np.zeros((a,), np.int32)
    keys_a2 = np.zeros((a, 2), np.uint32)
    for j, p in enumerate(prompts):
      ids_ap[j, :len(p)] = p
      lens_a[j], rows_a[j], keys_a2[j] = len(p), rows[j], rng_a2[j]
      pids_a[j] = 0 if pids is None else pids[j]
    self._state = compiled.admit(d.static, d.flat, self._state, ids_ap, lens_a, rows_a, pids_a,
                                keys_a2, self.knobs, spec=d.spec, place=d.place)
    self._free_b[list(rows)] = False  # rewritten: nothing left to free
    self._after_run = None

  def run(self, max_passes: int | None = None, stop_on_done: bool = True,
          busy: Sequence[int] | None = None) -> None:
    """Dispatches passes until no row is active, a row is done (stop_on_done), or
    `max_passes` passes (None: no bound). Asynchronous: `read` waits for it.

    `busy` (optional) lists every row that is not free; the others must be. The
    passes then run over the smallest compiled row count that holds them
    (`row_counts`), padded with free rows, which costs less where a pass's cost
    grows with its rows (a CPU); tokens and pass counts are unchanged."""
    d = self.decoder
    if not isinstance(stop_on_done, (bool, np.bool_)):
      raise ValueError(f"run: stop_on_done must be a bool, got {stop_on_done!r}")
    stop = np.int32(stop_on_done)  # traced: one program for both
    # "No bound" is a bound no decode reaches (passes + bound must not overflow int32).
    limit = np.int32(1 << 30 if max_passes is None else min(max_passes, 1 << 30))
    n = self._row_count(len(busy)) if busy is not None else self.rows
    self.runs_by_rows[n] += 1
    free_b, self._free_b = self._free_b, np.zeros((self.rows,), bool)
    if n < self.rows:
      taken = set(busy)
      idx = list(busy) + [r for r in range(self.rows) if r not in taken][:n - len(taken)]
      self._state, packed = compiled.live_run_rows(d.static, d.flat, self._state, self.knobs, stop,
                                           np.asarray(idx, np.int32), spec=d.spec,
                                           max_passes=limit, free_b=free_b, place=d.place)
    else:
      self._state, packed = compiled.live_run(d.static, d.flat, self._state, self.knobs, stop,
                                      spec=d.spec, max_passes=limit, free_b=free_b,
                                      place=d.place)
    packed.copy_to_host_async()
    self._after_run = packed  # what a read gives until an admission changes the rows

  def _row_count(self, busy: int) -> int:
    return min([n for n in self.row_counts if n >= busy] or [self.rows])

  def read(self) -> Snapshot:
    """Waits for what was dispatched and reads every row (one device-to-host copy)."""
    return self.read_later()()

  def read_later(self) -> PendingRead:
    """Dispatches the read of every row as it stands after what was dispatched so
    far, without waiting; the `PendingRead` returned waits for it when called and
    gives the `Snapshot`. More passes may be dispatched in between (the device then runs
    them while the host reads): the snapshot is still of this point. Right after a
    run (or frees since) it is that run's own packed output, and no program runs."""
    packed = self._after_run
    if packed is None:  # an admission since the last run (or none yet): read the rows
      packed = compiled.live_read(self._state, self.knobs, spec=self.decoder.spec)
      packed.copy_to_host_async()
    return PendingRead(packed, self._read_like,
                       self._free_b.copy() if self._free_b.any() else None)

  def free(self, rows: Sequence[int]) -> None:
    """Releases `rows` (finished, or cancelled mid-decode). No program runs for it: the
    next `run` frees them before its first pass, a read shows them free at once, and
    an admission into one rewrites it."""
    rows = list(rows)
    bad = [r for r in rows if not isinstance(r, (int, np.integer)) or not 0 <= r < self.rows]
    if bad:
      raise ValueError(f"free: rows {bad} are not rows of this batch (0 to {self.rows - 1})")
    self._free_b[rows] = True

  def warm_up(self) -> None:
    """Compiles every program this batch calls (padding rows only: nothing runs)."""
    d = self.decoder
    for a, w in self.admit_programs():
      self._state = compiled.admit(d.static, d.flat, self._state, np.zeros((a, w), np.int32),
                                  np.ones((a,), np.int32), np.full((a,), self.rows, np.int32),
                                  np.zeros((a,), np.int32), np.zeros((a, 2), np.uint32),
                                  self.knobs, spec=d.spec, place=d.place)
    self.run(1)
    for n in self.row_counts:
      self.run(1, busy=list(range(n)))
    self._after_run = None
    self.read()  # the read of its own (after an admission)
    jax.block_until_ready(self.state)
    self.runs_by_rows.clear()  # counts runs that decode, not these
    self.admits_by_width.clear()
