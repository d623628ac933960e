"""One protocol for every decoder: the row program.

Each decoding method (`refusion`, `ar`, `mdm`, `bd3lm`, `d2f`) is a *row program*:
a fixed number of rows, each holding one prompt (or nothing), each in its own
phase. A program provides

* `init(model, spec, rows, width)`: every row free, the KV buffer empty;
* `admit(model, spec, state, ids_ap, lens_a, rows_a, keys_a2, knobs)`:
  prefills prompts into the given rows (row index `rows` = padding, ignored);
* `step(model, spec, state, knobs)`: **one forward pass** in which every
  active row advances by its own phase;
* `output(spec, state, knobs)`: a `DecodeOutput` of every row.

A program's state has `passes` (forward passes run) and `rows`, whose
`phase_b` the engine reads and writes. Row phases share two values: `FREE`
(no prompt) and `DONE` (finished, result not yet taken); a program's own
phases are >= `FIRST_PHASE`.

What a program compiles for is split in two, as its method's options declare
(decode/methods.py): its `Spec` is static (the shared shapes and platform
settings, then the method's static fields), its `Knobs` traced (temperature and
the special token ids, then the method's traced fields), so a threshold sweep or
a new temperature reuses every compiled program. Each method subclasses both
with its own fields (`refusion.Spec`, `mdm.Knobs`, ...).

Randomness is per prompt: prompt i of a call draws from `fold_in(rng, i)` and,
within it, from the row's own pass count, so a prompt decodes the same whether
alone, in a batch, or admitted mid-run into any row (`prompt_keys`, `pass_keys`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
from typing import Callable

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from refusion_jax.config import MAX_STOP_IDS
from refusion_jax.decode import heads
from refusion_jax.decode import options as options_lib
from refusion_jax.decode.settings import DecodeConfig
from refusion_jax.kv_cache import KVCache

FREE, DONE, FIRST_PHASE = 0, 1, 2


@dataclasses.dataclass(frozen=True, kw_only=True)
class Spec:
  """What a decode program is compiled for (hashable); a method's subclass adds its
  static fields."""

  method: str
  gen_length: int
  vocab_chunk: int = heads.DEFAULT_VOCAB_CHUNK
  kv_chunk: int = 0  # DecodeConfig.kv_chunk as resolved for the platform (KVCache.chunk)
  matmul_precision: str | None = None  # DecodeConfig.matmul_precision as resolved (None: JAX's)
  # The module of the program that runs it ("": the method's own, its options' `module`);
  # a method's options may pick another (`MethodOptions.program_module`).
  program: str = ""


@flax.struct.dataclass(kw_only=True)
class Knobs:
  """Traced settings (changing them never recompiles); a method's subclass adds its
  traced fields."""

  temperature: jax.Array
  mask_id: jax.Array
  eos_id: jax.Array  # -1 when the model has no EOS or decode.ignore_eos: never matches a token
  pad_id: jax.Array
  # ModelConfig.stop_token_ids, padded with -1 to MAX_STOP_IDS - 1 (all -1 under ignore_eos)
  stop_ids: jax.Array

  def is_stop(self, tokens):
    """Where `tokens` end a response: EOS or one of the other stop ids."""
    tokens = jnp.asarray(tokens)
    return (tokens == self.eos_id) | (tokens[..., None] == self.stop_ids).any(-1)


@flax.struct.dataclass
class State:
  """The state of a program over the KV buffer (every method but MDM, whose cache is
  optional): forward passes run (loop iterations, a scalar), the buffer, the rows."""

  passes: jax.Array
  cache: KVCache
  rows: object  # the method's own `Rows`


@dataclasses.dataclass(frozen=True)
class Program:
  """A decoding method as a row program (module docstring).

  `spec_type` and `knobs_type` are its `Spec` and `Knobs` (with its own fields);
  `pass_widths(spec)` the token widths of its passes over the KV cache (what `aot`
  compiles one pass of); `canvas_spec(spec)`, for a method whose steps feed prompt and
  canvas whole (MDM), the spec of such a step without a cache (None: none do).
  """

  name: str
  init: Callable
  admit: Callable
  step: Callable
  output: Callable
  spec_type: type = Spec
  knobs_type: type = Knobs
  pass_widths: Callable = lambda spec: (1,)
  canvas_spec: Callable | None = None
  needs_rng_to_sample: bool = True


_PROGRAMS: dict[str, Program] = {}  # by the module that registers it


def register(prog: Program, module: str) -> Program:
  """Makes `prog` the program of `module` (the module calling this: `__name__`)."""
  _PROGRAMS[module] = prog
  return prog


def _method_module(method: str) -> str:
  cls = options_lib.registry().get(method)
  if cls is None or not cls.module:
    raise ValueError(f"decode.method={method!r}: known decoders are "
                     f"{sorted(n for n, c in options_lib.registry().items() if c.module)}")
  return cls.module


def _loaded(module: str) -> Program:
  if module not in _PROGRAMS:
    importlib.import_module(module)  # registers it
  return _PROGRAMS[module]


def program(method: str) -> Program:
  """The program of `method` (its options' `module`), loaded on first use: its Spec and
  Knobs types, which every program of the method shares."""
  return _loaded(_method_module(method))


def program_of(spec: Spec) -> Program:
  """The program that runs `spec`: the one its method's options chose (`Spec.program`:
  ReFusion's lossless mode is a program of its own), else the method's."""
  return _loaded(spec.program or _method_module(spec.method))


def spec_of(decode_config: DecodeConfig, vocab_chunk: int = heads.DEFAULT_VOCAB_CHUNK,
            platform: str = "cpu") -> Spec:
  """The static part of a DecodeConfig on `platform`: the shared settings, then the
  method's own (its options' `static`, which may override a shared one)."""
  dc = decode_config
  fields = dict(method=dc.method, gen_length=dc.gen_length, vocab_chunk=vocab_chunk,
                kv_chunk=dc.kv_chunk_on(platform),
                matmul_precision=dc.matmul_precision_on(platform))
  fields.update(dc.options.static(dc))
  module = dc.options.program_module(dc)
  if module != dc.options.module:
    fields["program"] = module
  return program(dc.method).spec_type(**fields)


def stop_ids_of(model_config, decode_config: DecodeConfig) -> np.ndarray:
  """`Knobs.stop_ids`: the model's stop ids besides EOS, padded with -1 (none under
  `ignore_eos`)."""
  out = np.full((MAX_STOP_IDS - 1,), -1, np.int32)
  if not decode_config.ignore_eos:
    ids = tuple(getattr(model_config, "stop_token_ids", ()))
    out[:len(ids)] = ids
  return out


def knobs_of(model_config, decode_config: DecodeConfig) -> Knobs:
  """The traced part: the shared settings and special ids, then the method's own (its
  options' `traced`)."""
  dc, mc = decode_config, model_config
  fields = dict(
      temperature=jnp.float32(dc.temperature),
      mask_id=jnp.int32(-1 if mc.mask_token_id is None else mc.mask_token_id),
      eos_id=jnp.int32(-1 if mc.eos_token_id is None or dc.ignore_eos else mc.eos_token_id),
      pad_id=jnp.int32(0 if mc.pad_token_id is None else mc.pad_token_id),
      stop_ids=jnp.asarray(stop_ids_of(mc, dc)))
  fields.update({k: jnp.asarray(v) for k, v in dc.options.traced(dc).items()})
  return program(dc.method).knobs_type(**fields)


