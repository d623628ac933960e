"""The offline decoder and its continuous-batching engine.

`Decoder(model, decode_config)` splits and checks a model and a DecodeConfig once;
`generate` decodes one batch in one compiled program (admit all, loop until every
row is done). `Engine` serves many prompts through a fixed number of rows: when a
row finishes, its result is taken and the next prompt is prefilled into it, without
recompiling; prompts are bucketed by length (one program per bucket). The server's
rows, run a few passes at a time, are live.py's `LiveBatch`; the row-program
protocol every method implements is program.py; the compiled functions compiled.py.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from refusion_jax.decode import common, compiled, heads
from refusion_jax.decode import program as program_lib
from refusion_jax.decode.program import Spec
from refusion_jax.decode.settings import DecodeConfig


class Decoder:
  """A model and a DecodeConfig, split and checked once; every call after is a dispatch.

  `generate(ids_bp, lens_b, rng)` decodes a batch in one compiled program;
  `engine(rows)` serves many prompts. `method` names the decoder a caller
  expects (its own check then refuses a DecodeConfig of another method);
  by default it is `decode_config.method`.

  `spec` is the DecodeConfig's static part on this platform, for any number of
  rows; `generate` and `Engine` compile `spec_for(rows)`, where an unset
  `decode.kv_chunk` also follows the row count (`DecodeConfig.kv_chunk_on`: on a
  CPU one row reads the whole buffer).
  """

  def __init__(self, model, decode_config: DecodeConfig, *, method: str | None = None,
               vocab_chunk: int = heads.DEFAULT_VOCAB_CHUNK):
    if not isinstance(decode_config, DecodeConfig):
      raise TypeError(f"decode_config must be a DecodeConfig, got "
                      f"{type(decode_config).__name__}")
    if method is not None and decode_config.method != method:
      raise ValueError(f"this decoder runs decode.method={method!r}, got "
                       f"{decode_config.method!r}")
    decode_config.replace()  # every check again, on an instance altered after construction
    decode_config.require_compiled("the compiled decoder")
    decode_config.check_fits(model.config, 1)
    self.program = program_lib.program(decode_config.method)
    self.model = model
    self.config = decode_config
    self.knobs = program_lib.knobs_of(model.config, decode_config)
    self.graphdef, self.params = nnx.split(model)
    self.platform = compiled.platform_of(self.params)
    self.spec = program_lib.spec_of(decode_config, vocab_chunk, self.platform)
    self._row_specs: dict[int, Spec] = {}
    self.static = compiled.interned(self.graphdef)  # what this module's dispatches pass
    self.flat = compiled.flat_params(self.params)  # the same for the parameters
    self.place = compiled.placement_of(self.params)

  def spec_for(self, rows: int) -> Spec:
    """`spec` for a program over `rows` rows: an unset `decode.kv_chunk` as the
    platform's default takes it at that row count (a set one, or MDM's 0, as is)."""
    spec = self._row_specs.get(rows)
    if spec is None:
      spec = self.spec
      if spec.kv_chunk:  # 0: MDM (no cache), a GPU, or decode.kv_chunk=0
        spec = dataclasses.replace(spec, kv_chunk=self.config.kv_chunk_on(self.platform, rows))
      self._row_specs[rows] = spec
    return spec

  def _rng(self, rng):
    if rng is None:
      if self.config.temperature > 0 and self.program.needs_rng_to_sample:
        raise ValueError(f"decode.temperature={self.config.temperature} > 0 needs an rng key")
      rng = jax.random.PRNGKey(0)
    return program_lib.raw_key(rng)

  def check_prompts(self, prompt_ids_bp, prompt_len_b):
    """The prompts' own checks; the config was checked once, in `__init__`, so only
    whether the longest prompt fits is left."""
    return common.checked_prompts(self.model, prompt_ids_bp, prompt_len_b, self.config,
                                  lambda mc, dc, longest: dc.check_fits(mc, longest))

  def generate(self, prompt_ids_bp, prompt_len_b, rng=None, *, with_state: bool = False):
    ids, lens = self.check_prompts(prompt_ids_bp, prompt_len_b)
    out, state = compiled.generate(self.static, self.flat, jnp.asarray(ids), jnp.asarray(lens),
                                   self._rng(rng), self.knobs, spec=self.spec_for(ids.shape[0]))
    return (out, state) if with_state else out

  def engine(self, rows: int, **kwargs) -> "Engine":
    return Engine(self, rows, **kwargs)


def decoder_for(model, decode_config: DecodeConfig):
  """The decoder that runs `decode_config`: a compiled `Decoder`, or the host-side one its
  options name (the MCTS planner), behind the same `engine(rows)` / `generate` interface."""
  if decode_config.host_decoder:
    module, name = decode_config.host_decoder.split(":")
    return getattr(importlib.import_module(module), name)(model, decode_config)
  return Decoder(model, decode_config)


def generate(model, prompt_ids_bp, prompt_len_b, decode_config: DecodeConfig, rng=None):
  """Decodes right-padded prompts `[B, P]` with `decode_config.method`."""
  return Decoder(model, decode_config).generate(prompt_ids_bp, prompt_len_b, rng)


@dataclasses.dataclass
class PromptResult:
  """One prompt's decode, as the engine hands it back."""

  index: int
  tokens: list[int]  # generated tokens up to and including EOS
  counters: dict[str, float]  # per-prompt counters (DecodeCounters.as_dict, per row)
  commit_steps: list[int]
  seconds: float  # wall time from its admission to the end of the call that finished it
  trace: dict | None = None  # decode.record: the row's DecodeOutput.trace as numpy arrays


