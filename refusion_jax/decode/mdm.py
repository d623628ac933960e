"""Block-wise masked-diffusion decoding (the MDM baseline: LLaDA / Fast-dLLM).

The canvas of row b is its prompt followed by `gen_length` mask tokens at
positions `prompt_len_b[b] + i`; columns past that are padding, hidden from
every query by the attention mask. The response area is split into blocks of
`block_size` decoded left to right. Every step re-runs the whole canvas with
bidirectional attention (no KV cache, unless Fast-dLLM's below) and unmasks masked
tokens of the row's current block:

* `mdm_threshold is None` (LLaDA, low-confidence remasking): the
  `mdm_tokens_per_step` most confident ones (fewer when fewer are left);
* otherwise (Fast-dLLM parallel decoding): every one whose confidence is at least
  `mdm_threshold` (Fast-dLLM's code compares >=), and the most confident one when none
  is.

Draft = argmax of the logits (a sample at temperature > 0, i.e. argmax with
Gumbel noise); confidence = its softmax probability under the plain logits.
The mask token is never drafted. Ties in confidence go to the lower position.

Dream's samplers (`mdm_ranking`, `mdm_steps`; ALGORITHM.md "Baselines"). The
candidates are ranked by a score under `softmax(logits / temperature)`
(`heads.sampler_stats`): the drafted token's probability ("maskgit_plus"), top-1
minus top-2 probability ("topk_margin") or the negative entropy ("entropy"),
either `mdm_tokens_per_step` at a time or on Dream's linear schedule: with
`mdm_steps_per_block` n and timesteps `ts = linspace(1, eps, n + 1)`, step i of a
block unmasks the `int(m * (1 - ts[i+1] / ts[i]))` best of its m masked
positions, every one left at step n - 1 (the counts depend only on the block
size and n: `schedule_counts`). "origin" ranks nothing: at step i each masked
position is revealed with probability `1 - ts[i+1] / ts[i]` (1 at the last step),
a uniform draw per position from the row's key (`reveal_uniforms_bg`). With
`block_size = gen_length` this is Dream's `diffusion_generate(steps=n, alg=...)`
on one canvas. Departures from Dream's code, all per row where Dream's couple
rows: its count uses the batch's mean number of masks; the schedule is
computed in float64 here (float32 there: the counts agree for every setting
checked, docs/DESIGN.md "Dream"); the mask token is never drafted.

LLaDA's sampler (`mdm_schedule="llada"`, the default with confidence ranking and
`mdm_steps`; ALGORITHM.md "Table 1's baselines"): step i of a block unmasks
`m // n` of its m masked positions, one more for the first `m % n` steps
(`llada_counts`); steps that would unmask nothing (n > m) are not run. Its
options: `mdm_ban_eos` (EOS never drafted), `mdm_defer_stop` (at temperature 0
EOS, at any temperature the model's stop ids, score confidence 0: they are
committed last in their block), `mdm_cfg_scale` s > 0 (classifier-free guidance:
a second canvas with the prompt masked runs in the same forward, and the
hidden state read is `h_cond + s (h_cond - h_uncond)`, which gives LLaDA's
logits because the head is linear). At temperature > 0 the draft is the
Gumbel-max sample of `logits / T` in float32; LLaDA draws `exp(l) / (-log u)^T`
in float64, the same distribution (docs/DESIGN.md "LLaDA").

A model with `ModelConfig.shift_logits` (Dream) predicts token i at position
i-1: the pass reads the hidden state one column to the left of each generated
position (a prompt has at least one token, so that column exists).

EOS rule (EOS or any of the model's stop ids, `Knobs.stop_ids`): a row stops as
soon as it has a decided EOS and every position before its first decided EOS is
decided too (that EOS is then final: nothing
before it can still change). Its response is the tokens up to and including
that EOS; later positions are discarded (pad id, commit step -1) and not
counted. Without an EOS a row stops after its last block.

Fast-dLLM (`mdm_cache`, `mdm_factor`; ALGORITHM.md "Table 1's baselines"). The factor
rule unmasks, of the block's masked positions sorted by confidence c_1 >= c_2 >= ...,
the largest n with (n + 1)(1 - c_n) < f (`factor_counts_b`, as Fast-dLLM's code scans
it). With a cache, a row's first step in a block (and, with `mdm_cache_refresh` N, every
N-th) is a full pass over the canvas that also writes the K/V of the columns the cache
keeps into the row's `KVCache` (compacted; attention does not care where an entry sits):
"prefix" the columns before the block, "dual" every live column but the block's. Its
other steps are cached passes: "prefix" feeds the block and every column after it (a
static width of `gen_length`, padded past the canvas), "dual" the block alone; the fed
columns attend to each other both ways and to the row's cache. A step runs the full
pass under a `lax.cond` when some row needs it and the cached pass when some row needs
that, so each row advances one pass per step whatever its neighbours do. A shifted model
(Dream) cannot read its block's first position in a cached pass (the column before the
block is not fed): as Fast-dLLM's Dream variant, a block's full first pass decodes that
position alone. Logits are computed for the current block's positions only (the only
candidates), with or without a cache.

Counters: `plan_b` counts denoising passes (one per step while the row is
active), `refresh_b` the full passes of a row with a cache (counted in `plan_b` too),
`prefill_b` is 0 (there is no separate prompt pass).

A row program of `engine`: admission writes the prompt and the masks into
the row's canvas; each pass re-runs every canvas. Whether the fixed count or
the threshold or the factor rule applies, the count, the threshold, the factor, the
refresh interval and the temperature are traced knobs (one program for LLaDA and
Fast-dLLM settings); the ranking, the schedule's steps, guidance and the cache are
static (`Spec`: one program each).
"""

