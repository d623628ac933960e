"""Cloud TPU chips and slices: what each chip offers, and gcloud names -> libtpu topologies.

`CHIPS` holds, per TPU generation, the figures the ahead-of-time check (`aot`)
compares a compiled program with: HBM per chip, peak bf16 matmul throughput
and HBM bandwidth. `parse_slice("v5p-128")` turns an accelerator type as
`gcloud compute tpus tpu-vm create --accelerator-type` names it into the
topology libtpu describes (`v5p:4x4x4`), and `slice_devices` gives that
slice's devices for compiling without a TPU
(`jax.experimental.topologies.get_topology_desc`).

gcloud counts TensorCores in v4 and v5p names (two per chip: `v4-128` and
`v5p-128` are 64 chips) and chips in v5e and v6e names (`v5litepod-256`,
alias `v5e-256`, and `v6e-256` are 256 chips). v4 and v5p slices are 3D tori
(`AxBxC` chips), v5e and v6e slices 2D (`AxB`). A libtpu topology name
(`v5p:4x4x12`) is accepted as it is, for shapes the default rule does not give.
"""

from __future__ import annotations

import dataclasses
import math
import re

from jax.experimental import topologies


@dataclasses.dataclass(frozen=True)
class Chip:
  """One TPU chip (two TensorCores acting as one device on v4 and v5p)."""

  name: str  # generation as libtpu spells it: "v4", "v5e", "v5p", "v6e"
  hbm_gib: float  # HBM per chip, GiB
  bf16_tflops: float  # peak dense bf16 matmul throughput per chip, TFLOP/s
  hbm_gbps: float  # HBM bandwidth per chip, GB/s (1e9 bytes)
  dims: int  # torus dimensions of a slice (3: v4, v5p; 2: v5e, v6e)
  cores_in_name: int  # gcloud's accelerator-type number counts this many per chip


CHIPS = {
    # https://cloud.google.com/tpu/docs/v4: 32 GiB HBM2, 1,200 GB/s, 275 TFLOP/s bf16 per chip.
    "v4": Chip("v4", 32, 275, 1200, dims=3, cores_in_name=2),
    # https://cloud.google.com/tpu/docs/v5e: 16 GiB HBM2, 819 GB/s, 197 TFLOP/s bf16 per chip.
    "v5e": Chip("v5e", 16, 197, 819, dims=2, cores_in_name=1),
    # https://cloud.google.com/tpu/docs/v5p: 95 GiB HBM2e, 2,765 GB/s, 459 TFLOP/s bf16 per chip.
    "v5p": Chip("v5p", 95, 459, 2765, dims=3, cores_in_name=2),
    # https://cloud.google.com/tpu/docs/v6e: 32 GiB HBM, 1,640 GB/s, 918 TFLOP/s bf16 per chip.
    "v6e": Chip("v6e", 32, 918, 1640, dims=2, cores_in_name=1),
}
# gcloud's generation prefixes (before the dash) -> CHIPS key.
_GCLOUD_PREFIX = {"v4": "v4", "v5p": "v5p", "v5litepod": "v5e", "v5e": "v5e", "v6e": "v6e"}


@dataclasses.dataclass(frozen=True)
class Slice:
  """A named TPU slice (or several of them: multislice) and its libtpu topology."""

  name: str  # as given, e.g. "v5p-128" or "v5e:2x2"
  chip: Chip
  topology: str  # libtpu topology name of one slice, e.g. "v5p:4x4x4"
  shape: tuple[int, ...]  # chips along each torus dimension of one slice
  num_slices: int = 1

  @property
  def chips_per_slice(self) -> int:
    return math.prod(self.shape)

  @property
  def chips(self) -> int:
    return self.chips_per_slice * self.num_slices

  def topology_kwargs(self) -> dict:
    """Keyword arguments of `get_topology_desc` for this slice."""
    kwargs = {"platform": "tpu", "topology_name": self.topology}
    if self.chip.name == "v4":
      kwargs["chip_config_name"] = "megacore"  # one device per chip, as v4 VMs run JAX
    if self.chips_per_slice == 1:
      kwargs["chips_per_host_bounds"] = (1, 1, 1)  # the default host (2x2x1) is larger
    if self.num_slices > 1:
      kwargs["num_slices"] = self.num_slices
    return kwargs


