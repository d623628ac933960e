"""ReFusion's iterative plan-and-infill decoder as a per-row phase machine.

(One file on purpose, over 800 lines: its row state, the layout every phase computes
positions from, the feeds and the transitions are one state machine whose parts share
private helpers; its sections are marked `# ---` below: helpers, feeds, transitions,
sub-slot re-masking, left to right, the row program.)

ALGORITHM.md "Decoding: iterative plan-and-infill", with its "Deliberate
differences". One iteration of the compiled loop is **one forward pass** in
which every active row feeds what its own phase needs and then moves to its
next phase; no row waits for another row's plan, verification or infill:

    PLAN        its undecided slots of the current block, as masks, causal
                among themselves -> a draft per slot; choose slots
    GLOBAL      the chosen drafts, one causal run in position order -> the
                accepted prefix; commit whole slots / up to an EOS, or infill
    DRAFT       the slots still pending, accepted tokens kept, the rest masks,
                each slot on its own (slot-local attention) -> argmax drafts
    VERIFY      those slots again (in the first round every chosen slot, so that
                each slot's KV is slot-local) -> accepted prefix per slot
    RECOMPUTE   (recompute_kv) the committed tokens, causal -> their KV
    LTR_PLAN / LTR_AR   the left-to-right ablation (below)

Each transition is a small pure function over the row state (`plan`,
`global_verify`, `infill_draft`, `infill_verify`, `recompute`, `commit`,
`ltr_plan`, `ltr_ar`), computed for every row and selected per row by phase.
A pass feeds only the tokens that take part, compacted in position order at
the smallest static width that holds every row's need (`passes.run_pass`).

KV staging. A pass that may be committed writes its K/V right after the
row's live cache entries, where nothing sees them: global verification at
`length + rank` of each chosen token, an infill verify at
`length + (rank of its slot among the chosen) * k + offset`, a recomputation
at `length + rank`. What a step commits is always a prefix of that staging
area (whole slots in position order, cut after the first EOS), so committing
is raising the row's length. Every entry is the KV of the last pass that fed
its token, so the infill's slots stay independent of each other, as in the
block-diagonal pass of the specification.

Every chosen slot starts its infill from its own accepted prefix read from the
global-verification pass (its first token, then each next token while its
autoregressive probability there exceeds tau_t; for later slots those
probabilities saw the earlier chosen drafts).

Temperature: the plan step is the one place the spec samples ("argmax, with
Gumbel noise when temperature > 0"); infill drafts are argmax, and every
probability compared with a threshold is read from the un-noised softmax.

`recompute_kv` (the paper's Table 8): after a step whose parallel infill
commits two or more slots, one extra pass feeds exactly the committed tokens
(cut after EOS) in position order after the committed context, causal among
themselves, and its KV entries are committed instead of the infill's.
Commits from global verification, and an infill commit of one slot, are causal
already and are not recomputed. Counted in `recompute_b`.

RL rollouts (`decode.sample_drafts`, `decode.record`): the infill's drafts are drawn at
the temperature as the plan's are, and each committed token keeps the pass that drafted
it (the plan of its step, or infill round r with m tokens of its slot kept), its
probability there, whether its K/V came from one causal run of its step, and each
step's plan feed (`DecodeOutput.trace`); `rl.replay` scores a rollout from it.

`left_to_right` (ReFusion used as a plain AR model): slots strictly in
position order over the whole response (blocks and thresholds play no part).
A slot's first token comes from a plan pass: the previous slot's last token
(whose KV that pass commits) followed by the slot's `k` masks, causal. Each
further token is the next-token prediction of a pass that feeds only the
newest token and commits its KV (`ar_b`). Every token costs one pass
(`nfe_b == tokens_b`); an EOS ends the text at once; with temperature > 0
every token is sampled.
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp

from refusion_jax.decode import common, compiled, engine, heads, passes
from refusion_jax.decode import program as program_lib
from refusion_jax.decode.counters import DecodeCounters, DecodeOutput
from refusion_jax.decode.methods import PLAN_FEATURES
from refusion_jax.decode.program import DONE, FIRST_PHASE, FREE
from refusion_jax.decode.settings import DecodeConfig
from refusion_jax.kv_cache import KVCache

PLAN, GLOBAL, DRAFT, VERIFY, RECOMPUTE, LTR_PLAN, LTR_AR, RECHECK = range(
    FIRST_PHASE, FIRST_PHASE + 8)
PHASE_NAMES = {FREE: "free", DONE: "done", PLAN: "plan", GLOBAL: "global_verify",
               DRAFT: "draft", VERIFY: "verify", RECOMPUTE: "recompute",
               LTR_PLAN: "ltr_plan", LTR_AR: "ltr_ar", RECHECK: "recheck"}
# The attention group of a re-check's tokens in a pass (decode.remask): they see the
# cache and each other causally, and every other fed entry sees them.
RECHECK_GROUP = 1 << 20


@dataclasses.dataclass(frozen=True, kw_only=True)
class Spec(program_lib.Spec):
  slot_size: int  # decode.slot_size
  block_size: int  # decode.block_size (left to right: gen_length, blocks play no part)
  left_to_right: bool = False  # decode.left_to_right
  verify: bool = False  # decode.verify != "off" ("exact" is a knob)
  remask: bool = False  # decode.remask
  record: bool = False  # decode.record: DecodeOutput.trace
  plan_policy: bool = False  # decode.planner == "policy"


@flax.struct.dataclass(kw_only=True)
class Knobs(program_lib.Knobs):
  slot_threshold: jax.Array  # tau_s
  token_threshold: jax.Array  # tau_t
  recompute_kv: jax.Array
  verify_exact: jax.Array  # decode.verify == "exact" (with Spec.verify)
  boundary_check: jax.Array  # decode.boundary_check (with Spec.verify)
  remask_threshold: jax.Array  # tau_remask (with Spec.remask)
  sample_drafts: jax.Array  # decode.sample_drafts (the infill's drafts drawn)
  plan_w: jax.Array  # the selection policy's weights (PLAN_FEATURES), then
  plan_b: jax.Array  # its bias (with Spec.plan_policy)
  plan_sample: jax.Array  # each slot drawn (with Spec.plan_policy)


@flax.struct.dataclass
class Rows:
  """Everything a row carries between passes except the KV buffer's contents."""

  phase_b: jax.Array
  length_b: jax.Array  # live cache entries (the cache's own length is kept equal)
  prompt_len_b: jax.Array
  key_b2: jax.Array  # the prompt's PRNG key (raw uint32)
  tokens_bg: jax.Array  # committed tokens at their generated index, pad elsewhere
  commit_step_bg: jax.Array  # the row's step at which each index was committed, -1 never
  block_b: jax.Array  # current block (left to right: current slot)
  decided_bs: jax.Array  # slots of the current block committed or removed
  eos_b: jax.Array  # an EOS was committed: no block after the current one
  # The step in progress.
  draft_bt: jax.Array  # chosen slots' current tokens (block layout)
  chosen_bs: jax.Array
  accepted_bt: jax.Array  # per slot, always a prefix of the slot
  removed_bs: jax.Array  # slots dropped after an EOS found during infill
  infill_eos_b: jax.Array
  round_b: jax.Array  # infill rounds done (left to right: offset of the newest token)
  verify_bs: jax.Array  # slots the next infill verify feeds
  stage_bs: jax.Array  # rank of each chosen slot among the chosen (staging order)
  step_nfe_b: jax.Array  # nfe when the step began (for the paper's TPF)
  counters: DecodeCounters
  # Verified infill only (Spec.verify; None otherwise).
  after_bg: jax.Array | None = None  # the causal argmax after each generated index, from
  #                                    the pass that committed it (its next token's prediction)
  after_prompt_b: jax.Array | None = None  # the same after the prompt (from its prefill)
  succ_bt: jax.Array | None = None  # the causal argmax after each token of the block, from
  #                                   the latest pass that fed it (what commit keeps)
  stale_bs: jax.Array | None = None  # the slot holds a corrected token whose K/V are not
  #                                    yet from a pass that fed it
  # Sub-slot re-masking only (Spec.remask; None otherwise).
  start_bs: jax.Array | None = None  # first undecided offset of each slot (> 0: re-masked)
  early_bs: jax.Array | None = None  # committed before its left neighbour; not re-checked
  rechecked_bs: jax.Array | None = None  # re-checked once (never again)
  recheck_slot_b: jax.Array | None = None  # the slot whose re-check the next pass feeds (-1: none)
  cache_at_bg: jax.Array | None = None  # cache entry of each committed token (-1: none)
  # The rollout record only (Spec.record; None otherwise): each token's deciding pass.
  src_round_bt: jax.Array | None = None  # the step in progress: -1 the plan, r infill round r
  src_prefix_bt: jax.Array | None = None  # tokens its slot kept in that draft (plan: 0)
  src_p_bt: jax.Array | None = None  # its probability there (un-noised softmax)
  src_round_bg: jax.Array | None = None  # the same, of each committed token
  src_prefix_bg: jax.Array | None = None
  src_p_bg: jax.Array | None = None
  chain_bg: jax.Array | None = None  # committed from one causal run of its step (global
  #                                    verification, recompute_kv), else slot-local K/V
  plan_fed_ts: jax.Array | None = None  # slots of its block each step's plan fed
  plan_block_t: jax.Array | None = None  # the block of each step
  plan_feats_tsf: jax.Array | None = None  # (with the selection policy) each step's features
  plan_chosen_ts: jax.Array | None = None  # and the slots it chose