from __future__ import annotations

import dataclasses
import functools

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from refusion_jax.decode import compiled, engine, heads
from refusion_jax.decode import program as program_lib
from refusion_jax.decode.counters import DecodeCounters, DecodeOutput
from refusion_jax.decode.methods import MDM_SCHEDULE_EPS
from refusion_jax.decode.program import DONE, FIRST_PHASE, FREE
from refusion_jax.decode.settings import DecodeConfig
from refusion_jax.kv_cache import KVCache

DENOISE = FIRST_PHASE


@dataclasses.dataclass(frozen=True, kw_only=True)
class Spec(program_lib.Spec):
  block_size: int  # decode.block_size
  mdm_ranking: str = "confidence"  # decode.mdm_ranking
  mdm_steps_per_block: int = 0  # a schedule's steps per block (0: none)
  mdm_schedule: str = ""  # decode.mdm_schedule as resolved, with a schedule ("" without one)
  mdm_cfg: bool = False  # decode.mdm_cfg_scale > 0 (a second, unconditional forward)
  mdm_cache: str = ""  # decode.mdm_cache ("" without one)


@flax.struct.dataclass(kw_only=True)
class Knobs(program_lib.Knobs):
  mdm_threshold: jax.Array  # < 0: off (LLaDA's fixed count per step)
  mdm_tokens_per_step: jax.Array
  mdm_ban_eos: jax.Array  # LLaDA's flags (decode.mdm_ban_eos, mdm_defer_stop)
  mdm_defer_stop: jax.Array
  cfg_scale: jax.Array  # decode.mdm_cfg_scale
  mdm_factor: jax.Array  # Fast-dLLM's factor rule (< 0: off)
  cache_refresh: jax.Array  # decode.mdm_cache_refresh


def canvas_spec(spec: Spec) -> Spec:
  """The spec of a step that feeds prompt and canvas whole: `spec` without its cache."""
  return dataclasses.replace(spec, mdm_cache="", kv_chunk=0)


def widths(spec: Spec) -> tuple[int, ...]:
  """The widths of its cached passes (Fast-dLLM's): the block and all after it (prefix,
  the first block's), or the block alone (dual); none without a cache (every step feeds
  prompt and canvas whole)."""
  if not spec.mdm_cache:
    return ()
  return (spec.gen_length if spec.mdm_cache == "prefix" else spec.block_size,)


