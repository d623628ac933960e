"""One protocol for every decoder, and a continuous-batching engine over it.

Each decoding method (`refusion`, `ar`, `mdm`, `bd3lm`) is a *row program*: a fixed
number of rows, each holding one prompt (or nothing), each in its own phase.
A program provides

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

What a program compiles for is split in two. `Spec` is static (shapes and
structure: method, gen_length, slot and block size, the left-to-right
ablation, the vocabulary chunk, the MDM ranking and schedule); `Knobs` is
traced (thresholds, temperature, recompute_kv, the MDM per-step count and
threshold, the special token ids, EOS's -1 under
`ignore_eos`), so a threshold sweep or a new temperature reuses every compiled
program of every method.

Randomness is per prompt: prompt i of a call draws from
`fold_in(rng, i)` and, within it, from the row's own pass count, so a prompt
decodes the same whether alone, in a batch, or admitted mid-run into any row.

`generate` decodes one batch in one compiled program (admit all, loop until
every row is done). `Engine` serves many prompts through a fixed number of
rows: when a row finishes, its result is taken and the next prompt is
prefilled into it, without recompiling; prompts are bucketed by length (one
program per bucket).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import math
import time
from typing import Any, Callable, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from refusion_jax import sharding
from refusion_jax.config import DECODE_PROGRAMS, MAX_STOP_IDS, PLAN_FEATURES, DecodeConfig
from refusion_jax.decode import common, heads
from refusion_jax.kv_cache import KVCache

FREE, DONE, FIRST_PHASE = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class Spec:
  """What a decode program is compiled for (hashable)."""

  method: str
  gen_length: int
  slot_size: int
  block_size: int
  left_to_right: bool = False
  vocab_chunk: int = heads.DEFAULT_VOCAB_CHUNK
  kv_chunk: int = 0  # DecodeConfig.kv_chunk as resolved for the platform (KVCache.chunk)
  matmul_precision: str | None = None  # DecodeConfig.matmul_precision as resolved (None: JAX's)
  mdm_ranking: str = "confidence"  # DecodeConfig.mdm_ranking (MDM only)
  mdm_steps_per_block: int = 0  # a schedule's steps per block (0: none; MDM only)
  mdm_schedule: str = ""  # DecodeConfig.mdm_schedule_on with a schedule ("" without one)
  mdm_cfg: bool = False  # DecodeConfig.mdm_cfg_scale > 0 (a second, unconditional forward)
  mdm_cache: str = ""  # DecodeConfig.mdm_cache ("" without one)
  d2f_window: int = 0  # DecodeConfig.d2f_window (D2F only)
  verify: bool = False  # DecodeConfig.verify != "off" (ReFusion only; "exact" is a knob)
  remask: bool = False  # DecodeConfig.remask (ReFusion only)
  record: bool = False  # DecodeConfig.record (ReFusion only): DecodeOutput.trace
  plan_policy: bool = False  # DecodeConfig.planner == "policy" (ReFusion only)


@flax.struct.dataclass
class Knobs:
  """Traced settings: changing them never recompiles."""

  slot_threshold: jax.Array
  token_threshold: jax.Array
  temperature: jax.Array
  recompute_kv: jax.Array
  mdm_threshold: jax.Array  # < 0: off (LLaDA's fixed count per step)
  mdm_tokens_per_step: jax.Array
  mask_id: jax.Array
  eos_id: jax.Array  # -1 when the model has no EOS or decode.ignore_eos: never matches a token
  pad_id: jax.Array
  verify_exact: jax.Array = False  # DecodeConfig.verify == "exact" (with Spec.verify)
  boundary_check: jax.Array = True  # DecodeConfig.boundary_check (with Spec.verify)
  remask_threshold: jax.Array = 0.5  # DecodeConfig.remask_threshold (with Spec.remask)
  sample_drafts: jax.Array = False  # DecodeConfig.sample_drafts (ReFusion's infill drafts)
  # DecodeConfig.plan_weights (w, then b) and plan_sample (with Spec.plan_policy)
  plan_w: jax.Array = flax.struct.field(
      default_factory=lambda: np.zeros((len(PLAN_FEATURES),), np.float32))
  plan_b: jax.Array = 0.0
  plan_sample: jax.Array = False
  # ModelConfig.stop_token_ids, padded with -1 to MAX_STOP_IDS - 1 (all -1 under ignore_eos)
  stop_ids: jax.Array = flax.struct.field(
      default_factory=lambda: np.full((MAX_STOP_IDS - 1,), -1, np.int32))
  # MDM, LLaDA's flags (DecodeConfig.mdm_ban_eos, mdm_defer_stop) and guidance scale
  mdm_ban_eos: jax.Array = False
  mdm_defer_stop: jax.Array = False
  cfg_scale: jax.Array = 0.0
  # MDM, Fast-dLLM's (DecodeConfig.mdm_factor, -1: off; mdm_cache_refresh)
  mdm_factor: jax.Array = -1.0
  cache_refresh: jax.Array = 0
  # D2F's tau_add, tau_act, tau_conf (DecodeConfig.d2f_*_threshold)
  d2f_add: jax.Array = 0.1
  d2f_act: jax.Array = 0.95
  d2f_conf: jax.Array = 0.9

  def is_stop(self, tokens):
    """Where `tokens` end a response: EOS or one of the other stop ids."""
    tokens = jnp.asarray(tokens)
    return (tokens == self.eos_id) | (tokens[..., None] == self.stop_ids).any(-1)


@dataclasses.dataclass(frozen=True)
class Program:
  """A decoding method as a row program (module docstring)."""

  name: str
  check: Callable  # (model_config, decode_config, longest_prompt) -> None, raises
  init: Callable
  admit: Callable
  step: Callable
  output: Callable
  needs_rng_to_sample: bool = True


_PROGRAMS: dict[str, Program] = {}


def register(program: Program) -> Program:
  _PROGRAMS[program.name] = program
  return program


def program(method: str) -> Program:
  if method not in _PROGRAMS:
    raise ValueError(f"decode.method={method!r}: known decoders are {sorted(_PROGRAMS)}")
  return _PROGRAMS[method]


def spec_of(decode_config: DecodeConfig, vocab_chunk: int = heads.DEFAULT_VOCAB_CHUNK,
            platform: str = "cpu") -> Spec:
  """The static part of a DecodeConfig on `platform`; fields a method ignores are
  normalised so that they share one program."""
  dc, g = decode_config, decode_config.gen_length
  kv_chunk, mp = dc.kv_chunk_on(platform), dc.matmul_precision_on(platform)
  if dc.method == "ar":
    return Spec("ar", g, g, g, False, vocab_chunk, kv_chunk, mp)
  if dc.method == "mdm":  # a KV cache only with Fast-dLLM's
    steps = dc.mdm_steps_per_block or 0
    return Spec("mdm", g, dc.block_size, dc.block_size, False, vocab_chunk,
                kv_chunk if dc.mdm_cache else 0, mp,
                mdm_ranking=dc.mdm_ranking, mdm_steps_per_block=steps,
                mdm_schedule=dc.mdm_schedule_on if steps and dc.mdm_ranking != "origin" else "",
                mdm_cfg=dc.mdm_cfg_scale > 0, mdm_cache=dc.mdm_cache or "")
  if dc.method == "bd3lm":  # blocks only: no slots
    return Spec("bd3lm", g, dc.block_size, dc.block_size, False, vocab_chunk, kv_chunk, mp)
  if dc.method == "d2f":  # blocks only: no slots
    return Spec("d2f", g, dc.block_size, dc.block_size, False, vocab_chunk, kv_chunk, mp,
                d2f_window=min(dc.d2f_window, dc.num_blocks))
  verify = dc.verify != "off"
  if dc.left_to_right:  # blocks play no part left to right
    return Spec("refusion", g, dc.slot_size, g, True, vocab_chunk, kv_chunk, mp, verify=verify)
  return Spec("refusion", g, dc.slot_size, dc.block_size, False, vocab_chunk, kv_chunk, mp,
              verify=verify, remask=dc.remask, record=dc.record,
              plan_policy=dc.planner == "policy")


def precision(spec: Spec):
  """The context a decode program is traced in: its float32 matrix products at
  `spec.matmul_precision` (None: JAX's default, as set outside)."""
  if spec.matmul_precision is None:
    return contextlib.nullcontext()
  return jax.default_matmul_precision(spec.matmul_precision)


def stop_ids_of(model_config, decode_config: DecodeConfig) -> np.ndarray:
  """`Knobs.stop_ids`: the model's stop ids besides EOS, padded with -1 (none under
  `ignore_eos`)."""
  out = np.full((MAX_STOP_IDS - 1,), -1, np.int32)
  if not decode_config.ignore_eos:
    ids = tuple(getattr(model_config, "stop_token_ids", ()))
    out[:len(ids)] = ids
  return out


def knobs_of(model_config, decode_config: DecodeConfig) -> Knobs:
  dc = decode_config
  return Knobs(
      slot_threshold=jnp.float32(dc.slot_threshold),
      token_threshold=jnp.float32(dc.token_threshold),
      temperature=jnp.float32(dc.temperature),
      recompute_kv=jnp.bool_(dc.recompute_kv),
      mdm_threshold=jnp.float32(-1.0 if dc.mdm_threshold is None else dc.mdm_threshold),
      mdm_tokens_per_step=jnp.int32(dc.mdm_tokens_per_step),
      mask_id=jnp.int32(-1 if model_config.mask_token_id is None else model_config.mask_token_id),
      eos_id=jnp.int32(-1 if model_config.eos_token_id is None or dc.ignore_eos
                       else model_config.eos_token_id),
      stop_ids=jnp.asarray(stop_ids_of(model_config, dc)),
      pad_id=jnp.int32(0 if model_config.pad_token_id is None else model_config.pad_token_id),
      verify_exact=jnp.bool_(dc.verify == "exact"),
      boundary_check=jnp.bool_(dc.boundary_check),
      remask_threshold=jnp.float32(dc.remask_threshold),
      sample_drafts=jnp.bool_(dc.sample_drafts),
      plan_w=jnp.asarray(dc.plan_weights_on[:-1], jnp.float32),
      plan_b=jnp.float32(dc.plan_weights_on[-1]),
      plan_sample=jnp.bool_(dc.plan_sample),
      mdm_ban_eos=jnp.bool_(dc.mdm_ban_eos),
      mdm_defer_stop=jnp.bool_(dc.mdm_defer_stop),
      cfg_scale=jnp.float32(dc.mdm_cfg_scale),
      mdm_factor=jnp.float32(-1.0 if dc.mdm_factor is None else dc.mdm_factor),
      cache_refresh=jnp.int32(dc.mdm_cache_refresh),
      d2f_add=jnp.float32(dc.d2f_add_threshold),
      d2f_act=jnp.float32(dc.d2f_act_threshold),
      d2f_conf=jnp.float32(dc.d2f_conf_threshold))


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


@dataclasses.dataclass(frozen=True)
class Placement:
  """Where a decode state lives when the parameters are on a mesh: K/V split over
  their heads as the rules split the model's, everything else replicated.

  The engine's programs hand a state from one to the next (init, admit, run,
  release); left to propagation, a leaf's sharding can differ from one program's
  output to another's, and every new combination is a new compile that warm_up
  never did. Each program therefore pins its output state to this one placement.
  """

  mesh: Mesh
  rules: sharding.ShardingRules = sharding.ShardingRules()

  def apply(self, state):
    def pin(x, spec=PartitionSpec()):
      return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))
    cache = getattr(state, "cache", None)
    if cache is None:
      return jax.tree.map(pin, state)
    axes = (None, "kv_heads", "cache_seq", "head_dim")
    if cache.stacked:
      axes = ("layers",) + axes
    shape = cache.k.shape if cache.stacked else cache.k[0].shape
    kv = sharding.logical_to_physical(axes, self.rules, shape, self.mesh)
    cache = cache.map_kv(lambda x: pin(x, kv)).replace(
        positions_bs=pin(cache.positions_bs), length_b=pin(cache.length_b))
    return jax.tree.map(pin, state.replace(cache=None)).replace(cache=cache)