def precision(spec: Spec):
  """The context a decode program is traced in: its float32 matrix products at
  `spec.matmul_precision` (None: JAX's default, as set outside)."""
  if spec.matmul_precision is None:
    return contextlib.nullcontext()
  return jax.default_matmul_precision(spec.matmul_precision)


# --- randomness ----------------------------------------------------------------------------


def raw_key(rng) -> jax.Array:
  """A uint32[2] key from either key flavour."""
  rng = jnp.asarray(rng) if not isinstance(rng, jax.Array) else rng
  if jnp.issubdtype(rng.dtype, jax.dtypes.prng_key):
    return jax.random.key_data(rng)
  return rng


def prompt_keys(rng, prompt_ids_a) -> jax.Array:
  """`[A, 2]` per-prompt keys: `fold_in(rng, prompt id)`."""
  return jax.vmap(lambda i: jax.random.fold_in(rng, i))(prompt_ids_a)


def pass_keys(key_b2, pass_b, n: int, temperature=None) -> jax.Array:
  """`[B, n, 2]` keys for the n layout entries of each row's current pass.

  With a (traced) `temperature`, the keys are derived only when it is > 0 and
  are zeros otherwise: greedy decoding samples nothing, so its passes skip the
  hashing.
  """
  def derive():
    def row(key, count):
      k = jax.random.fold_in(key, count)
      return jax.vmap(lambda i: jax.random.fold_in(k, i))(jnp.arange(n))
    return jax.vmap(row)(key_b2, pass_b)
  if temperature is None:
    return derive()
  return jax.lax.cond(temperature > 0, derive,
                      lambda: jnp.zeros((key_b2.shape[0], n, 2), jnp.uint32))


def pass_uniforms(key_b2, pass_b, offset: int, n: int) -> jax.Array:
  """`[B, n]` uniform draws of each row's current pass beside its token keys: draw i of
  a row's pass c is `uniform(fold_in(fold_in(key, c), offset + i))` (`pass_keys` gives
  the pass's token keys 0..offset-1, so the two never share a key)."""
  def row(key, count):
    k = jax.random.fold_in(key, count)
    return jax.vmap(lambda i: jax.random.uniform(jax.random.fold_in(k, offset + i)))(
        jnp.arange(n))
  return jax.vmap(row)(key_b2, pass_b)


# --- rows ----------------------------------------------------------------------------------


def set_rows(full, new, rows_a):
  """Writes the `[A, ...]` leaves of `new` into rows `rows_a` of `full` (index B: dropped)."""
  return jax.tree.map(lambda f, x: f.at[rows_a].set(x.astype(f.dtype), mode="drop"), full, new)


def take_rows(state, idx_n):
  """The state of rows `idx_n` only (a program's state of `len(idx_n)` rows): every
  per-row leaf gathered, the KV buffer by its own layout, `passes` as it is."""
  parts = {}
  for f in dataclasses.fields(state):
    x = getattr(state, f.name)
    if f.name == "passes":
      continue
    parts[f.name] = (x.take_rows(idx_n) if isinstance(x, KVCache)
                     else jax.tree.map(lambda a: a[idx_n], x))
  return state.replace(**parts)


def put_rows(state, sub, idx_n):
  """`state` with rows `idx_n` (distinct) replaced by `sub`'s rows; `passes` from `sub`."""
  parts = {}
  for f in dataclasses.fields(state):
    x, y = getattr(state, f.name), getattr(sub, f.name)
    if f.name == "passes":
      parts[f.name] = y
    elif isinstance(x, KVCache):
      parts[f.name] = x.put_rows(idx_n, y)
    else:
      parts[f.name] = set_rows(x, y, idx_n)
  return state.replace(**parts)
