"""Memory-efficient full-sequence attention: `ModelConfig.attention_impl`.

The training forward (`Transformer.__call__` / `Transformer.hidden` without an explicit
mask, the call every objective's loss makes) attends over the whole row with
one fixed mask: causal in input order (ReFusion's reorganised row and the ARM)
or full (the MDM baseline). The einsum reference (`model.attend`, "xla")
materialises `[B, N, T, T]` float32 scores and keeps them for the backward
pass (XLA's TPU fusions avoid that only for short rows: in a v5e program of a
small model, at 2048 tokens but not at 4096); the kernels here never hold more
than a tile of them:

* "splash": the Pallas TPU splash-attention kernel shipped with JAX
  (`jax.experimental.pallas.ops.tpu.splash_attention`), one kernel per row
  (vmapped over the batch), `CausalMask` or `FullMask` over every head, GQA
  through its grouped key/value heads. Its forward and backward passes are the
  library's own. On a backend other than TPU it runs in Pallas interpret mode:
  same numerics, slow, for checking on a CPU. The sequence length must be a
  multiple of `SPLASH_BLOCK` (its tile).
* "cudnn": `jax.nn.dot_product_attention(implementation="cudnn")`, cuDNN's
  fused attention on NVIDIA GPUs, for bfloat16 / float16 compute only.

Packed rows (`segment_ids_bt`: each row's samples numbered from 1, 0 for
padding) give every token attention within its own sample only, exactly as
`masks.segment_btt` does for the einsum path: splash takes them as its
`SegmentIds`, each padding token alone in a segment of its own (so it sees only
itself, as in `segment_btt`). cuDNN's fused attention here has no segment ids:
it takes rows of one sample followed by padding only (`length_b`, the sample's
length: keys at or past it are hidden), and the trainer refuses packed rows
with it before anything compiles.

Under `sharding.use_mesh` the kernel runs inside `shard_map`, split over the
batch axes and, where the sharding rules split them, the heads (key/value heads
that the tensor axis does not divide are repeated to one per query head first,
so each device holds the heads its queries need); the sequence and head
dimension stay whole on each device.

Everything else keeps the einsum path: a call with an explicit attention mask
and every decoding pass (a chunk against the KV cache, the prompt prefill, the
plan / infill / verification masks) use `model.attend` whatever
`attention_impl` says.
"""

from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu import splash_attention
from jax.sharding import PartitionSpec

from refusion_jax import sharding
from refusion_jax.config import ATTENTION_IMPLS


@flax.struct.dataclass
class RowSegments:
  """The mask of a kernel call: the whole row under the model's own attention (causal
  or bidirectional), within each segment of `segment_ids_bt` (int32 `[B, T]`, 0 =
  padding). `model.Attention` runs `attend_full` when given one instead of a dense mask.
  """

  segment_ids_bt: jax.Array


SPLASH_BLOCK = 128  # splash attention's query / key tile (its default BlockSizes)
_CUDNN_DTYPES = ("bfloat16", "float16")