def _sharding_of(params):
  """The sharding of the first of `params`' leaves (None where it has none)."""
  leaves = jax.tree.leaves(params)
  return getattr(leaves[0], "sharding", None) if leaves else None


def placement_of(params) -> Placement | None:
  """The placement for states decoded with these parameters (None: a single device
  without a mesh, where nothing varies)."""
  where = _sharding_of(params)
  return Placement(where.mesh) if isinstance(where, NamedSharding) else None


def platform_of(params) -> str:
  """The platform ("cpu", "gpu", "tpu") of the devices holding `params` (arrays, or
  shapes placed on a mesh), or JAX's default backend where they name none."""
  devices = getattr(_sharding_of(params), "device_set", None)
  if devices:
    platform = next(iter(devices)).platform
  else:
    platform = jax.default_backend()
  return "gpu" if platform in ("cuda", "rocm") else platform


def _placed(state, place: Placement | None):
  return state if place is None else place.apply(state)


def set_rows(full, new, rows_a):
  """Writes the `[A, ...]` leaves of `new` into rows `rows_a` of `full` (index B: dropped)."""
  return jax.tree.map(lambda f, x: f.at[rows_a].set(x.astype(f.dtype), mode="drop"), full, new)


# --- the compiled programs ----------------------------------------------------------------