@flax.struct.dataclass
class Rows:
  phase_b: jax.Array
  prompt_len_b: jax.Array
  key_b2: jax.Array
  prompt_bp: jax.Array  # the prompt, right-padded to the bucket width
  gen_bg: jax.Array  # response tokens (mask id where undecided)
  decided_bg: jax.Array
  commit_step_bg: jax.Array
  block_b: jax.Array  # index of each row's current block
  block_step_b: jax.Array  # steps taken in the current block (Dream's schedule: i)
  counters: DecodeCounters


@flax.struct.dataclass
class State:
  passes: jax.Array
  rows: Rows
  # Fast-dLLM (Spec.mdm_cache): per row, K/V of the canvas columns its last full pass
  # kept, compacted in column order; None without a cache.
  cache: KVCache | None = None


def confidence_rank_bg(conf_bg, candidate_bg):
  """Rank of each candidate by confidence (0 = most confident; ties: lower index first)."""
  g = conf_bg.shape[1]
  idx = jnp.arange(g)
  conf_i = conf_bg[:, :, None]
  conf_j = conf_bg[:, None, :]
  beats_bgg = candidate_bg[:, None, :] & (
      (conf_j > conf_i) | ((conf_j == conf_i) & (idx[None, None, :] < idx[None, :, None])))
  return beats_bgg.sum(axis=-1)


def schedule_timesteps(steps: int, eps: float = MDM_SCHEDULE_EPS) -> list[float]:
  """Dream's timesteps `linspace(1, eps, steps + 1)` (float64)."""
  return [1.0 + (eps - 1.0) * j / steps for j in range(steps + 1)]


@functools.lru_cache(maxsize=None)
def schedule_counts(masked: int, steps: int, eps: float = MDM_SCHEDULE_EPS) -> tuple[int, ...]:
  """Tokens each of `steps` steps unmasks from `masked` masked positions on Dream's
  linear schedule: `int(m * (1 - s / t))` of the m still masked, all at the last step."""
  ts = schedule_timesteps(steps, eps)
  counts, left = [], masked
  for i in range(steps):
    n = left if i == steps - 1 else int(left * (1.0 - ts[i + 1] / ts[i]))
    counts.append(n)
    left -= n
  return tuple(counts)


def schedule_reveal_probs(steps: int, eps: float = MDM_SCHEDULE_EPS) -> np.ndarray:
  """"origin": each masked position's reveal probability at each step, float32
  `1 - s / t` (1 at the last step)."""
  ts = schedule_timesteps(steps, eps)
  return np.asarray([1.0 - ts[i + 1] / ts[i] for i in range(steps - 1)] + [1.0], np.float32)


def reveal_uniforms_bg(key_b2, pass_b, g: int):
  """"origin"'s draws `[B, G]`: position i of a row's pass n draws
  `uniform(fold_in(fold_in(key, n), G + i))` (the token draws of the pass use keys
  0..G-1 of the same pass, `program_lib.pass_keys`)."""
  return program_lib.pass_uniforms(key_b2, pass_b, g, g)


