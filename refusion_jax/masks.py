"""Pure attention-mask builders (True = the query may attend to the key).

Chunk masks are `[B, T, T]` over the tokens of one forward chunk; the KV
cache has its own validity mask `[B, S]` (every chunk query sees every live
cache entry). Tokens that are "not members" of a pass (decided, unchosen or
padding) still occupy their place in the fixed-shape chunk: they see only
themselves, so no softmax row is empty, and no member ever sees them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def causal_tt(t: int) -> jax.Array:
  """Lower-triangular `[T, T]`: query i sees keys 0..i."""
  return jnp.tril(jnp.ones((t, t), bool))


def full_tt(t: int) -> jax.Array:
  """`[T, T]` all True: every query sees every key (the MDM baseline's attention)."""
  return jnp.ones((t, t), bool)


def segment_btt(segment_ids_bt: jax.Array, causal: bool) -> jax.Array:
  """`[B, T, T]` attention of packed rows: a token sees the tokens of its own segment
  (those before it in row order when `causal`, every one otherwise).

  `segment_ids_bt` numbers each row's samples (any distinct positive ids); 0 is
  padding, which sees only itself and is seen by nobody. A row of one sample and
  right padding under `causal` is `prefix_causal_btt`.
  """
  segment_ids_bt = jnp.asarray(segment_ids_bt)
  t = segment_ids_bt.shape[1]
  same_btt = segment_ids_bt[:, :, None] == segment_ids_bt[:, None, :]
  mask = same_btt & (segment_ids_bt > 0)[:, None, :]
  if causal:
    mask = mask & causal_tt(t)[None]
  return _with_diagonal(mask)


def cache_valid_bs(length_b: jax.Array, max_len: int) -> jax.Array:
  """`[B, S]`: entry s of row b is live when s < length_b[b]."""
  return jnp.arange(max_len)[None, :] < jnp.asarray(length_b)[:, None]


def prefix_causal_btt(length_b: jax.Array, t: int) -> jax.Array:
  """Causal mask over right-padded rows: keys at or past `length_b` are hidden.

  Padding queries keep their diagonal so their rows are never empty.
  """
  valid_bt = jnp.arange(t)[None, :] < jnp.asarray(length_b)[:, None]
  return _with_diagonal(causal_tt(t)[None] & valid_bt[:, None, :])


def block_causal_btt(prompt_len_b: jax.Array, block: int, t: int) -> jax.Array:
  """D2F's block-causal attention over rows `[prompt, blocks of `block`...]` of length t:
  a prompt query sees the prompt; a query in response block j sees the prompt, the blocks
  before j and all of block j. `prompt_len_b` may be an int (then `[t, t]`)."""
  q = jnp.arange(t)
  plen = jnp.asarray(prompt_len_b)
  block_of = jnp.where(q >= plen[..., None], (q - plen[..., None]) // block, -1)
  bq, bk = block_of[..., :, None], block_of[..., None, :]
  return jnp.where(bq < 0, bk < 0, bk <= bq)


def block_causal_tt(prompt_len: int, block: int, t: int) -> jax.Array:
  """`block_causal_btt` for one prompt length: `[t, t]`."""
  return block_causal_btt(jnp.asarray(prompt_len), block, t)


def subset_causal_btt(member_bt: jax.Array) -> jax.Array:
  """Causal attention among the member tokens only, in chunk (position) order.

  Used by the plan pass (members: undecided slots) and by global verification
  (members: chosen slots, whose drafts then form one causal concatenation).
  """
  member_bt = member_bt.astype(bool)
  t = member_bt.shape[1]
  mask = causal_tt(t)[None] & member_bt[:, :, None] & member_bt[:, None, :]
  return _with_diagonal(mask)


def slot_local_btt(member_bt: jax.Array, slot_size: int) -> jax.Array:
  """Block-diagonal causal mask: a member token sees earlier tokens of its own slot.

  Slots are the consecutive runs of `slot_size` chunk entries. This is the
  infill's per-slot independence: with the committed context in the cache,
  each chosen slot sees the context and itself, never another slot.
  """
  member_bt = member_bt.astype(bool)
  t = member_bt.shape[1]
  if t % slot_size:
    raise ValueError(f"chunk length {t} is not a multiple of slot_size={slot_size}")
  slot_t = jnp.arange(t) // slot_size
  same_slot_tt = slot_t[:, None] == slot_t[None, :]
  mask = (causal_tt(t) & same_slot_tt)[None] & member_bt[:, :, None] & member_bt[:, None, :]
  return _with_diagonal(mask)


def block_diffusion_btt(segment_ids_bt: jax.Array, block_bt: jax.Array, noised_bt: jax.Array,
                        positions_bt: jax.Array) -> jax.Array:
  """`[B, T, T]` attention of BD3-LM's two-half rows (ALGORITHM.md "Baselines", BD3-LM).

  Every token carries its sample (`segment_ids_bt`, 0 = padding or a token no one
  reads), its response block (`block_bt`: -1 for a prompt token), whether it is in
  the noised half (`noised_bt`) and its position within its sample. Within a sample:
  a noised token sees its own noised block (both directions), the clean prompt and
  the clean blocks before its block; a clean prompt token sees the clean prompt up to
  its own position; a clean response token sees the clean prompt, the clean blocks
  before its own and its whole own clean block. Nothing sees a noised token from
  outside its block; tokens of segment 0 see only themselves.
  """
  seg_bt = jnp.asarray(segment_ids_bt)
  blk_bt = jnp.asarray(block_bt)
  noised_bt = jnp.asarray(noised_bt).astype(bool)
  pos_bt = jnp.asarray(positions_bt)
  same_btt = (seg_bt[:, :, None] == seg_bt[:, None, :]) & (seg_bt > 0)[:, None, :]
  q_blk, k_blk = blk_bt[:, :, None], blk_bt[:, None, :]
  q_noised, k_noised = noised_bt[:, :, None], noised_bt[:, None, :]
  earlier_clean = ~k_noised & (k_blk < q_blk)
  from_noised = (k_noised & (k_blk == q_blk)) | earlier_clean
  same_clean_block = ~k_noised & (k_blk == q_blk) & (
      (q_blk >= 0) | (pos_bt[:, None, :] <= pos_bt[:, :, None]))
  from_clean = earlier_clean | same_clean_block
  mask = same_btt & jnp.where(q_noised, from_noised, from_clean)
  return _with_diagonal(mask)


def _with_diagonal(mask_btt: jax.Array) -> jax.Array:
  t = mask_btt.shape[-1]
  return mask_btt | jnp.eye(t, dtype=bool)[None]