def _loop(model, prog: Program, spec: Spec, state, knobs: Knobs, stop_on_done, pass_limit=None):
  """Passes until no row is active, or some row is done (`stop_on_done`, traced: True
  or 1; False or 0: never), or (a traced `pass_limit`) the state has run that many
  passes in all; at `spec`'s precision."""
  def cond(s):
    phase_b = s.rows.phase_b
    stop = (stop_on_done > 0) & (phase_b == DONE).any()
    go = (phase_b >= FIRST_PHASE).any() & ~stop
    return go if pass_limit is None else go & (s.passes < pass_limit)
  with precision(spec):
    return jax.lax.while_loop(cond, lambda s: prog.step(model, spec, s, knobs), state)


class Interned:
  """A value as a static jit argument or pytree aux data whose hash is computed once.

  Every dispatch of a jitted function hashes its static arguments and the aux data
  of its arguments' pytrees: a GraphDef's hash walks the whole module graph (about
  half a millisecond per dispatch on a small CPU, for a two-layer model), a
  parameter tree's structure its Variables, which a server loop dispatching a pass
  at a time pays on every pass. `interned` keeps one per distinct value, so a cache
  lookup is a precomputed hash and an identity check."""

  __slots__ = ("value", "_hash")

  def __init__(self, value):
    self.value = value
    self._hash = hash(value)

  def __hash__(self):
    return self._hash

  def __eq__(self, other):
    return self is other or (isinstance(other, Interned) and self._hash == other._hash
                             and self.value == other.value)