State = program_lib.State


# --- small helpers ------------------------------------------------------------------------


def first_true(x_bn: jax.Array) -> jax.Array:
  """Index of the first True along the last axis (its length when none)."""
  n = x_bn.shape[-1]
  return jnp.where(x_bn.any(-1), jnp.argmax(x_bn, axis=-1), n)


def prefix_within_slot(ok_bt: jax.Array, slot_size: int) -> jax.Array:
  """True up to (excluding) the first False of each slot."""
  b, t = ok_bt.shape
  ok_bsk = ok_bt.reshape(b, t // slot_size, slot_size)
  return (jnp.cumprod(ok_bsk.astype(jnp.int32), axis=-1) > 0).reshape(b, t)


def shift_right(x_bt: jax.Array, fill) -> jax.Array:
  """`x_bt[:, t - 1]` at t (`fill` at t = 0)."""
  return jnp.concatenate([jnp.full(x_bt.shape[:1] + (1,), fill, x_bt.dtype), x_bt[:, :-1]], 1)


def verified(knobs: Knobs, draft_bt, p_prev_bt, prev_pick_bt) -> jax.Array:
  """A draft token stands under verification: it is the causal argmax read at the
  entry before it, or (verify='correct') its AR probability there exceeds tau_t."""
  return (draft_bt == prev_pick_bt) | (~knobs.verify_exact & (p_prev_bt > knobs.token_threshold))


class _Layout:
  """Index arrays of the block layout (static sizes)."""

  def __init__(self, spec: Spec):
    self.k, self.blk = spec.slot_size, spec.block_size
    self.n_slots = self.blk // self.k
    self.n_blocks = spec.gen_length // self.blk
    self.t = jnp.arange(self.blk)
    self.slot_t = self.t // self.k
    self.offset_t = self.t % self.k
    self.first_t = self.offset_t == 0
    self.verify = spec.verify
    self.remask = spec.remask
    self.record = spec.record
    self.policy = spec.plan_policy

  def live_bt(self, r: Rows):
    """Positions of the block outside a re-masked slot's committed prefix (all without
    re-masking: None)."""
    return self.offset_t[None] >= self.per_token(r.start_bs) if self.remask else None

  def first_live_bt(self, r: Rows):
    """Each slot's first undecided position (its first token without re-masking)."""
    if not self.remask:
      return self.first_t[None]
    return self.offset_t[None] == self.per_token(r.start_bs)

  def block_view(self, r: Rows, x_bg):
    """The current block's part of a `[B, gen_length]` array: `[B, block]`."""
    b = x_bg.shape[0]
    return x_bg.reshape(b, self.n_blocks, self.blk)[jnp.arange(b), r.block_b]

  def per_token(self, x_bs):
    return x_bs[:, self.slot_t]

  def canvas_bt(self, r: Rows):
    return r.block_b[:, None] * self.blk + self.t[None]

  def positions_bt(self, r: Rows):
    return r.prompt_len_b[:, None] + self.canvas_bt(r)


def _and(x, mask):
  """`x & mask`, where a `mask` of None means all True."""
  return x if mask is None else x & mask


def _feed(lay: _Layout, r: Rows, fed_bt, ids_bt, group_bt, dest_bt, sample: bool):
  b = fed_bt.shape[0]
  return passes.Feed(fed_bn=fed_bt, ids_bn=ids_bt.astype(jnp.int32),
                     positions_bn=lay.positions_bt(r).astype(jnp.int32),
                     group_bn=jnp.broadcast_to(group_bt, fed_bt.shape).astype(jnp.int32),
                     dest_bn=dest_bt.astype(jnp.int32),
                     sample_bn=jnp.full((b, lay.blk), sample))


def _staged_dest(r: Rows, fed_bt):
  """`length + rank` of each fed token (-1 elsewhere)."""
  rank = jnp.cumsum(fed_bt, axis=-1) - 1
  return jnp.where(fed_bt, r.length_b[:, None] + rank, -1)


# --- feeds: what each phase puts into the pass --------------------------------------------


def plan_feed(lay: _Layout, r: Rows, knobs: Knobs) -> passes.Feed:
  fed = _and(lay.per_token(~r.decided_bs), lay.live_bt(r))
  ids = jnp.full(fed.shape, knobs.mask_id)
  return _feed(lay, r, fed, ids, 0, jnp.full(fed.shape, -1), sample=True)


def recheck_feed(lay: _Layout, r: Rows, knobs: Knobs) -> passes.Feed:
  """A re-check (decode.remask): the slot `recheck_slot_b` and the token before it (its left
  neighbour's last), causal after the committed context, staged after its live entries."""
  del knobs
  s_b = r.recheck_slot_b[:, None]
  fed = (r.recheck_slot_b[:, None] >= 0) & ((lay.slot_t[None] == s_b)
                                        | (lay.t[None] == s_b * lay.k - 1))
  ids = lay.block_view(r, r.tokens_bg)
  return _feed(lay, r, fed, ids, RECHECK_GROUP, _staged_dest(r, fed), sample=False)


def global_verify_feed(lay: _Layout, r: Rows, knobs: Knobs) -> passes.Feed:
  fed = _and(lay.per_token(r.chosen_bs), lay.live_bt(r))
  return _feed(lay, r, fed, r.draft_bt, 0, _staged_dest(r, fed), sample=False)


def _pending_bt(lay: _Layout, r: Rows):
  return lay.per_token(r.chosen_bs) & ~r.accepted_bt


def infill_draft_feed(lay: _Layout, r: Rows, knobs: Knobs) -> passes.Feed:
  pending_bs = _pending_bt(lay, r).reshape(-1, lay.n_slots, lay.k).any(-1)
  fed = _and(lay.per_token(pending_bs), lay.live_bt(r))
  ids = jnp.where(r.accepted_bt, r.draft_bt, knobs.mask_id)
  return _feed(lay, r, fed, ids, lay.slot_t[None], jnp.full(fed.shape, -1),
               sample=knobs.sample_drafts)


def infill_verify_feed(lay: _Layout, r: Rows, knobs: Knobs) -> passes.Feed:
  del knobs
  fed = lay.per_token(r.verify_bs)
  if lay.remask:
    # Slots may start past their committed prefix: each live chosen token's place among
    # them (the same places as below when every slot is whole).
    live = lay.live_bt(r)
    fed = fed & live
    dest = _staged_dest(r, lay.per_token(r.chosen_bs) & live)
  else:
    dest = r.length_b[:, None] + lay.per_token(r.stage_bs) * lay.k + lay.offset_t[None]
  return _feed(lay, r, fed, r.draft_bt, lay.slot_t[None], jnp.where(fed, dest, -1),
               sample=False)


def recompute_feed(lay: _Layout, r: Rows, keep_bt) -> passes.Feed:
  return _feed(lay, r, keep_bt, r.draft_bt, 0, _staged_dest(r, keep_bt), sample=False)


# --- transitions: what a row does with its pass's result ----------------------------------


def _write_block(lay: _Layout, r: Rows, x_bg, put_bt, value):
  """`x_bg` with `value` (`[B, block]` or a scalar) where `put_bt` in the current block:
  the block is one row of the `[B, blocks, block]` view of the generated area, so an
  elementwise select writes it (no gather and scatter)."""
  b = x_bg.shape[0]
  put = (jnp.arange(lay.n_blocks)[None] == r.block_b[:, None])[:, :, None] & put_bt[:, None, :]
  value = value[:, None, :] if jnp.ndim(value) == 2 else value
  return jnp.where(put, value, x_bg.reshape(b, lay.n_blocks, lay.blk)).reshape(b, -1)


def _recheck_candidates(lay: _Layout, r: Rows, knobs: Knobs) -> jax.Array:
  """Slots to re-check (decode.remask): committed before their left neighbour, which is
  committed now, never re-checked, and neither holding nor following a committed EOS
  (`[B, slots]`)."""
  b = r.phase_b.shape[0]
  done_bt = lay.block_view(r, r.commit_step_bg) >= 0
  whole_bs = done_bt.reshape(b, lay.n_slots, lay.k).all(-1)
  left_bs = jnp.concatenate([jnp.zeros((b, 1), bool), whole_bs[:, :-1]], 1)
  eos_bt = done_bt & knobs.is_stop(lay.block_view(r, r.tokens_bg))
  eos_upto_bs = jnp.cumsum(eos_bt.reshape(b, lay.n_slots, lay.k).any(-1), -1) > 0
  return r.early_bs & ~r.rechecked_bs & whole_bs & left_bs & ~eos_upto_bs


def _end_step(lay: _Layout, r: Rows, decided_bs, eos_b, knobs: Knobs) -> Rows:
  """Where a row goes after a step: the next plan of its block; when the block is done,
  the next block, or DONE after an EOS or the last block; with re-masking, a re-check
  pass first when a slot awaits one and no plan would carry it."""
  block_done = decided_bs.all(-1)
  if lay.remask:
    waiting = _recheck_candidates(lay, r.replace(decided_bs=decided_bs), knobs).any(-1)
    recheck = block_done & waiting
    block_done = block_done & ~waiting
  finish = block_done & (eos_b | (r.block_b == lay.n_blocks - 1))
  advance = block_done & ~finish
  phase = jnp.where(finish, DONE, PLAN)
  changes = {}
  if lay.remask:
    phase = jnp.where(recheck, RECHECK, phase)
    changes = dict(early_bs=r.early_bs & ~advance[:, None],
                   rechecked_bs=r.rechecked_bs & ~advance[:, None],
                   start_bs=jnp.where(advance[:, None], 0, r.start_bs))
  return r.replace(phase_b=phase, block_b=r.block_b + advance.astype(jnp.int32),
                   decided_bs=jnp.where(advance[:, None], False, decided_bs), eos_b=eos_b,
                   **changes)


def commit(lay: _Layout, r: Rows, keep_bt, tokens_bt, decided_bs, eos_b, knobs: Knobs,
           succ_bt=None, causal_run: bool = False, kv_chain: bool = False) -> Rows:
  """Commits the kept tokens (a prefix of the staged KV) and ends the step. With
  verification, each kept token's causal argmax (`succ_bt`, default the row's) is kept
  for the generated index after it. With re-masking, a kept slot is marked early when
  its left neighbour was neither committed before nor (`causal_run`: global
  verification's one causal run) committed just before it in this pass."""
  b = keep_bt.shape[0]
  n_b = keep_bt.sum(-1).astype(jnp.int32)
  if lay.remask:
    kept_bs = keep_bt.reshape(b, lay.n_slots, lay.k).any(-1)
    before_bt = lay.block_view(r, r.commit_step_bg) >= 0
    # The token before each slot's first kept token: committed earlier, or (causal run)
    # kept in this commit right before it; a block's first slot follows the last block.
    first_kept = keep_bt & lay.first_live_bt(r)
    seen = shift_right(before_bt, True)
    if causal_run:
      seen = seen | shift_right(keep_bt, True)
    anchored_bs = ~(first_kept & ~seen).reshape(b, lay.n_slots, lay.k).any(-1)
    rank = jnp.cumsum(keep_bt, axis=-1) - 1
    r = r.replace(early_bs=jnp.where(kept_bs, ~anchored_bs, r.early_bs),
                  cache_at_bg=_write_block(lay, r, r.cache_at_bg, keep_bt,
                                           r.length_b[:, None] + rank))
  if lay.verify:
    succ_bt = r.succ_bt if succ_bt is None else succ_bt
    r = r.replace(after_bg=_write_block(lay, r, r.after_bg, keep_bt, succ_bt))
  if lay.record:
    r = r.replace(src_round_bg=_write_block(lay, r, r.src_round_bg, keep_bt, r.src_round_bt),
                  src_prefix_bg=_write_block(lay, r, r.src_prefix_bg, keep_bt, r.src_prefix_bt),
                  src_p_bg=_write_block(lay, r, r.src_p_bg, keep_bt, r.src_p_bt),
                  chain_bg=_write_block(lay, r, r.chain_bg, keep_bt, kv_chain))
  tokens_bg = _write_block(lay, r, r.tokens_bg, keep_bt, tokens_bt)
  commit_step_bg = _write_block(lay, r, r.commit_step_bg, keep_bt,
                                r.counters.steps_b[:, None, None])
  ones = jnp.ones((b,), bool)
  nfe_b = r.counters.nfe_b()
  counters = r.counters.add(ones, steps_b=1).add_step_tpf(ones, n_b, nfe_b - r.step_nfe_b)
  r = r.replace(length_b=r.length_b + n_b, tokens_bg=tokens_bg, commit_step_bg=commit_step_bg,
                step_nfe_b=nfe_b, counters=counters)
  # A finished block moves the row to the next one, unless an EOS ended the text
  # (later blocks are never generated) or it was the last block.
  return _end_step(lay, r, decided_bs, eos_b, knobs)


def plan_features(lay: _Layout, r: Rows, out: passes.PassOut) -> jax.Array:
  """`[B, slots, F]` features of each slot of the block at a plan pass (PLAN_FEATURES):
  its first token's probability, the mean probability of its drafts, its distance in
  slots to the leftmost undecided slot (over the slots of a block), whether its left
  neighbour is committed (the first slot's always is: the prompt or the last block), and
  the fraction of the block's slots decided."""
  b = r.phase_b.shape[0]
  p = out.p_pick_bn.reshape(b, lay.n_slots, lay.k)
  undecided = ~r.decided_bs
  slot = jnp.arange(lay.n_slots)[None]
  leftmost = first_true(undecided)[:, None]
  left = jnp.concatenate([jnp.ones((b, 1), bool), r.decided_bs[:, :-1]], 1)
  progress = jnp.broadcast_to(r.decided_bs.mean(-1, keepdims=True), (b, lay.n_slots))
  return jnp.stack([p[..., 0], p.mean(-1), (slot - leftmost) / lay.n_slots,
                    left.astype(jnp.float32), progress], -1).astype(jnp.float32)


def policy_logits(feats_sf, w_f, b):
  """The selection policy's logit of each slot, `w . f + b` over its plan features
  (`[..., slots, F]` -> `[..., slots]`); sigmoid of it is the slot's probability of being
  chosen. `rl.selector` scores recorded choices with the same logit."""
  return jnp.asarray(feats_sf, jnp.float32) @ w_f + b


def plan(lay: _Layout, r: Rows, out: passes.PassOut, knobs: Knobs) -> Rows:
  """Drafts every undecided slot; chooses the slots whose first token is confident
  (tau_s), or the single best one."""
  undecided = ~r.decided_bs
  b = undecided.shape[0]
  # A slot's score is the probability of its FIRST token only (un-noised softmax): with
  # re-masking, its first undecided one.
  first = (out.p_pick_bn[:, ::lay.k] if not lay.remask else
           jnp.where(lay.first_live_bt(r), out.p_pick_bn, 0.0).reshape(
               b, lay.n_slots, lay.k).sum(-1))
  score = jnp.where(undecided, first, -1.0)
  over = undecided & (score > knobs.slot_threshold)
  if lay.policy:
    # The selection policy (decode.planner='policy'): slot s is chosen with probability
    # sigmoid(w . f_s + b) (drawn, or above one half), the most likely slot when none is.
    feats = plan_features(lay, r, out)
    logit = jnp.where(undecided, policy_logits(feats, knobs.plan_w, knobs.plan_b), -jnp.inf)
    score = logit
    # Slot s draws with key blk + s of the plan pass (its tokens use 0..blk-1).
    u = program_lib.pass_uniforms(r.key_b2, r.counters.nfe_b(), lay.blk, lay.n_slots)
    over = undecided & jnp.where(knobs.plan_sample, u < jax.nn.sigmoid(logit), logit > 0)
  best = jax.nn.one_hot(jnp.argmax(score, axis=-1), lay.n_slots, dtype=bool)
  chosen = jnp.where(over.any(-1, keepdims=True), over, best)
  draft = out.pick_bn
  counters = r.counters.add(jnp.ones((b,), bool), plan_b=1)
  if lay.verify:
    # The first-token check: a chosen slot whose positional left neighbour is committed
    # (the prompt, for the first slot) starts with that neighbour's causal next-token
    # argmax, kept from the pass that committed it, instead of its masked draft.
    canvas = lay.canvas_bt(r)
    rows = jnp.arange(b)[:, None]
    before = jnp.maximum(canvas - 1, 0)
    left_done = (canvas == 0) | (r.commit_step_bg[rows, before] >= 0)
    check = lay.first_live_bt(r) & lay.per_token(chosen) & left_done & knobs.boundary_check
    kept = jnp.where(canvas == 0, r.after_prompt_b[:, None], r.after_bg[rows, before])
    counters = counters.add(jnp.ones((b,), bool),
                            corrected_b=(check & (kept != draft)).sum(-1))
    draft = jnp.where(check, kept, draft)
  extra = {}
  if lay.record:
    # Every draft of this step so far is the plan's; the plan's feed, by step.
    at_ts = (jnp.arange(r.plan_block_t.shape[1])[None] == r.counters.steps_b[:, None])
    extra = dict(src_round_bt=jnp.full(draft.shape, -1, jnp.int32),
                 src_prefix_bt=jnp.zeros(draft.shape, jnp.int32), src_p_bt=out.p_pick_bn,
                 plan_fed_ts=jnp.where(at_ts[:, :, None], undecided[:, None, :], r.plan_fed_ts),
                 plan_block_t=jnp.where(at_ts, r.block_b[:, None], r.plan_block_t))
    if lay.policy:
      extra.update(
          plan_feats_tsf=jnp.where(at_ts[:, :, None, None], feats[:, None], r.plan_feats_tsf),
          plan_chosen_ts=jnp.where(at_ts[:, :, None], chosen[:, None, :], r.plan_chosen_ts))
  return r.replace(phase_b=jnp.full((b,), GLOBAL), draft_bt=draft, chosen_bs=chosen,
                   stage_bs=(jnp.cumsum(chosen, -1) - 1).astype(jnp.int32),
                   counters=counters, **extra)


def global_verify(lay: _Layout, r: Rows, out: passes.PassOut, knobs: Knobs) -> Rows:
  """The chosen drafts as one causal run: commit whole leading slots (or up to an
  EOS in the accepted prefix); otherwise infill every chosen slot."""
  b = r.phase_b.shape[0]
  r = r.replace(counters=r.counters.add(jnp.ones((b,), bool), global_verify_b=1))
  chosen_bt = lay.per_token(r.chosen_bs)
  live = lay.live_bt(r)  # re-masking: a slot's committed prefix is not fed (None: none)
  fed_bt = _and(chosen_bt, live)
  first_bt = lay.first_live_bt(r)
  if lay.verify:
    # Every token whose predecessor in the concatenation is its positional one (the
    # token before it in its slot, or the last token of the chosen slot to its left) is
    # verified against the causal argmax there; a first token after a gap stands.
    prev_pick = shift_right(out.pick_bn, -1)
    checkable = ~first_bt | (shift_right(fed_bt, False) & knobs.boundary_check)
    accepted_bt = ~checkable | verified(knobs, r.draft_bt, out.p_prev_bn, prev_pick)
  else:
    # In the concatenation a non-first token's predecessor is the token before it
    # (same slot, also chosen); first tokens are accepted unconditionally.
    accepted_bt = first_bt | (out.p_prev_bn > knobs.token_threshold)
  if lay.remask:
    accepted_bt = accepted_bt | ~live  # a committed prefix counts as accepted
  first_reject = first_true(fed_bt & ~accepted_bt)
  prefix_bt = fed_bt & (lay.t[None] < first_reject[:, None])
  eos_bt = knobs.is_stop(r.draft_bt)
  gv_eos = (prefix_bt & eos_bt).any(-1)
  first_eos = first_true(prefix_bt & eos_bt)
  whole_bs = r.chosen_bs & (prefix_bt | ~fed_bt).reshape(b, lay.n_slots, lay.k).all(-1)
  gv_whole = ~gv_eos & whole_bs.any(-1)

  # EOS in the prefix: the chosen slots up to and including the EOS token; every slot
  # at or after the EOS slot is removed; earlier undecided ones remain.
  slot_s = jnp.arange(lay.n_slots)[None]
  eos_slot = (first_eos // lay.k)[:, None]
  keep_eos = fed_bt & (lay.t[None] <= first_eos[:, None])
  decided_eos = r.decided_bs | (r.chosen_bs & (slot_s < eos_slot)) | (slot_s >= eos_slot)
  # One commit for both outcomes: up to the EOS where the prefix holds one, else the
  # whole leading slots.
  committed = commit(lay, r, jnp.where(gv_eos[:, None], keep_eos,
                                       _and(lay.per_token(whole_bs), live)),
                     r.draft_bt, jnp.where(gv_eos[:, None], decided_eos, r.decided_bs | whole_bs),
                     r.eos_b | gv_eos, knobs, succ_bt=out.pick_bn, causal_run=True,
                     kv_chain=True)
  # Parallel infill: every chosen slot starts from its own accepted prefix.
  accepted = chosen_bt & prefix_within_slot(accepted_bt, lay.k)
  draft, extra = r.draft_bt, {}
  if lay.verify:
    # The first chosen slot keeps its verified prefix, and the causal argmax replaces its
    # first failing draft (its K/V come from the infill's first verify, which feeds
    # every chosen slot). A later slot's probabilities here saw the drafts before it,
    # not its own context: it starts from its first token.
    first_slot = lay.per_token(jax.nn.one_hot(first_true(r.chosen_bs), lay.n_slots,
                                              dtype=bool))
    own = accepted & first_slot
    fix = first_slot & ~own & (lay.t[None] == first_reject[:, None])
    later = first_bt if live is None else first_bt | ~live  # from its first (live) token
    accepted = jnp.where(first_slot, own | fix, chosen_bt & later)
    draft = jnp.where(fix, prev_pick, draft)
    extra = dict(succ_bt=out.pick_bn,
                 stale_bs=fix.reshape(b, lay.n_slots, lay.k).any(-1),
                 counters=r.counters.add(jnp.ones((b,), bool), corrected_b=fix.sum(-1)))
  to_infill = r.replace(
      phase_b=jnp.full((b,), DRAFT), draft_bt=draft, accepted_bt=accepted,
      removed_bs=jnp.zeros_like(r.chosen_bs), infill_eos_b=jnp.zeros((b,), bool),
      round_b=jnp.zeros((b,), jnp.int32), verify_bs=r.chosen_bs, **extra)
  if lay.verify:
    # Only a corrected token and no draft left to fill: straight to the verify.
    to_infill = to_infill.replace(phase_b=jnp.where(
        _pending_bt(lay, to_infill).any(-1), DRAFT, VERIFY))
  return passes.select([(gv_eos | gv_whole, committed)], to_infill)


def infill_draft(lay: _Layout, r: Rows, out: passes.PassOut, knobs: Knobs) -> Rows:
  """Each pending token takes the argmax at its position."""
  del knobs
  b = r.phase_b.shape[0]
  pending_bt = _pending_bt(lay, r)
  pending_bs = pending_bt.reshape(b, lay.n_slots, lay.k).any(-1)
  # The first round's verify feeds every chosen slot (their KV must be slot-local);
  # later ones only the slots that changed.
  verify_bs = jnp.where((r.round_b == 0)[:, None], r.chosen_bs, pending_bs)
  if lay.verify:
    verify_bs = verify_bs | r.stale_bs
  extra = {}
  if lay.record:
    kept_bt = lay.per_token(r.accepted_bt.reshape(b, lay.n_slots, lay.k).sum(-1))
    extra = dict(src_round_bt=jnp.where(pending_bt, r.round_b[:, None], r.src_round_bt),
                 src_prefix_bt=jnp.where(pending_bt, kept_bt, r.src_prefix_bt),
                 src_p_bt=jnp.where(pending_bt, out.p_pick_bn, r.src_p_bt))
  return r.replace(phase_b=jnp.full((b,), VERIFY),
                   draft_bt=jnp.where(pending_bt, out.pick_bn, r.draft_bt), verify_bs=verify_bs,
                   counters=r.counters.add(jnp.ones((b,), bool), draft_b=1), **extra)


def _infill_outcome(lay: _Layout, r: Rows, knobs: Knobs):
  """(kept tokens, decided slots, eos) when the infill ends."""
  chosen_bt = _and(lay.per_token(r.chosen_bs), lay.live_bt(r))
  keep = chosen_bt & (lay.t[None] <= first_true(chosen_bt & knobs.is_stop(r.draft_bt))
                      [:, None])
  return keep, r.decided_bs | r.chosen_bs | r.removed_bs, r.eos_b | r.infill_eos_b


def infill_verify(lay: _Layout, r: Rows, out: passes.PassOut, knobs: Knobs) -> Rows:
  """Accept per slot: what was accepted, the first pending token, then each next token
  while its AR probability exceeds tau_t. An accepted EOS ends the chosen slots.

  Verified (`Spec.verify`): from the first pending token on, each token that stands
  (`verified`) is accepted, and the first that does not becomes the causal argmax read
  at the token before it (fed in this pass, accepted); that token's K/V come from a
  later verify that feeds it (`stale_bs`), so the infill runs until no slot has a
  pending or stale token (at most k + 1 rounds)."""
  b = r.phase_b.shape[0]
  pending_bt = _pending_bt(lay, r)
  chosen_bt = lay.per_token(r.chosen_bs)
  extra = {}
  if lay.verify:
    prev_pick = shift_right(out.pick_bn, -1)
    ok = r.accepted_bt | (pending_bt & verified(knobs, r.draft_bt, out.p_prev_bn, prev_pick))
    accepted = chosen_bt & prefix_within_slot(ok, lay.k)
    fix = (pending_bt & ~accepted
           & (lay.offset_t[None] == lay.per_token(accepted.reshape(b, lay.n_slots, lay.k).sum(-1))))
    accepted = accepted | fix
    fed = lay.per_token(r.verify_bs)
    extra = dict(draft_bt=jnp.where(fix, prev_pick, r.draft_bt),
                 succ_bt=jnp.where(fed, out.pick_bn, r.succ_bt),
                 stale_bs=fix.reshape(b, lay.n_slots, lay.k).any(-1))
    counters = r.counters.add(jnp.ones((b,), bool), verify_b=1, corrected_b=fix.sum(-1),
                              refresh_b=~pending_bt.any(-1))
  else:
    first_pending_bs = first_true(pending_bt.reshape(b, lay.n_slots, lay.k))
    is_first_pending = lay.offset_t[None] == lay.per_token(first_pending_bs)
    ok = r.accepted_bt | is_first_pending | (out.p_prev_bn > knobs.token_threshold)
    accepted = chosen_bt & prefix_within_slot(ok, lay.k)
    counters = r.counters.add(jnp.ones((b,), bool), verify_b=1)
  r = r.replace(**extra)
  # EOS among accepted tokens: keep the chosen slots up to the first such slot by
  # position, mark it fully accepted, drop every later slot. Undecided slots before
  # it stay undecided and are still decoded.
  slot_s = jnp.arange(lay.n_slots)[None]
  eos_slot_bs = r.chosen_bs & _and(accepted & knobs.is_stop(r.draft_bt),
                                   lay.live_bt(r)).reshape(b, lay.n_slots, lay.k).any(-1)
  has_eos = eos_slot_bs.any(-1)
  eos_slot = jnp.where(has_eos, jnp.argmax(eos_slot_bs, -1), lay.n_slots)
  after = slot_s > eos_slot[:, None]
  chosen = r.chosen_bs & ~after
  accepted = accepted | lay.per_token(slot_s == eos_slot[:, None])
  r = r.replace(accepted_bt=accepted & lay.per_token(chosen), chosen_bs=chosen,
                removed_bs=r.removed_bs | after, infill_eos_b=r.infill_eos_b | has_eos,
                round_b=r.round_b + 1, counters=counters)
  if lay.verify:
    r = r.replace(stale_bs=r.stale_bs & chosen)
    pending = _pending_bt(lay, r).any(-1)
    more = (pending | r.stale_bs.any(-1)) & (r.round_b < lay.k + 1)
    next_phase = jnp.where(pending, DRAFT, VERIFY)
  else:
    more = _pending_bt(lay, r).any(-1) & (r.round_b < lay.k)
    next_phase = jnp.full((b,), DRAFT)
  keep, decided, eos = _infill_outcome(lay, r, knobs)
  n_slots_kept = keep.reshape(b, lay.n_slots, lay.k).any(-1).sum(-1)
  recompute = knobs.recompute_kv & (n_slots_kept >= 2)
  done = commit(lay, r, keep, r.draft_bt, decided, eos, knobs)
  go_on = r.replace(phase_b=next_phase)
  if lay.verify:
    # Straight to another verify (no draft left to fill): it feeds the stale slots.
    go_on = go_on.replace(verify_bs=jnp.where((next_phase == DRAFT)[:, None], r.verify_bs,
                                              r.stale_bs))
  return passes.select([(more, go_on),
                        (recompute, r.replace(phase_b=jnp.full((b,), RECOMPUTE)))], done)


def recompute(lay: _Layout, r: Rows, out: passes.PassOut, knobs: Knobs) -> Rows:
  """The committed tokens' KV came from a causal pass: commit them now."""
  b = r.phase_b.shape[0]
  r = r.replace(counters=r.counters.add(jnp.ones((b,), bool), recompute_b=1))
  keep, decided, eos = _infill_outcome(lay, r, knobs)
  return commit(lay, r, keep, r.draft_bt, decided, eos, knobs,
                succ_bt=out.pick_bn if lay.verify else None, kv_chain=True)


# --- sub-slot re-masking (decode.remask) --------------------------------------------------


def recheck(lay: _Layout, r: Rows, out: passes.PassOut, knobs: Knobs) -> Rows:
  """A re-check's outcome, in rows whose pass fed one (`recheck_slot_b` >= 0): the token
  before the slot and the slot's tokens up to the first whose probability there is at
  most tau_remask are committed again, their K/V from this pass; from that token on the
  slot is masked again (undecided, a shorter slot). A re-check pass of its own
  (phase RECHECK) then moves the row on as a step's end does."""
  b = r.phase_b.shape[0]
  on = r.recheck_slot_b >= 0
  s_b = r.recheck_slot_b[:, None]
  in_slot = on[:, None] & (lay.slot_t[None] == s_b)
  ok = out.p_prev_bn > knobs.remask_threshold
  keep_slot = in_slot & prefix_within_slot(ok | ~in_slot, lay.k)
  kept_n = keep_slot.sum(-1).astype(jnp.int32)
  kept = keep_slot | (on[:, None] & (lay.t[None] == s_b * lay.k - 1))
  dropped = in_slot & ~keep_slot
  masked_again = on & (kept_n < lay.k)
  slot_s = jnp.arange(lay.n_slots)[None]
  this = on[:, None] & (slot_s == s_b)
  rank = jnp.cumsum(kept, axis=-1) - 1
  cache_at = _write_block(lay, r, r.cache_at_bg, kept, r.length_b[:, None] + rank)
  changes = {}
  if lay.verify:
    changes = dict(after_bg=_write_block(lay, r, r.after_bg, kept, out.pick_bn))
  r = r.replace(
      length_b=r.length_b + kept.sum(-1).astype(jnp.int32),
      cache_at_bg=_write_block(lay, r, cache_at, dropped, -1),
      commit_step_bg=_write_block(lay, r, r.commit_step_bg, dropped, -1),
      decided_bs=r.decided_bs & ~(this & masked_again[:, None]),
      start_bs=jnp.where(this & masked_again[:, None], kept_n[:, None], r.start_bs),
      early_bs=r.early_bs & ~this, rechecked_bs=r.rechecked_bs | this,
      recheck_slot_b=jnp.full((b,), -1, jnp.int32),
      counters=r.counters.add(on, remasked_b=masked_again,
                              remasked_tokens_b=jnp.where(masked_again, lay.k - kept_n, 0)),
      **changes)
  # A pass of its own ends like a step: the row's block has a slot to decode again, or it
  # moves on (or awaits another re-check).
  alone = r.phase_b == RECHECK
  moved_on = _end_step(lay, r, r.decided_bs, r.eos_b, knobs)
  return passes.select([(alone & masked_again, r.replace(phase_b=jnp.full((b,), PLAN))),
                        (alone, moved_on)], r)


def start_recheck(lay: _Layout, r: Rows, cache: KVCache, knobs: Knobs) -> tuple[Rows, KVCache]:
  """Starts the leftmost waiting re-check of each row about to plan (or in RECHECK): the
  slot's and its left neighbour's last token's entries leave the cache (the last live
  entries move into their places), so that the next pass feeds them again."""
  b = r.phase_b.shape[0]
  cand = _recheck_candidates(lay, r, knobs)
  go = ((r.phase_b == PLAN) | (r.phase_b == RECHECK)) & (r.recheck_slot_b < 0) & cand.any(-1)
  target = jnp.where(go, first_true(cand), -1).astype(jnp.int32)
  n = lay.k + 1
  # The removed tokens' block positions (the neighbour's last, then the slot) and entries.
  pos_bn = target[:, None] * lay.k - 1 + jnp.arange(n)[None]
  at_bt = lay.block_view(r, r.cache_at_bg)
  holes = jnp.take_along_axis(at_bt, jnp.clip(pos_bn, 0, lay.blk - 1), axis=1)
  new_len = r.length_b - jnp.where(go, n, 0)
  # The last n live entries that are not removed move into the removed ones below them.
  tail = new_len[:, None] + jnp.arange(n)[None]
  tail_hole = (tail[:, :, None] == holes[:, None, :]).any(-1)
  src = jnp.take_along_axis(tail, jnp.argsort(tail_hole, axis=1, stable=True), axis=1)
  low = jnp.take_along_axis(holes, jnp.argsort(holes >= new_len[:, None], axis=1, stable=True),
                            axis=1)
  moves = go[:, None] & (jnp.arange(n)[None] < (~tail_hole).sum(-1, keepdims=True))
  rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, n))
  cache = cache.move_entries(rows, src, jnp.where(moves, low, cache.max_len))
  # Each moved token's entry index follows it; the removed tokens have none until the
  # re-check commits them again.
  gone = _write_block(lay, r, r.cache_at_bg,
                      go[:, None] & (lay.t[None] >= target[:, None] * lay.k - 1)
                      & (lay.t[None] < (target[:, None] + 1) * lay.k), -1)
  match = moves[:, None, :] & (gone[:, :, None] == src[:, None, :])
  cache_at = jnp.where(match.any(-1), jnp.where(match, low[:, None, :], 0).sum(-1), gone)
  r = r.replace(length_b=new_len, cache_at_bg=cache_at,
                recheck_slot_b=jnp.where(go, target, r.recheck_slot_b))
  return r, cache.replace(length_b=new_len)