@dataclasses.dataclass
class EngineRun:
  results: list[PromptResult]  # in input order
  passes: int  # forward passes of the whole run (every row advanced by each)
  seconds: float  # wall time of the whole run, compiles excluded when warmed up
  admissions: int  # admit calls (prefill passes)


def bucket_width(length: int, minimum: int = 8) -> int:
  """Prompt buckets: powers of two from `minimum`."""
  return max(minimum, 1 << max(0, math.ceil(math.log2(max(1, length)))))


class Engine:
  """Continuous batching over a fixed number of rows (module docstring).

  `run(prompts)` decodes a list of token-id lists and returns their results in
  input order. Within a length bucket, the rows run one compiled loop that
  returns to the host whenever a row finishes while prompts still wait; the
  host takes that row's result and prefills the next prompt into it (the
  other rows keep their state). An admission takes as many prompts as rows are free
  (padded to a power of two up to `rows`, one small program each). With `admit_widths`, an
  admission prefills at the narrowest of them below its bucket's width that holds
  its prompts (one more admission program per width and size; `warm_up` compiles
  them all), so short prompts do not pay for the bucket's widest, as `LiveBatch`'s.
  Its programs are compiled for `decoder.spec_for(rows)`.
  """

  def __init__(self, decoder: Decoder, rows: int, *, width: int | None = None,
               min_bucket: int = 8, admit_widths: Sequence[int] = ()):
    if not isinstance(rows, int) or isinstance(rows, bool) or rows < 1:
      raise ValueError(f"engine rows must be a positive int, got {rows!r}")
    if width is not None and (not isinstance(width, int) or width < 1):
      raise ValueError(f"engine width must be a positive int or None, got {width!r}")
    self.decoder = decoder
    self.rows = rows
    self.spec = decoder.spec_for(rows)  # what its programs are compiled for
    self.width = width  # one bucket of this width for every prompt (None: power-of-two buckets)
    self.min_bucket = min_bucket
    bad = [w for w in admit_widths if not isinstance(w, int) or isinstance(w, bool) or w < 1]
    if bad:
      raise ValueError(f"engine admit_widths must be positive ints, got {bad}")
    self.admit_widths = tuple(sorted(set(admit_widths)))

  def _prefill_widths(self, width: int) -> list[int]:
    """The prefill widths of a bucket of this width: the narrower `admit_widths`, and it."""
    return [w for w in self.admit_widths if w < width] + [width]

  def _bucket(self, length: int) -> int:
    if self.width is not None:
      if length > self.width:
        raise ValueError(f"a prompt of {length} tokens is wider than the engine's width "
                         f"{self.width}")
      return self.width
    return bucket_width(length, self.min_bucket)

  def warm_up(self, lengths: Sequence[int] = ()) -> None:
    """Compiles every program a run over prompts of these lengths can call (with a
    fixed `width`: that bucket), so that timed runs exclude compilation."""
    d = self.decoder
    widths = {self._bucket(n) for n in lengths} or ({self.width} if self.width else set())
    sizes, a = set(), 1
    while True:
      sizes.add(self._admit_size(a))
      if a >= self.rows:
        break
      a *= 2
    for width in sorted(widths):
      state = compiled.init(d.static, d.flat, spec=self.spec, rows=self.rows, width=width,
                           place=d.place)
      for a, w in ((a, w) for a in sorted(sizes) for w in self._prefill_widths(width)):
        # padding rows only: nothing is admitted
        state = compiled.admit(d.static, d.flat, state, np.zeros((a, w), np.int32),
                              np.ones((a,), np.int32), np.full((a,), self.rows, np.int32),
                              np.zeros((a,), np.int32), program_lib.raw_key(jax.random.PRNGKey(0)), d.knobs,
                              spec=self.spec, place=d.place)
      for stop in (True, False):
        state, packed = compiled.step(d.static, d.flat, state, d.knobs, np.bool_(stop),
                                     np.zeros((self.rows,), bool), spec=self.spec, place=d.place)
      jax.block_until_ready(packed)

  def _admit_size(self, n: int) -> int:
    return min(self.rows, 1 << math.ceil(math.log2(max(1, n))))

  def run(self, prompts: Sequence[Sequence[int]], rng=None, *, progress: Any = None
          ) -> EngineRun:
    d = self.decoder
    if len(prompts) == 0:
      return EngineRun(results=[], passes=0, seconds=0.0, admissions=0)
    lens = np.asarray([len(p) for p in prompts], np.int64)
    width = max(1, int(lens.max()))
    ids = np.zeros((len(prompts), width), np.int64)
    for i, p in enumerate(prompts):
      ids[i, :len(p)] = np.asarray(p, np.int64)
    ids, lens = d.check_prompts(ids, lens)
    rng = d._rng(rng)  # pylint: disable=protected-access
    results: list[PromptResult | None] = [None] * len(prompts)
    total_passes, admissions = 0, 0
    start = time.perf_counter()
    buckets: dict[int, list[int]] = {}
    for i, n in enumerate(lens):
      buckets.setdefault(self._bucket(int(n)), []).append(i)
    for width in sorted(buckets):
      order = buckets[width]
      passes, adm = self._run_bucket(order, ids, lens, width, rng, results, progress)
      total_passes += passes
      admissions += adm
    return EngineRun(results=results, passes=total_passes,
                     seconds=time.perf_counter() - start, admissions=admissions)

  def _run_bucket(self, order, ids, lens, width, rng, results, progress):
    d = self.decoder
    b = self.rows
    state = compiled.init(d.static, d.flat, spec=self.spec, rows=b, width=width, place=d.place)
    queue = list(order)
    row_prompt = [-1] * b
    row_start = [0.0] * b
    passes = 0
    admissions = 0
    like = compiled.output_like(state, d.knobs, self.spec)
    while True:
      free = [r for r in range(b) if row_prompt[r] < 0]
      if queue and free:
        n = min(len(free), len(queue))
        a = self._admit_size(n)
        take, queue = queue[:n], queue[n:]
        longest = max(int(lens[i]) for i in take)
        ids_ap = np.zeros((a, min(w for w in self._prefill_widths(width) if w >= longest)),
                          np.int32)
        lens_a = np.ones((a,), np.int32)
        rows_a = np.full((a,), b, np.int32)  # index b: padding, dropped
        pids_a = np.zeros((a,), np.int32)
        now = time.perf_counter()
        for j, i in enumerate(take):
          ids_ap[j, :lens[i]] = ids[i, :lens[i]]
          lens_a[j], rows_a[j], pids_a[j] = lens[i], free[j], i
          row_prompt[free[j]] = i
          row_start[free[j]] = now
        # Host arrays go in as they are: the call's own transfer, no eager op each.
        state = compiled.admit(d.static, d.flat, state, ids_ap, lens_a, rows_a, pids_a, rng,
                              d.knobs, spec=self.spec, place=d.place)
        admissions += 1
        if queue and len(free) > n:
          continue  # more free rows: admit again before running
      if all(p < 0 for p in row_prompt):
        return passes, admissions
      # Rows holding no prompt are freed at the step's start: finished ones whose
      # results were taken below in an earlier turn. (A row can finish at its admission,
      # as when its first token is EOS: it holds its prompt until the host takes it.)
      free_b = np.asarray([p < 0 for p in row_prompt])
      state, packed = compiled.step(d.static, d.flat, state, d.knobs, np.bool_(bool(queue)),
                                   free_b, spec=self.spec, place=d.place)
      out, phase, total = compiled.unpack32(np.asarray(packed), like)
      before, passes = passes, int(total)  # the bucket's state counts its passes from zero
      if passes == before and not any(i >= 0 and phase[r] == program_lib.DONE
                                      for r, i in enumerate(row_prompt)):
        raise RuntimeError(f"the engine's step ran no pass and finished no row (rows "
                           f"{[r for r, i in enumerate(row_prompt) if i >= 0]} hold prompts, "
                           f"phases {phase.tolist()})")
      now = time.perf_counter()
      counter_arrays = {k: np.asarray(v) for k, v in out.counters.as_dict().items()}
      for r in range(b):
        i = row_prompt[r]
        if i >= 0 and phase[r] == program_lib.DONE:
          n = int(out.length_b[r])
          counters = {k: float(v[r]) for k, v in counter_arrays.items()}
          results[i] = PromptResult(index=i, tokens=[int(t) for t in out.tokens_bg[r, :n]],
                                    counters=counters,
                                    commit_steps=[int(s) for s in out.commit_step_bg[r, :n]],
                                    seconds=now - row_start[r],
                                    trace=None if out.trace is None else
                                    {k: np.array(v[r]) for k, v in out.trace.items()})
          row_prompt[r] = -1
          if progress is not None:
            progress.update(1)