_INTERNED: dict = {}


def interned(value) -> Interned:
  """The one `Interned` of values equal to this one (a GraphDef, a tree structure)."""
  return _INTERNED.setdefault(value, Interned(value))


@jax.tree_util.register_pytree_node_class
class FlatParams:
  """A model's parameters as the tuple of their arrays and their interned structure,
  as this module's dispatches pass them: flattening an `nnx.State` walks it Variable
  by Variable in Python (about 43 µs a dispatch for a two-layer model on a small
  CPU), this one step (about 2.5 µs). Programs take it back with `_merge`."""

  __slots__ = ("leaves", "structure")

  def __init__(self, leaves: tuple, structure: Interned):
    self.leaves, self.structure = leaves, structure

  def tree_flatten(self):
    return self.leaves, self.structure

  @classmethod
  def tree_unflatten(cls, structure, leaves):
    return cls(tuple(leaves), structure)

  def state(self):
    return jax.tree_util.tree_unflatten(self.structure.value, self.leaves)


def flat_params(params) -> FlatParams:
  """`params` (an `nnx.State`) as a `FlatParams`, its structure interned."""
  leaves, treedef = jax.tree_util.tree_flatten(params)
  return FlatParams(tuple(leaves), interned(treedef))


def _merge(graphdef, params):
  """`nnx.merge` of a GraphDef (or its `Interned`) with an `nnx.State` or `FlatParams`."""
  if isinstance(params, FlatParams):
    params = params.state()
  return nnx.merge(graphdef.value if isinstance(graphdef, Interned) else graphdef, params)


