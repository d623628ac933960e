"""A static key/value buffer shared by every decoder in refusion_jax.

Shapes are fixed for a whole decode: per layer, K and V of `[batch,
kv_heads, max_len, head_dim]`, true position ids per entry and a valid length
per row. Entries are stored in *commit order*, not position order: RoPE has been
applied with each token's true position before the entry is written, so
attention does not care where in the buffer an entry sits.

Two layout choices keep a decoding pass from copying the cache. Each layer's
K and V are arrays of their own (a tuple over layers), because a layer
sliced out of one stacked `[layers, ...]` buffer is a copy before it can
feed a matrix product; and the heads come before the entries, so each (row,
head) is one contiguous `[max_len, head_dim]` matrix, the operand layout of
attention's two products (`[.., max_len, kv_heads, ..]` had to be transposed
into it). Either way every layer's cache was copied on every pass.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from refusion_jax.config import ModelConfig


@flax.struct.dataclass
class KVCache:
  k_bksh: tuple[jax.Array, ...]  # one [batch, kv_heads, max_len, head_dim] per layer
  v_bksh: tuple[jax.Array, ...]
  positions_bs: jax.Array  # true position of each entry (-1 where empty)
  length_b: jax.Array  # valid entries per row; entries [0, length) are live

  @classmethod
  def init(cls, config: ModelConfig, batch: int, max_len: int, dtype=None) -> "KVCache":
    dtype = config.compute_dtype if dtype is None else dtype
    shape = (batch, config.num_kv_heads, max_len, config.head_dim)
    layers = range(config.num_layers)
    return cls(
        k_bksh=tuple(jnp.zeros(shape, dtype) for _ in layers),
        v_bksh=tuple(jnp.zeros(shape, dtype) for _ in layers),
        positions_bs=jnp.full((batch, max_len), -1, jnp.int32),
        length_b=jnp.zeros((batch,), jnp.int32),
    )

  @property
  def max_len(self) -> int:
    return self.k_bksh[0].shape[2]

  @property
  def batch(self) -> int:
    return self.k_bksh[0].shape[0]

  @property
  def num_layers(self) -> int:
    return len(self.k_bksh)

  def valid_bs(self) -> jax.Array:
    """True for live entries."""
    return jnp.arange(self.max_len)[None, :] < self.length_b[:, None]

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

  def write(self, rows_bt, dest_bt, k_lbtkh, v_lbtkh, positions_bt=None) -> "KVCache":
    """Writes chunk entry `(b, t)` (K/V in the model's `[layers, B, T, kv_heads,
    head_dim]` output layout) into cache row `rows_bt[b, t]` at entry
    `dest_bt[b, t]`; an out-of-range row or entry (e.g. `max_len`) is dropped.
    The valid lengths are left as they are: entries past a row's length stay
    invisible until the caller raises it."""
    def put(bufs_bksh, x_lbtkh):
      # Advanced indices around a slice: the indexed part is `[B, T, heads, H]`.
      return tuple(buf.at[rows_bt, :, dest_bt].set(x_lbtkh[i].astype(buf.dtype), mode="drop")
                   for i, buf in enumerate(bufs_bksh))
    out = self.replace(k_bksh=put(self.k_bksh, k_lbtkh), v_bksh=put(self.v_bksh, v_lbtkh))
    if positions_bt is not None:
      out = out.replace(positions_bs=self.positions_bs.at[rows_bt, dest_bt].set(
          positions_bt.astype(jnp.int32), mode="drop"))
    return out
