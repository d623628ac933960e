"""A static key/value buffer shared by every decoder in refusion_jax.

Shapes are fixed for a whole decode: per layer, K and V of `[batch,
kv_heads, max_len, head_dim]`, true position ids per entry and a valid length
per row. Entries are stored in *commit order*, not position order: RoPE has been
applied with each token's true position before the entry is written, so
attention does not care where in the buffer an entry sits.

Two layout choices keep a decoding pass of an unrolled model from copying the
cache. Each layer's K and V are arrays of their own (a tuple over layers),
because a layer sliced out of one stacked `[layers, ...]` buffer by the
program is a copy before it can feed a matrix product (XLA on the CPU); and
the heads come before the entries, so each (row, head) is one contiguous
`[max_len, head_dim]` matrix, the operand layout of attention's two products
(`[.., max_len, kv_heads, ..]` had to be transposed into it).

A model with scanned layers (`ModelConfig.scan_layers`) runs one layer body
inside a `lax.scan` over its stacked parameters and reads the cache there, so
its K and V are one stacked `[layers, batch, kv_heads, max_len, head_dim]`
array each, which the scan slices a layer at a time together with the
parameters.
"""

from __future__ import annotations

from typing import Callable

import flax.struct
import jax
import jax.numpy as jnp

from refusion_jax.config import ModelConfig