@functools.partial(jax.jit, static_argnames=("graphdef", "spec"))
def _generate(graphdef, params, ids_bp, lens_b, rng, knobs: Knobs, spec: Spec):
  model = _merge(graphdef, params)
  prog = program(spec.method)
  b, p = ids_bp.shape
  state = prog.init(model, spec, b, p)
  rows = jnp.arange(b)
  with precision(spec):
    state = prog.admit(model, spec, state, ids_bp, lens_b, rows, prompt_keys(rng, rows), knobs)
  state = _loop(model, prog, spec, state, knobs, jnp.bool_(False))
  return prog.output(spec, state, knobs), state


@functools.partial(jax.jit, static_argnames=("graphdef", "spec", "rows", "width", "place"))
def _engine_init(graphdef, params, spec: Spec, rows: int, width: int,
                 place: Placement | None = None):
  state = program(spec.method).init(_merge(graphdef, params), spec, rows, width)
  return _placed(state, place)


@functools.partial(jax.jit, static_argnames=("graphdef", "spec", "place"),
                   donate_argnames=("state",))
def _engine_admit(graphdef, params, state, ids_ap, lens_a, rows_a, pids_a, rng, knobs, spec,
                  place: Placement | None = None):
  """Prefills prompts into rows; prompt j draws from `fold_in(rng, pids_a[j])`, where
  `rng` is one key `[2]` or a key per prompt `[A, 2]` (prompts of different seeds)."""
  model = _merge(graphdef, params)
  rng_a2 = jnp.broadcast_to(rng, (ids_ap.shape[0], 2))
  keys_a2 = jax.vmap(jax.random.fold_in)(rng_a2, pids_a)
  with precision(spec):
    state = program(spec.method).admit(model, spec, state, ids_ap, lens_a, rows_a, keys_a2,
                                       knobs)
  return _placed(state, place)


@functools.partial(jax.jit, static_argnames=("graphdef", "spec", "place"),
                   donate_argnames=("state",))
def _engine_run(graphdef, params, state, knobs, stop_on_done, spec, max_passes=None,
                place: Placement | None = None):
  """The loop; with a (traced) `max_passes` it also returns after that many passes."""
  model = _merge(graphdef, params)
  limit = None if max_passes is None else state.passes + max_passes
  return _placed(_loop(model, program(spec.method), spec, state, knobs, stop_on_done, limit),
                 place)


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


@functools.partial(jax.jit, static_argnames=("graphdef", "spec", "place"),
                   donate_argnames=("state",))
def _engine_run_rows(graphdef, params, state, knobs, stop_on_done, idx_n, spec, max_passes,
                     place: Placement | None = None):
  """`_engine_run` over rows `idx_n` only (the others must be free or idle): a pass then
  costs what a pass over `len(idx_n)` rows costs. Rows are independent, so each row's
  tokens and passes are those of a run over every row."""
  model = _merge(graphdef, params)
  sub = take_rows(state, idx_n)
  sub = _loop(model, program(spec.method), spec, sub, knobs, stop_on_done,
              sub.passes + max_passes)
  return _placed(put_rows(state, sub, idx_n), place)


