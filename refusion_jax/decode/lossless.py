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
from refusion_jax.decode.methods import PLAN_FEATURES
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
  # With the selection policy recorded (decode.planner='policy', decode.record): each
  # pass's slots of the window (`plan_slots`), their features and the ones it chose.
  plan_feats_tsf: jax.Array | None = None
  plan_fed_ts: jax.Array | None = None
  plan_chosen_ts: jax.Array | None = None


State = program_lib.State


def widths(spec) -> tuple[int, ...]:
  """A pass feeds the window (the head and `block_size - 1` drafts or masks); a fresh
  pass also a mask behind every draft (module docstring)."""
  w = min(spec.block_size, spec.gen_length)
  return (w, 2 * w)


_CONTEXT = 2  # run_pass's context group: the head, seen by every entry of the pass


def plan_slots(spec) -> int:
  """The slots a window of `block_size` indices can touch (it starts at any index)."""
  w, k = widths(spec)[0], spec.slot_size
  return (w + k - 2) // k + 1


def _empty_rows(spec, b: int, pad) -> Rows:
  zi = jnp.zeros((b,), jnp.int32)
  g = spec.gen_length
  extra = {}
  if spec.plan_policy and spec.record:
    t, n = g + 1, plan_slots(spec)  # a plan per pass: the prefill's and <= g more
    extra = dict(plan_feats_tsf=jnp.zeros((b, t, n, len(PLAN_FEATURES)), jnp.float32),
                 plan_fed_ts=jnp.zeros((b, t, n), bool), plan_chosen_ts=jnp.zeros((b, t, n), bool))
  return Rows(phase_b=zi + FREE, length_b=zi, prompt_len_b=zi,
              key_b2=jnp.zeros((b, 2), jnp.uint32), tokens_bg=jnp.full((b, g), pad, jnp.int32),
              commit_step_bg=jnp.full((b, g), -1, jnp.int32), final_b=zi,
              draft_bg=jnp.zeros((b, g), jnp.int32), has_bg=jnp.zeros((b, g), bool),
              p_bg=jnp.zeros((b, g), jnp.float32), fresh_b=jnp.zeros((b,), bool),
              counters=DecodeCounters.zeros(b), **extra)


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


def admit(model, spec, st: State, ids_ap, lens_a, rows_a, keys_a2, knobs,
          plan=None) -> State:
  """Prefills each prompt with the first window's masks behind it, in one pass: the first
  token is the pick at the prompt's last token, as the AR decoder's (final at once: its
  context is the whole prompt), and the masks give the first drafts."""
  plan = plan or plan_slots_chosen
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
  zero = jnp.zeros((a,), jnp.int32)
  chosen, record = plan(spec, idx_aw > 0, idx_aw, stats.p_pick_bt, stats.pick_bt, zero + 1,
                        keys_a2, zero, knobs)
  fresh = _empty_rows(spec, a, knobs.pad_id)
  fresh = fresh.replace(draft_bg=fresh.draft_bg.at[:, :w].set(stats.pick_bt),
                        has_bg=fresh.has_bg.at[:, :w].set(chosen),
                        **_recorded(fresh, record, zero))
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


def plan_features(spec, mask_w, idx_w, p_w, final_b):
  """`(feats [B, S, F], fed [B, S], in [B, w, S])`: the window's slots (S =
  `plan_slots`, counted from the head's slot) that hold a mask, and each one's
  PLAN_FEATURES, as ReFusion's plan has them: its first mask's probability, the mean of
  its masks', its distance from the leftmost such slot (over S), whether the entry left
  of its first mask is a token (final or a draft), and the share of the answer final."""
  k, n = spec.slot_size, plan_slots(spec)
  g = spec.gen_length
  rel_w = idx_w // k - (idx_w[:, :1] // k)
  in_ws = (rel_w[..., None] == jnp.arange(n)) & mask_w[..., None]
  before = jnp.cumsum(in_ws, axis=1) - in_ws  # masks of the slot at earlier offsets
  first_ws = in_ws & (before == 0)
  fed = in_ws.any(1)
  count = in_ws.sum(1)
  p_first = (first_ws * p_w[..., None]).sum(1)
  p_slot = (in_ws * p_w[..., None]).sum(1) / jnp.maximum(count, 1)
  slot = jnp.arange(n)[None]
  leftmost = jnp.where(fed, slot, n).min(-1, keepdims=True)
  left_mask_w = jnp.concatenate([jnp.zeros_like(mask_w[:, :1]), mask_w[:, :-1]], 1)
  left_token = (first_ws & ~left_mask_w[..., None]).any(1)
  progress = jnp.broadcast_to((final_b / g)[:, None], fed.shape)
  feats = jnp.stack([p_first, p_slot, (slot - leftmost) / n, left_token.astype(jnp.float32),
                     progress], -1)
  return jnp.where(fed[..., None], feats, 0.0).astype(jnp.float32), fed, in_ws