# --- left to right ------------------------------------------------------------------------


def _ltr_feed(spec: Spec, r: Rows, knobs: Knobs) -> passes.Feed:
  """Layout of k+1 entries: LTR_PLAN feeds [previous slot's last token, k masks];
  LTR_AR feeds entry 0, the newest token."""
  k = spec.slot_size
  b = r.phase_b.shape[0]
  c = jnp.arange(k + 1)
  start_b = r.block_b * k
  rows = jnp.arange(b)
  is_plan = (r.phase_b == LTR_PLAN)[:, None]
  prev = r.tokens_bg[rows, jnp.maximum(start_b - 1, 0)]
  newest = r.tokens_bg[rows, start_b + r.round_b]
  plan_ids = jnp.where(c[None] == 0, prev[:, None], knobs.mask_id)
  plan_fed = jnp.where(c[None] == 0, (r.block_b > 0)[:, None], True)
  plan_pos = r.prompt_len_b[:, None] + start_b[:, None] - 1 + c[None]
  ar_ids = jnp.where(c[None] == 0, newest[:, None], 0)
  ar_pos = r.prompt_len_b[:, None] + start_b[:, None] + r.round_b[:, None] + c[None]
  dest = jnp.where(c[None] == 0, r.length_b[:, None], -1)
  return passes.Feed(
      fed_bn=jnp.where(is_plan, plan_fed, c[None] == 0),
      ids_bn=jnp.where(is_plan, plan_ids, ar_ids).astype(jnp.int32),
      positions_bn=jnp.where(is_plan, plan_pos, ar_pos).astype(jnp.int32),
      group_bn=jnp.zeros((b, k + 1), jnp.int32), dest_bn=dest.astype(jnp.int32),
      sample_bn=jnp.ones((b, k + 1), bool))