def default_shape(chips: int, dims: int) -> tuple[int, ...]:
  """Google's default slice shape for a power-of-two chip count.

  2D (v5e, v6e): 1x1, 2x2, 2x4, 4x4, 4x8, ... (the longer side last).
  3D (v4, v5p): 2x2x1, 2x2x2, 2x2x4, 2x4x4, 4x4x4, 4x4x8, ... (from 2x2x1, the
  smallest dimension doubles, the last one first on ties).
  """
  if chips < 1 or chips & (chips - 1):
    raise ValueError(f"{chips} chips is not a power of two")
  if dims == 2:
    if chips == 2:
      raise ValueError("2 chips is not a v5e/v6e slice size")
    k = chips.bit_length() - 1
    return (1 << (k // 2), 1 << (k - k // 2))
  if chips < 4:
    raise ValueError(f"{chips} chips is smaller than the smallest 3D slice (2x2x1, 4 chips)")
  shape = [2, 2, 1]
  while math.prod(shape) < chips:
    i = max(j for j in range(3) if shape[j] == min(shape))
    shape[i] *= 2
  return tuple(shape)


def parse_slice(name: str, num_slices: int = 1) -> Slice:
  """A gcloud accelerator type (`v5p-128`, `v5litepod-8`, `v5e-256`, `v4-64`, `v6e-16`)
  or a libtpu topology (`v5p:4x4x4`, `v5e:2x2`); raises ValueError naming the problem."""
  if not isinstance(num_slices, int) or isinstance(num_slices, bool) or num_slices < 1:
    raise ValueError(f"--num_slices must be a positive int, got {num_slices!r}")
  known = "v4-N, v5p-N (N TensorCores), v5litepod-N / v5e-N, v6e-N (N chips), or a libtpu " \
          "topology like v5p:4x4x4"
  text = str(name).strip()
  m = re.fullmatch(r"(v4|v5p|v5e|v6e):(\d+(?:x\d+)*)", text)
  if m:
    chip = CHIPS[m.group(1)]
    shape = tuple(int(d) for d in m.group(2).split("x"))
    if len(shape) != chip.dims or min(shape) < 1:
      raise ValueError(f"topology {text!r}: a {chip.name} slice has {chip.dims} dimensions "
                       f"({'AxBxC' if chip.dims == 3 else 'AxB'} chips)")
    return Slice(text, chip, text, shape, num_slices)
  m = re.fullmatch(r"([a-z0-9]+)-(\d+)", text)
  if not m or m.group(1) not in _GCLOUD_PREFIX:
    raise ValueError(f"unknown TPU accelerator type {text!r}; expected {known}")
  chip = CHIPS[_GCLOUD_PREFIX[m.group(1)]]
  count = int(m.group(2))
  if count % chip.cores_in_name:
    raise ValueError(f"{text!r}: {chip.name} names count TensorCores, two per chip; "
                     f"{count} is odd")
  chips = count // chip.cores_in_name
  try:
    shape = default_shape(chips, chip.dims)
  except ValueError as e:
    raise ValueError(f"{text!r}: {e}; give the shape as a libtpu topology instead "
                     f"(e.g. {chip.name}:{'x'.join(['2'] * chip.dims)})") from None
  topology = f"{chip.name}:{'x'.join(str(d) for d in shape)}"
  return Slice(text, chip, topology, shape, num_slices)


def slice_devices(tpu_slice: Slice) -> list:
  """The devices of the slice(s), for compiling without a TPU (libtpu must be installed)."""
  try:
    return list(topologies.get_topology_desc(**tpu_slice.topology_kwargs()).devices)
  except Exception as e:  # libtpu's own refusal of a shape, or no libtpu
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    raise ValueError(f"topology {tpu_slice.topology} (from {tpu_slice.name!r}) cannot be "
                     f"described by libtpu: {first}") from None
