"""The one token picker every decoder uses, reduced over the vocabulary in the pass.

A decoding pass needs three numbers per fed token, never the distribution
itself: the picked token (argmax of the logits, with Gumbel noise at the
temperature where the token is sampled), the picked token's probability under
the *un-noised* softmax, and the probability of one given token (the next fed
token, for verification). `token_stats` computes them from the final hidden
states and the output projection; with a vocabulary larger than
its chunk it walks the vocabulary in chunks with an online log-sum-exp, so
no `[B, T, V]` float32 array exists (Qwen3's 151,671 tokens at batch 16 x
block 128 would be 1.2 GB per pass). A chunk holds at most `vocab_chunk`
columns and, for a wide pass over many rows, fewer (`chunk_columns`): one
chunk's `[B, T, columns]` logits stay within `LOGITS_BUDGET` elements, so the
picker's memory does not grow with batch x width (at batch 64 x block 128 a
32,768-column chunk alone is 1 GiB, and the reduction holds several).

Where the vocabulary is split over devices (tensor parallelism: the LM head's
"vocab" axis on the active mesh), the chunks are taken inside each device's
part of the vocabulary: every device reduces its own columns and only `[B, T]`
statistics cross devices. A chunk of the whole vocabulary would instead make
every device gather the entire projection (1.2 GB for Qwen3-8B) on every pass.

Noise is drawn per token from its own key (`keys_bt2`) and per vocabulary
column, so a token's draw does not depend on how many other tokens share the
pass, on its place in the pass or on the chunking: a row decoded inside a
batch equals the row decoded alone even when sampling.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
from jax.extend.random import threefry2x32_p

from refusion_jax import sharding
from refusion_jax.model import Unembed

DEFAULT_VOCAB_CHUNK = 32768
# Elements of one chunk's [B, T, columns] float32 logits (64 MiB); a chunk never has
# fewer than MIN_CHUNK columns (a narrower matmul would cost more in loop steps).
LOGITS_BUDGET = 1 << 24
MIN_CHUNK = 1024


def chunk_columns(tokens: int, vocab_chunk: int = DEFAULT_VOCAB_CHUNK,
                  budget: int = LOGITS_BUDGET) -> int:
  """Vocabulary columns reduced at a time for a pass over `tokens` (= B x T) tokens:
  `vocab_chunk`, or fewer (a multiple of 128, at least MIN_CHUNK) where
  `tokens x vocab_chunk` would exceed `budget` elements."""
  if tokens <= 0 or vocab_chunk <= 0:
    raise ValueError(f"tokens and vocab_chunk must be > 0, got {tokens} and {vocab_chunk}")
  fit = max(MIN_CHUNK, budget // tokens // 128 * 128)
  return min(vocab_chunk, fit)


@flax.struct.dataclass
class TokenStats:
  pick_bt: jax.Array  # argmax (noisy where sampled), int32
  p_pick_bt: jax.Array  # its probability under the plain softmax
  p_given_bt: jax.Array  # probability of `given_bt` under the plain softmax


def _noise(keys_bt2, start, width):
  """Gumbel noise `[B, T, width]` for vocabulary columns `[start, start + width)`."""
  return _column_noise(keys_bt2, start + jnp.arange(width))


def _column_noise(keys_bt2, cols_c):
  """Gumbel noise `[B, T, C]` for the vocabulary columns `cols_c` (any order).

  Column c's draw is Threefry-2x32 of the token's key with counter (c, 0), so it
  depends on the key and on c alone, never on how the vocabulary is chunked (a
  pass's chunk size follows its batch x width, and a row must sample the same
  tokens in a batch as alone) or split over devices. One counter-mode hash per
  column: the branch of every pass width compiles one small fusion for it.
  `cols_c` may be traced.
  """
  b, t = keys_bt2.shape[:2]
  cols = cols_c.astype(jnp.uint32)

  def one(key2):
    bits, _ = threefry2x32_p.bind(key2[0], key2[1], cols, jnp.zeros_like(cols))
    # 23 random mantissa bits -> a float in [1, 2) -> uniform in (0, 1).
    unit = jax.lax.bitcast_convert_type((bits >> 9) | jnp.uint32(0x3F800000), jnp.float32) - 1.0
    u = jnp.maximum(unit, jnp.finfo(jnp.float32).tiny)
    return -jnp.log(-jnp.log(u))

  return jax.vmap(one)(keys_bt2.reshape(b * t, -1)).reshape(b, t, cols.shape[0])


def _member(cols_c, ids):
  """`[C]` whether each column is one of `ids` (an id or a 1-D array of them; -1 never
  matches a column)."""
  ids = jnp.atleast_1d(jnp.asarray(ids))
  return (cols_c[..., None] == ids).any(-1)


def token_stats(h_btd, unembed, given_bt, *, sample_bt=None, temperature=None,
                keys_bt2=None, banned_id=None, unscored_ids=None,
                vocab_chunk: int = DEFAULT_VOCAB_CHUNK, at_temperature: bool = False
                ) -> TokenStats:
  """Per-token pick and probabilities from hidden states `[B, T, D]`.

  Args:
    h_btd: hidden states after the final norm.
    unembed: the output projection, `Transformer.unembed()` (a `model.Unembed`), or a
      plain `[V, D]` array.
    given_bt: token whose probability `p_given_bt` reports.
    sample_bt: where the pick is a sample (argmax of logits / temperature +
      Gumbel noise); elsewhere, and everywhere when `temperature <= 0`, it is
      the plain argmax. Traced: a new temperature does not recompile.
    temperature: traced float scalar.
    keys_bt2: raw uint32 PRNG key per token (needed when `sample_bt` is given).
    banned_id: a token id (or a 1-D array of ids, -1 for none) never picked, whose
      probability mass is removed before the softmax (MDM never drafts the mask
      token). Static or traced.
    unscored_ids: ids (a 1-D array, -1 for none; traced) left out of the softmax that
      `p_pick_bt` and `p_given_bt` are taken under; a pick or given token among them
      has probability 0 (LLaDA's `confidence_eos_eot_inf`). They can still be picked.
    vocab_chunk: the most vocabulary columns reduced at a time (static); fewer for
      a pass of many tokens (`chunk_columns`).
    at_temperature: (static) `p_pick_bt` and `p_given_bt` under `softmax(logits / T)`,
      the distribution a sampled pick is drawn from (the plain softmax at T <= 0).
  """
  if not isinstance(unembed, Unembed):
    unembed = Unembed(unembed, vocab_axis=0)
  v = unembed.vocab_size
  sampling = sample_bt is not None
  if sampling:
    any_sample = (temperature > 0) & sample_bt.any()
    inv_t = 1.0 / jnp.where(temperature > 0, temperature, 1.0)
  # Probabilities under softmax(logits / T): the logits scaled once, the noisy score
  # then adds the noise only (the same score either way).
  if at_temperature:
    scale = 1.0 / jnp.where(temperature > 0, temperature, 1.0)
  noisy = (lambda x: x) if at_temperature else (lambda x: x * inv_t)

  def chunk_terms(logits_btc, cols_c, start, with_noise):
    if banned_id is not None:
      logits_btc = jnp.where(_member(cols_c, banned_id)[None, None], -jnp.inf, logits_btc)
    if at_temperature:
      logits_btc = logits_btc * scale
    score = logits_btc
    if with_noise:
      noise = _noise(keys_bt2, start, logits_btc.shape[-1])
      score = jnp.where(sample_bt[..., None], noisy(logits_btc) + noise, logits_btc)
    return logits_btc, score

  b, t = given_bt.shape
  vocab_chunk = chunk_columns(b * t, vocab_chunk)
  # Where the vocabulary is split over devices (the LM head's "vocab" axis on the active
  # mesh), chunks are taken inside every device's part: `groups` parts of `vg` columns.
  groups = sharding.split_count("vocab", v)
  vg = v // groups
  if vg <= vocab_chunk:
    logits = unembed.logits(h_btd)
    cols = jnp.arange(v)

    def reduce_all(with_noise):
      logits_b, score = chunk_terms(logits, cols, 0, with_noise)
      pick = jnp.argmax(score, axis=-1).astype(jnp.int32)
      if unscored_ids is not None:
        logits_b = jnp.where(_member(cols, unscored_ids)[None, None], -jnp.inf, logits_b)
      lse = jax.nn.logsumexp(logits_b, axis=-1)
      pick_logit = jnp.take_along_axis(logits_b, pick[..., None], axis=-1)[..., 0]
      given_logit = jnp.take_along_axis(logits_b, given_bt[..., None], axis=-1)[..., 0]
      return pick, jnp.exp(pick_logit - lse), jnp.exp(given_logit - lse)

    return _dispatch(reduce_all, sampling and any_sample)

  # Chunked: an online reduction over chunks of `vocab_chunk` columns of every group.
  # The last chunk is read from a clamped start (`dynamic_slice` needs a full chunk);
  # the columns it shares with the previous chunk are masked out, so each column
  # counts once. Chunk c of group g holds the global columns g * vg + [start, +chunk).
  n_chunks = -(-vg // vocab_chunk)
  g_offset = (jnp.arange(groups) * vg)[:, None]
  given_group, given_local = given_bt // vg, given_bt % vg

  def reduce_chunks(with_noise):
    def body(carry, c):
      m, s, best, best_idx, best_logit, given_logit = carry
      start = jnp.minimum(c * vocab_chunk, vg - vocab_chunk)
      local = start + jnp.arange(vocab_chunk)
      cols = (g_offset + local[None]).reshape(-1)  # [groups * chunk], global ids
      fresh = jnp.broadcast_to(local[None] >= c * vocab_chunk, (groups, vocab_chunk)).reshape(-1)
      logits = unembed.group_logits(h_btd, groups, start, vocab_chunk).reshape(b, t, -1)
      logits = jnp.where(fresh[None, None], logits, -jnp.inf)
      if banned_id is not None:
        logits = jnp.where(_member(cols, banned_id)[None, None], -jnp.inf, logits)
      if at_temperature:
        logits = logits * scale
      score = logits
      if with_noise:
        noise = _column_noise(keys_bt2, cols)
        score = jnp.where(sample_bt[..., None], noisy(logits) + noise, logits)
        score = jnp.where(fresh[None, None], score, -jnp.inf)
      if unscored_ids is not None:  # the pick above may be one; the softmax below leaves them out
        logits = jnp.where(_member(cols, unscored_ids)[None, None], -jnp.inf, logits)
      c_max = logits.max(-1)
      new_m = jnp.maximum(m, c_max)
      safe_m = jnp.where(jnp.isfinite(new_m), new_m, 0.0)
      s = s * jnp.exp(m - safe_m) + jnp.exp(logits - safe_m[..., None]).sum(-1)
      c_idx = jnp.argmax(score, axis=-1)  # the lowest global column among a chunk's ties
      c_best = jnp.take_along_axis(score, c_idx[..., None], axis=-1)[..., 0]
      c_logit = jnp.take_along_axis(logits, c_idx[..., None], axis=-1)[..., 0]
      c_col = cols[c_idx].astype(jnp.int32)
      # Ties keep the lower column, as argmax does (a later chunk of group 0 holds lower
      # columns than an earlier chunk of group 1).
      better = (c_best > best) | ((c_best == best) & (c_col < best_idx))
      best_idx = jnp.where(better, c_col, best_idx)
      best_logit = jnp.where(better, c_logit, best_logit)
      best = jnp.where(better, c_best, best)
      hit = (given_local >= c * vocab_chunk) & (given_local < start + vocab_chunk)
      g_flat = given_group * vocab_chunk + jnp.clip(given_local - start, 0, vocab_chunk - 1)
      g_logit = jnp.take_along_axis(logits, g_flat[..., None], axis=-1)[..., 0]
      given_logit = jnp.where(hit, g_logit, given_logit)
      return (new_m, s, best, best_idx, best_logit, given_logit), None

    neg = jnp.full((b, t), -jnp.inf, jnp.float32)
    init = (neg, jnp.zeros((b, t), jnp.float32), neg, jnp.zeros((b, t), jnp.int32), neg, neg)
    (m, s, _, best_idx, best_logit, given_logit), _ = jax.lax.scan(
        body, init, jnp.arange(n_chunks))
    lse = m + jnp.log(s)
    return (best_idx.astype(jnp.int32), jnp.exp(best_logit - lse), jnp.exp(given_logit - lse))

  return _dispatch(reduce_chunks, sampling and any_sample)


def _dispatch(reduce, any_sample) -> TokenStats:
  """`reduce(with_noise)` behind a `lax.cond` when some token may be sampled (no noise is
  drawn otherwise); `any_sample` is False when nothing is ever sampled."""
  if any_sample is False:
    pick, p_pick, p_given = reduce(False)
  else:
    pick, p_pick, p_given = jax.lax.cond(any_sample, lambda: reduce(True),
                                         lambda: reduce(False))
  return TokenStats(pick_bt=pick, p_pick_bt=p_pick, p_given_bt=p_given)


@flax.struct.dataclass
class SamplerStats:
  """Dream's sampler scores of each token, under the softmax at the temperature
  (`softmax(logits / T)`; the plain softmax when T = 0)."""

  pick_bt: jax.Array  # argmax (greedy) or a sample (T > 0), int32
  p_pick_bt: jax.Array  # the pick's probability ("maskgit_plus")
  margin_bt: jax.Array  # top-1 minus top-2 probability ("topk_margin")
  neg_entropy_bt: jax.Array  # sum_v p_v log p_v ("entropy")


def sampler_stats(h_btd, unembed, *, temperature, keys_bt2, banned_id=None,
                  vocab_chunk: int = DEFAULT_VOCAB_CHUNK) -> SamplerStats:
  """Dream's per-token scores from hidden states `[B, T, D]`, reduced over the
  vocabulary a chunk at a time as `token_stats` does (no `[B, T, V]` array).

  Every score is taken under `p = softmax(logits / T)` (T = `temperature`, traced;
  the plain softmax at T = 0), as Dream's samplers take them: the pick is the argmax
  of `logits / T` plus Gumbel noise drawn from `keys_bt2` exactly as `token_stats`
  draws it (the argmax at T = 0), so it is a sample of `p`. `banned_id` is never
  picked and its mass is removed before the softmax. The entropy is `sum p log p`
  over the vocabulary (Dream adds 1e-10 inside the log, which moves it by at most
  V * 1e-10).
  """
  if not isinstance(unembed, Unembed):
    unembed = Unembed(unembed, vocab_axis=0)
  v = unembed.vocab_size
  b, t = h_btd.shape[:2]
  scale = 1.0 / jnp.where(temperature > 0, temperature, 1.0)
  groups = sharding.split_count("vocab", v)
  vg = v // groups
  chunk = min(chunk_columns(b * t, vocab_chunk), vg)
  n_chunks = -(-vg // chunk)
  g_offset = (jnp.arange(groups) * vg)[:, None]

  def reduce(with_noise):
    def body(carry, c):
      m, s, a, t1, t2, best, best_idx, best_z = carry
      start = jnp.minimum(c * chunk, vg - chunk)
      local = start + jnp.arange(chunk)
      cols = (g_offset + local[None]).reshape(-1)  # [groups * chunk], global ids
      fresh = jnp.broadcast_to(local[None] >= c * chunk, (groups, chunk)).reshape(-1)
      if n_chunks == 1 and groups == 1:
        logits = unembed.logits(h_btd)
      else:
        logits = unembed.group_logits(h_btd, groups, start, chunk).reshape(b, t, -1)
      keep = fresh if banned_id is None else fresh & ~_member(cols, banned_id)
      z = jnp.where(keep[None, None], logits * scale, -jnp.inf)
      score = z
      if with_noise:
        score = jnp.where(keep[None, None], z + _column_noise(keys_bt2, cols), -jnp.inf)
      # Online softmax statistics of z: s = sum e^(z-m), a = sum e^(z-m) (z-m).
      new_m = jnp.maximum(m, z.max(-1))
      safe_m = jnp.where(jnp.isfinite(new_m), new_m, 0.0)
      alpha = jnp.exp(m - safe_m)
      d = z - safe_m[..., None]
      e = jnp.exp(d)
      shift = jnp.where(s > 0, (m - safe_m) * s, 0.0)
      a = alpha * (a + shift) + jnp.where(e > 0, e * d, 0.0).sum(-1)
      s = s * alpha + e.sum(-1)
      c_top, _ = jax.lax.top_k(z, 2)
      t1, t2 = (jnp.maximum(t1, c_top[..., 0]),
                jnp.maximum(jnp.minimum(t1, c_top[..., 0]), jnp.maximum(t2, c_top[..., 1])))
      c_idx = jnp.argmax(score, axis=-1)
      c_best = jnp.take_along_axis(score, c_idx[..., None], axis=-1)[..., 0]
      c_z = jnp.take_along_axis(z, c_idx[..., None], axis=-1)[..., 0]
      c_col = cols[c_idx].astype(jnp.int32)
      better = (c_best > best) | ((c_best == best) & (c_col < best_idx))
      best_idx = jnp.where(better, c_col, best_idx)
      best_z = jnp.where(better, c_z, best_z)
      best = jnp.where(better, c_best, best)
      return (new_m, s, a, t1, t2, best, best_idx, best_z), None

    neg = jnp.full((b, t), -jnp.inf, jnp.float32)
    zero = jnp.zeros((b, t), jnp.float32)
    init = (neg, zero, zero, neg, neg, neg, jnp.zeros((b, t), jnp.int32), neg)
    (m, s, a, t1, t2, _, best_idx, best_z), _ = jax.lax.scan(body, init, jnp.arange(n_chunks))
    lse = m + jnp.log(s)
    return best_idx, (jnp.exp(best_z - lse), jnp.exp(t1 - lse) - jnp.exp(t2 - lse),
                      a / s - jnp.log(s))

  pick, (p_pick, margin, neg_entropy) = jax.lax.cond(
      temperature > 0, lambda: reduce(True), lambda: reduce(False))
  return SamplerStats(pick_bt=pick, p_pick_bt=p_pick, margin_bt=margin,
                      neg_entropy_bt=neg_entropy)