def _ltr_next_slot(spec: Spec, r: Rows, finished_slot_b, eos_b) -> Rows:
  n_slots = spec.gen_length // spec.slot_size
  last = r.block_b == n_slots - 1
  done = eos_b | (finished_slot_b & last)
  nxt = finished_slot_b & ~done
  phase = jnp.where(done, DONE, jnp.where(nxt, LTR_PLAN, LTR_AR))
  return r.replace(phase_b=phase, block_b=r.block_b + nxt.astype(jnp.int32),
                   round_b=jnp.where(nxt, 0, r.round_b), eos_b=r.eos_b | eos_b)


def ltr_plan(spec: Spec, r: Rows, out: passes.PassOut, knobs: Knobs) -> Rows:
  """The slot's first token, read at its first mask; the previous token's KV committed."""
  b = r.phase_b.shape[0]
  rows = jnp.arange(b)
  start = r.block_b * spec.slot_size
  first = out.pick_bn[:, 1]
  ones = jnp.ones((b,), bool)
  if spec.verify:
    # The first-token check: the previous token's causal argmax (fed at entry 0 of this
    # pass; the first slot's from the prompt's prefill) instead of the masked draft.
    causal = jnp.where(r.block_b > 0, out.pick_bn[:, 0], r.after_prompt_b)
    causal = jnp.where(knobs.boundary_check, causal, first)
    r = r.replace(counters=r.counters.add(ones, corrected_b=causal != first))
    first = causal
  r = r.replace(
      length_b=r.length_b + (r.block_b > 0).astype(jnp.int32),
      tokens_bg=r.tokens_bg.at[rows, start].set(first),
      commit_step_bg=r.commit_step_bg.at[rows, start].set(r.counters.steps_b),
      round_b=jnp.zeros((b,), jnp.int32),
      # One step per slot, every token of it one pass: its TPF is 1.
      counters=r.counters.add(ones, plan_b=1, steps_b=1).add_step_tpf(ones, ones, ones))
  return _ltr_next_slot(spec, r, spec.slot_size == 1, knobs.is_stop(first))


