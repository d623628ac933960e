"""One narrow forward pass in which every row feeds what its own phase needs.

A row describes its feed in a fixed *layout* of `N` entries (for ReFusion
the current block): which entries take part (`fed_bn`), their token ids and
position ids, an attention group per entry (an entry sees the earlier fed
entries of its own group: group 0 for a causal run over everything fed, the
slot index for the infill's slot-local attention), where its K/V go in the
row's cache (`dest_bn`, -1 for nowhere) and whether its pick is sampled.

`run_pass` compacts every row's fed entries to the front, in layout order,
and runs the model at the smallest of the static `widths` that holds every
row's count, all widths in one compiled program (`lax.switch`; a pass in
which no row feeds anything runs no model). An infill of
one slot therefore pays for one slot, not for a block. K/V are written into
the cache at `dest_bn` (beyond a row's live length they stay invisible until
the row commits them by raising its length); the per-token statistics come
back in the layout, zero where nothing was fed.

`p_prev_bn[n]` is the probability of entry n's token under the logits of the
fed entry just before it in the same row (1.0 for a row's first fed entry):
the autoregressive probability that verification compares with tau_t.
"""

from __future__ import annotations

from typing import Sequence

import flax.struct
import jax
import jax.numpy as jnp

from refusion_jax import masks
from refusion_jax.decode import heads
from refusion_jax.kv_cache import KVCache


@flax.struct.dataclass
class Feed:
  fed_bn: jax.Array  # bool
  ids_bn: jax.Array  # int32
  positions_bn: jax.Array  # int32
  group_bn: jax.Array  # int32
  dest_bn: jax.Array  # int32 cache index, -1 = not written
  sample_bn: jax.Array  # bool: the pick is sampled (at temperature > 0)

  @classmethod
  def empty(cls, b: int, n: int) -> "Feed":
    zi = jnp.zeros((b, n), jnp.int32)
    zb = jnp.zeros((b, n), bool)
    return cls(fed_bn=zb, ids_bn=zi, positions_bn=zi, group_bn=zi, dest_bn=zi - 1, sample_bn=zb)


def select(cases: Sequence[tuple[jax.Array, object]], default):
  """Per-row choice among pytrees with leading batch axis: the first case whose `[B]`
  condition holds, else `default`."""
  out = default
  for cond_b, value in reversed(cases):
    out = jax.tree.map(
        lambda a, o: jnp.where(cond_b.reshape(cond_b.shape + (1,) * (a.ndim - 1)), a, o),
        value, out)
  return out


@flax.struct.dataclass
class PassOut:
  pick_bn: jax.Array
  p_pick_bn: jax.Array
  p_prev_bn: jax.Array


def width_index(need: jax.Array, widths: Sequence[int]) -> jax.Array:
  """Index of the smallest width >= need (the last one when none is)."""
  ws = jnp.asarray(widths)
  return jnp.minimum((need > ws).sum(), len(widths) - 1)


