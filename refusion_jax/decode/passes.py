"""One narrow forward pass in which every row feeds what its own phase needs.

A row describes its feed in a fixed *layout* of `N` entries (for ReFusion
the current block): which entries take part (`fed_bn`), their token ids and
position ids, an attention group per entry (an entry sees the earlier fed
entries of its own group: group 0 for a causal run over everything fed, the
slot index for the infill's slot-local attention; with `block_groups`, every fed
entry of its own group and of lower groups), where its K/V go in the
row's cache (`dest_bn`, -1 for nowhere) and whether its pick is sampled.

`run_pass` compacts every row's fed entries to the front, in layout order
(once, before the width is chosen: one gather of all the feed's fields), and
runs the model at the smallest of the static `widths` that holds every row's
count, all widths in one compiled program (`lax.switch`; a pass in which no
row feeds anything runs no model). A branch holds only the model and the token
picker, so each extra width costs little compile time. An infill of
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


def merge(a: Feed, b: Feed) -> Feed:
  """`a` with `b`'s fed entries put in (entries `b` feeds are not fed by `a`)."""
  return jax.tree.map(lambda x, y: jnp.where(b.fed_bn, y, x), a, b).replace(
      fed_bn=a.fed_bn | b.fed_bn)


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


def compact(fed_bn: jax.Array) -> tuple[jax.Array, jax.Array]:
  """`(src_bn, rank_bn)`: the layout index of each row's j-th fed entry (clipped to
  the layout; meaningful for j < the row's count) and each entry's place among
  its row's fed entries. Elementwise compares and sums only (no scatter)."""
  n = fed_bn.shape[-1]
  cum_bn = jnp.cumsum(fed_bn, axis=-1, dtype=jnp.int32)
  # The j-th fed entry sits after exactly the entries whose running count is <= j.
  src_bn = (cum_bn[:, None, :] <= jnp.arange(n, dtype=jnp.int32)[None, :, None]).sum(
      -1, dtype=jnp.int32)
  return jnp.minimum(src_bn, n - 1), cum_bn - 1