def ltr_ar(spec: Spec, r: Rows, out: passes.PassOut, knobs: Knobs) -> Rows:
  """The next token of the slot from the newest one, whose KV is committed."""
  b = r.phase_b.shape[0]
  rows = jnp.arange(b)
  index = r.block_b * spec.slot_size + r.round_b + 1
  nxt = out.pick_bn[:, 0]
  r = r.replace(
      length_b=r.length_b + 1, tokens_bg=r.tokens_bg.at[rows, index].set(nxt),
      commit_step_bg=r.commit_step_bg.at[rows, index].set(r.counters.steps_b - 1),
      round_b=r.round_b + 1, counters=r.counters.add(jnp.ones((b,), bool), ar_b=1))
  return _ltr_next_slot(spec, r, r.round_b + 1 >= spec.slot_size, knobs.is_stop(nxt))


# --- the row program ----------------------------------------------------------------------


def widths(spec: Spec) -> tuple[int, ...]:
  """Static pass widths: slot, 2 slots, 4 slots, ... and the block (left to right: 1, k+1)."""
  if spec.left_to_right:
    return (1, spec.slot_size + 1)
  out, w = [], spec.slot_size
  while w < spec.block_size:
    out.append(w)
    w *= 2
  return tuple(out) + (spec.block_size,)