def check_supported(impl: str, *, seq_len: int, dtype: str, platform: str,
                    field: str = "ModelConfig.attention_impl") -> None:
  """Raises ValueError (naming `field`) when `impl` cannot run full-sequence attention
  over `seq_len` tokens in compute dtype `dtype` on `platform` ("tpu", "gpu", "cpu")."""
  if impl not in ATTENTION_IMPLS:
    raise ValueError(f"{field} must be one of {ATTENTION_IMPLS}, got {impl!r}")
  if impl == "splash" and seq_len % SPLASH_BLOCK:
    tiled = -(-seq_len // SPLASH_BLOCK) * SPLASH_BLOCK
    raise ValueError(f"{field}='splash' needs a sequence length that is a multiple of its "
                     f"{SPLASH_BLOCK}-token tile, got {seq_len} (use {tiled} or "
                     "attention_impl='xla')")
  if impl == "cudnn":
    if platform != "gpu":
      raise ValueError(f"{field}='cudnn' runs on NVIDIA GPUs only, but the devices are "
                       f"{platform!r} (use 'splash' on TPU or 'xla')")
    if dtype not in _CUDNN_DTYPES:
      raise ValueError(f"{field}='cudnn' needs a bfloat16 or float16 compute dtype "
                       f"(ModelConfig.dtype), got {dtype!r}")


def current_platform() -> str:
  """The platform the traced program runs on: the active mesh's devices (which may be
  an ahead-of-time TPU topology on a CPU host), else JAX's default backend."""
  active = sharding.active()
  if active is not None:
    return active[0].devices.flat[0].platform
  return jax.default_backend()


def attend_full(q_btnh, k_btkh, v_btkh, *, impl: str, causal: bool = True,
                segment_ids_bt=None, length_b=None):
  """Attention of every token over its row (or its segment of the row) with a kernel.

  q `[B, T, N, H]`, k and v `[B, T, K, H]` (N a multiple of K, query head n
  reads key/value head n // (N / K), as in `model.attend`), all of one dtype.
  `causal`: query i sees keys 0..i (else every key). At most one of:
  `segment_ids_bt` (int `[B, T]`, packed rows: a token sees only tokens of its
  own segment, 0 = padding, as `masks.segment_btt`; splash only) and `length_b`
  (int `[B]`: keys at or past it are hidden, so queries before it attend as
  under `masks.prefix_causal_btt`). The rows of padding queries are not the
  reference's (splash: each sees only itself; cudnn: cuDNN's). Returns
  `[B, T, N, H]` in the input dtype; softmax runs in float32 and q is scaled
  by H^-1/2 in its own dtype first, as the reference does.
  """
  if impl not in ("splash", "cudnn"):
    raise ValueError(f"attend_full runs the 'splash' and 'cudnn' kernels, got impl={impl!r} "
                     "(the einsum reference is model.attend)")
  b, t, n, h = q_btnh.shape
  kv = k_btkh.shape[2]
  if k_btkh.shape != (b, t, kv, h) or v_btkh.shape != k_btkh.shape or n % kv:
    raise ValueError(f"attend_full: q {q_btnh.shape}, k {k_btkh.shape}, v {v_btkh.shape} must "
                     "be [B, T, N, H], [B, T, K, H], [B, T, K, H] with N a multiple of K")
  if segment_ids_bt is not None and length_b is not None:
    raise ValueError("attend_full takes segment_ids_bt or length_b, not both")
  where = current_platform()
  check_supported(impl, seq_len=t, dtype=jnp.dtype(q_btnh.dtype).name, platform=where,
                  field="attention_impl")
  q_btnh = q_btnh * (h ** -0.5)  # the reference's scaling, in q's dtype
  if impl == "cudnn":
    if segment_ids_bt is not None:
      raise ValueError("attention_impl='cudnn' cannot keep packed samples apart (no segment "
                       "ids); give rows of one sample with length_b, or use 'xla'")
    fn = functools.partial(_cudnn, causal=causal, padded=length_b is not None)
    lengths = jnp.full((b,), t, jnp.int32) if length_b is None else length_b
    return _sharded(fn, q_btnh, k_btkh, v_btkh, jnp.asarray(lengths, jnp.int32))
  index_1t = jnp.arange(t, dtype=jnp.int32)[None]
  if segment_ids_bt is None:
    lengths = jnp.full((b,), t, jnp.int32) if length_b is None else length_b
    segment_ids_bt = (index_1t < jnp.asarray(lengths, jnp.int32)[:, None]).astype(jnp.int32)
  # Padding token i is alone in segment T + 1 + i, past every sample's id.
  segment_ids_bt = jnp.asarray(segment_ids_bt, jnp.int32)
  segment_ids_bt = jnp.where(segment_ids_bt > 0, segment_ids_bt, t + 1 + index_1t)
  fn = functools.partial(_splash, causal=causal, interpret=where != "tpu")
  return _sharded(fn, q_btnh, k_btkh, v_btkh, segment_ids_bt)


@functools.lru_cache(maxsize=32)
def _splash_kernel(t: int, n: int, causal: bool, interpret: bool):
  # Built once per shape: its block-mask tables are host constants (an unrolled model
  # would otherwise rebuild them in every layer).
  head_mask = splash_attention.CausalMask((t, t)) if causal else splash_attention.FullMask((t, t))
  b = SPLASH_BLOCK
  # One fused backward kernel (dq and dk/dv together) instead of two passes over the scores.
  block_sizes = splash_attention.BlockSizes(
      block_q=b, block_kv=b, block_kv_compute=b, block_q_dkv=b, block_kv_dkv=b,
      block_kv_dkv_compute=b, use_fused_bwd_kernel=True)
  with jax.ensure_compile_time_eval():  # concrete tables even when first built while tracing
    return splash_attention.make_splash_mha(
        splash_attention.MultiHeadMask([head_mask] * n), block_sizes=block_sizes,
        head_shards=1, q_seq_shards=1, interpret=interpret)


def _splash(q_btnh, k_btkh, v_btkh, segment_ids_bt, *, causal: bool, interpret: bool):
  _, t, n, _ = q_btnh.shape
  kernel = _splash_kernel(t, n, causal, interpret)

  def row(q_nth, k_kth, v_kth, segments_t):
    return kernel(q_nth, k_kth, v_kth, splash_attention.SegmentIds(q=segments_t, kv=segments_t))

  out_bnth = jax.vmap(row)(q_btnh.transpose(0, 2, 1, 3), k_btkh.transpose(0, 2, 1, 3),
                           v_btkh.transpose(0, 2, 1, 3), segment_ids_bt)
  return out_bnth.transpose(0, 2, 1, 3)


def _cudnn(q_btnh, k_btkh, v_btkh, length_b, *, causal: bool, padded: bool):
  # q is already scaled (in its dtype, like the reference), hence scale=1.
  return jax.nn.dot_product_attention(q_btnh, k_btkh, v_btkh, scale=1.0, is_causal=causal,
                                      key_value_seq_lengths=length_b if padded else None,
                                      implementation="cudnn")


def _sharded(fn, q_btnh, k_btkh, v_btkh, rows):
  """`fn(q, k, v, rows)` per device under the active mesh (plain call without one); `rows`
  is per-row data (`[B]` lengths or `[B, T]` segment ids), split like the batch."""
  active = sharding.active()
  if active is None:
    return fn(q_btnh, k_btkh, v_btkh, rows)
  mesh, rules = active
  n = q_btnh.shape[2]
  q_spec = sharding.logical_to_physical(("batch", None, "q_heads", None), rules, q_btnh.shape,
                                        mesh)
  k_spec = sharding.logical_to_physical(("batch", None, "kv_heads", None), rules,
                                        k_btkh.shape, mesh)
  if q_spec[2] is not None and k_spec[2] != q_spec[2]:
    # The query heads are split but the key/value heads are not (too few of them): one
    # key/value head per query head keeps each device's queries with their own keys.
    groups = n // k_btkh.shape[2]
    k_btkh = jnp.repeat(k_btkh, groups, axis=2)
    v_btkh = jnp.repeat(v_btkh, groups, axis=2)
    k_spec = q_spec
  kv_spec = PartitionSpec(q_spec[0], None, k_spec[2], None)
  rows_spec = PartitionSpec(q_spec[0], *([None] * (rows.ndim - 1)))
  return jax.shard_map(fn, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec, rows_spec),
                       out_specs=q_spec, check_vma=False)(q_btnh, k_btkh, v_btkh, rows)

