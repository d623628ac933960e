"""Lossless ReFusion decoding (`decode.verify='lossless'`): the answer of AR decoding.

ALGORITHM.md "Lossless decoding". A token is *final* only once every token to
its left is final and it has passed the causal check with that full context;
everything else is a *draft*. Planning, drafting and checking stay parallel;
only finality goes in position order. Every pass is one fused forward:

    fed in this order, after the row's final context (the KV cache), causal:
      the head     the newest final token (its K/V not cached yet)
      the drafts   every drafted index of the window, in position order
      the masks    every undrafted index of the window, in position order
                   (on a fresh pass, below: every index after the head)

The window is the `block_size` indices from the head on (it slides with the
head; blocks are not decoded one after another). Tokens before masks is the
training layout (clean slots, then masked slots), so a mask sees the context,
the head and every draft, as a masked slot saw every clean one.

From the one pass:

* **check**: the drafts right after the head (the *chain*) are compared, in
  order, with the causal pick at the entry before each (its context is final:
  the cache, the head and the chain's earlier drafts). The longest run that
  matches becomes final with its K/V from this pass; the causal pick after the
  run is final too (the correction of the first mismatch, or the next token
  after the whole chain) and is the new head. Every pass makes >= 1 token
  final, so every row ends within `gen_length` passes.
* **draft** (for the indices after the new head): where the entry on the left
  was a token, its causal pick (a slot's next token given its own prefix: the
  infill of ReFusion, here in the same forward, and Jacobi's update of a draft);
  else, at a mask of a *chosen* slot, the mask's pick (the plan). A slot (its
  `slot_size` indices) is chosen when its first masked token's probability
  exceeds `tau_s`, or when it is the leftmost slot holding a mask. A draft
  with a mask on its left keeps its value.
* **fresh pass**: after a correction every later draft saw the failed token.
  The next pass still checks them, and beside them plans every index of the
  window afresh: a mask at each, seeing the final context, the head and the
  earlier masks only (run_pass's groups: the head is context, the drafts one
  causal group, these masks another). Should that pass correct again, the
  drafts come from the fresh plan alone. A fresh pass is twice as wide.

The pick at every entry is the one AR decoding makes at the same index: the
argmax at temperature 0, else the argmax of logits / T plus Gumbel noise drawn
from the key of the *index* it predicts (`fold_in(fold_in(key, index), 0)`,
the AR decoder's key of that token). A final token is the pick at its index
under its full causal context, so the answer is the AR decoder's answer with
the same rng, token for token, at every temperature (speculative sampling's
guarantee for drafts that are picks: a draft passes with the probability of
its token, and on a mismatch the token is drawn from the rest). Drafts use
the same noise as the check they meet (coupled drafts pass more often); no
choice above changes an answer, only the passes.

Counters: `fused_b` counts the passes (the first token, read from the prefill
as the AR decoder reads it, counts one, so `nfe` compares with AR's `nfe ==
tokens`); `corrected_b` the heads that replaced a failed draft.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from refusion_jax.decode import common, heads, passes
from refusion_jax.decode import program as program_lib
from refusion_jax.decode import refusion
from refusion_jax.decode.counters import DecodeCounters, DecodeOutput
from refusion_jax.decode.program import DONE, FIRST_PHASE, FREE
from refusion_jax.kv_cache import KVCache

DECODE = FIRST_PHASE


@flax.struct.dataclass
class Rows:
  phase_b: jax.Array
  length_b: jax.Array  # live cache entries: the prompt and every final token but the head
  prompt_len_b: jax.Array
  key_b2: jax.Array
  tokens_bg: jax.Array  # final tokens at their index, pad elsewhere
  commit_step_bg: jax.Array  # the pass that made each index final (-1: not final)
  final_b: jax.Array  # F: final tokens (index F - 1 is the head)
  draft_bg: jax.Array  # the draft at each index (meaningful where has_bg)
  has_bg: jax.Array
  p_bg: jax.Array  # each final token's probability under its causal softmax(logits / T)
  fresh_b: jax.Array  # the last pass corrected a draft: this one plans afresh beside them
  counters: DecodeCounters


State = program_lib.State


def widths(spec) -> tuple[int, ...]:
  """A pass feeds the window (the head and `block_size - 1` drafts or masks); a fresh
  pass also a mask behind every draft (module docstring)."""
  w = min(spec.block_size, spec.gen_length)
  return (w, 2 * w)


_CONTEXT = 2  # run_pass's context group: the head, seen by every entry of the pass


def _empty_rows(spec, b: int, pad) -> Rows:
  zi = jnp.zeros((b,), jnp.int32)
  g = spec.gen_length
  return Rows(phase_b=zi + FREE, length_b=zi, prompt_len_b=zi,
              key_b2=jnp.zeros((b, 2), jnp.uint32), tokens_bg=jnp.full((b, g), pad, jnp.int32),
              commit_step_bg=jnp.full((b, g), -1, jnp.int32), final_b=zi,
              draft_bg=jnp.zeros((b, g), jnp.int32), has_bg=jnp.zeros((b, g), bool),
              p_bg=jnp.zeros((b, g), jnp.float32), fresh_b=jnp.zeros((b,), bool),
              counters=DecodeCounters.zeros(b))


def init(model, spec, rows: int, width: int) -> State:
  # The staging area of a pass (after the live entries) never passes index gen_length:
  # a pass feeds at most the indices from the head to the end.
  cache = KVCache.init(model.config, rows, width + spec.gen_length, chunk=spec.kv_chunk)
  pad = 0 if model.config.pad_token_id is None else model.config.pad_token_id
  return State(passes=jnp.zeros((), jnp.int32), cache=cache, rows=_empty_rows(spec, rows, pad))


def index_keys(key_b2, index_bn, temperature) -> jax.Array:
  """`[B, N, 2]` keys of the picks at response indices `index_bn`: the AR decoder's key
  of that token (its pass count is the token's index: `pass_keys(key, index, 1)`)."""
  b, n = index_bn.shape
  keys = program_lib.pass_keys(jnp.repeat(key_b2, n, axis=0), index_bn.reshape(-1), 1,
                               temperature)
  return keys.reshape(b, n, 2)


def admit(model, spec, st: State, ids_ap, lens_a, rows_a, keys_a2, knobs) -> State:
  """Prefills each prompt with the first window's masks behind it, in one pass: the first
  token is the pick at the prompt's last token, as the AR decoder's (final at once: its
  context is the whole prompt), and the masks give the first drafts."""
  a = ids_ap.shape[0]
  w = widths(spec)[0]
  cache, last_ad, tail_amd = common.prefill_rows(
      model, st.cache, ids_ap, lens_a, rows_a,
      tail_ids_am=jnp.broadcast_to(knobs.mask_id, (a, w)))
  ones = jnp.ones((a,), bool)
  idx_aw = jnp.broadcast_to(jnp.arange(w, dtype=jnp.int32)[None], (a, w))
  keys = index_keys(keys_a2, idx_aw, knobs.temperature)
  h = jnp.concatenate([last_ad[:, None], tail_amd[:, 1:]], 1)  # index 0: the causal pick
  stats = heads.token_stats(h, model.unembed(), jnp.zeros((a, w), jnp.int32),
                            sample_bt=jnp.ones((a, w), bool), temperature=knobs.temperature,
                            keys_bt2=keys, vocab_chunk=spec.vocab_chunk, at_temperature=True)
  first = stats.pick_bt[:, 0]
  done = knobs.is_stop(first) | (spec.gen_length <= 1)
  chosen = _chosen_masks(spec, idx_aw > 0, idx_aw, stats.p_pick_bt, knobs)
  fresh = _empty_rows(spec, a, knobs.pad_id)
  fresh = fresh.replace(draft_bg=fresh.draft_bg.at[:, :w].set(stats.pick_bt),
                        has_bg=fresh.has_bg.at[:, :w].set(chosen))
  counters = fresh.counters.add(ones, prefill_b=1, fused_b=1, steps_b=1).add_step_tpf(
      ones, ones, ones)
  fresh = fresh.replace(
      phase_b=jnp.where(done, DONE, DECODE), length_b=lens_a, prompt_len_b=lens_a,
      key_b2=keys_a2, tokens_bg=fresh.tokens_bg.at[:, 0].set(first),
      p_bg=fresh.p_bg.at[:, 0].set(stats.p_pick_bt[:, 0]),
      commit_step_bg=fresh.commit_step_bg.at[:, 0].set(0), final_b=ones.astype(jnp.int32),
      counters=counters)
  return st.replace(cache=cache, rows=program_lib.set_rows(st.rows, fresh, rows_a))


def _take(x_bg, idx_bw):
  return jnp.take_along_axis(x_bg, jnp.clip(idx_bw, 0, x_bg.shape[1] - 1), axis=1)


def _chosen_masks(spec, mask_w, idx_w, p_w, knobs):
  """The masks whose draft is kept: every mask of a chosen slot (module docstring)."""
  slot_w = idx_w // spec.slot_size
  same = slot_w[:, :, None] == slot_w[:, None, :]  # [B, e, e']
  w = mask_w.shape[1]
  earlier = jnp.tril(jnp.ones((w, w), bool), -1)[None]  # e' < e
  first_w = mask_w & ~(same & earlier & mask_w[:, None, :]).any(-1)
  p_first_w = (same & first_w[:, None, :]).astype(p_w.dtype) @ p_w[..., None]
  big = jnp.iinfo(jnp.int32).max
  leftmost_b = jnp.where(mask_w, slot_w, big).min(-1)
  chosen = (p_first_w[..., 0] > knobs.slot_threshold) | (slot_w == leftmost_b[:, None])
  return mask_w & chosen


def step(model, spec, st: State, knobs) -> State:
  """One fused pass: check the chain, make final, draft (module docstring)."""
  r = st.rows
  b, g = r.tokens_bg.shape
  w = widths(spec)[0]
  active = r.phase_b == DECODE
  e_w = jnp.arange(w)
  idx_bw = r.final_b[:, None] - 1 + e_w[None]  # the window: index of offset e
  inside = (idx_bw < g) & active[:, None]
  head_b = _take(r.tokens_bg, r.final_b[:, None] - 1)[:, 0]
  draft_w = _take(r.draft_bg, idx_bw)
  has_w = _take(r.has_bg, idx_bw) & inside & (e_w > 0)[None]
  tok_w = has_w | ((e_w == 0)[None] & inside)
  fresh = r.fresh_b[:, None]
  # Masks: the undrafted offsets; on a fresh pass every offset after the head, seeing
  # only the final context and the earlier masks (a plan that no draft misled).
  mask_w = inside & (e_w > 0)[None] & (fresh | ~tok_w)

  # The layout: the window's token entries (the head, then the drafts, by offset), then
  # its mask entries (by offset); run_pass feeds the fed ones in this order.
  ids = jnp.concatenate([jnp.where(e_w[None] == 0, head_b[:, None], draft_w),
                         jnp.broadcast_to(knobs.mask_id, (b, w))], 1)
  pos = jnp.tile(r.prompt_len_b[:, None] + idx_bw, (1, 2))
  fed = jnp.concatenate([tok_w, mask_w], 1)
  # Groups: the head is context (every entry sees it); the drafts see each other
  # causally; the masks see the drafts too, except on a fresh pass.
  group = jnp.concatenate([jnp.where(e_w[None] == 0, _CONTEXT, 0) + jnp.zeros((b, w), jnp.int32),
                           jnp.broadcast_to(jnp.where(fresh, 1, 0), (b, w))], 1)
  target = jnp.concatenate([idx_bw + 1, idx_bw], 1)  # a token predicts the next index
  dest = jnp.where(fed, r.length_b[:, None] + jnp.cumsum(fed, -1) - 1, -1)
  feed = passes.Feed(fed_bn=fed, ids_bn=ids, positions_bn=pos, group_bn=group, dest_bn=dest,
                     sample_bn=jnp.ones((b, 2 * w), bool))
  keys = index_keys(r.key_b2, jnp.minimum(target, g - 1), knobs.temperature)
  cache, out = passes.run_pass(model, st.cache, feed, widths(spec),
                               temperature=knobs.temperature, keys_bn2=keys,
                               vocab_chunk=spec.vocab_chunk, at_temperature=True,
                               context_group=_CONTEXT)
  pick_w, p_w = out.pick_bn[:, :w], out.p_pick_bn[:, :w]  # token entries
  mpick_w, mp_w = out.pick_bn[:, w:], out.p_pick_bn[:, w:]  # mask entries

  # Check: offset e (1..w-1) of the chain passes when its draft is the pick at e - 1.
  nxt_w = jnp.where(tok_w, pick_w, -1)  # the causal pick for offset e + 1
  prev_w = jnp.concatenate([jnp.full((b, 1), -1, jnp.int32), nxt_w[:, :-1]], 1)
  match_w = has_w & (draft_w == prev_w)
  a_b = jnp.cumprod(match_w[:, 1:], axis=1).sum(-1).astype(jnp.int32)  # drafts made final
  head_new = jnp.take_along_axis(nxt_w, a_b[:, None], axis=1)[:, 0]  # the pick after them
  # New final tokens, at offsets 1..a+1 (offset a+1 may be w: just past the window).
  e_x = jnp.arange(1, w + 1)[None]
  draft_x = jnp.concatenate([draft_w[:, 1:], jnp.zeros((b, 1), jnp.int32)], 1)
  val_x = jnp.where(e_x <= a_b[:, None], draft_x, head_new[:, None])
  idx_x = r.final_b[:, None] - 1 + e_x
  new_x = (e_x <= a_b[:, None] + 1) & (idx_x < g) & active[:, None]
  stop_x = new_x & knobs.is_stop(val_x)
  n_b = jnp.where(stop_x.any(-1), jnp.argmax(stop_x, axis=-1) + 1, new_x.sum(-1))
  n_b = jnp.where(active, n_b, 0).astype(jnp.int32)
  new_x = new_x & (e_x <= n_b[:, None])
  step_b = r.counters.steps_b
  dst_x = jnp.where(new_x, idx_x, g)
  rows_b1 = jnp.arange(b)[:, None]
  tokens = r.tokens_bg.at[rows_b1, dst_x].set(val_x, mode="drop")
  # A new final token at offset e is the pick at offset e - 1 (a token entry).
  p_bg = r.p_bg.at[rows_b1, dst_x].set(p_w, mode="drop")
  commit = r.commit_step_bg.at[rows_b1, dst_x].set(
      jnp.broadcast_to(step_b[:, None], dst_x.shape), mode="drop")
  final = r.final_b + n_b
  done = active & (stop_x.any(-1) | (final >= g))
  corrected = active & (n_b == a_b + 1) & jnp.take_along_axis(
      jnp.concatenate([has_w, jnp.zeros((b, 1), bool)], 1), a_b[:, None] + 1, axis=1)[:, 0]

  # Draft the indices after the new head: offsets a+2..w (offset w: past the window,
  # from the last entry when it was a token).
  chosen_w = _chosen_masks(spec, mask_w, idx_bw, mp_w, knobs)
  shift = lambda x, fill: jnp.concatenate([x[:, 1:], jnp.full((b, 1), fill, x.dtype)], 1)
  mask_x, mp_x, has_x = shift(chosen_w, False), shift(mpick_w, 0), shift(has_w, False)
  # A causal pick after a token (its slot's next token); after a correction on a fresh
  # pass, the fresh plan alone (every causal pick there saw the failed draft).
  jac_x = tok_w & ~(corrected & r.fresh_b)[:, None]
  d_has = jac_x | mask_x | has_x
  d_val = jnp.where(jac_x, pick_w, jnp.where(mask_x, mp_x, draft_x))
  redraft = (e_x >= a_b[:, None] + 2) & (idx_x < g) & active[:, None] & ~done[:, None]
  dst_d = jnp.where(redraft, idx_x, g)
  draft_bg = r.draft_bg.at[rows_b1, dst_d].set(d_val, mode="drop")
  has_bg = r.has_bg.at[rows_b1, dst_d].set(d_has, mode="drop")
  # After a correction every later draft saw the failed token: the next pass checks them
  # beside a fresh plan (a fresh pass's own correction drafts from its plan at once).
  fresh_b = active & corrected & ~r.fresh_b

  counters = r.counters.add(active, fused_b=1, steps_b=1, corrected_b=corrected).add_step_tpf(
      active, n_b, active)
  # The head and the drafts made final keep the K/V of this pass (fed first, in order).
  length = r.length_b + jnp.where(active, a_b + 1, 0)
  new = r.replace(phase_b=jnp.where(done, DONE, r.phase_b), length_b=length, tokens_bg=tokens,
                  p_bg=p_bg, commit_step_bg=commit, final_b=final, draft_bg=draft_bg,
                  has_bg=has_bg, fresh_b=fresh_b, counters=counters)
  return State(passes=st.passes + 1, cache=cache.replace(length_b=length), rows=new)


def output(spec, st: State, knobs) -> DecodeOutput:
  """The final tokens; with `decode.record`, `trace["p"]`: each one's probability under
  the causal softmax(logits / T) that decided it (the AR decoder's distribution, so a
  trajectory's log-probability is its answer's AR log-likelihood at T)."""
  r = st.rows
  g = r.tokens_bg.shape[1]
  within = jnp.arange(g)[None] < r.final_b[:, None]
  trace = dict(p=jnp.where(within, r.p_bg, 1.0)) if spec.record else None
  return DecodeOutput(tokens_bg=jnp.where(within, r.tokens_bg, knobs.pad_id),
                      length_b=r.final_b, counters=r.counters.replace(tokens_b=r.final_b),
                      commit_step_bg=jnp.where(within, r.commit_step_bg, -1), trace=trace)


# ReFusion's options choose this program for decode.verify='lossless' (their
# `program_module`); it shares ReFusion's Spec and Knobs.
PROGRAM = program_lib.register(program_lib.Program(
    name="refusion-lossless", init=init, admit=admit, step=step, output=output,
    spec_type=refusion.Spec, knobs_type=refusion.Knobs, pass_widths=widths), __name__)