def _pack32(tree) -> jax.Array:
  """Every leaf of `tree` as 32-bit words in one uint32 vector, so that the host
  reads it in one device-to-host copy rather than one per leaf (on a GPU each
  copy costs about 0.1 ms). Leaves narrower than 32 bits travel as int32."""
  words = []
  for x in jax.tree.leaves(tree):
    x = jnp.asarray(x)
    if x.dtype.itemsize != 4:
      x = x.astype(jnp.float32 if jnp.issubdtype(x.dtype, jnp.floating) else jnp.int32)
    words.append(jax.lax.bitcast_convert_type(x, jnp.uint32).ravel())
  return jnp.concatenate(words)


def _unpack32(words: np.ndarray, like):
  """`_pack32`'s inverse on the host: numpy leaves shaped and typed as `like`'s."""
  leaves, treedef = jax.tree.flatten(like)
  out, at = [], 0
  for leaf in leaves:
    dtype, n = np.dtype(leaf.dtype), int(np.prod(leaf.shape, dtype=np.int64))
    wire = dtype if dtype.itemsize == 4 else np.dtype(
        np.float32 if jnp.issubdtype(dtype, jnp.floating) else np.int32)
    out.append(words[at:at + n].view(wire).reshape(leaf.shape).astype(dtype, copy=False))
    at += n
  return jax.tree.unflatten(treedef, out)


def _output_tree(state, knobs, spec):
  return program(spec.method).output(spec, state, knobs), state.rows.phase_b, state.passes


def _output_like(state, knobs, spec):
  """Shapes and dtypes of `_output_tree` (what `_unpack32` rebuilds)."""
  return jax.eval_shape(functools.partial(_output_tree, spec=spec), state, knobs)


def _freed(state, free_b):
  """`state` with the rows where `free_b` is set freed (a finished row once its result is
  taken, or a cancelled one mid-decode: admission rewrites everything a row holds, so
  freeing only sets the phase)."""
  phase_b = jnp.where(free_b, FREE, state.rows.phase_b)
  return state.replace(rows=state.rows.replace(phase_b=phase_b))


@functools.partial(jax.jit, static_argnames=("graphdef", "spec", "place"),
                   donate_argnames=("state",))
def _engine_step(graphdef, params, state, knobs, stop_on_done, free_b, spec,
                 place: Placement | None = None):
  """The offline engine's turn after its admissions, in one program: the rows in
  `free_b` freed (those holding no prompt: finished rows whose results the host took),
  the loop, and every row's output, phase and the pass count packed (`_pack32`: one
  device-to-host copy)."""
  state = _engine_run.__wrapped__(graphdef, params, _freed(state, free_b), knobs,
                                  stop_on_done, spec, None, place)
  return state, _pack32(_output_tree(state, knobs, spec))


def compiled_programs() -> dict[str, int]:
  """Compiled programs so far, per entry point (tests prove reuse with it)."""
  return {"generate": _generate._cache_size(), "run": _engine_run._cache_size(),
          "step": _engine_step._cache_size(),
          "run_rows": _engine_run_rows._cache_size(),
          "admit": _engine_admit._cache_size(), "read": _live_read._cache_size(),
          "live_run": _live_run._cache_size(), "live_run_rows": _live_run_rows._cache_size()}