def run_pass(model, cache: KVCache, feed: Feed, widths: Sequence[int], *, temperature,
             keys_bn2, banned_id=None, vocab_chunk: int = heads.DEFAULT_VOCAB_CHUNK
             ) -> tuple[KVCache, PassOut]:
  """One forward pass over every row's fed entries (module docstring)."""
  b, n = feed.fed_bn.shape
  widths = tuple(sorted(set(int(w) for w in widths)))
  if widths[-1] < n:
    raise ValueError(f"the widest pass {widths[-1]} cannot hold a layout of {n} entries")
  fed = feed.fed_bn
  need_b = fed.sum(-1).astype(jnp.int32)
  rows_b1 = jnp.arange(b)[:, None]
  rank_bn = jnp.cumsum(fed, axis=-1) - 1
  unembed = model.unembed()

  def branch(w: int):
    def run():
      # Layout index of the w-th fed entry of each row (n where there is none).
      src_bw = jnp.full((b, w), n, jnp.int32).at[rows_b1, jnp.where(fed, rank_bn, w)].set(
          jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, n)), mode="drop")
      valid_bw = jnp.arange(w)[None] < need_b[:, None]
      src_c = jnp.minimum(src_bw, n - 1)

      def gather(x_bn, fill):
        return jnp.where(valid_bw, jnp.take_along_axis(x_bn, src_c, axis=1), fill)

      ids = gather(feed.ids_bn, 0)
      pos = gather(feed.positions_bn, 0)
      group = gather(feed.group_bn, -1)
      dest = gather(feed.dest_bn, -1)
      sample = gather(feed.sample_bn, False)
      keys = jnp.take_along_axis(keys_bn2, src_c[..., None], axis=1)
      causal_ww = masks.causal_tt(w)
      mask = (causal_ww[None] & (group[:, :, None] == group[:, None, :])
              & valid_bw[:, :, None] & valid_bw[:, None, :]) | jnp.eye(w, dtype=bool)[None]
      h, k, v = model.forward_hidden(ids, pos, cache, mask)
      next_ids = jnp.concatenate([ids[:, 1:], jnp.zeros((b, 1), jnp.int32)], axis=1)
      stats = heads.token_stats(h, unembed, next_ids, sample_bt=sample,
                                temperature=temperature, keys_bt2=keys, banned_id=banned_id,
                                vocab_chunk=vocab_chunk)
      p_prev = jnp.concatenate([jnp.ones((b, 1), jnp.float32), stats.p_given_bt[:, :-1]], 1)
      rows_bw = jnp.broadcast_to(rows_b1, (b, w))

      def back(x_bw, fill):
        out = jnp.full((b, n), fill, x_bw.dtype)
        return out.at[rows_bw, jnp.where(valid_bw, src_bw, n)].set(x_bw, mode="drop")

      # K/V leave the branch padded to the widest width, with where each goes
      # (-1: nowhere), and are written below, outside the switch: a cache written
      # inside a branch is copied on every pass.
      def widest(x_lbw, fill=0):
        pad = [(0, 0)] * x_lbw.ndim
        pad[2] = (0, n_max - w)
        return jnp.pad(x_lbw, pad, constant_values=fill)

      dest_w = jnp.where(valid_bw & (dest >= 0), dest, -1)
      return (widest(k), widest(v), widest(dest_w[None], -1)[0], widest(pos[None])[0],
              PassOut(pick_bn=back(stats.pick_bt, 0), p_pick_bn=back(stats.p_pick_bt, 0.0),
                      p_prev_bn=back(p_prev, 0.0)))
    return run

  def idle():
    # No row feeds anything: no forward, nothing written.
    c = model.config
    kv = jnp.zeros((c.num_layers, b, n_max, c.num_kv_heads, c.head_dim), c.compute_dtype)
    zf = jnp.zeros((b, n), jnp.float32)
    return (kv, kv, jnp.full((b, n_max), -1, jnp.int32), jnp.zeros((b, n_max), jnp.int32),
            PassOut(pick_bn=jnp.zeros((b, n), jnp.int32), p_pick_bn=zf, p_prev_bn=zf))

  n_max = widths[-1]
  # The model always runs inside a conditional, also with a single width (AR):
  # with the cache's reads and its in-place write in the same loop body, XLA
  # (CPU, measured) copies every layer's K and V twice per pass.
  index = jnp.where(need_b.max() > 0, 1 + width_index(need_b.max(), widths), 0)
  k, v, dest, pos, out = jax.lax.switch(index, [idle] + [branch(w) for w in widths])
  # Everything not written goes out of bounds and is dropped.
  dst = jnp.where(dest >= 0, dest, cache.max_len)
  rows_bw = jnp.broadcast_to(rows_b1, dest.shape)
  return cache.write(rows_bw, dst, k, v, pos), out
