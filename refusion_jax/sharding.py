"""Logical axis names -> device-mesh axes.

Every parameter carries `logical_axes` metadata (set in model.py) and the
main activations are constrained with `constrain(x, names)`. A
`ShardingRules` maps each logical name to a mesh axis (`data`, `fsdp`,
`tensor`), a tuple of mesh axes, or None (replicated). Mapping two logical
axes of one array onto the same mesh axis is an error, reported by name.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from typing import Mapping, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor")

MeshAxes = str | tuple[str, ...] | None


@dataclasses.dataclass(frozen=True)
class ShardingRules:
  """Logical axis -> mesh axis (or axes). Unlisted names are replicated."""

  batch: MeshAxes = ("data", "fsdp")
  seq: MeshAxes = None
  act_embed: MeshAxes = None  # hidden size of activations
  embed: MeshAxes = "fsdp"  # hidden size of parameters (FSDP/ZeRO-3 shards it)
  vocab: MeshAxes = "tensor"
  q_heads: MeshAxes = "tensor"
  kv_heads: MeshAxes = "tensor"
  head_dim: MeshAxes = None
  mlp: MeshAxes = "tensor"
  norm: MeshAxes = None
  layers: MeshAxes = None
  cache_seq: MeshAxes = None

  def __post_init__(self):
    for name, value in dataclasses.asdict(self).items():
      for axis in _as_tuple(value):
        if axis not in MESH_AXES:
          raise ValueError(
              f"ShardingRules.{name}={value!r}: {axis!r} is not a mesh axis {MESH_AXES}")

  @classmethod
  def from_mapping(cls, mapping: Mapping[str, MeshAxes]) -> "ShardingRules":
    unknown = set(mapping) - {f.name for f in dataclasses.fields(cls)}
    if unknown:
      raise ValueError(f"unknown logical axis name(s) in sharding rules: {sorted(unknown)}")
    return cls(**{k: (tuple(v) if isinstance(v, list) else v) for k, v in mapping.items()})


def _as_tuple(value: MeshAxes) -> tuple[str, ...]:
  if value is None:
    return ()
  if isinstance(value, str):
    return (value,)
  return tuple(value)


def logical_to_physical(logical_axes: Sequence[str | None], rules: ShardingRules,
                        shape: Sequence[int] | None = None,
                        mesh: Mesh | None = None) -> PartitionSpec:
  """PartitionSpec for an array whose dimensions have these logical names.

  Raises when two dimensions would be sharded over the same mesh axis. With a
  `shape` and `mesh`, a dimension that the mesh axes do not divide evenly is
  replicated instead (e.g. 2 kv heads on a tensor axis of 4).
  """
  used: dict[str, str] = {}
  spec = []
  for dim, name in enumerate(logical_axes):
    if name is None:
      spec.append(None)
      continue
    if not hasattr(rules, name):
      raise ValueError(f"logical axis {name!r} has no sharding rule")
    axes = _as_tuple(getattr(rules, name))
    for axis in axes:
      if axis in used:
        raise ValueError(
            f"logical axes {used[axis]!r} and {name!r} both map to mesh axis {axis!r} "
            f"in one array with axes {tuple(logical_axes)}")
      used[axis] = name
    if axes and shape is not None and mesh is not None:
      size = math.prod(mesh.shape[a] for a in axes)
      if shape[dim] % size:
        axes = ()
    spec.append(None if not axes else axes[0] if len(axes) == 1 else axes)
  return PartitionSpec(*spec)


def make_mesh(data: int = 1, fsdp: int = -1, tensor: int = 1,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A (data, fsdp, tensor) mesh; one size may be -1 to take the remaining devices."""
  devices = list(jax.devices() if devices is None else devices)
  sizes = {"data": data, "fsdp": fsdp, "tensor": tensor}
  free = [k for k, v in sizes.items() if v == -1]
  if len(free) > 1:
    raise ValueError(f"at most one mesh axis may be -1, got {sizes}")
  for k, v in sizes.items():
    if v != -1 and (not isinstance(v, int) or v < 1):
      raise ValueError(f"mesh axis {k} must be a positive int or -1, got {v!r}")
  fixed = math.prod(v for v in sizes.values() if v != -1)
  if free:
    if len(devices) % fixed:
      raise ValueError(f"{len(devices)} devices are not divisible by the fixed mesh axes {sizes}")
    sizes[free[0]] = len(devices) // fixed
  total = math.prod(sizes.values())
  if total != len(devices):
    raise ValueError(f"mesh {sizes} needs {total} devices, but {len(devices)} are available")
  shape = tuple(sizes[a] for a in MESH_AXES)
  try:
    device_array = jax.experimental.mesh_utils.create_device_mesh(shape, devices=devices)
  except Exception:  # CPU / unusual topologies: plain order is fine
    device_array = np.asarray(devices).reshape(shape)
  return Mesh(device_array, MESH_AXES)


import jax.experimental.mesh_utils  # noqa: E402  (for create_device_mesh)

_ACTIVE: contextvars.ContextVar[tuple[Mesh, ShardingRules] | None] = contextvars.ContextVar(
    "refusion_jax_sharding", default=None)


@contextlib.contextmanager
def use_mesh(mesh: Mesh | None, rules: ShardingRules | None = None):
  """Activation constraints inside this context (while tracing) use this mesh."""
  token = _ACTIVE.set(None if mesh is None else (mesh, rules or ShardingRules()))
  try:
    yield
  finally:
    _ACTIVE.reset(token)


def active() -> tuple[Mesh, ShardingRules] | None:
  """The `(mesh, rules)` of the enclosing `use_mesh` (None outside one)."""
  return _ACTIVE.get()


def constrain(x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
  """Sharding constraint on an activation; a no-op outside `use_mesh`."""
  active = _ACTIVE.get()
  if active is None:
    return x
  mesh, rules = active
  spec = logical_to_physical(logical_axes, rules, x.shape, mesh)
  return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def split_count(logical_axis: str, dim_size: int) -> int:
  """How many pieces the active mesh cuts a dimension of this logical name into (1
  outside `use_mesh`, or where the mesh axes do not divide `dim_size`, which the
  rules then replicate)."""
  active = _ACTIVE.get()
  if active is None:
    return 1
  mesh, rules = active
  size = math.prod(mesh.shape[a] for a in _as_tuple(getattr(rules, logical_axis)))
  return size if dim_size % size == 0 else 1


def state_shardings(state, mesh: Mesh, rules: ShardingRules):
  """NamedShardings for an nnx.State whose Variables carry `logical_axes`."""

  def one(var):
    axes = getattr(var, "logical_axes", None)
    value = var.get_value() if hasattr(var, "get_value") else var.value
    if axes is None:
      spec = PartitionSpec()
    else:
      spec = logical_to_physical(axes, rules, value.shape, mesh)
    return var.replace(NamedSharding(mesh, spec))

  return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def shard_model(model: nnx.Module, mesh: Mesh, rules: ShardingRules | None = None) -> nnx.Module:
  """Places every parameter of `model` on `mesh` according to its logical axes."""
  rules = rules or ShardingRules()
  graphdef, state = nnx.split(model)
  shardings = state_shardings(state, mesh, rules)
  state = jax.device_put(state, shardings)
  return nnx.merge(graphdef, state)


def data_sharding(mesh: Mesh, rules: ShardingRules | None = None, ndim: int = 2) -> NamedSharding:
  """Sharding of a [batch, ...] input array: batch over the batch axes."""
  rules = rules or ShardingRules()
  return NamedSharding(mesh, logical_to_physical(("batch",) + (None,) * (ndim - 1), rules))
