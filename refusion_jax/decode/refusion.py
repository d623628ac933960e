"""ReFusion's iterative plan-and-infill decoder as one jitted program.

ALGORITHM.md "Decoding: iterative plan-and-infill", with its "Deliberate
differences": fixed shapes (every pass feeds the whole current block as a
`[B, block_size]` chunk; undecided, unchosen and finished parts are masked,
never sliced out), one compiled program per static shape configuration, one
shared KV cache (the infill's per-slot independence is a block-diagonal
chunk mask, not a cache copy per slot), EOS found during infill drops only
the chosen slots *after* it, and every forward pass is counted.

Per row the program keeps: the current block, which of its slots are
decided (committed, or removed after an EOS), and whether an EOS has been
committed. One step of the outer `lax.while_loop` is one plan pass, one
global-verification pass, an optional infill (an inner `lax.while_loop` of
draft/verify rounds) and one cache commit. Finished rows are frozen.

Thresholds, temperature, the special token ids and `recompute_kv` are traced
scalars, so a threshold sweep (or reuse vs recompute) reuses one compiled
program; shapes (batch, prompt length, gen_length, slot and block size),
whether to sample and `left_to_right` are static.

Temperature: the plan step is the one place the spec samples ("argmax, with
Gumbel noise when temperature > 0"); infill drafts are argmax as specified,
and every probability compared with a threshold is read from the un-noised
softmax.

Two ablations of the paper are flags of `DecodeConfig`:

`recompute_kv` (the paper's Table 8). After a step whose parallel infill
commits two or more slots, one extra forward pass feeds exactly the committed
tokens (each slot cut after EOS as usual) in position order after the
committed context, with causal attention among them, and its KV entries are
committed instead of the infill's (whose slots saw only the context and
themselves). Commits from global verification are causal already, and so is
an infill commit of a single slot (it saw the context and itself, which is
all that precedes it): neither is recomputed. Each recomputation pass counts
one `recompute_b` (part of `nfe_b`). Afterwards every cache entry is the KV of
a causal run over the committed tokens in commit order.

`left_to_right` (ReFusion used as a plain AR model). Slots are decoded
strictly in position order, one slot per outer step, over the whole response
(blocks and both thresholds play no part; the order is the same). A slot's
first token comes from a plan pass: the slot's `k` mask tokens at their
positions after the committed context. Each further token is the next-token
prediction of a causal pass over the slot's tokens so far; a pass feeds only
the newest token (its predecessors' KV are in the cache already) and commits
its KV. The slot's last token is fed, and its KV committed, by the next
slot's plan pass (the chunk is that token followed by the masks, causal), so
every token costs exactly one pass: `plan_b` per slot, `verify_b` per further
token, `nfe_b == tokens_b`. Drafting and verification never happen. An EOS
ends the text at once (nothing after it is generated). With temperature > 0
every token is drawn with Gumbel noise, as a sampling AR model would.
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp

from refusion_jax import masks
from refusion_jax.config import DecodeConfig
from refusion_jax.decode import common
from refusion_jax.decode.counters import DecodeCounters, DecodeOutput
from refusion_jax.kv_cache import KVCache


@dataclasses.dataclass(frozen=True)
class _Static:
  """What the compiled program depends on besides array shapes."""

  gen_length: int
  slot_size: int
  block_size: int
  sample: bool  # temperature > 0: Gumbel noise in the plan step (every token left to right)
  left_to_right: bool = False  # ablation: one slot per step, one token per pass


@flax.struct.dataclass
class _Knobs:
  """Traced scalars (changing them does not recompile)."""

  slot_threshold: jax.Array
  token_threshold: jax.Array
  temperature: jax.Array
  mask_id: jax.Array
  eos_id: jax.Array  # -1 when the model has no EOS: never matches a token
  pad_id: jax.Array
  # Ablation flag (bool scalar): traced, so that reuse vs recompute is one program;
  # when it is off the recomputation's cond never runs its pass.
  recompute_kv: jax.Array


@flax.struct.dataclass
class _State:
  """Carry of the outer loop (one iteration = one plan-and-infill step)."""

  cache: KVCache
  tokens_bg: jax.Array  # committed tokens at their generated position, pad elsewhere
  commit_step_bg: jax.Array  # step at which each position was committed, -1 never
  block_b: jax.Array  # current block per row
  decided_bs: jax.Array  # slots of the current block committed or removed
  eos_b: jax.Array  # an EOS was committed: no block after the current one
  done_b: jax.Array
  counters: DecodeCounters
  rng: jax.Array
  step: jax.Array  # scalar loop counter


@flax.struct.dataclass
class _Infill:
  """Carry of the infill rounds of one step."""

  tokens_bt: jax.Array  # the chosen slots' current tokens (block chunk layout)
  accepted_bt: jax.Array  # per slot, always a prefix of the slot
  chosen_bs: jax.Array
  removed_bs: jax.Array  # slots after an EOS found during infill
  eos_b: jax.Array
  k_lbtkh: jax.Array  # KV of the last verify pass
  v_lbtkh: jax.Array
  counters: DecodeCounters
  round: jax.Array


def _first_true(x_bn: jax.Array) -> jax.Array:
  """Index of the first True along the last axis (its length when none)."""
  n = x_bn.shape[-1]
  return jnp.where(x_bn.any(-1), jnp.argmax(x_bn, axis=-1), n)


def _ar_prob_bt(logits_btv: jax.Array, tokens_bt: jax.Array) -> jax.Array:
  """Probability of token i under the logits at i-1 (1.0 at i = 0).

  Callers only read it where i-1 is in the same slot: the first token of a
  slot is accepted unconditionally, so the cross-slot value is never used.
  """
  probs_btv = jax.nn.softmax(logits_btv[:, :-1].astype(jnp.float32), axis=-1)
  p = jnp.take_along_axis(probs_btv, tokens_bt[:, 1:, None], axis=-1)[..., 0]
  return jnp.concatenate([jnp.ones_like(p[:, :1]), p], axis=1)


def _prefix_within_slot(ok_bt: jax.Array, slot_size: int) -> jax.Array:
  """True up to (excluding) the first False of each slot."""
  b, t = ok_bt.shape
  ok_bsk = ok_bt.reshape(b, t // slot_size, slot_size)
  return (jnp.cumprod(ok_bsk.astype(jnp.int32), axis=-1) > 0).reshape(b, t)


def _decode(graphdef, state, prompt_ids_bp, prompt_len_b, knobs: _Knobs, rng,
            static: _Static) -> tuple[DecodeOutput, KVCache]:
  model = common.merge_model(graphdef, state)
  b, p = prompt_ids_bp.shape
  g, k, blk = static.gen_length, static.slot_size, static.block_size
  # The static KV buffer (P + gen_length entries per row) is created inside the
  # program: no host-side zeros are built or transferred, and since the buffer is
  # not an output there would be nothing for a donated input to alias.
  cache = common.init_cache(model.config, b, p + g)
  n_slots, n_blocks = blk // k, g // blk
  arange_t = jnp.arange(blk)
  slot_t = arange_t // k  # slot of each chunk entry
  first_t = (arange_t % k) == 0  # first token of its slot
  rows_b1 = jnp.arange(b)[:, None]

  cache, _ = common.prefill(model, cache, prompt_ids_bp, prompt_len_b)
  counters = DecodeCounters.zeros(b).add(jnp.ones((b,), bool), prefill_b=1)

  def per_token(x_bs):
    return x_bs[:, slot_t]

  def step_fn(s: _State) -> _State:
    active_b = ~s.done_b
    canvas_bt = s.block_b[:, None] * blk + arange_t[None]  # index into the generated area
    positions_bt = prompt_len_b[:, None] + canvas_bt
    counters = s.counters

    # 1. Plan: every undecided slot as mask tokens, causal among themselves.
    undecided_bs = ~s.decided_bs
    mask_ids_bt = jnp.full((b, blk), knobs.mask_id, jnp.int32)
    plan_logits_btv, _, _ = model.forward_chunk(
        mask_ids_bt, positions_bt, s.cache, masks.subset_causal_btt(per_token(undecided_bs)))
    plan_logits_btv = plan_logits_btv.astype(jnp.float32)
    rng = s.rng
    if static.sample:
      rng, noise_key = jax.random.split(rng)
      gumbel_btv = jax.random.gumbel(noise_key, plan_logits_btv.shape, jnp.float32)
      draft_bt = jnp.argmax(plan_logits_btv / knobs.temperature + gumbel_btv, axis=-1)
    else:
      draft_bt = jnp.argmax(plan_logits_btv, axis=-1)
    draft_bt = draft_bt.astype(jnp.int32)
    # The draft's probability is read from the un-noised distribution.
    draft_p_bt = jnp.take_along_axis(
        jax.nn.softmax(plan_logits_btv, axis=-1), draft_bt[..., None], axis=-1)[..., 0]
    # A slot's score is the probability of its FIRST token only.
    score_bs = jnp.where(undecided_bs, draft_p_bt[:, ::k], -1.0)
    over_bs = undecided_bs & (score_bs > knobs.slot_threshold)
    # If no slot exceeds tau_s, the single best undecided slot is chosen.
    best_bs = jax.nn.one_hot(jnp.argmax(score_bs, axis=-1), n_slots, dtype=bool)
    chosen_bs = jnp.where(over_bs.any(-1, keepdims=True), over_bs, best_bs)
    chosen_bt = per_token(chosen_bs)
    counters = counters.add(active_b, plan_b=1)

    # 2. Global verification: the chosen drafts, in position order, form one causal
    # sequence after the committed context (the mask hides unchosen slots).
    gv_logits_btv, gv_k, gv_v = model.forward_chunk(
        draft_bt, positions_bt, s.cache, masks.subset_causal_btt(chosen_bt))
    counters = counters.add(active_b, global_verify_b=1)
    # In the concatenation, token j's predecessor is chunk entry j-1 whenever j is not
    # the first token of its slot; first tokens are accepted unconditionally.
    ar_p_bt = _ar_prob_bt(gv_logits_btv, draft_bt)
    accepted_bt = first_t[None] | (ar_p_bt > knobs.token_threshold)
    first_reject_b = _first_true(chosen_bt & ~accepted_bt)
    # Longest accepted prefix of the concatenation (chunk order = position order).
    prefix_bt = chosen_bt & (arange_t[None] < first_reject_b[:, None])
    eos_bt = draft_bt == knobs.eos_id
    gv_eos_b = (prefix_bt & eos_bt).any(-1)
    gv_first_eos_b = _first_true(prefix_bt & eos_bt)
    whole_bs = chosen_bs & (prefix_bt | ~chosen_bt).reshape(b, n_slots, k).all(-1)
    gv_whole_b = ~gv_eos_b & whole_bs.any(-1)
    infill_b = active_b & ~gv_eos_b & ~gv_whole_b

    # EOS in the prefix: commit the chosen slots up to and including the EOS token;
    # every slot at or after the EOS slot is removed; earlier undecided ones remain.
    slot_s = jnp.arange(n_slots)[None]
    gv_eos_slot_b1 = (gv_first_eos_b // k)[:, None]
    keep_eos_bt = chosen_bt & (arange_t[None] <= gv_first_eos_b[:, None])
    decided_eos_bs = (s.decided_bs | (chosen_bs & (slot_s < gv_eos_slot_b1))
                      | (slot_s >= gv_eos_slot_b1))
    # Whole leading chosen slots: committed with this pass's KV; the rest go back.
    keep_whole_bt = per_token(whole_bs)
    decided_whole_bs = s.decided_bs | whole_bs

    # 3. Parallel infill of all chosen slots. Every chosen slot starts from its own
    # accepted prefix read from the global-verification pass: its first token, then
    # each next token while its AR probability there exceeds tau_t (for later slots
    # those probabilities saw the earlier chosen drafts, as the release uses them).
    # The mask is block-diagonal, so slots dropped after an EOS may keep being fed:
    # no other slot ever sees them.
    slot_mask_btt = masks.slot_local_btt(chosen_bt, k)

    def infill_pending_bt(c: _Infill):
      return per_token(c.chosen_bs) & ~c.accepted_bt

    def infill_cond(c: _Infill):
      return (c.round < k) & (infill_b & infill_pending_bt(c).any(-1)).any()

    def infill_round(c: _Infill) -> _Infill:
      pending_bt = infill_pending_bt(c)
      run_b = infill_b & pending_bt.any(-1)
      chosen_bt = per_token(c.chosen_bs)
      # a. Draft: unaccepted tokens become masks; each takes the argmax at its position.
      draft_in_bt = jnp.where(c.accepted_bt, c.tokens_bt, knobs.mask_id)
      d_logits_btv, _, _ = model.forward_chunk(draft_in_bt, positions_bt, s.cache,
                                               slot_mask_btt)
      filled_bt = jnp.where(pending_bt, jnp.argmax(d_logits_btv, -1).astype(jnp.int32),
                            c.tokens_bt)
      # b. Verify: accepted stays accepted; the first unaccepted token is accepted;
      # later ones while their AR probability exceeds tau_t (a prefix per slot).
      v_logits_btv, v_k, v_v = model.forward_chunk(filled_bt, positions_bt, s.cache,
                                                   slot_mask_btt)
      v_ar_p_bt = _ar_prob_bt(v_logits_btv, filled_bt)
      first_pending_bs = _first_true(pending_bt.reshape(b, n_slots, k))
      offset_t = arange_t % k
      is_first_pending_bt = offset_t[None] == per_token(first_pending_bs)
      ok_bt = c.accepted_bt | is_first_pending_bt | (v_ar_p_bt > knobs.token_threshold)
      new_accepted_bt = _prefix_within_slot(ok_bt, k)
      # c. EOS among accepted tokens: keep the chosen slots up to the first such slot
      # by position, mark it fully accepted, drop (remove) every later slot. Undecided
      # slots before it stay undecided and are still decoded.
      eos_slot_bs = c.chosen_bs & (new_accepted_bt & chosen_bt & (filled_bt == knobs.eos_id)
                                  ).reshape(b, n_slots, k).any(-1)
      has_eos_b = eos_slot_bs.any(-1)
      eos_slot_b = jnp.where(has_eos_b, jnp.argmax(eos_slot_bs, -1), n_slots)
      after_bs = slot_s > eos_slot_b[:, None]
      new_chosen_bs = c.chosen_bs & ~after_bs
      new_removed_bs = c.removed_bs | after_bs
      new_accepted_bt = new_accepted_bt | per_token(slot_s == eos_slot_b[:, None])
      # Rows without pending tokens (or not in infill) are frozen.
      run_b1, run_lb111 = run_b[:, None], run_b[None, :, None, None, None]
      return _Infill(
          tokens_bt=jnp.where(run_b1, filled_bt, c.tokens_bt),
          accepted_bt=jnp.where(run_b1, new_accepted_bt, c.accepted_bt),
          chosen_bs=jnp.where(run_b1, new_chosen_bs, c.chosen_bs),
          removed_bs=jnp.where(run_b1, new_removed_bs, c.removed_bs),
          eos_b=c.eos_b | (run_b & has_eos_b),
          k_lbtkh=jnp.where(run_lb111, v_k, c.k_lbtkh),
          v_lbtkh=jnp.where(run_lb111, v_v, c.v_lbtkh),
          counters=c.counters.add(run_b, draft_b=1, verify_b=1),
          round=c.round + 1)

    infill = jax.lax.while_loop(infill_cond, infill_round, _Infill(
        tokens_bt=draft_bt,
        accepted_bt=chosen_bt & _prefix_within_slot(accepted_bt, k),
        chosen_bs=chosen_bs,
        removed_bs=jnp.zeros_like(chosen_bs),
        eos_b=jnp.zeros((b,), bool),
        k_lbtkh=gv_k, v_lbtkh=gv_v,
        counters=counters,
        round=jnp.zeros((), jnp.int32)))
    counters = infill.counters
    # 4. Commit the chosen slots in position order, cut after the first EOS (kept).
    in_chosen_bt = per_token(infill.chosen_bs)
    in_first_eos_b = _first_true(in_chosen_bt & (infill.tokens_bt == knobs.eos_id))
    keep_infill_bt = in_chosen_bt & (arange_t[None] <= in_first_eos_b[:, None])
    decided_infill_bs = s.decided_bs | infill.chosen_bs | infill.removed_bs

    gv_eos_b1, gv_whole_b1 = gv_eos_b[:, None], gv_whole_b[:, None]
    keep_bt = active_b[:, None] & jnp.where(
        gv_eos_b1, keep_eos_bt, jnp.where(gv_whole_b1, keep_whole_bt, keep_infill_bt))
    decided_bs = jnp.where(gv_eos_b1, decided_eos_bs,
                           jnp.where(gv_whole_b1, decided_whole_bs, decided_infill_bs))
    decided_bs = jnp.where(active_b[:, None], decided_bs, s.decided_bs)
    # Ablation (recompute_kv): an infill that commits two or more slots left KV in
    # which each slot saw only the context and itself; one causal pass over exactly
    # the committed tokens (position order, after the context) gives a causal run's.
    infill_slots_b = keep_infill_bt.reshape(b, n_slots, k).any(-1).sum(-1)
    recompute_rows_b = knobs.recompute_kv & infill_b & (infill_slots_b >= 2)

    def recompute(_):
      _, r_k, r_v = model.forward_chunk(infill.tokens_bt, positions_bt, s.cache,
                                        masks.subset_causal_btt(keep_infill_bt))
      return r_k, r_v

    # A cond, not a masked pass: steps where no row needs it cost nothing.
    infill_k, infill_v = jax.lax.cond(recompute_rows_b.any(), recompute,
                                      lambda _: (infill.k_lbtkh, infill.v_lbtkh), None)
    use_r = recompute_rows_b[None, :, None, None, None]
    infill_k = jnp.where(use_r, infill_k, infill.k_lbtkh)
    infill_v = jnp.where(use_r, infill_v, infill.v_lbtkh)
    counters = counters.add(recompute_rows_b, recompute_b=1)
    use_infill = infill_b[None, :, None, None, None]
    commit_k = jnp.where(use_infill, infill_k, gv_k)
    commit_v = jnp.where(use_infill, infill_v, gv_v)
    commit_tokens_bt = jnp.where(infill_b[:, None], infill.tokens_bt, draft_bt)
    cache = s.cache.commit(commit_k, commit_v, positions_bt, keep_bt)
    tokens_bg = s.tokens_bg.at[rows_b1, canvas_bt].set(
        jnp.where(keep_bt, commit_tokens_bt, s.tokens_bg[rows_b1, canvas_bt]))
    commit_step_bg = s.commit_step_bg.at[rows_b1, canvas_bt].set(
        jnp.where(keep_bt, s.step, s.commit_step_bg[rows_b1, canvas_bt]))
    eos_b = s.eos_b | (active_b & (gv_eos_b | infill.eos_b))

    # A finished block moves the row to the next one, unless an EOS ended the text
    # (later blocks are never generated) or it was the last block.
    block_done_b = active_b & decided_bs.all(-1)
    finish_b = block_done_b & (eos_b | (s.block_b == n_blocks - 1))
    advance_b = block_done_b & ~finish_b
    counters = counters.add(active_b, steps_b=1)
    counters = counters.add_step_tpf(active_b, keep_bt.sum(-1),
                                     counters.nfe_b() - s.counters.nfe_b())
    return _State(
        cache=cache,
        tokens_bg=tokens_bg,
        commit_step_bg=commit_step_bg,
        block_b=s.block_b + advance_b.astype(jnp.int32),
        decided_bs=jnp.where(advance_b[:, None], False, decided_bs),
        eos_b=eos_b,
        done_b=s.done_b | finish_b,
        counters=counters,
        rng=rng,
        step=s.step + 1)

  # Every step decides at least one slot, so the slot count bounds the loop.
  max_steps = g // k

  def outer_cond(s: _State):
    return (~s.done_b).any() & (s.step < max_steps)

  if static.left_to_right:
    final = _left_to_right(model, cache, prompt_len_b, knobs, rng, counters, static)
  else:
    final = jax.lax.while_loop(outer_cond, step_fn, _State(
        cache=cache,
        tokens_bg=jnp.full((b, g), knobs.pad_id, jnp.int32),
        commit_step_bg=jnp.full((b, g), -1, jnp.int32),
        block_b=jnp.zeros((b,), jnp.int32),
        decided_bs=jnp.zeros((b, n_slots), bool),
        eos_b=jnp.zeros((b,), bool),
        done_b=jnp.zeros((b,), bool),
        counters=counters,
        rng=rng,
        step=jnp.zeros((), jnp.int32)))

  # The text is the committed tokens by position, ending at the first EOS. Every
  # position before it is committed (earlier slots are always decoded), so the
  # useful token count is the length itself; tokens committed past it (an EOS
  # later found in an earlier slot) are not counted.
  committed_bg = final.commit_step_bg >= 0
  eos_at_bg = committed_bg & (final.tokens_bg == knobs.eos_id)
  length_b = jnp.where(eos_at_bg.any(-1), _first_true(eos_at_bg) + 1, g).astype(jnp.int32)
  within_bg = jnp.arange(g)[None] < length_b[:, None]
  tokens_bg = jnp.where(within_bg & committed_bg, final.tokens_bg, knobs.pad_id)
  commit_step_bg = jnp.where(within_bg, final.commit_step_bg, -1)
  counters = final.counters.replace(
      tokens_b=(within_bg & committed_bg).sum(-1).astype(jnp.int32))
  output = DecodeOutput(tokens_bg=tokens_bg, length_b=length_b, counters=counters,
                        commit_step_bg=commit_step_bg)
  # The final cache is returned for tests of its contents; `generate` drops it (it
  # is the loop's carry, in memory anyway).
  return output, final.cache


def _pick_bv(logits_bv: jax.Array, key: jax.Array, temperature: jax.Array,
             sample: bool) -> jax.Array:
  """Argmax, with Gumbel noise at `temperature` when sampling (a categorical draw)."""
  logits_bv = logits_bv.astype(jnp.float32)
  if sample:
    logits_bv = logits_bv / temperature + jax.random.gumbel(key, logits_bv.shape, jnp.float32)
  return jnp.argmax(logits_bv, axis=-1).astype(jnp.int32)


@flax.struct.dataclass
class _LeftToRight:
  """Carry of the left-to-right ablation (one iteration = one slot per row)."""

  cache: KVCache
  tokens_bg: jax.Array
  commit_step_bg: jax.Array
  done_b: jax.Array
  counters: DecodeCounters
  rng: jax.Array
  step: jax.Array  # scalar; every active row decodes slot `step` of the response


@flax.struct.dataclass
class _ArPass:
  """Carry of the one-token AR passes that extend the current slot."""

  cache: KVCache
  tokens_bg: jax.Array
  commit_step_bg: jax.Array
  run_b: jax.Array  # rows still extending the slot
  eos_b: jax.Array  # the slot produced an EOS
  counters: DecodeCounters
  rng: jax.Array
  offset: jax.Array  # scalar: slot offset of the newest token, the one fed next


def _left_to_right(model, cache: KVCache, prompt_len_b, knobs: _Knobs, rng,
                   counters: DecodeCounters, static: _Static) -> _LeftToRight:
  """The `left_to_right` ablation (module docstring): one slot per outer step."""
  b = prompt_len_b.shape[0]
  g, k = static.gen_length, static.slot_size
  n_slots = g // k
  chunk_c = jnp.arange(k + 1)

  def write(tokens_bg, commit_step_bg, index, new_b, keep_b, step):
    tokens_bg = tokens_bg.at[:, index].set(jnp.where(keep_b, new_b, tokens_bg[:, index]))
    commit_step_bg = commit_step_bg.at[:, index].set(
        jnp.where(keep_b, step, commit_step_bg[:, index]))
    return tokens_bg, commit_step_bg

  def slot_fn(s: _LeftToRight) -> _LeftToRight:
    active_b = ~s.done_b
    start = s.step * k  # the slot's first index in the generated area
    # Plan: the previous slot's last token (not yet fed, so not in the cache), then the
    # slot as masks, causal. Only that token's KV is kept; the masks' are discarded.
    feeds_prev_b = active_b & (s.step > 0)
    prev_b = s.tokens_bg[:, jnp.maximum(start - 1, 0)]
    ids_bc = jnp.concatenate(
        [prev_b[:, None], jnp.full((b, k), knobs.mask_id, jnp.int32)], axis=1)
    positions_bc = prompt_len_b[:, None] + start - 1 + chunk_c[None]
    member_bc = jnp.concatenate([feeds_prev_b[:, None], jnp.ones((b, k), bool)], axis=1)
    logits_bcv, k_lbckh, v_lbckh = model.forward_chunk(
        ids_bc, positions_bc, s.cache, masks.subset_causal_btt(member_bc))
    cache = s.cache.commit(k_lbckh, v_lbckh, positions_bc, member_bc & (chunk_c == 0)[None])
    rng, key = jax.random.split(s.rng)
    first_b = _pick_bv(logits_bcv[:, 1], key, knobs.temperature, static.sample)
    tokens_bg, commit_step_bg = write(s.tokens_bg, s.commit_step_bg, start, first_b, active_b,
                                      s.step)
    first_eos_b = active_b & (first_b == knobs.eos_id)

    # AR: feed the newest token, commit its KV, read the next token at its position.
    def ar_pass(c: _ArPass) -> _ArPass:
      positions_b1 = prompt_len_b[:, None] + start + c.offset
      newest_b1 = c.tokens_bg[:, start + c.offset][:, None]
      logits_b1v, k_lb1kh, v_lb1kh = model.forward_chunk(
          newest_b1, positions_b1, c.cache, jnp.ones((b, 1, 1), bool))
      cache = c.cache.commit(k_lb1kh, v_lb1kh, positions_b1, c.run_b[:, None])
      rng, key = jax.random.split(c.rng)
      next_b = _pick_bv(logits_b1v[:, 0], key, knobs.temperature, static.sample)
      tokens_bg, commit_step_bg = write(c.tokens_bg, c.commit_step_bg, start + c.offset + 1,
                                        next_b, c.run_b, s.step)
      eos_now_b = c.run_b & (next_b == knobs.eos_id)
      return _ArPass(cache=cache, tokens_bg=tokens_bg, commit_step_bg=commit_step_bg,
                     run_b=c.run_b & ~eos_now_b & (c.offset + 2 < k),
                     eos_b=c.eos_b | eos_now_b,
                     counters=c.counters.add(c.run_b, verify_b=1),
                     rng=rng, offset=c.offset + 1)

    ar = jax.lax.while_loop(lambda c: c.run_b.any(), ar_pass, _ArPass(
        cache=cache, tokens_bg=tokens_bg, commit_step_bg=commit_step_bg,
        run_b=active_b & ~first_eos_b & (k > 1), eos_b=first_eos_b,
        counters=s.counters.add(active_b, plan_b=1, steps_b=1),
        rng=rng, offset=jnp.zeros((), jnp.int32)))
    finish_b = active_b & (ar.eos_b | (s.step == n_slots - 1))
    # Every token of the slot cost one pass (its first one the plan).
    slot_passes_b = ar.counters.nfe_b() - s.counters.nfe_b()
    counters = ar.counters.add_step_tpf(active_b, slot_passes_b, slot_passes_b)
    return _LeftToRight(cache=ar.cache, tokens_bg=ar.tokens_bg,
                        commit_step_bg=ar.commit_step_bg, done_b=s.done_b | finish_b,
                        counters=counters, rng=ar.rng, step=s.step + 1)

  return jax.lax.while_loop(
      lambda s: (~s.done_b).any() & (s.step < n_slots), slot_fn, _LeftToRight(
          cache=cache,
          tokens_bg=jnp.full((b, g), knobs.pad_id, jnp.int32),
          commit_step_bg=jnp.full((b, g), -1, jnp.int32),
          done_b=jnp.zeros((b,), bool),
          counters=counters,
          rng=rng,
          step=jnp.zeros((), jnp.int32)))


_decode_jit = jax.jit(_decode, static_argnames=("graphdef", "static"))


def compiled_cache_size() -> int:
  """Programs compiled so far by `generate` (one per static config and shapes)."""
  return _decode_jit._cache_size()


def validate(model_config, decode_config: DecodeConfig, prompt_len: int) -> None:
  """Every check that can fail, run in Python before anything is traced."""
  if not isinstance(decode_config, DecodeConfig):
    raise TypeError(f"decode_config must be a DecodeConfig, got {type(decode_config).__name__}")
  if decode_config.method != "refusion":
    raise ValueError(
        f"decode.method={decode_config.method!r}: refusion.generate only runs 'refusion'")
  # `replace()` re-runs DecodeConfig's own field checks (block multiple of slot,
  # gen_length multiple of block, thresholds in [0, 1], ...), even on an instance
  # whose fields were altered after construction.
  decode_config.replace()
  decode_config.check_fits(model_config, prompt_len)


def generate(model, prompt_ids_bp, prompt_len_b, decode_config: DecodeConfig,
             rng: jax.Array | None = None) -> DecodeOutput:
  """Decodes right-padded prompts `[B, P]` with ReFusion's plan-and-infill.

  Generated position i of row b has position id `prompt_len_b[b] + i`. The
  mask, EOS and pad ids come from `model.config`. `rng` is required when
  `decode_config.temperature > 0`. `decode_config.left_to_right` and
  `recompute_kv` select the ablations of the module docstring.
  """
  return _generate_with_cache(model, prompt_ids_bp, prompt_len_b, decode_config, rng)[0]


def _generate_with_cache(model, prompt_ids_bp, prompt_len_b, decode_config: DecodeConfig,
                         rng: jax.Array | None = None) -> tuple[DecodeOutput, KVCache]:
  """`generate`, plus the final KV cache (entries in commit order), for tests.

  Same compiled program as `generate`.
  """
  config = model.config
  ids_bp, lens_b = common.checked_prompts(model, prompt_ids_bp, prompt_len_b, decode_config,
                                         validate)
  sample = decode_config.temperature > 0
  if rng is None:
    if sample:
      raise ValueError(f"decode.temperature={decode_config.temperature} > 0 needs an rng key")
    rng = jax.random.PRNGKey(0)
  knobs = _Knobs(
      slot_threshold=jnp.float32(decode_config.slot_threshold),
      token_threshold=jnp.float32(decode_config.token_threshold),
      temperature=jnp.float32(decode_config.temperature if sample else 1.0),
      mask_id=jnp.int32(config.mask_token_id),
      eos_id=jnp.int32(-1 if config.eos_token_id is None else config.eos_token_id),
      pad_id=jnp.int32(0 if config.pad_token_id is None else config.pad_token_id),
      recompute_kv=jnp.bool_(decode_config.recompute_kv))
  # Left to right, blocks play no part: one program serves every block size.
  block_size = (decode_config.gen_length if decode_config.left_to_right
                else decode_config.block_size)
  static = _Static(gen_length=decode_config.gen_length, slot_size=decode_config.slot_size,
                   block_size=block_size, sample=sample,
                   left_to_right=decode_config.left_to_right)
  graphdef, state = common.split_model(model)
  return _decode_jit(graphdef, state, jnp.asarray(ids_bp), jnp.asarray(lens_b), knobs, rng,
                     static=static)
