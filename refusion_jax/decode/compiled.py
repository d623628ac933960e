"""The decode programs as compiled functions, and how they are dispatched cheaply.

Every function here is jitted over a `program.Program` chosen by its (static) `Spec`:
`generate` decodes a batch whole; `init`, `admit`, `run`, `run_rows` and `step` are
the offline engine's turns; `live_read`, `live_run`, `live_run_rows` the server's
(live.py). Their states are pinned to one `Placement` when the parameters lie on a
mesh; their parameters travel as `FlatParams` with an `Interned` structure, and
what the host reads is packed into one vector (`pack32`), so a dispatch costs
microseconds. `lower_program` lowers a decoder's programs from shapes alone (aot).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from refusion_jax import sharding
from refusion_jax.config import DECODE_PROGRAMS
from refusion_jax.decode import program as program_lib
from refusion_jax.decode.program import Knobs, Program, Spec

PROGRAMS = DECODE_PROGRAMS  # what `lower_program` lowers


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


def placed(state, place: Placement | None):
  return state if place is None else place.apply(state)


# --- the compiled programs ----------------------------------------------------------------


def loop(model, prog: Program, spec: Spec, state, knobs: Knobs, stop_on_done, pass_limit=None):
  """Passes until no row is active, or some row is done (`stop_on_done`, traced: True
  or 1; False or 0: never), or (a traced `pass_limit`) the state has run that many
  passes in all; at `spec`'s precision."""
  def cond(s):
    phase_b = s.rows.phase_b
    stop = (stop_on_done > 0) & (phase_b == program_lib.DONE).any()
    go = (phase_b >= program_lib.FIRST_PHASE).any() & ~stop
    return go if pass_limit is None else go & (s.passes < pass_limit)
  with program_lib.precision(spec):
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
  CPU), this one step (about 2.5 µs). Programs take it back with `merge`."""

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


def merge(graphdef, params):
  """`nnx.merge` of a GraphDef (or its `Interned`) with an `nnx.State` or `FlatParams`."""
  if isinstance(params, FlatParams):
    params = params.state()
  return nnx.merge(graphdef.value if isinstance(graphdef, Interned) else graphdef, params)


@functools.partial(jax.jit, static_argnames=("graphdef", "spec"))
def generate(graphdef, params, ids_bp, lens_b, rng, knobs: Knobs, spec: Spec):
  model = merge(graphdef, params)
  prog = program_lib.program_of(spec)
  b, p = ids_bp.shape
  state = prog.init(model, spec, b, p)
  rows = jnp.arange(b)
  with program_lib.precision(spec):
    keys_b2 = program_lib.prompt_keys(rng, rows)
    state = prog.admit(model, spec, state, ids_bp, lens_b, rows, keys_b2, knobs)
  state = loop(model, prog, spec, state, knobs, jnp.bool_(False))
  return prog.output(spec, state, knobs), state


@functools.partial(jax.jit, static_argnames=("graphdef", "spec", "rows", "width", "place"))
def init(graphdef, params, spec: Spec, rows: int, width: int, place: Placement | None = None):
  state = program_lib.program_of(spec).init(merge(graphdef, params), spec, rows, width)
  return placed(state, place)


@functools.partial(jax.jit, static_argnames=("graphdef", "spec", "place"),
                   donate_argnames=("state",))
def admit(graphdef, params, state, ids_ap, lens_a, rows_a, pids_a, rng, knobs, spec,
          place: Placement | None = None):
  """Prefills prompts into rows; prompt j draws from `fold_in(rng, pids_a[j])`, where
  `rng` is one key `[2]` or a key per prompt `[A, 2]` (prompts of different seeds)."""
  model = merge(graphdef, params)
  rng_a2 = jnp.broadcast_to(rng, (ids_ap.shape[0], 2))
  keys_a2 = jax.vmap(jax.random.fold_in)(rng_a2, pids_a)
  with program_lib.precision(spec):
    state = program_lib.program_of(spec).admit(model, spec, state, ids_ap, lens_a, rows_a,
                                                   keys_a2, knobs)
  return placed(state, place)


@functools.partial(jax.jit, static_argnames=("graphdef", "spec", "place"),
                   donate_argnames=("state",))
def run(graphdef, params, state, knobs, stop_on_done, spec, max_passes=None,
        place: Placement | None = None):
  """The loop; with a (traced) `max_passes` it also returns after that many passes."""
  model = merge(graphdef, params)
  limit = None if max_passes is None else state.passes + max_passes
  prog = program_lib.program_of(spec)
  return placed(loop(model, prog, spec, state, knobs, stop_on_done, limit), place)


@functools.partial(jax.jit, static_argnames=("graphdef", "spec", "place"),
                   donate_argnames=("state",))
def run_rows(graphdef, params, state, knobs, stop_on_done, idx_n, spec, max_passes,
             place: Placement | None = None):
  """`run` over rows `idx_n` only (the others must be free or idle): a pass then
  costs what a pass over `len(idx_n)` rows costs. Rows are independent, so each row's
  tokens and passes are those of a run over every row."""
  model = merge(graphdef, params)
  sub = program_lib.take_rows(state, idx_n)
  sub = loop(model, program_lib.program_of(spec), spec, sub, knobs, stop_on_done,
             sub.passes + max_passes)
  return placed(program_lib.put_rows(state, sub, idx_n), place)


def pack32(tree) -> jax.Array:
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


def unpack32(words: np.ndarray, like):
  """`pack32`'s inverse on the host: numpy leaves shaped and typed as `like`'s."""
  leaves, treedef = jax.tree.flatten(like)
  out, at = [], 0
  for leaf in leaves:
    dtype, n = np.dtype(leaf.dtype), int(np.prod(leaf.shape, dtype=np.int64))
    wire = dtype if dtype.itemsize == 4 else np.dtype(
        np.float32 if jnp.issubdtype(dtype, jnp.floating) else np.int32)
    out.append(words[at:at + n].view(wire).reshape(leaf.shape).astype(dtype, copy=False))
    at += n
  return jax.tree.unflatten(treedef, out)


def output_tree(state, knobs, spec):
  out = program_lib.program_of(spec).output(spec, state, knobs)
  return out, state.rows.phase_b, state.passes


def output_like(state, knobs, spec):
  """Shapes and dtypes of `output_tree` (what `unpack32` rebuilds)."""
  return jax.eval_shape(functools.partial(output_tree, spec=spec), state, knobs)


def freed(state, free_b):
  """`state` with the rows where `free_b` is set freed (a finished row once its result is
  taken, or a cancelled one mid-decode: admission rewrites everything a row holds, so
  freeing only sets the phase)."""
  phase_b = jnp.where(free_b, program_lib.FREE, state.rows.phase_b)
  return state.replace(rows=state.rows.replace(phase_b=phase_b))


@functools.partial(jax.jit, static_argnames=("graphdef", "spec", "place"),
                   donate_argnames=("state",))
def step(graphdef, params, state, knobs, stop_on_done, free_b, spec,
         place: Placement | None = None):
  """The offline engine's turn after its admissions, in one program: the rows in
  `free_b` freed (those holding no prompt: finished rows whose results the host took),
  the loop, and every row's output, phase and the pass count packed (`pack32`: one
  device-to-host copy)."""
  state = run.__wrapped__(graphdef, params, freed(state, free_b), knobs, stop_on_done, spec,
                          None, place)
  return state, pack32(output_tree(state, knobs, spec))


def compiled_programs() -> dict[str, int]:
  """Compiled programs so far, per entry point (tests prove reuse with it)."""
  return {"generate": generate._cache_size(), "run": run._cache_size(),
          "step": step._cache_size(),
          "run_rows": run_rows._cache_size(),
          "admit": admit._cache_size(), "read": live_read._cache_size(),
          "live_run": live_run._cache_size(), "live_run_rows": live_run_rows._cache_size()}


# --- ahead of time ------------------------------------------------------------------------


def abstract_state(decoder, rows: int, width: int, spec: Spec | None = None):
  """Shapes (and placement) of the engine's state for `rows` rows and prompts `width` wide
  (of the decoder's spec, or of `spec`)."""
  d = decoder
  lowered = init.lower(d.static, d.params, spec=spec or d.spec, rows=rows, width=width,
                       place=d.place)
  return jax.tree.map(lambda o: jax.ShapeDtypeStruct(o.shape, o.dtype, sharding=o.sharding),
                      lowered.out_info)


def lower_program(decoder, name: str, rows: int, width: int) -> jax.stages.Lowered:
  """One of the decoder's programs lowered from shapes alone (nothing runs):

  * "generate": a batch of `rows` prompts `width` wide decoded in one program;
  * "admit": the engine's prefill of `rows` prompts into a running state;
  * "run": the engine's loop of passes over `rows` rows.

  The decoder's parameters may be abstract (`ShapeDtypeStruct`s, with shardings
  when they lie on a mesh, e.g. a TPU slice described without a TPU); the other
  inputs are then replicated over that mesh.
  """
  if name not in PROGRAMS:
    raise ValueError(f"decode program {name!r}: known programs are {PROGRAMS}")
  d = decoder
  where = None if d.place is None else NamedSharding(d.place.mesh, PartitionSpec())

  def shape(shape_, dtype):
    return jax.ShapeDtypeStruct(shape_, dtype, sharding=where)

  knobs = jax.tree.map(lambda x: shape(jnp.shape(x), jnp.result_type(x)), d.knobs)
  rng = shape((2,), jnp.uint32)
  if name == "generate":
    return generate.lower(d.static, d.params, shape((rows, width), jnp.int32),
                          shape((rows,), jnp.int32), rng, knobs, spec=d.spec)
  state = abstract_state(d, rows, width)
  if name == "admit":
    ids = shape((rows,), jnp.int32)
    return admit.lower(d.static, d.params, state, shape((rows, width), jnp.int32),
                       ids, ids, ids, rng, knobs, spec=d.spec, place=d.place)
  return run.lower(d.static, d.params, state, knobs, shape((), jnp.bool_), spec=d.spec,
                   place=d.place)


def read_tree(state, knobs, spec):
  out = program_lib.program_of(spec).output(spec, state, knobs)
  return (out.tokens_bg, out.commit_step_bg, out.length_b, out.counters.nfe_b(),
          state.rows.phase_b, state.passes)


@functools.partial(jax.jit, static_argnames=("spec",))
def live_read(state, knobs, spec):
  """What a `Snapshot` holds, packed (`pack32`): a read is one device-to-host copy."""
  return pack32(read_tree(state, knobs, spec))


# `LiveBatch`'s runs: the rows freed since the last run (`free_b`) freed, the run, and
# what a read after it gives (packed), in one program, so that neither a free nor a
# read right after a run needs a program of its own.

@functools.partial(jax.jit, static_argnames=("graphdef", "spec", "place"),
                   donate_argnames=("state",))
def live_run(graphdef, params, state, knobs, stop_on_done, spec, max_passes, free_b,
             place: Placement | None = None):
  state = run.__wrapped__(graphdef, params, freed(state, free_b), knobs, stop_on_done, spec,
                          max_passes, place)
  return state, pack32(read_tree(state, knobs, spec))


@functools.partial(jax.jit, static_argnames=("graphdef", "spec", "place"),
                   donate_argnames=("state",))
def live_run_rows(graphdef, params, state, knobs, stop_on_done, idx_n, spec, max_passes,
                  free_b, place: Placement | None = None):
  state = run_rows.__wrapped__(graphdef, params, freed(state, free_b), knobs, stop_on_done,
                               idx_n, spec, max_passes, place)
  return state, pack32(read_tree(state, knobs, spec))


