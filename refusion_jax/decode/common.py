"""Helpers shared by the decoders: model split/merge for jax.jit, cache, prefill."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from refusion_jax import masks
from refusion_jax.config import ModelConfig
from refusion_jax.kv_cache import KVCache


def split_model(model: nnx.Module):
  """`(graphdef, state)`: the graphdef is hashable (a static jit argument), the state a pytree."""
  return nnx.split(model)


def merge_model(graphdef, state) -> nnx.Module:
  """Rebuilds the module inside a traced function from `split_model`'s halves."""
  return nnx.merge(graphdef, state)


def init_cache(config: ModelConfig, batch: int, max_len: int) -> KVCache:
  """An empty static KV buffer of `max_len` entries per row.

  Built inside the jitted decode; the barrier keeps XLA from constant-folding
  the prefill over the all-zero buffer (which made compiles several times slower).
  """
  return jax.lax.optimization_barrier(KVCache.init(config, batch, max_len))


def check_prompts(prompt_ids_bp, prompt_len_b) -> tuple[np.ndarray, np.ndarray]:
  """Validates right-padded prompts on the host; returns them as int32 numpy arrays."""
  ids = np.asarray(prompt_ids_bp)
  lens = np.asarray(prompt_len_b)
  if ids.ndim != 2 or ids.shape[0] == 0 or ids.shape[1] == 0:
    raise ValueError(
        f"prompt_ids_bp must be a non-empty [batch, length] array, got shape {ids.shape}")
  if not np.issubdtype(ids.dtype, np.integer):
    raise ValueError(f"prompt_ids_bp must hold integer token ids, got dtype {ids.dtype}")
  if lens.shape != (ids.shape[0],):
    raise ValueError(
        f"prompt_len_b must have shape ({ids.shape[0]},) to match prompt_ids_bp, got {lens.shape}")
  if not np.issubdtype(lens.dtype, np.integer):
    raise ValueError(f"prompt_len_b must hold integers, got dtype {lens.dtype}")
  bad = np.flatnonzero((lens < 1) | (lens > ids.shape[1]))
  if bad.size:
    raise ValueError(
        f"prompt_len_b[{bad[0]}]={lens[bad[0]]} must lie in [1, {ids.shape[1]}] "
        "(the padded prompt length)")
  return ids.astype(np.int32), lens.astype(np.int32)


def check_vocab(ids: np.ndarray, prompt_len_b: np.ndarray, vocab_size: int) -> None:
  live = np.arange(ids.shape[1])[None, :] < prompt_len_b[:, None]
  bad = live & ((ids < 0) | (ids >= vocab_size))
  if bad.any():
    b, p = np.argwhere(bad)[0]
    raise ValueError(
        f"prompt_ids_bp[{b}, {p}]={ids[b, p]} is outside the vocabulary [0, {vocab_size})")


def checked_prompts(model, prompt_ids_bp, prompt_len_b, decode_config,
                    check_config) -> tuple[np.ndarray, np.ndarray]:
  """Every decoder's host-side checks, before anything compiles.

  Validates the prompt arrays, then `check_config(model_config, decode_config,
  longest_prompt)` (the decoder's own rules), then the token ids against the
  vocabulary. Returns the prompts as int32 numpy arrays.
  """
  ids, lens = check_prompts(prompt_ids_bp, prompt_len_b)
  check_config(model.config, decode_config, int(lens.max()))
  check_vocab(ids, lens, model.config.vocab_size)
  return ids, lens


def prefill_rows(model, cache: KVCache, ids_ap, lens_a, rows_a, bidirectional: bool = False,
                 tail_ids_am=None):
  """Prefills prompts into cache rows `rows_a` (index B: dropped); returns the cache
  and the final hidden state at each prompt's last token `[A, D]`. `bidirectional`:
  every prompt token sees the whole prompt (D2F's prompt), else the ones before it.

  `tail_ids_am` (causal only): `[A, M]` tokens fed in the same pass after each prompt at
  positions `len, len + 1, ...`, each seeing the prompt and the tail's earlier entries
  (lossless decoding's first drafts from masks); their K/V are not kept, and their
  final hidden states `[A, M, D]` are returned third."""
  a, p = ids_ap.shape
  positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32)[None], (a, p))
  if bidirectional:
    live = jnp.arange(p)[None] < lens_a[:, None]
    mask = (live[:, None, :] & live[:, :, None]) | jnp.eye(p, dtype=bool)[None]
  else:
    mask = masks.prefix_causal_btt(lens_a, p)
  if tail_ids_am is not None:
    m = tail_ids_am.shape[1]
    live = jnp.arange(p)[None] < lens_a[:, None]
    sees_prompt = jnp.broadcast_to(live[:, None, :], (a, m, p))
    tail_mask = jnp.concatenate([sees_prompt, jnp.broadcast_to(masks.causal_tt(m)[None],
                                                               (a, m, m))], 2)
    mask = jnp.concatenate([jnp.concatenate([mask, jnp.zeros((a, p, m), bool)], 2),
                            tail_mask], 1)
    positions = jnp.concatenate(
        [positions, lens_a[:, None] + jnp.arange(m, dtype=jnp.int32)[None]], 1)
    ids_ap = jnp.concatenate([ids_ap, tail_ids_am.astype(ids_ap.dtype)], 1)
  h, k, v = model.forward_hidden(ids_ap, positions, None, mask)
  if tail_ids_am is not None:
    h, tail_h = h[:, :p], h[:, p:]
    k, v = k[:, :, :p], v[:, :, :p]
  keep = jnp.arange(p)[None] < lens_a[:, None]
  dst = jnp.where(keep, jnp.arange(p)[None], cache.max_len)
  rows_ap = jnp.broadcast_to(rows_a[:, None], (a, p))
  s = jnp.arange(cache.max_len)[None]
  cache = cache.write(rows_ap, dst, k, v)
  cache = cache.replace(
      positions_bs=cache.positions_bs.at[rows_a].set(
          jnp.where(s < lens_a[:, None], s, -1).astype(jnp.int32), mode="drop"),
      length_b=cache.length_b.at[rows_a].set(lens_a, mode="drop"))
  last = jnp.take_along_axis(h, (lens_a - 1)[:, None, None], axis=1)[:, 0]
  if tail_ids_am is not None:
    return cache, last, tail_h
  return cache, last


def prefill(model, cache: KVCache, prompt_ids_bp, prompt_len_b):
  """Prefills right-padded prompts into every row (`prefill_rows` over all rows).

  Returns `(cache, last_logits_bv)`, the float32 logits at each row's last prompt
  token (what an autoregressive decoder samples its first token from).
  Traceable: call it inside the decoder's jitted program.
  """
  rows_b = jnp.arange(prompt_ids_bp.shape[0])
  cache, last_bd = prefill_rows(model, cache, prompt_ids_bp, prompt_len_b, rows_b)
  return cache, model.unembed().logits(last_bd[:, None])[:, 0]