def _empty_rows(spec: Spec, b: int, pad_id) -> Rows:
  blk, n_slots = spec.block_size, spec.block_size // spec.slot_size
  zi, zb = jnp.zeros((b,), jnp.int32), jnp.zeros((b,), bool)
  extra = {}
  if spec.verify:
    extra = dict(after_bg=jnp.zeros((b, spec.gen_length), jnp.int32), after_prompt_b=zi,
                 succ_bt=jnp.zeros((b, blk), jnp.int32),
                 stale_bs=jnp.zeros((b, n_slots), bool))
  if spec.remask:
    extra.update(start_bs=jnp.zeros((b, n_slots), jnp.int32),
                 early_bs=jnp.zeros((b, n_slots), bool),
                 rechecked_bs=jnp.zeros((b, n_slots), bool), recheck_slot_b=zi - 1,
                 cache_at_bg=jnp.full((b, spec.gen_length), -1, jnp.int32))
  if spec.record:
    g, steps = spec.gen_length, spec.gen_length // spec.slot_size
    extra.update(src_round_bt=jnp.zeros((b, blk), jnp.int32),
                 src_prefix_bt=jnp.zeros((b, blk), jnp.int32),
                 src_p_bt=jnp.zeros((b, blk), jnp.float32),
                 src_round_bg=jnp.zeros((b, g), jnp.int32),
                 src_prefix_bg=jnp.zeros((b, g), jnp.int32),
                 src_p_bg=jnp.zeros((b, g), jnp.float32), chain_bg=jnp.zeros((b, g), bool),
                 plan_fed_ts=jnp.zeros((b, steps, n_slots), bool),
                 plan_block_t=jnp.full((b, steps), -1, jnp.int32))
    if spec.plan_policy:
      extra.update(plan_feats_tsf=jnp.zeros((b, steps, n_slots, len(PLAN_FEATURES)), jnp.float32),
                   plan_chosen_ts=jnp.zeros((b, steps, n_slots), bool))
  return Rows(
      phase_b=zi + FREE, length_b=zi, prompt_len_b=zi, key_b2=jnp.zeros((b, 2), jnp.uint32),
      tokens_bg=jnp.full((b, spec.gen_length), pad_id, jnp.int32),
      commit_step_bg=jnp.full((b, spec.gen_length), -1, jnp.int32), block_b=zi,
      decided_bs=jnp.zeros((b, n_slots), bool), eos_b=zb,
      draft_bt=jnp.zeros((b, blk), jnp.int32), chosen_bs=jnp.zeros((b, n_slots), bool),
      accepted_bt=jnp.zeros((b, blk), bool), removed_bs=jnp.zeros((b, n_slots), bool),
      infill_eos_b=zb, round_b=zi, verify_bs=jnp.zeros((b, n_slots), bool),
      stage_bs=jnp.zeros((b, n_slots), jnp.int32), step_nfe_b=zi,
      counters=DecodeCounters.zeros(b), **extra)