def run_pass(model, cache: KVCache, feed: Feed, widths: Sequence[int], *, temperature,
             keys_bn2, banned_id=None, vocab_chunk: int = heads.DEFAULT_VOCAB_CHUNK,
             block_groups: bool = False, context_group: int | None = None,
             at_temperature: bool = False) -> tuple[KVCache, PassOut]:
  """One forward pass over every row's fed entries (module docstring).

  `block_groups` (static): an entry sees every fed entry of its own group (both
  directions) and of every lower group, instead of the earlier entries of its own
  group only; a row's groups must not decrease in layout order (BD3-LM's pass: a
  clean block, then the masked block that attends to it and to itself).
  `context_group` (static): entries of this group are seen by every entry of another
  group, wherever they sit (committed context fed again: ReFusion's re-check), and
  see the earlier entries of their own group.
  `at_temperature` (static): probabilities under softmax(logits / T) (`heads.token_stats`).
  """
  b, n = feed.fed_bn.shape
  widths = tuple(sorted(set(int(w) for w in widths)))
  if widths[-1] < n:
    raise ValueError(f"the widest pass {widths[-1]} cannot hold a layout of {n} entries")
  n_max = widths[-1]
  fed = feed.fed_bn
  need_b = fed.sum(-1).astype(jnp.int32)
  rows_b1 = jnp.arange(b)[:, None]
  unembed = model.unembed()
  # A scanned model writes each layer's K/V inside its scan (the branch returns the
  # updated buffers); an unrolled one hands them out and they are written below.
  in_scan = cache.stacked

  # Compaction, once for every width: each row's fed entries moved to the front in
  # layout order (one gather of all the feed's fields), padded to the widest width;
  # a branch of width w reads the first w columns.
  src_bn, rank_bn = compact(fed)
  valid_bn = jnp.arange(n)[None] < need_b[:, None]
  fields = jnp.stack([feed.ids_bn, feed.positions_bn, feed.group_bn, feed.dest_bn,
                      feed.sample_bn.astype(jnp.int32),
                      jax.lax.bitcast_convert_type(keys_bn2[..., 0], jnp.int32),
                      jax.lax.bitcast_convert_type(keys_bn2[..., 1], jnp.int32)], -1)
  fill = jnp.asarray([0, 0, -1, -1, 0, 0, 0], jnp.int32)
  packed = jnp.where(valid_bn[..., None], jnp.take_along_axis(fields, src_bn[..., None], axis=1),
                     fill)
  packed = jnp.concatenate([packed, jnp.broadcast_to(fill, (b, n_max - n, fill.size))], 1)

  def branch(w: int):
    def run():
      c = packed[:, :w]
      ids, pos, group, dest = c[..., 0], c[..., 1], c[..., 2], c[..., 3]
      sample = c[..., 4] > 0
      keys = jax.lax.bitcast_convert_type(c[..., 5:7], jnp.uint32)
      valid_bw = jnp.arange(w)[None] < need_b[:, None]
      if block_groups:
        sees_bww = group[:, None, :] <= group[:, :, None]
      else:
        sees_bww = masks.causal_tt(w)[None] & (group[:, :, None] == group[:, None, :])
        if context_group is not None:
          ctx = group == context_group
          sees_bww = sees_bww | (ctx[:, None, :] & ~ctx[:, :, None])
      mask = (sees_bww & valid_bw[:, :, None] & valid_bw[:, None, :]) | jnp.eye(w, dtype=bool)[None]
      if in_scan:
        dst = jnp.where(dest >= 0, dest, cache.max_len)
        h, written = model.forward_hidden(ids, pos, cache, mask,
                                          write_bt=(jnp.broadcast_to(rows_b1, dst.shape), dst))
      else:
        h, k, v = model.forward_hidden(ids, pos, cache, mask)
      next_ids = jnp.concatenate([ids[:, 1:], jnp.zeros((b, 1), jnp.int32)], axis=1)
      stats = heads.token_stats(h, unembed, next_ids, sample_bt=sample,
                                temperature=temperature, keys_bt2=keys, banned_id=banned_id,
                                vocab_chunk=vocab_chunk, at_temperature=at_temperature)
      p_prev = jnp.concatenate([jnp.ones((b, 1), jnp.float32), stats.p_given_bt[:, :-1]], 1)
      # Everything leaves the branch padded to the widest width. K/V go with where
      # each goes (-1: nowhere) and are written below, outside the switch: a cache
      # written inside a branch is copied on every pass.
      def widest(x, axis, fill=0):
        pad = [(0, 0)] * x.ndim
        pad[axis] = (0, n_max - w)
        return jnp.pad(x, pad, constant_values=fill)

      # `dest` is already -1 on padding (the compaction's fill).
      rest = (widest(dest, 1, -1), widest(pos, 1), widest(stats.pick_bt, 1),
              widest(jnp.stack([stats.p_pick_bt, p_prev], -1), 1))
      if in_scan:
        return (written.k, written.v) + rest
      return (widest(k, 2), widest(v, 2)) + rest
    return run

  def idle():
    # No row feeds anything: no forward, nothing written.
    c = model.config
    zi = jnp.zeros((b, n_max), jnp.int32)
    rest = (zi - 1, zi, zi, jnp.zeros((b, n_max, 2), jnp.float32))
    if in_scan:
      return (cache.k, cache.v) + rest
    kv = jnp.zeros((c.num_layers, b, n_max, c.num_kv_heads, c.head_dim), c.compute_dtype)
    return (kv, kv) + rest

  # The model always runs inside a conditional, also with a single width (AR):
  # with the cache's reads and its in-place write in the same loop body, XLA
  # (CPU, measured) copies every layer's K and V twice per AR pass.
  index = jnp.where(need_b.max() > 0, 1 + width_index(need_b.max(), widths), 0)
  k, v, dest, pos, pick, probs = jax.lax.switch(index, [idle] + [branch(w) for w in widths])
  if in_scan:
    cache = cache.replace(k=k, v=v)
  # Back to the layout: entry n reads the compacted column of its rank (a gather).
  rank = jnp.clip(rank_bn, 0, n_max - 1)
  pick = jnp.where(fed, jnp.take_along_axis(pick, rank, axis=1), 0)
  probs = jnp.where(fed[..., None], jnp.take_along_axis(probs, rank[..., None], axis=1), 0.0)
  out = PassOut(pick_bn=pick, p_pick_bn=probs[..., 0], p_prev_bn=probs[..., 1])
  # Everything not written goes out of bounds and is dropped.
  dst = jnp.where(dest >= 0, dest, cache.max_len)
  rows_bw = jnp.broadcast_to(rows_b1, dest.shape)
  if in_scan:  # K/V already written by the layers; the positions go in here
    return cache.replace(positions_bs=cache.positions_bs.at[rows_bw, dst].set(
        pos.astype(jnp.int32), mode="drop")), out
  return cache.write(rows_bw, dst, k, v, pos), out