def plan_slots_chosen(spec, mask_w, idx_w, p_w, pick_w, final_b, key_b2, step_b, knobs):
  """`(chosen masks [B, w], record or None)`. The threshold rule (below); with
  the selection policy (decode.planner='policy'), slot s of the window is chosen with
  probability sigmoid(w . f_s + b) over its `plan_features` (drawn with `plan_sample`,
  else above one half), the most likely one when none is: ReFusion's policy and
  `rl.selector`'s likelihood of it. No choice changes an answer, only the passes.
  (`pick_w`, the masks' picks, is what `answer_plan` reads; this rule does not.)"""
  del pick_w
  feats, fed, in_ws = plan_features(spec, mask_w, idx_w, p_w, final_b)
  if not spec.plan_policy:
    # The threshold rule: a slot whose first mask's probability exceeds tau_s, and the
    # leftmost slot holding a mask (distance 0).
    chosen = fed & ((feats[..., 0] > knobs.slot_threshold) | (feats[..., 2] == 0))
    return mask_w & (in_ws & chosen[:, None, :]).any(-1), None
  logit = jnp.where(fed, refusion.policy_logits(feats, knobs.plan_w, knobs.plan_b), -jnp.inf)
  # Slot s draws uniform 1 + s of the pass (the token picks use key 0 of their index).
  u = program_lib.pass_uniforms(key_b2, step_b, 1, fed.shape[1])
  over = fed & jnp.where(knobs.plan_sample, u < jax.nn.sigmoid(logit), logit > 0)
  best = jax.nn.one_hot(jnp.argmax(logit, axis=-1), fed.shape[1], dtype=bool) & fed
  chosen = jnp.where(over.any(-1, keepdims=True), over, best)
  return mask_w & (in_ws & chosen[:, None, :]).any(-1), (feats, fed, chosen)


def answer_plan(answers_bg):
  """A planner that knows the answer (`benchmarks/planner_speed.py`): it keeps exactly
  the masks whose pick is the answer's token at its index, so no pass checks a wrong
  masked draft. A `plan` for `admit` and `step`; rows are the answers' rows."""
  def plan(spec, mask_w, idx_w, p_w, pick_w, final_b, key_b2, step_b, knobs):
    del spec, p_w, final_b, key_b2, step_b, knobs
    return mask_w & (pick_w == _take(answers_bg, idx_w)), None
  return plan


def _recorded(r: Rows, record, at_b) -> dict:
  """The rows' plan record with this pass's (`plan_slots_chosen`) at step `at_b`."""
  if record is None or r.plan_feats_tsf is None:
    return {}
  feats, fed, chosen = record
  at = (jnp.arange(r.plan_fed_ts.shape[1])[None] == at_b[:, None])
  return dict(plan_feats_tsf=jnp.where(at[..., None, None], feats[:, None], r.plan_feats_tsf),
              plan_fed_ts=jnp.where(at[..., None], fed[:, None], r.plan_fed_ts),
              plan_chosen_ts=jnp.where(at[..., None], chosen[:, None], r.plan_chosen_ts))


def step(model, spec, st: State, knobs, plan=None) -> State:
  """One fused pass: check the chain, make final, draft (module docstring); `plan`
  chooses the masks whose draft is kept (`plan_slots_chosen`)."""
  plan = plan or plan_slots_chosen
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
  chosen_w, record = plan(spec, mask_w, idx_bw, mp_w, mpick_w, r.final_b, r.key_b2,
                          r.counters.steps_b, knobs)
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
                  has_bg=has_bg, fresh_b=fresh_b, counters=counters,
                  **_recorded(r, record, jnp.where(active, step_b, -1)))
  return State(passes=st.passes + 1, cache=cache.replace(length_b=length), rows=new)


def output(spec, st: State, knobs) -> DecodeOutput:
  """The final tokens; with `decode.record`, `trace["p"]`: each one's probability under
  the causal softmax(logits / T) that decided it (the AR decoder's distribution, so a
  trajectory's log-probability is its answer's AR log-likelihood at T)."""
  r = st.rows
  g = r.tokens_bg.shape[1]
  within = jnp.arange(g)[None] < r.final_b[:, None]
  trace = dict(p=jnp.where(within, r.p_bg, 1.0)) if spec.record else None
  if trace is not None and r.plan_feats_tsf is not None:
    trace.update(plan_feats=r.plan_feats_tsf, plan_fed=r.plan_fed_ts,
                 plan_chosen=r.plan_chosen_ts)
  return DecodeOutput(tokens_bg=jnp.where(within, r.tokens_bg, knobs.pad_id),
                      length_b=r.final_b, counters=r.counters.replace(tokens_b=r.final_b),
                      commit_step_bg=jnp.where(within, r.commit_step_bg, -1), trace=trace)


# ReFusion's options choose this program for decode.verify='lossless' (their
# `program_module`); it shares ReFusion's Spec and Knobs.
PROGRAM = program_lib.register(program_lib.Program(
    name="refusion-lossless", init=init, admit=admit, step=step, output=output,
    spec_type=refusion.Spec, knobs_type=refusion.Knobs, pass_widths=widths), __name__)