def cache_length(spec: Spec, width: int) -> int:
  """KV entries a row holds: its prompt and generated tokens (with re-masking, a
  re-check feeds a slot and the token before it again: k + 1 more, briefly)."""
  return width + spec.gen_length + (spec.slot_size + 1 if spec.remask else 0)


def init(model, spec: Spec, rows: int, width: int) -> State:
  cache = KVCache.init(model.config, rows, cache_length(spec, width), chunk=spec.kv_chunk)
  pad = 0 if model.config.pad_token_id is None else model.config.pad_token_id
  r = _empty_rows(spec, rows, pad)
  return State(passes=jnp.zeros((), jnp.int32), cache=cache, rows=r)


def admit(model, spec: Spec, st: State, ids_ap, lens_a, rows_a, keys_a2, knobs: Knobs) -> State:
  cache, last_ad = common.prefill_rows(model, st.cache, ids_ap, lens_a, rows_a)
  a = ids_ap.shape[0]
  fresh = _empty_rows(spec, a, knobs.pad_id).replace(
      phase_b=jnp.full((a,), LTR_PLAN if spec.left_to_right else PLAN, jnp.int32),
      length_b=lens_a, prompt_len_b=lens_a, key_b2=keys_a2)
  if spec.verify:
    # The prompt's causal next-token argmax: the first slot's first-token check.
    first = heads.token_stats(last_ad[:, None], model.unembed(), jnp.zeros((a, 1), jnp.int32),
                              vocab_chunk=spec.vocab_chunk).pick_bt[:, 0]
    fresh = fresh.replace(after_prompt_b=first)
  fresh = fresh.replace(counters=fresh.counters.add(jnp.ones((a,), bool), prefill_b=1))
  rows = program_lib.set_rows(st.rows, fresh, rows_a)
  return st.replace(cache=cache, rows=rows)