@functools.lru_cache(maxsize=None)
def llada_counts(masked: int, steps: int) -> tuple[int, ...]:
  """Tokens each of `steps` steps unmasks from `masked` masked positions on LLaDA's
  schedule: `masked // steps` each, one more for the first `masked % steps` steps."""
  return tuple(masked // steps + (i < masked % steps) for i in range(steps))


def first_eos_b(tokens_bg, decided_bg, knobs: Knobs):
  """(index of the first decided EOS or stop id, or G; whether it is final)."""
  g = tokens_bg.shape[1]
  is_eos_bg = decided_bg & knobs.is_stop(tokens_bg)
  first_b = jnp.where(is_eos_bg.any(axis=1), jnp.argmax(is_eos_bg, axis=1), g)
  before_bg = jnp.arange(g)[None, :] < first_b[:, None]
  final_b = (first_b < g) & jnp.all(decided_bg | ~before_bg, axis=1)
  return first_b, final_b


def _empty_rows(spec: Spec, b: int, width: int, mask_id) -> Rows:
  g = spec.gen_length
  zi = jnp.zeros((b,), jnp.int32)
  return Rows(phase_b=zi + FREE, prompt_len_b=zi + 1, key_b2=jnp.zeros((b, 2), jnp.uint32),
              prompt_bp=jnp.zeros((b, width), jnp.int32),
              gen_bg=jnp.full((b, g), mask_id, jnp.int32), decided_bg=jnp.zeros((b, g), bool),
              commit_step_bg=jnp.full((b, g), -1, jnp.int32), block_b=zi, block_step_b=zi,
              counters=DecodeCounters.zeros(b))


def init(model, spec: Spec, rows: int, width: int) -> State:
  mask = model.config.mask_token_id
  r = _empty_rows(spec, rows, width, -1 if mask is None else mask)
  cache = None
  if spec.mdm_cache:
    cache = KVCache.init(model.config, rows, width + spec.gen_length, chunk=spec.kv_chunk)
  return State(passes=jnp.zeros((), jnp.int32), rows=r, cache=cache)


def admit(model, spec: Spec, st: State, ids_ap, lens_a, rows_a, keys_a2, knobs: Knobs) -> State:
  del model
  # A prompt admitted at a narrower width than the canvas's prompt part is padded to it.
  ids_ap = jnp.pad(ids_ap, ((0, 0), (0, st.rows.prompt_bp.shape[1] - ids_ap.shape[1])))
  a, p = ids_ap.shape
  fresh = _empty_rows(spec, a, p, knobs.mask_id).replace(
      phase_b=jnp.full((a,), DENOISE, jnp.int32), prompt_len_b=lens_a, key_b2=keys_a2,
      prompt_bp=jnp.where(jnp.arange(p)[None] < lens_a[:, None], ids_ap, knobs.pad_id))
  rows = program_lib.set_rows(st.rows, fresh, rows_a)
  return st.replace(rows=rows)


def factor_counts_b(conf_bg, candidate_bg, rank_bg, factor):
  """Fast-dLLM's factor rule: with the candidates' confidences sorted c_1 >= c_2 >= ...,
  the largest n with (n + 1)(1 - c_n) < factor, at least 1 (0 without candidates). As
  Fast-dLLM's code scans it: the count stops before the first rank i >= 2 whose confidence
  is below 1 - factor / (i + 1), except that a first failure at the last rank keeps all."""
  b, g = conf_bg.shape
  n_b = candidate_bg.sum(axis=1)
  rows_bg = jnp.broadcast_to(jnp.arange(b)[:, None], (b, g))
  sorted_bg = jnp.full((b, g), -jnp.inf, conf_bg.dtype).at[
      rows_bg, jnp.where(candidate_bg, rank_bg, g)].set(conf_bg, mode="drop")
  i = jnp.arange(g)[None, :]  # 0-based rank: the (i + 1)-th
  fail_bg = (i >= 1) & (i < n_b[:, None]) & (sorted_bg < 1.0 - factor / (i + 2.0))
  first_b = jnp.where(fail_bg.any(axis=1), jnp.argmax(fail_bg, axis=1), n_b)
  return jnp.where(first_b >= n_b - 1, n_b, first_b)


def _cache_plan(spec: Spec, r: Rows, knobs: Knobs, active_b, start_b, cols_l, key_live_bl):
  """Fast-dLLM: which active rows run a full pass this step (a block's first step, or
  every `cache_refresh` steps), and which canvas columns the cache then keeps."""
  every = knobs.cache_refresh
  refresh_b = active_b & ((r.block_step_b == 0)
                          | ((every > 0) & (r.block_step_b % jnp.maximum(every, 1) == 0)))
  before_bl = cols_l[None] < start_b[:, None]
  if spec.mdm_cache == "prefix":  # the positions before the block
    keep_bl = before_bl
  else:  # "dual": every live position but the block's
    keep_bl = key_live_bl & (before_bl | (cols_l[None] >= start_b[:, None] + spec.block_size))
  return refresh_b, keep_bl


def step(model, spec: Spec, st: State, knobs: Knobs) -> State:
  """One denoising pass for every active row; each unmasks in its block.

  Without a cache the pass is over every canvas. With Fast-dLLM's cache a row takes a
  full pass (caching its K/V) at a block's first step and a cached pass otherwise; a
  step runs the full pass when some row needs one and the cached pass when some row
  needs that, so each row advances one pass per step whatever the others do."""
  r = st.rows
  b, p = r.prompt_bp.shape
  g, bs = spec.gen_length, spec.block_size
  total = p + g
  active_b = r.phase_b == DENOISE
  cols_l = jnp.arange(total)
  gen_col_bg = r.prompt_len_b[:, None] + jnp.arange(g)[None, :]
  rows_bg = jnp.broadcast_to(jnp.arange(b)[:, None], (b, g))
  seq_bl = jnp.concatenate([r.prompt_bp, jnp.full((b, g), knobs.pad_id, jnp.int32)], axis=1)
  seq_bl = seq_bl.at[rows_bg, gen_col_bg].set(r.gen_bg)
  live_end_b = r.prompt_len_b + g
  key_live_bl = cols_l[None] < live_end_b[:, None]
  # Padding queries keep their own key so that no softmax row is empty.
  attn_bll = key_live_bl[:, None, :] | jnp.eye(total, dtype=bool)[None]
  positions_bl = jnp.broadcast_to(cols_l[None].astype(jnp.int32), (b, total))
  # The current block: response positions blk_gen_bj, canvas columns from start_b (a
  # finished row's block index runs past the canvas: clipped; it chooses nothing).
  blk_b = jnp.minimum(r.block_b, g // bs - 1)
  blk_gen_bj = blk_b[:, None] * bs + jnp.arange(bs)[None, :]
  start_b = r.prompt_len_b + blk_b * bs
  # A shifted model (Dream) predicts each position from the column to its left.
  shift = 1 if model.config.shift_logits else 0
  read_full_bj = start_b[:, None] + jnp.arange(bs)[None, :] - shift
  take = lambda h_bld, col_bj: jnp.take_along_axis(h_bld, col_bj[:, :, None], axis=1)
  refresh_b = jnp.zeros((b,), bool)
  cache = st.cache
  if spec.mdm_cfg:
    # Guidance: the same canvas with its prompt masked, in the same forward. The logits
    # are linear in the final hidden state, so cond + s (cond - uncond) is taken there.
    uncond_bl = jnp.where(cols_l[None] < r.prompt_len_b[:, None], knobs.mask_id, seq_bl)
    h2, _, _ = model.forward_hidden(
        jnp.concatenate([seq_bl, uncond_bl]), jnp.concatenate([positions_bl, positions_bl]),
        None, jnp.concatenate([attn_bll, attn_bll]))
    h_c, h_u = take(h2[:b], read_full_bj), take(h2[b:], read_full_bj)
    h_bjd = h_c + jnp.asarray(knobs.cfg_scale, h_c.dtype) * (h_c - h_u)
  elif not spec.mdm_cache:
    h_bld, _, _ = model.forward_hidden(seq_bl, positions_bl, None, attn_bll)
    h_bjd = take(h_bld, read_full_bj)
  else:
    refresh_b, keep_bl = _cache_plan(spec, r, knobs, active_b, start_b, cols_l, key_live_bl)
    cached_b = active_b & ~refresh_b
    d = model.config.hidden_size
    zeros = jnp.zeros((b, bs, d), model.config.compute_dtype)

    def full(cache):
      # The whole canvas, its K/V written into the cache as it goes (the kept columns of
      # the refreshing rows, compacted: attention does not care where an entry sits).
      keep = keep_bl & refresh_b[:, None]
      dest = jnp.where(keep, jnp.cumsum(keep, axis=1) - 1, cache.max_len)
      rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, total))
      lengths = cache.length_b
      h_bld, cache = model.forward_hidden(
          seq_bl, positions_bl, cache.replace(length_b=jnp.zeros_like(lengths)), attn_bll,
          write_bt=(rows, dest))
      lengths = jnp.where(refresh_b, keep.sum(axis=1).astype(jnp.int32), lengths)
      return take(h_bld, read_full_bj), cache.replace(length_b=lengths)

    def cached():
      # "prefix": the block and every position after it (a static width of g, padded past
      # the canvas); "dual": the block alone. Both attend to the cache too.
      width = g if spec.mdm_cache == "prefix" else bs
      cols_bu = start_b[:, None] + jnp.arange(width)[None, :]
      live_bu = cols_bu < live_end_b[:, None]
      cols_bu = jnp.minimum(cols_bu, total - 1)
      ids_bu = jnp.where(live_bu, jnp.take_along_axis(seq_bl, cols_bu, axis=1), knobs.pad_id)
      mask_buu = (live_bu[:, None, :] & live_bu[:, :, None]) | jnp.eye(width, dtype=bool)[None]
      h_bud, _, _ = model.forward_hidden(ids_bu, cols_bu.astype(jnp.int32), cache, mask_buu)
      # The block's first position under a shift reads the column before the block,
      # which is not fed: it was decided by the block's full pass (Dream's variant).
      read_bj = jnp.broadcast_to(jnp.maximum(jnp.arange(bs) - shift, 0)[None], (b, bs))
      return take(h_bud, read_bj)

    h_full, cache = jax.lax.cond(refresh_b.any(), full, lambda c: (zeros, c), cache)
    h_cached = jax.lax.cond(cached_b.any(), cached, lambda: zeros)
    h_bjd = jnp.where(refresh_b[:, None, None], h_full, h_cached)
  nfe_b = r.counters.nfe_b()
  keys = jnp.take_along_axis(program_lib.pass_keys(r.key_b2, nfe_b, g, knobs.temperature),
                             blk_gen_bj[:, :, None], axis=1)
  # LLaDA's flags: EOS never drafted; EOS (greedy only) and the stop ids scored 0.
  banned = jnp.stack([knobs.mask_id, jnp.where(knobs.mdm_ban_eos, knobs.eos_id, -1)])
  eos_unscored = jnp.where(knobs.temperature > 0, -1, knobs.eos_id)
  unscored = jnp.where(knobs.mdm_defer_stop,
                       jnp.concatenate([eos_unscored[None], knobs.stop_ids]), -1)
  if spec.mdm_ranking == "confidence":
    stats = heads.token_stats(h_bjd, model.unembed(), jnp.zeros((b, bs), jnp.int32),
                              sample_bt=jnp.ones((b, bs), bool), temperature=knobs.temperature,
                              keys_bt2=keys, banned_id=banned, unscored_ids=unscored,
                              vocab_chunk=spec.vocab_chunk)
    draft_bj, conf_bj = stats.pick_bt, stats.p_pick_bt
  else:  # Dream's samplers: scores under the softmax at the temperature
    stats = heads.sampler_stats(h_bjd, model.unembed(), temperature=knobs.temperature,
                                keys_bt2=keys, banned_id=banned,
                                vocab_chunk=spec.vocab_chunk)
    draft_bj = stats.pick_bt
    conf_bj = {"maskgit_plus": stats.p_pick_bt, "topk_margin": stats.margin_bt,
               "entropy": stats.neg_entropy_bt, "origin": stats.p_pick_bt}[spec.mdm_ranking]
  # Back to response positions (only the block's are ever candidates).
  rows_bj = jnp.broadcast_to(jnp.arange(b)[:, None], (b, bs))
  draft_bg = jnp.zeros((b, g), jnp.int32).at[rows_bj, blk_gen_bj].set(draft_bj)
  conf_bg = jnp.full((b, g), -jnp.inf, conf_bj.dtype).at[rows_bj, blk_gen_bj].set(conf_bj)

  block_of_g = jnp.arange(g) // spec.block_size
  in_block_bg = block_of_g[None, :] == r.block_b[:, None]
  candidate_bg = in_block_bg & ~r.decided_bg & active_b[:, None]
  n = spec.mdm_steps_per_block
  if n and spec.mdm_ranking == "origin":
    p_b = jnp.asarray(schedule_reveal_probs(n))[jnp.minimum(r.block_step_b, n - 1)]
    chosen_bg = candidate_bg & (reveal_uniforms_bg(r.key_b2, nfe_b, g) < p_b[:, None])
  else:
    rank_bg = confidence_rank_bg(conf_bg, candidate_bg)
    if n:  # a schedule: a count per step of the block
      counts = (llada_counts if spec.mdm_schedule == "llada" else schedule_counts)(
          spec.block_size, n)
      count_b = jnp.asarray(counts, jnp.int32)[jnp.minimum(r.block_step_b, n - 1)]
      chosen_bg = candidate_bg & (rank_bg < count_b[:, None])
    else:
      factor_b = factor_counts_b(conf_bg, candidate_bg, rank_bg, knobs.mdm_factor)
      chosen_bg = candidate_bg & jnp.where(
          knobs.mdm_factor > 0, rank_bg < factor_b[:, None],
          jnp.where(knobs.mdm_threshold >= 0, (conf_bg >= knobs.mdm_threshold) | (rank_bg == 0),
                    rank_bg < knobs.mdm_tokens_per_step))
  if spec.mdm_cache and shift:
    # Dream's variant: a block's full first pass decodes its first position only.
    block_start_b = refresh_b & (r.block_step_b == 0)
    first_bg = jnp.arange(g)[None, :] == blk_b[:, None] * bs
    chosen_bg = jnp.where(block_start_b[:, None], candidate_bg & first_bg, chosen_bg)
  gen_bg = jnp.where(chosen_bg, draft_bg, r.gen_bg)
  decided_bg = r.decided_bg | chosen_bg
  commit_step_bg = jnp.where(chosen_bg, r.counters.steps_b[:, None], r.commit_step_bg)
  block_left_b = jnp.any(in_block_bg & ~decided_bg, axis=1)
  next_block_b = active_b & ~block_left_b
  block_b = r.block_b + next_block_b.astype(jnp.int32)
  block_step_b = jnp.where(next_block_b, 0, r.block_step_b + active_b.astype(jnp.int32))
  _, eos_final_b = first_eos_b(gen_bg, decided_bg, knobs)
  done_b = active_b & (eos_final_b | (block_b >= g // spec.block_size))
  counters = r.counters.add(active_b, plan_b=1, steps_b=1).add(
      refresh_b, refresh_b=1).add_step_tpf(active_b, chosen_bg.sum(-1), active_b)
  r = r.replace(phase_b=jnp.where(done_b, DONE, r.phase_b), gen_bg=gen_bg, decided_bg=decided_bg,
                commit_step_bg=commit_step_bg, block_b=block_b, block_step_b=block_step_b,
                counters=counters)
  return State(passes=st.passes + 1, rows=r, cache=cache)


def output(spec: Spec, st: State, knobs: Knobs) -> DecodeOutput:
  r = st.rows
  g = spec.gen_length
  first_b, _ = first_eos_b(r.gen_bg, r.decided_bg, knobs)
  length_b = jnp.minimum(first_b + 1, g).astype(jnp.int32)
  kept_bg = jnp.arange(g)[None, :] < length_b[:, None]
  tokens_bg = jnp.where(kept_bg & r.decided_bg, r.gen_bg, knobs.pad_id)
  commit_step_bg = jnp.where(kept_bg, r.commit_step_bg, -1)
  return DecodeOutput(tokens_bg=tokens_bg, length_b=length_b,
                      counters=r.counters.replace(tokens_b=length_b),
                      commit_step_bg=commit_step_bg)


PROGRAM = program_lib.register(program_lib.Program(
    name="mdm", init=init, admit=admit, step=step, output=output, spec_type=Spec,
    knobs_type=Knobs, pass_widths=widths, canvas_spec=canvas_spec, needs_rng_to_sample=False),
    __name__)


def generate(model, prompt_ids_bp, prompt_len_b, decode_config: DecodeConfig,
             rng=None) -> DecodeOutput:
  """Decodes up to `decode_config.gen_length` tokens after each prompt by unmasking.

  Args:
    model: a bidirectional `Transformer` (ModelConfig.attention == 'bidirectional'; a
      Dream model is read shifted by one, `ModelConfig.shift_logits`).
    prompt_ids_bp: `[B, P]` right-padded prompt ids.
    prompt_len_b: `[B]` real prompt lengths (1..P).
    decode_config: `DecodeConfig` with `method='mdm'`.
    rng: PRNG key (used only when temperature > 0; default key 0).
  """
  return engine.Decoder(model, decode_config, method="mdm").generate(
      prompt_ids_bp, prompt_len_b, rng)


def compiled_programs() -> int:
  """Programs compiled so far by `generate` (tests use it to prove a bucket is reused)."""
  return compiled.compiled_programs()["generate"]
