"""A static key/value buffer shared by every decoder in refusion_jax.

Shapes are fixed for a whole decode: `[layers, batch, max_len, kv_heads,
head_dim]` for K and V, true position ids per entry and a valid length per
row. Entries are stored in *commit order*, not position order: RoPE has been
applied with each token's true position before the entry is written, so
attention does not care where in the buffer an entry sits.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from refusion_jax.config import ModelConfig


@flax.struct.dataclass
class KVCache:
  k_lbskh: jax.Array
  v_lbskh: jax.Array
  positions_bs: jax.Array  # true position of each entry (-1 where empty)
  length_b: jax.Array  # valid entries per row; entries [0, length) are live

  @classmethod
  def init(cls, config: ModelConfig, batch: int, max_len: int, dtype=None) -> "KVCache":
    dtype = config.compute_dtype if dtype is None else dtype
    shape = (config.num_layers, batch, max_len, config.num_kv_heads, config.head_dim)
    return cls(
        k_lbskh=jnp.zeros(shape, dtype),
        v_lbskh=jnp.zeros(shape, dtype),
        positions_bs=jnp.full((batch, max_len), -1, jnp.int32),
        length_b=jnp.zeros((batch,), jnp.int32),
    )

  @property
  def max_len(self) -> int:
    return self.k_lbskh.shape[2]

  @property
  def batch(self) -> int:
    return self.k_lbskh.shape[1]

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
    k = self.k_lbskh.at[:, rows_bt, dest_bt].set(
        chunk_k_lbtkh.astype(self.k_lbskh.dtype), mode="drop")
    v = self.v_lbskh.at[:, rows_bt, dest_bt].set(
        chunk_v_lbtkh.astype(self.v_lbskh.dtype), mode="drop")
    pos = self.positions_bs.at[rows_bt, dest_bt].set(positions_bt.astype(jnp.int32), mode="drop")
    length = jnp.minimum(self.length_b + keep_bt.sum(axis=1).astype(jnp.int32), self.max_len)
    return KVCache(k_lbskh=k, v_lbskh=v, positions_bs=pos, length_b=length)