def step(model, spec: Spec, st: State, knobs: Knobs) -> State:
  """One forward pass; every active row advances by its own phase."""
  r = st.rows
  b = r.phase_b.shape[0]
  active = r.phase_b >= FIRST_PHASE
  if spec.left_to_right:
    feed = _ltr_feed(spec, r, knobs)
    feed = feed.replace(fed_bn=feed.fed_bn & active[:, None])
  else:
    lay = _Layout(spec)
    phase = r.phase_b
    keep_bt, _, _ = _infill_outcome(lay, r, knobs)
    planned = plan_feed(lay, r, knobs)
    cases = []
    if spec.remask:
      # A re-check rides on the plan pass where the row plans next (its tokens seen by
      # the plan's masks as committed context), else it has a pass of its own.
      again = recheck_feed(lay, r, knobs)
      planned = passes.select([(r.recheck_slot_b >= 0, passes.merge(planned, again))], planned)
      cases = [(phase == RECHECK, again)]
    feed = passes.select(
        [(phase == PLAN, planned),
         (phase == GLOBAL, global_verify_feed(lay, r, knobs)),
         (phase == DRAFT, infill_draft_feed(lay, r, knobs)),
         (phase == VERIFY, infill_verify_feed(lay, r, knobs)),
         (phase == RECOMPUTE, recompute_feed(lay, r, keep_bt))] + cases,
        passes.Feed.empty(b, lay.blk))
  n = feed.fed_bn.shape[1]
  keys = program_lib.pass_keys(r.key_b2, r.counters.nfe_b(), n, knobs.temperature)
  cache, out = passes.run_pass(model, st.cache, feed, widths(spec),
                               temperature=knobs.temperature, keys_bn2=keys,
                               vocab_chunk=spec.vocab_chunk,
                               context_group=RECHECK_GROUP if spec.remask else None)
  if spec.left_to_right:
    new = passes.select([(r.phase_b == LTR_PLAN, ltr_plan(spec, r, out, knobs)),
                         (r.phase_b == LTR_AR, ltr_ar(spec, r, out, knobs))], r)
  else:
    new = passes.select(
        [(phase == PLAN, plan(lay, r, out, knobs)),
         (phase == GLOBAL, global_verify(lay, r, out, knobs)),
         (phase == DRAFT, infill_draft(lay, r, out, knobs)),
         (phase == VERIFY, infill_verify(lay, r, out, knobs)),
         (phase == RECOMPUTE, recompute(lay, r, out, knobs))], r)
  if spec.remask:
    new = recheck(lay, new.replace(counters=new.counters.add(phase == RECHECK, recheck_b=1)),
                  out, knobs)
    new, cache = start_recheck(lay, new, cache, knobs)
  cache = cache.replace(length_b=new.length_b)
  return State(passes=st.passes + 1, cache=cache, rows=new)


def output(spec: Spec, st: State, knobs: Knobs) -> DecodeOutput:
  """The text is the committed tokens by position, ending at the first EOS. Every
  position before it is committed (earlier slots are always decoded); tokens
  committed past it (an EOS later found in an earlier slot) are not counted."""
  r = st.rows
  g = spec.gen_length
  committed = r.commit_step_bg >= 0
  eos_at = committed & knobs.is_stop(r.tokens_bg)
  length = jnp.where(eos_at.any(-1), first_true(eos_at) + 1, g).astype(jnp.int32)
  within = jnp.arange(g)[None] < length[:, None]
  tokens = jnp.where(within & committed, r.tokens_bg, knobs.pad_id)
  counters = r.counters.replace(tokens_b=(within & committed).sum(-1).astype(jnp.int32))
  trace = None
  if spec.record:
    # Every committed token, past the text's end too: each shaped what came after it.
    trace = dict(tokens=r.tokens_bg, step=r.commit_step_bg, round=r.src_round_bg,
                 prefix=r.src_prefix_bg, p=r.src_p_bg, chain=r.chain_bg,
                 plan_fed=r.plan_fed_ts, plan_block=r.plan_block_t, prompt_len=r.prompt_len_b)
    if spec.plan_policy:
      trace.update(plan_feats=r.plan_feats_tsf, plan_chosen=r.plan_chosen_ts)
  return DecodeOutput(tokens_bg=tokens, length_b=length, counters=counters,
                      commit_step_bg=jnp.where(within, r.commit_step_bg, -1), trace=trace)


PROGRAM = program_lib.register(program_lib.Program(
    name="refusion", init=init, admit=admit, step=step, output=output, spec_type=Spec,
    knobs_type=Knobs, pass_widths=widths), __name__)


def generate(model, prompt_ids_bp, prompt_len_b, decode_config: DecodeConfig,
             rng: jax.Array | None = None) -> DecodeOutput:
  """Decodes right-padded prompts `[B, P]` with ReFusion's plan-and-infill.

  Generated position i of row b has position id `prompt_len_b[b] + i`. The
  mask, EOS and pad ids come from `model.config`. `rng` is required when
  `decode_config.temperature > 0`. `decode_config.left_to_right` and
  `recompute_kv` select the ablations of the module docstring.
  """
  return engine.Decoder(model, decode_config, method="refusion").generate(
      prompt_ids_bp, prompt_len_b, rng)


def _generate_with_cache(model, prompt_ids_bp, prompt_len_b, decode_config: DecodeConfig,
                         rng: jax.Array | None = None) -> tuple[DecodeOutput, KVCache]:
  """`generate`, plus the final KV cache (entries in commit order), for tests."""
  out, state = engine.Decoder(model, decode_config, method="refusion").generate(
      prompt_ids_bp, prompt_len_b, rng, with_state=True)
  return out, state.cache


def compiled_cache_size() -> int:
  """Programs compiled so far by `generate` (one per static config and shapes)."""
  return compiled.compiled_programs()["generate"]