# --- host side ----------------------------------------------------------------------------


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
    self.program = program(decode_config.method if method is None else method)
    decode_config.replace()  # re-runs DecodeConfig's own field checks
    self.program.check(model.config, decode_config, 1)
    self.model = model
    self.config = decode_config
    self.knobs = knobs_of(model.config, decode_config)
    self.graphdef, self.params = nnx.split(model)
    self.platform = platform_of(self.params)
    self.spec = spec_of(decode_config, vocab_chunk, self.platform)
    self._row_specs: dict[int, Spec] = {}
    self.static = interned(self.graphdef)  # what this module's dispatches pass
    self.flat = flat_params(self.params)  # the same for the parameters
    self.place = placement_of(self.params)

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
    return raw_key(rng)

  def check_prompts(self, prompt_ids_bp, prompt_len_b):
    """The prompts' own checks; the config was checked once, in `__init__`, so only
    whether the longest prompt fits is left."""
    return common.checked_prompts(self.model, prompt_ids_bp, prompt_len_b, self.config,
                                  lambda mc, dc, longest: dc.check_fits(mc, longest))

  def generate(self, prompt_ids_bp, prompt_len_b, rng=None, *, with_state: bool = False):
    ids, lens = self.check_prompts(prompt_ids_bp, prompt_len_b)
    out, state = _generate(self.static, self.flat, jnp.asarray(ids), jnp.asarray(lens),
                           self._rng(rng), self.knobs, spec=self.spec_for(ids.shape[0]))
    return (out, state) if with_state else out

  def engine(self, rows: int, **kwargs) -> "Engine":
    return Engine(self, rows, **kwargs)


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
      state = _engine_init(d.static, d.flat, spec=self.spec, rows=self.rows, width=width,
                           place=d.place)
      for a, w in ((a, w) for a in sorted(sizes) for w in self._prefill_widths(width)):
        # padding rows only: nothing is admitted
        state = _engine_admit(d.static, d.flat, state, np.zeros((a, w), np.int32),
                              np.ones((a,), np.int32), np.full((a,), self.rows, np.int32),
                              np.zeros((a,), np.int32), raw_key(jax.random.PRNGKey(0)), d.knobs,
                              spec=self.spec, place=d.place)
      for stop in (True, False):
        state, packed = _engine_step(d.static, d.flat, state, d.knobs, np.bool_(stop),
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
    state = _engine_init(d.static, d.flat, spec=self.spec, rows=b, width=width, place=d.place)
    queue = list(order)
    row_prompt = [-1] * b
    row_start = [0.0] * b
    passes = 0
    admissions = 0
    like = _output_like(state, d.knobs, self.spec)
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
        state = _engine_admit(d.static, d.flat, state, ids_ap, lens_a, rows_a, pids_a, rng,
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
      state, packed = _engine_step(d.static, d.flat, state, d.knobs, np.bool_(bool(queue)),
                                   free_b, spec=self.spec, place=d.place)
      out, phase, total = _unpack32(np.asarray(packed), like)
      before, passes = passes, int(total)  # the bucket's state counts its passes from zero
      if passes == before and not any(i >= 0 and phase[r] == DONE
                                      for r, i in enumerate(row_prompt)):
        raise RuntimeError(f"the engine's step ran no pass and finished no row (rows "
                           f"{[r for r, i in enumerate(row_prompt) if i >= 0]} hold prompts, "
                           f"phases {phase.tolist()})")
      now = time.perf_counter()
      counter_arrays = {k: np.asarray(v) for k, v in out.counters.as_dict().items()}
      for r in range(b):
        i = row_prompt[r]
        if i >= 0 and phase[r] == DONE:
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


# --- ahead of time ------------------------------------------------------------------------


def abstract_state(decoder: Decoder, rows: int, width: int):
  """Shapes (and placement) of the engine's state for `rows` rows and prompts `width` wide."""
  d = decoder
  init = _engine_init.lower(d.static, d.params, spec=d.spec, rows=rows, width=width,
                            place=d.place)
  return jax.tree.map(lambda o: jax.ShapeDtypeStruct(o.shape, o.dtype, sharding=o.sharding),
                      init.out_info)


def lower_program(decoder: Decoder, name: str, rows: int, width: int) -> jax.stages.Lowered:
  """One of the decoder's programs lowered from shapes alone (nothing runs):

  * "generate": a batch of `rows` prompts `width` wide decoded in one program;
  * "admit": the engine's prefill of `rows` prompts into a running state;
  * "run": the engine's loop of passes over `rows` rows.

  The decoder's parameters may be abstract (`ShapeDtypeStruct`s, with shardings
  when they lie on a mesh, e.g. a TPU slice described without a TPU); the other
  inputs are then replicated over that mesh.
  """
  if name not in DECODE_PROGRAMS:
    raise ValueError(f"decode program {name!r}: known programs are {DECODE_PROGRAMS}")
  d = decoder
  where = None if d.place is None else NamedSharding(d.place.mesh, PartitionSpec())

  def shape(shape_, dtype):
    return jax.ShapeDtypeStruct(shape_, dtype, sharding=where)

  knobs = jax.tree.map(lambda x: shape(jnp.shape(x), jnp.result_type(x)), d.knobs)
  rng = shape((2,), jnp.uint32)
  if name == "generate":
    return _generate.lower(d.static, d.params, shape((rows, width), jnp.int32),
                           shape((rows,), jnp.int32), rng, knobs, spec=d.spec)
  state = abstract_state(d, rows, width)
  if name == "admit":
    ids = shape((rows,), jnp.int32)
    return _engine_admit.lower(d.static, d.params, state, shape((rows, width), jnp.int32),
                               ids, ids, ids, rng, knobs, spec=d.spec, place=d.place)
  return _engine_run.lower(d.static, d.params, state, knobs, shape((), jnp.bool_),
                           spec=d.spec, place=d.place)


def _read_tree(state, knobs, spec):
  out = program(spec.method).output(spec, state, knobs)
  return (out.tokens_bg, out.commit_step_bg, out.length_b, out.counters.nfe_b(),
          state.rows.phase_b, state.passes)


@functools.partial(jax.jit, static_argnames=("spec",))
def _live_read(state, knobs, spec):
  """What a `Snapshot` holds, packed (`_pack32`): a read is one device-to-host copy."""
  return _pack32(_read_tree(state, knobs, spec))


# `LiveBatch`'s runs: the rows freed since the last run (`free_b`) freed, the run, and
# what a read after it gives (packed), in one program, so that neither a free nor a
# read right after a run needs a program of its own.

@functools.partial(jax.jit, static_argnames=("graphdef", "spec", "place"),
                   donate_argnames=("state",))
def _live_run(graphdef, params, state, knobs, stop_on_done, spec, max_passes, free_b,
              place: Placement | None = None):
  state = _engine_run.__wrapped__(graphdef, params, _freed(state, free_b), knobs,
                                  stop_on_done, spec, max_passes, place)
  return state, _pack32(_read_tree(state, knobs, spec))


@functools.partial(jax.jit, static_argnames=("graphdef", "spec", "place"),
                   donate_argnames=("state",))
def _live_run_rows(graphdef, params, state, knobs, stop_on_done, idx_n, spec, max_passes,
                   free_b, place: Placement | None = None):
  state = _engine_run_rows.__wrapped__(graphdef, params, _freed(state, free_b), knobs,
                                       stop_on_done, idx_n, spec, max_passes, place)
  return state, _pack32(_read_tree(state, knobs, spec))


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
    tokens, commit, length, nfe, phase, passes = _unpack32(np.asarray(self._packed),
                                                           self._like)
    if self._freed_b is not None:  # freed since the last run: the next run frees them
      phase = np.where(self._freed_b, FREE, phase).astype(phase.dtype)
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
    state = _engine_init(d.static, d.flat, spec=d.spec, rows=rows, width=width,
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
    self._read_like = jax.eval_shape(functools.partial(_read_tree, spec=d.spec), state,
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
    self._state = _engine_admit(d.static, d.flat, self._state, ids_ap, lens_a, rows_a, pids_a,
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
      self._state, packed = _live_run_rows(d.static, d.flat, self._state, self.knobs, stop,
                                           np.asarray(idx, np.int32), spec=d.spec,
                                           max_passes=limit, free_b=free_b, place=d.place)
    else:
      self._state, packed = _live_run(d.static, d.flat, self._state, self.knobs, stop,
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
      packed = _live_read(self._state, self.knobs, spec=self.decoder.spec)
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
      self._state = _engine_admit(d.static, d.flat, self._state, np.zeros((a, w), np.int32),
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