@flax.struct.dataclass
class KVCache:
  # Unrolled models: a tuple of one [batch, kv_heads, max_len, head_dim] array per layer.
  # Scanned models: one stacked [layers, batch, kv_heads, max_len, head_dim] array.
  k: tuple[jax.Array, ...] | jax.Array
  v: tuple[jax.Array, ...] | jax.Array
  positions_bs: jax.Array  # true position of each entry (-1 where empty)
  length_b: jax.Array  # valid entries per row; entries [0, length) are live
  # Static: attention reads this many entries at a time, only as far as the longest
  # row's live prefix (model.attend_live); 0 reads the whole buffer in one product.
  chunk: int = flax.struct.field(pytree_node=False, default=0)

  @classmethod
  def init(cls, config: ModelConfig, batch: int, max_len: int, dtype=None,
           chunk: int = 0) -> "KVCache":
    if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 0:
      raise ValueError(f"KVCache chunk must be an int >= 0, got {chunk!r}")
    dtype = config.compute_dtype if dtype is None else dtype
    shape = (batch, config.num_kv_heads, max_len, config.head_dim)
    if config.scan_layers:
      k = jnp.zeros((config.num_layers,) + shape, dtype)
      v = jnp.zeros((config.num_layers,) + shape, dtype)
    else:
      k = tuple(jnp.zeros(shape, dtype) for _ in range(config.num_layers))
      v = tuple(jnp.zeros(shape, dtype) for _ in range(config.num_layers))
    return cls(k=k, v=v, positions_bs=jnp.full((batch, max_len), -1, jnp.int32),
               length_b=jnp.zeros((batch,), jnp.int32), chunk=chunk)

  @property
  def stacked(self) -> bool:
    """One stacked array per K and V (a scanned model's cache)."""
    return not isinstance(self.k, tuple)

  def take_rows(self, idx_n: jax.Array) -> "KVCache":
    """The cache of rows `idx_n` (in that order): a cache of `len(idx_n)` rows."""
    axis = 1 if self.stacked else 0
    take = lambda x: jnp.take(x, idx_n, axis=axis)
    k = take(self.k) if self.stacked else tuple(take(x) for x in self.k)
    v = take(self.v) if self.stacked else tuple(take(x) for x in self.v)
    return self.replace(k=k, v=v, positions_bs=self.positions_bs[idx_n],
                        length_b=self.length_b[idx_n])

  def put_rows(self, idx_n: jax.Array, sub: "KVCache") -> "KVCache":
    """This cache with rows `idx_n` (distinct) replaced by the rows of `sub`."""
    if self.stacked:
      put = lambda full, x: full.at[:, idx_n].set(x)
      k, v = put(self.k, sub.k), put(self.v, sub.v)
    else:
      k = tuple(f.at[idx_n].set(x) for f, x in zip(self.k, sub.k))
      v = tuple(f.at[idx_n].set(x) for f, x in zip(self.v, sub.v))
    return self.replace(k=k, v=v, positions_bs=self.positions_bs.at[idx_n].set(sub.positions_bs),
                        length_b=self.length_b.at[idx_n].set(sub.length_b))

  @property
  def max_len(self) -> int:
    return self.positions_bs.shape[1]

  @property
  def batch(self) -> int:
    return self.positions_bs.shape[0]

  @property
  def num_layers(self) -> int:
    return self.k.shape[0] if self.stacked else len(self.k)

  def layer(self, i: int) -> tuple[jax.Array, jax.Array]:
    """Layer i's `([batch, kv_heads, max_len, head_dim] K, V)`."""
    return self.k[i], self.v[i]

  def map_kv(self, fn: Callable[[jax.Array], jax.Array]) -> "KVCache":
    """`fn` applied to every K/V buffer (each layer's, or the stacked pair)."""
    if self.stacked:
      return self.replace(k=fn(self.k), v=fn(self.v))
    return self.replace(k=tuple(fn(x) for x in self.k), v=tuple(fn(x) for x in self.v))

  def commit(self, chunk_k_lbtkh, chunk_v_lbtkh, positions_bt, keep_bt) -> "KVCache":
    """Appends the kept entries of a chunk at each row's length, in chunk order.

    The kept entries are compacted (their relative order preserved) and
    written at `[length_b, length_b + n_kept_b)`. Entries that would fall past
    the buffer are dropped; callers size the buffer so this never happens.
    """
    keep_bt = keep_bt.astype(bool)
    rank_bt = jnp.cumsum(keep_bt, axis=1) - 1
    # Non-kept entries are sent out of bounds and dropped by the scatter.
    dest_bt = jnp.where(keep_bt, self.length_b[:, None] + rank_bt, self.max_len)
    rows_bt = jnp.broadcast_to(jnp.arange(self.batch)[:, None], dest_bt.shape)
    length = jnp.minimum(self.length_b + keep_bt.sum(axis=1).astype(jnp.int32), self.max_len)
    return self.write(rows_bt, dest_bt, chunk_k_lbtkh, chunk_v_lbtkh,
                      positions_bt).replace(length_b=length)

  def move_entries(self, rows_bt, src_bt, dest_bt) -> "KVCache":
    """Copies entry `src_bt[b, t]` of row `rows_bt[b, t]` to entry `dest_bt[b, t]` of the
    same row (K, V and position), in place; an out-of-range destination (e.g. `max_len`)
    is dropped. Every source is read before any destination is written. A stacked
    buffer is moved a layer at a time in a loop: one gather and scatter over every layer
    at once makes XLA copy the buffer (measured: +1.2 GiB a chip for Qwen3-8B's 16 rows
    of 1536 entries on v5litepod-8)."""
    src = jnp.clip(src_bt, 0, self.max_len - 1)
    if self.stacked:
      def layer(i, kv):
        k, v = kv
        return (k.at[i, rows_bt, :, dest_bt].set(k[i, rows_bt, :, src], mode="drop"),
                v.at[i, rows_bt, :, dest_bt].set(v[i, rows_bt, :, src], mode="drop"))
      k, v = jax.lax.fori_loop(0, self.num_layers, layer, (self.k, self.v))
    else:
      k = tuple(buf.at[rows_bt, :, dest_bt].set(buf[rows_bt, :, src], mode="drop")
                for buf in self.k)
      v = tuple(buf.at[rows_bt, :, dest_bt].set(buf[rows_bt, :, src], mode="drop")
                for buf in self.v)
    positions = self.positions_bs.at[rows_bt, dest_bt].set(self.positions_bs[rows_bt, src],
                                                           mode="drop")
    return self.replace(k=k, v=v, positions_bs=positions)

  def write(self, rows_bt, dest_bt, k_lbtkh, v_lbtkh, positions_bt=None) -> "KVCache":
    """Writes chunk entry `(b, t)` (K/V in the model's `[layers, B, T, kv_heads,
    head_dim]` output layout) into cache row `rows_bt[b, t]` at entry
    `dest_bt[b, t]`; an out-of-range row or entry (e.g. `max_len`) is dropped.
    The valid lengths are left as they are: entries past a row's length stay
    invisible until the caller raises it."""
    if self.stacked:
      def put(buf_lbksh, x_lbtkh):
        # Advanced indices split by a slice put their dimensions first: `[B, T, L, K, H]`.
        return buf_lbksh.at[:, rows_bt, :, dest_bt].set(
            jnp.moveaxis(x_lbtkh, 0, 2).astype(buf_lbksh.dtype), mode="drop")
      out = self.replace(k=put(self.k, k_lbtkh), v=put(self.v, v_lbtkh))
    else:
      def put(bufs_bksh, x_lbtkh):
        # Advanced indices around a slice: the indexed part is `[B, T, heads, H]`.
        return tuple(buf.at[rows_bt, :, dest_bt].set(x_lbtkh[i].astype(buf.dtype), mode="drop")
                     for i, buf in enumerate(bufs_bksh))
      out = self.replace(k=put(self.k, k_lbtkh), v=put(self.v, v_lbtkh))
    if positions_bt is not None:
      out = out.replace(positions_bs=self.positions_bs.at[rows_bt, dest_bt].set(
          positions_bt.astype(jnp.int32), mode="drop"))
    return out
