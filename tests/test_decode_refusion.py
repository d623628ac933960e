"""The jitted plan-and-infill decoder against a plain-Python oracle.

The oracle below restates ALGORITHM.md "Decoding" with Python lists for one
prompt at a time. It has no KV cache: every pass calls the model's full
causal entry point `model(ids, positions, attention_mask)` on the committed
context followed by the pass's tokens. Each committed token remembers which
context entries it attended to when it was decided, and the explicit mask
reproduces exactly that, so the per-slot independence of the infill (and of
the cache entries it leaves behind) is rebuilt from scratch. The same record
checks the decoder's final KV cache entry by entry.

The two ablations (`left_to_right`, `recompute_kv`) run on a 2-layer model: with
one layer a cache entry is a function of its token and position alone, so
what an entry attended to could not change anything.
"""

import collections
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from refusion_jax import config as config_lib
from refusion_jax.decode import common, refusion
from refusion_jax.decode.settings import DecodeConfig
from refusion_jax.model import Transformer

VOCAB = 96
MASK_ID = 3
PAD_ID = 0
SEED = 7


def _make_model(eos_id, num_layers=1):
  cfg = config_lib.tiny(vocab_size=VOCAB, hidden_size=32, num_layers=num_layers, num_heads=2,
                        num_kv_heads=1, head_dim=16, mlp_dim=64, tie_embeddings=False,
                        max_position_embeddings=128, eos_token_id=eos_id, mask_token_id=MASK_ID,
                        pad_token_id=PAD_ID, bos_token_id=2)
  model = Transformer(cfg, rngs=nnx.Rngs(SEED))
  # Random weights give near-uniform distributions; a larger head spreads the
  # probabilities over (0, 1) so that every threshold branch happens.
  # Random weights give near-uniform distributions. A 60x head spreads the
  # probabilities over (0, 1) so that every threshold branch happens; small token
  # embeddings let the context (not just the current token) drive predictions, so
  # plan drafts and autoregressive continuations often agree, as in a trained model.
  # A zero mask embedding and a zero mask column keep the mask token out of the text.
  model.lm_head[...] = (model.lm_head[...] * 60.0).at[:, MASK_ID].set(0.0)
  model.embed[...] = (model.embed[...] * 0.1).at[MASK_ID].set(0.0)
  return model


# ----------------------------------------------------------------------------
# The oracle.

_ORACLE_WIDTH = 48


@nnx.jit
def _full_call(model, ids_bt, positions_bt, mask_btt):
  return model(ids_bt, positions_bt, mask_btt)


def _softmax(x):
  x = np.asarray(x, np.float64)
  e = np.exp(x - x.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


class Oracle:
  """Batch-1, dynamic-shape ReFusion decoding with explicit lists.

  The options of ALGORITHM.md "Past the paper" are restated here too:

  * `dc.verify` != "off" (verified infill): each committed token remembers the
    causal argmax computed after it in the pass that committed it (`self.kept`, by
    the generated index it predicts); the prompt's comes from a causal call over
    the prompt alone.
  * `dc.remask` (sub-slot re-masking): a context entry can be removed from the
    cache; it stays in the full call as a *ghost* that the entries which attended to
    it still see (so their K/V are rebuilt as they were computed), and that no later
    token sees. A slot re-masked from offset j is decoded again over its positions
    from j (`self.start`).
  """

  def __init__(self, model, dc: DecodeConfig, branches: collections.Counter,
               width: int = _ORACLE_WIDTH):
    self.model = model
    self.dc = dc
    self.eos = model.config.eos_token_id
    self.mask = model.config.mask_token_id
    self.branches = branches
    self.verify = dc.verify != "off"
    self.exact = dc.verify == "exact"
    self.width = width

  def _stands(self, probs_prev, token):
    """Verification: the draft is the causal argmax (or, 'correct', above tau_t)."""
    return (token == int(probs_prev.argmax())
            or (not self.exact and probs_prev[token] > self.dc.token_threshold))

  # Committed context: parallel lists of token, position, and the context indices the
  # entry attended to when it was computed (itself included); `dead` marks ghosts.
  def _alive(self):
    return [i for i in range(len(self.ctx_tok)) if i not in self.dead]

  def _run(self, tokens, positions, sees):
    """Logits of the pass tokens; `sees[a]` lists the pass tokens that token a sees."""
    n, t = len(self.ctx_tok), len(tokens)
    mask = np.zeros((n + t, n + t), bool)
    for i, vis in enumerate(self.ctx_vis):
      mask[i, vis] = True
    alive = self._alive()
    for a in range(t):
      mask[n + a, alive] = True
      for c in sees[a]:
        mask[n + a, n + c] = True
    # Padded to a fixed length (the padding is attended by nobody) only so that one
    # compiled forward serves every pass; the real tokens' logits are unaffected.
    width = self.width
    assert n + t <= width
    ids = np.zeros((1, width), np.int32)
    pos = np.zeros((1, width), np.int32)
    full_mask = np.eye(width, dtype=bool)[None]
    ids[0, :n + t] = self.ctx_tok + list(tokens)
    pos[0, :n + t] = self.ctx_pos + list(positions)
    full_mask[0, :n + t, :n + t] = mask
    logits = _full_call(self.model, jnp.asarray(ids), jnp.asarray(pos), jnp.asarray(full_mask))
    return np.asarray(logits[0, n:n + t], np.float64)

  def _append(self, tokens, positions, sees):
    """New context entries (they see every live entry, and `sees` among themselves)."""
    n = len(self.ctx_tok)
    alive = self._alive()
    for a, (tok, pos) in enumerate(zip(tokens, positions)):
      self.ctx_tok.append(int(tok))
      self.ctx_pos.append(int(pos))
      self.ctx_vis.append(alive + [n + c for c in sees[a]])
      self.entry[pos] = n + a

  def _commit(self, tokens, positions, sees, logits=None, causal_run=False):
    """Commits a step's tokens; `logits` (the pass's, per token) give the kept argmax
    after each; the slots they fill are marked early or not (re-masking)."""
    if self.dc.remask:
      by_slot = collections.defaultdict(list)
      for pos in positions:
        by_slot[(pos - self.block_start) // self.dc.slot_size].append(pos)
      for s, ps in by_slot.items():
        first = min(ps)
        seen = (first == self.block_start or first - 1 in self.committed
                or (causal_run and first - 1 in positions))
        self.early[s] = not seen
        if not seen:
          self.branches["remask_early_slot"] += 1
    self._append(tokens, positions, sees)
    for tok, pos in zip(tokens, positions):
      g = pos - self.prompt_len
      self.canvas[g] = int(tok)
      self.commit_step[g] = self.step
      self.committed.add(pos)
    if logits is not None:
      for pos, row in zip(positions, logits):
        self.kept[pos - self.prompt_len + 1] = int(np.asarray(row).argmax())
    n_tokens = len(tokens)
    self.step_tpf.append(n_tokens / (self.nfe - self.nfe_at_commit))
    self.nfe_at_commit = self.nfe

  @staticmethod
  def _causal(t):
    return [list(range(a + 1)) for a in range(t)]

  def _pass(self, counts, kind):
    counts[kind] += 1
    self.nfe += 1

  def decode(self, prompt):
    dc, k = self.dc, self.dc.slot_size
    n_slots = dc.block_size // k
    self.prompt_len = len(prompt)
    self.ctx_tok, self.ctx_pos, self.ctx_vis = [], [], []
    self.dead, self.entry, self.committed = set(), {}, set()
    self.canvas, self.commit_step = {}, {}
    self.step_tpf = []  # per step: tokens committed / forward passes (the paper's TPF)
    self.nfe = self.nfe_at_commit = 0
    self.kept = {}
    if self.verify:
      self.kept[0] = int(self._run(prompt, list(range(len(prompt))),
                                   self._causal(len(prompt)))[-1].argmax())
    self._commit_prompt(prompt)
    if dc.left_to_right:
      return self._decode_left_to_right()
    counts = collections.Counter()
    eos_found = False
    for blk in range(dc.num_blocks):
      self.block_start = self.prompt_len + blk * dc.block_size
      self.start = {s: 0 for s in range(n_slots)}
      self.early = {s: False for s in range(n_slots)}
      self.rechecked = set()
      self.undecided = list(range(n_slots))
      self.removed = set()
      self.recheck = None

      def slot_positions(s):
        start = self.block_start + s * k
        return list(range(start + self.start[s], start + k))

      self.slot_positions = slot_positions
      phase = "plan"
      while True:
        if phase == "recheck":
          # A re-check with a pass of its own.
          self.branches["remask_recheck_pass"] += 1
          toks, pos = self._recheck_run()
          logits = self._run(toks, pos, self._causal(len(toks)))
          self._pass(counts, "recheck")
          masked_again = self._recheck_outcome(logits, counts)
          phase = "plan" if masked_again else self._end_step(eos_found)
          self._start_recheck(phase)
          continue
        if phase != "plan":
          break
        self.step = counts["steps"]
        counts["steps"] += 1
        undecided = self.undecided
        # 1. Plan (a waiting re-check rides on it: its tokens, causal among themselves,
        # are seen by every mask).
        positions = [p for s in undecided for p in slot_positions(s)]
        toks = [self.mask] * len(positions)
        sees = self._causal(len(positions))
        if self.recheck is not None:
          self.branches["remask_recheck_rides_on_plan"] += 1
          rt, rp = self._recheck_run()
          m = len(positions)
          sees = [row + list(range(m, m + len(rt))) for row in sees]
          sees += [[m + c for c in range(a + 1)] for a in range(len(rt))]
          toks, positions = toks + rt, positions + rp
        logits = self._run(toks, positions, sees)
        self._pass(counts, "plan")
        probs = _softmax(logits)
        draft = probs.argmax(-1)
        drafts, score, at = {}, {}, 0
        for s in undecided:
          n = len(slot_positions(s))
          drafts[s] = [None] * self.start[s] + [int(x) for x in draft[at:at + n]]
          score[s] = probs[at, draft[at]]
          at += n
        chosen = [s for s in undecided if score[s] > dc.slot_threshold]
        if not chosen:
          best = undecided[0]
          for s in undecided:
            if score[s] > score[best]:
              best = s
          chosen = [best]
          self.branches["plan_fallback_single_best"] += 1
        elif len(chosen) > 1:
          self.branches["plan_several_slots"] += 1
        if self.verify and dc.boundary_check:
          # The first-token check: a committed left neighbour's causal argmax.
          for s in chosen:
            p0 = slot_positions(s)[0]
            c = p0 - self.prompt_len
            if c == 0 or p0 - 1 in self.committed:
              self.branches["first_token_checked"] += 1
              if self.start[s]:
                self.branches["first_token_checked_in_remasked_slot"] += 1
              if drafts[s][self.start[s]] != self.kept[c]:
                self.branches["first_token_corrected"] += 1
                counts["corrected"] += 1
                drafts[s][self.start[s]] = self.kept[c]
        if self.recheck is not None:
          self._recheck_outcome(logits[len(logits) - (k + 1):], counts)
        eos_found = self._step(chosen, drafts, counts) or eos_found
        phase = self._end_step(eos_found)
        self._start_recheck(phase)
      if phase == "done":
        break
    return self._result(counts)

  def _end_step(self, eos_found):
    """'plan', 'recheck' (the block is done but a slot awaits its re-check), 'next'
    (the next block) or 'done'."""
    if self.undecided:
      return "plan"
    if self._candidates():
      return "recheck"
    block = (self.block_start - self.prompt_len) // self.dc.block_size
    return "done" if eos_found or block == self.dc.num_blocks - 1 else "next"

  # --- re-masking ---

  def _candidates(self):
    if not self.dc.remask:
      return []
    k = self.dc.slot_size
    out = []
    for s in range(1, self.dc.block_size // k):
      slot = [self.block_start + s * k + j for j in range(k)]
      left = [p - k for p in slot]
      if not (self.early[s] and s not in self.rechecked
              and all(p in self.committed for p in slot + left)):
        continue
      if any(self.canvas[p - self.prompt_len] == self.eos for p in range(self.block_start,
                                                                           slot[-1] + 1)
             if p in self.committed):
        self.branches["remask_skipped_after_eos"] += 1
        continue
      out.append(s)
    return out

  def _start_recheck(self, phase):
    cands = self._candidates() if phase in ("plan", "recheck") else []
    if self.recheck is None and cands:
      s = cands[0]
      k = self.dc.slot_size
      first = self.block_start + s * k
      for p in range(first - 1, first + k):
        self.dead.add(self.entry.pop(p))
      self.recheck = s

  def _recheck_run(self):
    k = self.dc.slot_size
    first = self.block_start + self.recheck * k
    pos = list(range(first - 1, first + k))
    return [self.canvas[p - self.prompt_len] for p in pos], pos

  def _recheck_outcome(self, logits, counts):
    """Commits the neighbour's last token and the slot up to its first token at most
    tau_remask again; masks the rest again. Returns whether any was masked."""
    k, s = self.dc.slot_size, self.recheck
    toks, pos = self._recheck_run()
    probs = _softmax(logits)
    j = 0
    while j < k and probs[j, toks[j + 1]] > self.dc.remask_threshold:
      j += 1
    self._append(toks[:j + 1], pos[:j + 1], self._causal(j + 1))
    if self.verify:
      for p, row in zip(pos[:j + 1], logits):
        self.kept[p - self.prompt_len + 1] = int(np.asarray(row).argmax())
    for p in pos[j + 1:]:
      self.committed.discard(p)
      del self.canvas[p - self.prompt_len]
      del self.commit_step[p - self.prompt_len]
    self.rechecked.add(s)
    self.early[s] = False
    self.recheck = None
    if j < k:
      self.branches["remask_masked_again"] += 1
      if j:
        self.branches["remask_shorter_slot"] += 1
      counts["remasked"] += 1
      counts["remasked_tokens"] += k - j
      self.start[s] = j
      self.undecided = sorted(self.undecided + [s])
      return True
    self.branches["remask_kept_whole"] += 1
    return False

  # --- one step: global verification, then commit or infill ---

  def _step(self, chosen, drafts, counts):
    """Global verification and, if needed, the parallel infill of the chosen slots;
    commits. Returns whether an EOS ended the text."""
    dc, k = self.dc, self.dc.slot_size
    slot_positions = self.slot_positions
    live = {s: slot_positions(s) for s in chosen}
    concat = [drafts[s][self.start[s] + j] for s in chosen for j in range(len(live[s]))]
    positions = [p for s in chosen for p in live[s]]
    owner = [s for s in chosen for _ in live[s]]
    firsts = {i for i in range(len(concat)) if i == 0 or owner[i] != owner[i - 1]}
    logits = self._run(concat, positions, self._causal(len(concat)))
    self._pass(counts, "global_verify")
    probs = _softmax(logits)
    prefix = len(concat)
    for j in range(len(concat)):
      if self.verify:
        # Checked where the token before it in the concatenation is its positional
        # predecessor; a slot's first token after a gap stands.
        if j in firsts and not (dc.boundary_check and j > 0
                                and positions[j - 1] == positions[j] - 1):
          continue
        if j in firsts:
          self.branches["gv_adjacent_first_checked"] += 1
        if not self._stands(probs[j - 1], concat[j]):
          prefix = j
          break
        continue
      if j in firsts:
        continue  # first token of a slot: accepted unconditionally
      if not probs[j - 1, concat[j]] > dc.token_threshold:
        prefix = j
        break
    eos_at = next((j for j in range(prefix) if concat[j] == self.eos), None)
    if eos_at is not None:
      self._commit(concat[:eos_at + 1], positions[:eos_at + 1], self._causal(eos_at + 1),
                   logits, causal_run=True)
      eos_slot = owner[eos_at]
      done = set(chosen[:chosen.index(eos_slot)])
      self.undecided = [s for s in self.undecided if s < eos_slot and s not in done]
      self.branches["eos_in_global_verify"] += 1
      return True
    whole = [s for s in chosen
             if all(i < prefix for i, o in enumerate(owner) if o == s)]
    n_whole = 0
    while n_whole < len(chosen) and chosen[n_whole] in whole:
      n_whole += 1
    if n_whole:
      n = sum(len(live[s]) for s in chosen[:n_whole])
      self._commit(concat[:n], positions[:n], self._causal(n), logits, causal_run=True)
      self.undecided = [s for s in self.undecided if s not in chosen[:n_whole]]
      self.branches["global_verify_whole_slots"] += 1
      return False
    # 3. Parallel infill, each chosen slot on its own, from its own accepted prefix
    # read from the global-verification pass (for later slots, with the earlier
    # chosen drafts in front of them). Positions are offsets in the slot; a re-masked
    # slot's committed prefix counts as accepted.
    slots = {s: list(drafts[s]) for s in chosen}
    accepted = {}
    succ = {s: [None] * k for s in chosen}  # causal argmax after each token
    stale = {s: False for s in chosen}
    base = {s: sum(len(live[o]) for o in chosen[:i]) for i, s in enumerate(chosen)}
    if self.verify:
      # The first slot: its verified prefix, its first failing draft corrected;
      # later slots start from their first token.
      s0 = chosen[0]
      accepted = {s: self.start[s] + 1 for s in chosen}
      fix = self.start[s0] + prefix
      accepted[s0] = fix + 1
      slots[s0][fix] = int(probs[prefix - 1].argmax())
      stale[s0] = True
      counts["corrected"] += 1
      for j in range(len(live[s0])):
        succ[s0][self.start[s0] + j] = int(probs[j].argmax())
      if len(chosen) > 1:
        self.branches["verify_later_slots_restart"] += 1
    else:
      for i, s in enumerate(chosen):
        a, at = self.start[s] + 1, base[s]
        while a < k and probs[at + a - self.start[s] - 1,
                              concat[at + a - self.start[s]]] > dc.token_threshold:
          a += 1
        accepted[s] = a
        if i > 0 and a > self.start[s] + 1:
          self.branches["later_slot_starts_from_its_gv_prefix"] += 1
        if i > 0 and a == k:
          self.branches["later_slot_fully_accepted_by_gv"] += 1
      assert accepted[chosen[0]] - self.start[chosen[0]] == prefix
    if any(self.start[s] for s in chosen):
      self.branches["infill_of_a_remasked_slot"] += 1
    rounds = 0
    eos_found = False
    limit = k + 1 if self.verify else k
    while rounds < limit and any(accepted[s] < k or stale[s] for s in chosen):
      rounds += 1
      pending = [s for s in chosen if accepted[s] < k]
      if pending:
        self._pass(counts, "draft")
      self._pass(counts, "verify")
      if not pending:
        counts["refresh"] += 1
        self.branches["refresh_only_verify"] += 1
      for s in pending:
        a, st = accepted[s], self.start[s]
        inp = slots[s][st:a] + [self.mask] * (k - a)
        d_logits = self._run(inp, live[s], self._causal(k - st))
        for j in range(a, k):
          slots[s][j] = int(d_logits[j - st].argmax())
      fed = chosen if rounds == 1 else [s for s in chosen if accepted[s] < k or stale[s]]
      for s in fed:
        st = self.start[s]
        v_probs = _softmax(self._run(slots[s][st:], live[s], self._causal(k - st)))
        for j in range(st, k):
          succ[s][j] = int(v_probs[j - st].argmax())
        stale[s] = False
        if accepted[s] == k:
          continue
        if self.verify:
          a = accepted[s]
          while a < k and self._stands(v_probs[a - st - 1], slots[s][a]):
            a += 1
          if a < k:
            slots[s][a] = int(v_probs[a - st - 1].argmax())
            stale[s] = True
            counts["corrected"] += 1
            self.branches["infill_corrected"] += 1
            a += 1
          accepted[s] = a
          continue
        a = accepted[s] + 1  # the first unaccepted token is always accepted
        while a < k and v_probs[a - st - 1, slots[s][a]] > dc.token_threshold:
          a += 1
        accepted[s] = a
      eos_slot = next((s for s in chosen
                       if self.eos in slots[s][self.start[s]:accepted[s]]), None)
      if eos_slot is not None:
        self.branches["eos_in_infill"] += 1
        if any(s < eos_slot and s not in chosen for s in self.undecided):
          self.branches["undecided_before_infill_eos"] += 1
        chosen = [s for s in chosen if s <= eos_slot]
        accepted[eos_slot] = k
        self.undecided = [s for s in self.undecided if s <= eos_slot]
        eos_found = True
    if rounds >= 2:
      self.branches["multi_round_infill"] += 1
    # 4. Commit in position order, cut after the first EOS. Each slot saw the context
    # and itself only (one `_commit`, so no slot sees another).
    commit_tok, commit_pos, sees, commit_succ = [], [], [], []
    n_committed = 0
    for s in chosen:
      st = self.start[s]
      toks = slots[s][st:]
      if self.eos in toks:
        toks = toks[:toks.index(self.eos) + 1]
      sees += [[len(commit_tok) + c for c in range(a + 1)] for a in range(len(toks))]
      commit_tok += toks
      commit_pos += live[s][:len(toks)]
      commit_succ += succ[s][st:st + len(toks)]
      n_committed += 1
      if self.eos in toks:
        break
    if n_committed >= 2:
      counts["multi_slot_infill_commits"] += 1
      if dc.recompute_kv:
        # Ablation: one more pass, in which the committed tokens attend causally.
        sees = self._causal(len(commit_tok))
        self._pass(counts, "recompute")
        self.branches["recompute_kv"] += 1
        commit_succ = [int(x.argmax()) for x in self._run(commit_tok, commit_pos, sees)]
    onehot = ([np.eye(1, self.model.config.vocab_size, t)[0] for t in commit_succ]
              if self.verify else None)
    self._commit(commit_tok, commit_pos, sees, onehot)
    self.undecided = [s for s in self.undecided if s not in chosen]
    return eos_found

  def _decode_left_to_right(self):
    """The ablation: slot after slot, the first token planned, then one AR token a pass."""
    k = self.dc.slot_size
    counts = collections.Counter()
    for s in range(self.dc.gen_length // k):
      self.step = counts["steps"]
      counts["steps"] += 1
      positions = [self.prompt_len + s * k + j for j in range(k)]
      logits = self._run([self.mask] * k, positions, self._causal(k))
      self._pass(counts, "plan")
      toks = [int(logits[0].argmax())]
      if self.verify and self.dc.boundary_check:
        # The first-token check: the previous token's causal argmax.
        counts["corrected"] += toks[0] != self.kept[s * k]
        toks[0] = self.kept[s * k]
      while len(toks) < k and toks[-1] != self.eos:
        logits = self._run(toks, positions[:len(toks)], self._causal(len(toks)))
        self._pass(counts, "ar")
        toks.append(int(logits[-1].argmax()))
      self.branches["ltr_eos_" + ("planned" if len(toks) == 1 else "ar")] += toks[-1] == self.eos
      if self.verify:
        last = self._run(toks, positions[:len(toks)], self._causal(len(toks)))[-1]
        self.kept[s * k + len(toks)] = int(last.argmax())
      self._commit(toks, positions[:len(toks)], self._causal(len(toks)))
      self.step_tpf[-1] = 1.0  # one pass per token
      if toks[-1] == self.eos:
        break
    return self._result(counts)

  def _commit_prompt(self, prompt):
    for i, tok in enumerate(prompt):
      self.ctx_tok.append(int(tok))
      self.ctx_pos.append(i)
      self.ctx_vis.append(list(range(i + 1)))
      self.entry[i] = i

  def _result(self, counts):
    g = self.dc.gen_length
    length = g
    for i in range(g):
      if i not in self.canvas:
        break
      if self.canvas[i] == self.eos:
        length = i + 1
        break
    assert all(i in self.canvas for i in range(length)), "the oracle left a hole before the end"
    tokens = [self.canvas[i] for i in range(length)] + [PAD_ID] * (g - length)
    counts["commit_step"] = [self.commit_step[i] for i in range(length)] + [-1] * (g - length)
    assert len(self.step_tpf) == counts["steps"]
    counts["tpf_paper"] = sum(self.step_tpf) / len(self.step_tpf)
    return tokens, length, counts


# ----------------------------------------------------------------------------
# Tests.

# Static groups (one compile each): (padded prompt length, gen_length, slot, block),
# each with the EOS id of its model (the EOS id is part of the compiled model, so a
# per-group id costs no extra compile). The ids are tokens this random model emits
# now and then, picked so that some texts end early in every group.
_GROUPS = {(6, 16, 2, 4): 24, (6, 16, 4, 8): 43, (5, 24, 2, 12): 37, (6, 32, 4, 16): 73}
_CASES_PER_GROUP = 26
_EOS_ID = 43  # the model of the (6, 16, 4, 8) group, shared by the other tests


def _cases():
  rs = np.random.RandomState(0)
  for group in _GROUPS:
    p, g, k, blk = group
    for _ in range(_CASES_PER_GROUP):
      prompt_len = int(rs.randint(1, p + 1))
      prompt = [int(x) for x in rs.randint(4, VOCAB, size=prompt_len)]
      tau_s = float(rs.choice([0.0, 0.3, 0.5, 0.7, 0.9, 1.0]))
      tau_t = float(rs.choice([0.05, 0.2, 0.4, 0.6, 0.9]))
      yield group, prompt, DecodeConfig(gen_length=g, slot_size=k, block_size=blk,
                                        slot_threshold=tau_s, token_threshold=tau_t)


@pytest.fixture(scope="module")
def models():
  return {eos: _make_model(eos_id=eos) for eos in sorted(set(_GROUPS.values()))}


@pytest.fixture(scope="module")
def eos_model(models):
  return models[_EOS_ID]


def _pad(prompts, p):
  ids = np.full((len(prompts), p), PAD_ID, np.int32)
  for i, pr in enumerate(prompts):
    ids[i, :len(pr)] = pr
  return ids, np.array([len(pr) for pr in prompts], np.int32)


def _counts_of(out, row):
  c = out.counters
  return {"plan": int(c.plan_b[row]), "global_verify": int(c.global_verify_b[row]),
          "draft": int(c.draft_b[row]), "verify": int(c.verify_b[row]),
          "steps": int(c.steps_b[row]), "recompute": int(c.recompute_b[row]),
          "ar": int(c.ar_b[row]), "corrected": int(c.corrected_b[row]),
          "refresh": int(c.refresh_b[row]), "recheck": int(c.recheck_b[row]),
          "remasked": int(c.remasked_b[row]), "remasked_tokens": int(c.remasked_tokens_b[row])}


_PASS_KINDS = ("plan", "global_verify", "draft", "verify", "steps", "recompute", "ar",
               "corrected", "refresh", "recheck", "remasked", "remasked_tokens")


def _check_case(model, group, prompt, dc, branches, where):
  """Decodes one prompt alone and checks it against the oracle; returns its length."""
  oracle_tokens, oracle_len, oracle_counts = Oracle(model, dc, branches).decode(prompt)
  ids, lens = _pad([prompt], group[0])
  out = refusion.generate(model, ids, lens, dc)
  got = [int(x) for x in out.tokens_bg[0]]
  where = f"{where}: prompt={prompt} {dc}"
  assert got == oracle_tokens, where
  assert int(out.length_b[0]) == oracle_len, where
  assert int(out.counters.tokens_b[0]) == oracle_len, where
  assert int(out.counters.prefill_b[0]) == 1, where
  want = {name: oracle_counts[name] for name in _PASS_KINDS}
  assert _counts_of(out, 0) == want, where
  # The trace view: the step at which each position was committed (-1 past the end).
  assert [int(x) for x in out.commit_step_bg[0]] == oracle_counts["commit_step"], where
  assert abs(float(out.counters.tpf_paper_b()[0]) - oracle_counts["tpf_paper"]) < 1e-5, where
  return oracle_len


def test_matches_plain_python_oracle(models):
  start = time.time()
  compiled_before = refusion.compiled_cache_size()
  branches = collections.Counter()
  n_cases = eos_hits = 0
  for group, prompt, dc in _cases():
    oracle_len = _check_case(models[_GROUPS[group]], group, prompt, dc, branches,
                             f"case {n_cases}")
    eos_hits += oracle_len < dc.gen_length
    n_cases += 1
  print(f"\n{n_cases} oracle cases, {eos_hits} ended by EOS, branches: {dict(branches)}, "
        f"{time.time() - start:.1f}s")
  assert n_cases >= 100
  for branch in ("plan_several_slots", "plan_fallback_single_best",
                 "global_verify_whole_slots", "multi_round_infill", "eos_in_global_verify",
                 "eos_in_infill", "undecided_before_infill_eos",
                 "later_slot_starts_from_its_gv_prefix", "later_slot_fully_accepted_by_gv"):
    assert branches[branch] > 0, f"branch {branch} never happened: {dict(branches)}"
  # One program per static group, however many prompts and thresholds it ran.
  assert refusion.compiled_cache_size() - compiled_before <= len(_GROUPS)


def test_live_prefix_attention_matches_plain_python_oracle(models):
  # decode.kv_chunk=3: every cached pass reads its buffer (prompt width + gen_length
  # entries, 21 to 38) three entries at a time up to the row's live prefix, the last
  # chunk overlapping the one before it where 3 does not divide the buffer.
  branches = collections.Counter()
  for n, (group, prompt, dc) in enumerate(_cases()):
    if n % _CASES_PER_GROUP < 8:
      _check_case(models[_GROUPS[group]], group, prompt, dc.replace(kv_chunk=3), branches,
                  f"case {n}, kv_chunk=3")
  assert branches["multi_round_infill"] > 0 and branches["plan_several_slots"] > 0, branches


def test_ignore_eos_decodes_every_position_like_the_oracle_without_eos(models):
  """decode.ignore_eos: EOS is an ordinary token, so the decode equals the oracle's
  for a model without EOS (every position filled), with the same program."""
  compiled_before = refusion.compiled_cache_size()
  cases = [c for c in _cases() if c[0] == (6, 16, 4, 8)][:10]
  ended_early = 0
  for group, prompt, dc in cases:
    model = models[_GROUPS[group]]
    ended_early += Oracle(model, dc, collections.Counter()).decode(prompt)[1] < dc.gen_length
    oracle = Oracle(model, dc, collections.Counter())
    oracle.eos = None
    want = oracle.decode(prompt)
    ids, lens = _pad([prompt], group[0])
    out = refusion.generate(model, ids, lens, dc.replace(ignore_eos=True))
    _check_row(out, 0, want, f"prompt={prompt} {dc}")
    assert int(out.length_b[0]) == dc.gen_length
  assert ended_early >= 2  # EOS would have ended these decodes early
  assert refusion.compiled_cache_size() - compiled_before <= 1  # the cases' own group


def _random_prompts(rs, n, p):
  return [[int(x) for x in rs.randint(4, VOCAB, size=rs.randint(1, p + 1))] for _ in range(n)]


def _check_row(out, row, oracle_result, where):
  """Tokens, length, per-kind pass counts and commit steps of one row vs the oracle."""
  tokens, length, counts = oracle_result
  assert [int(x) for x in out.tokens_bg[row]] == tokens, where
  assert int(out.length_b[row]) == length, where
  assert int(out.counters.tokens_b[row]) == length, where
  assert int(out.counters.prefill_b[row]) == 1, where
  assert _counts_of(out, row) == {name: counts[name] for name in _PASS_KINDS}, where
  assert [int(x) for x in out.commit_step_bg[row]] == counts["commit_step"], where
  assert abs(float(out.counters.tpf_paper_b()[row]) - counts["tpf_paper"]) < 1e-5, where


# ----------------------------------------------------------------------------
# The ablations, on a 2-layer model.

# One 2-layer model serves every ablation group (so the oracle's forward compiles
# once); its EOS id is picked like _GROUPS's: some texts of every group end early.
_DEEP_EOS_ID = 55
# Static groups as in _GROUPS: one compiled program each (reuse and recompute share
# one: recompute_kv is a traced flag).
_LTR_GROUPS = ((6, 16, 4, 8), (5, 24, 2, 12))
_RECOMPUTE_GROUPS = ((6, 16, 4, 8), (6, 32, 4, 16))
# (tau_s, tau_t): low slot and high token thresholds make multi-slot infills common.
_RECOMPUTE_THRESHOLDS = ((0.0, 0.9), (0.3, 0.6), (0.7, 0.2))
_KV_ATOL = 1e-5


@pytest.fixture(scope="module")
def deep_model():
  return _make_model(eos_id=_DEEP_EOS_ID, num_layers=2)


@nnx.jit
def _chunk_kv(model, ids_bt, positions_bt, mask_btt):
  """K/V of one pass over an empty cache: each entry attends exactly as the mask says."""
  empty = common.init_cache(model.config, ids_bt.shape[0], 1)
  _, k, v = model.forward_chunk(ids_bt, positions_bt, empty, mask_btt)
  return k, v


def _cache_gap(model, cache, row, tokens, positions, vis):
  """Largest |difference| between row `row` of the cache and the KV of a context.

  Context entry i (token, position) attended to the entries `vis[i]` (itself
  included); the cache (host copy) must hold exactly these entries, in this order.
  """
  n, width = len(tokens), _ORACLE_WIDTH
  assert int(cache.length_b[row]) == n
  assert [int(x) for x in cache.positions_bs[row, :n]] == list(positions)
  ids = np.zeros((1, width), np.int32)
  pos = np.zeros((1, width), np.int32)
  mask = np.eye(width, dtype=bool)[None]
  ids[0, :n] = tokens
  pos[0, :n] = positions
  for i, seen in enumerate(vis):
    mask[0, i, seen] = True
  k, v = jax.device_get(_chunk_kv(model, jnp.asarray(ids), jnp.asarray(pos), jnp.asarray(mask)))
  # Cache: per layer [B, heads, S, H]; the chunk's K/V [layers, B, T, heads, H].
  cache_k = np.stack([cache.layer(i)[0][row, :, :n] for i in range(cache.num_layers)])
  cache_v = np.stack([cache.layer(i)[1][row, :, :n] for i in range(cache.num_layers)])
  return max(float(np.abs(cache_k - k[:, 0, :n].swapaxes(1, 2)).max()),
             float(np.abs(cache_v - v[:, 0, :n].swapaxes(1, 2)).max()))


def _causal_vis(n):
  return [list(range(i + 1)) for i in range(n)]


def test_left_to_right_matches_oracle(deep_model):
  start = time.time()
  rs = np.random.RandomState(21)
  branches = collections.Counter()
  ends = []
  model = deep_model
  for p, g, k, blk in _LTR_GROUPS:
    prompts = _random_prompts(rs, 6, p)
    # Random thresholds: they play no part left to right.
    dc = DecodeConfig(gen_length=g, slot_size=k, block_size=blk, left_to_right=True,
                      slot_threshold=float(rs.rand()), token_threshold=float(rs.rand()))
    ids, lens = _pad(prompts, p)
    # The whole group as one batch: each row must equal its own single-prompt oracle.
    out, cache = jax.device_get(refusion._generate_with_cache(model, ids, lens, dc))
    for row, prompt in enumerate(prompts):
      oracle = Oracle(model, dc, branches)
      result = oracle.decode(prompt)
      where = f"row {row}: prompt={prompt} {dc}"
      _check_row(out, row, result, where)
      # One pass per token: tokens per forward is exactly 1.
      assert int(out.counters.nfe_b()[row]) == result[1], where
      # The cache is a causal run over the text in position order, except the newest
      # token (it would only be fed to predict a token after the end).
      assert oracle.ctx_vis == _causal_vis(len(oracle.ctx_tok))
      assert oracle.ctx_pos == sorted(oracle.ctx_pos)
      gap = _cache_gap(model, cache, row, oracle.ctx_tok[:-1], oracle.ctx_pos[:-1],
                       oracle.ctx_vis[:-1])
      assert gap < _KV_ATOL, (where, gap)
      ends.append(result[1] < g)
    # Blocks play no part either: another block size reuses the program, same output.
    size = refusion.compiled_cache_size()
    other = refusion.generate(model, ids, lens, dc.replace(block_size=g))
    np.testing.assert_array_equal(other.tokens_bg, out.tokens_bg)
    np.testing.assert_array_equal(other.counters.nfe_b(), out.counters.nfe_b())
    assert refusion.compiled_cache_size() == size
  print(f"\n{len(ends)} left-to-right cases, {sum(ends)} ended by EOS, branches: "
        f"{dict(branches)}, {time.time() - start:.1f}s")
  assert any(ends) and not all(ends), ends
  assert branches["ltr_eos_planned"] + branches["ltr_eos_ar"] > 0


def test_recompute_kv_matches_oracle_and_leaves_a_causal_cache(deep_model):
  start = time.time()
  rs = np.random.RandomState(31)
  branches = collections.Counter()
  n_cases = changed = reuse_not_causal = 0
  model = deep_model
  compiled_before = refusion.compiled_cache_size()
  for p, g, k, blk in _RECOMPUTE_GROUPS:
    for tau_s, tau_t in _RECOMPUTE_THRESHOLDS:
      prompts = _random_prompts(rs, 4, p)
      ids, lens = _pad(prompts, p)
      texts = {}
      for recompute in (False, True):
        dc = DecodeConfig(gen_length=g, slot_size=k, block_size=blk, slot_threshold=tau_s,
                          token_threshold=tau_t, recompute_kv=recompute)
        out, cache = jax.device_get(refusion._generate_with_cache(model, ids, lens, dc))
        for row, prompt in enumerate(prompts):
          oracle = Oracle(model, dc, branches)
          result = oracle.decode(prompt)
          counts = result[2]
          where = f"row {row}: prompt={prompt} {dc}"
          _check_row(out, row, result, where)
          # Entry by entry, the cache holds the committed context in commit order, each
          # entry the KV of what the oracle says it attended to...
          gap = _cache_gap(model, cache, row, oracle.ctx_tok, oracle.ctx_pos, oracle.ctx_vis)
          assert gap < _KV_ATOL, (where, gap)
          # ...which, with recomputation, is a causal run over it (a prefill of the
          # committed text in commit order); without, it is not after a multi-slot infill.
          causal_gap = _cache_gap(model, cache, row, oracle.ctx_tok, oracle.ctx_pos,
                                  _causal_vis(len(oracle.ctx_tok)))
          if recompute:
            assert causal_gap < _KV_ATOL, (where, causal_gap)
            assert counts["recompute"] == counts["multi_slot_infill_commits"], where
          else:
            multi = counts["multi_slot_infill_commits"] > 0
            assert (causal_gap > 100 * _KV_ATOL) == multi, (where, causal_gap)
            reuse_not_causal += multi
          texts[recompute, row] = result[0]
        n_cases += len(prompts)
      changed += sum(texts[False, r] != texts[True, r] for r in range(len(prompts)))
  print(f"\n{n_cases} prompts x (reuse, recompute), {changed} texts changed by recomputing, "
        f"{reuse_not_causal} reuse caches not causal, branches: {dict(branches)}, "
        f"{time.time() - start:.1f}s")
  assert branches["recompute_kv"] > 0 and reuse_not_causal > 0
  # Recomputed KV is what later passes attend to: the text changes, at least sometimes.
  assert changed > 0
  # Reuse and recompute (and every threshold) share one program per group.
  assert refusion.compiled_cache_size() - compiled_before <= len(_RECOMPUTE_GROUPS)


def test_batch_decodes_like_single_rows(eos_model):
  # Same static group as the oracle cases (P=6, g=16, k=4, b=8): the single-row runs
  # reuse their compiled program; the batch of 8 is one more.
  rs = np.random.RandomState(5)  # prompts where some rows meet an EOS and some do not
  prompts = _random_prompts(rs, 8, 6)
  assert len({len(p) for p in prompts}) > 2
  dc = DecodeConfig(gen_length=16, slot_size=4, block_size=8, slot_threshold=0.5,
                    token_threshold=0.2)
  ids, lens = _pad(prompts, 6)
  batch = refusion.generate(eos_model, ids, lens, dc)
  lengths = []
  for i, prompt in enumerate(prompts):
    one_ids, one_lens = _pad([prompt], 6)
    one = refusion.generate(eos_model, one_ids, one_lens, dc)
    np.testing.assert_array_equal(batch.tokens_bg[i], one.tokens_bg[0], err_msg=f"row {i}")
    np.testing.assert_array_equal(batch.commit_step_bg[i], one.commit_step_bg[0])
    assert int(batch.length_b[i]) == int(one.length_b[0])
    for name, value in batch.counters.as_dict().items():
      assert int(value[i]) == int(one.counters.as_dict()[name][0]), (i, name)
    lengths.append(int(one.length_b[0]))
  # The rows really differ in how they end and how long they ran.
  assert min(lengths) < 16 and max(lengths) == 16, lengths
  assert len(set(np.asarray(batch.counters.steps_b).tolist())) > 1


def test_second_call_compiles_nothing(eos_model):
  rs = np.random.RandomState(2)
  dc = DecodeConfig(gen_length=16, slot_size=4, block_size=8, slot_threshold=0.7,
                    token_threshold=0.4)
  ids, lens = _pad(_random_prompts(rs, 1, 6), 6)
  first = refusion.generate(eos_model, ids, lens, dc)
  size = refusion.compiled_cache_size()
  ids2, lens2 = _pad(_random_prompts(rs, 1, 6), 6)
  second = refusion.generate(eos_model, ids2, lens2, dc)
  # Thresholds are traced scalars: a sweep over them reuses the program too.
  third = refusion.generate(eos_model, ids2, lens2, dc.replace(slot_threshold=0.2,
                                                               token_threshold=0.9))
  jax.block_until_ready((first, second, third))
  assert refusion.compiled_cache_size() == size
  assert not np.array_equal(first.tokens_bg, second.tokens_bg)


def _tampered(dc, **fields):
  """A DecodeConfig whose fields were altered after its own checks ran."""
  for name, value in fields.items():
    object.__setattr__(dc, name, value)
  return dc


@pytest.mark.parametrize("fields, needle", [
    (dict(block_size=6), "block_size"),
    (dict(gen_length=20), "gen_length"),
    (dict(slot_threshold=1.5), "slot_threshold"),
    (dict(token_threshold=-0.1), "token_threshold"),
    # 3 prompt tokens + 128 > the test model's 128 positions.
    (dict(gen_length=128, block_size=16), "max_position_embeddings"),
    # The ablations: both at once make no sense, flags are bools, refusion only.
    (dict(left_to_right=True, recompute_kv=True), "cannot be combined"),
    (dict(recompute_kv=1), "recompute_kv"),
    (dict(left_to_right="yes"), "left_to_right"),
    (dict(method="ar", left_to_right=True), "method"),
])
def test_bad_parameters_fail_before_compiling(eos_model, fields, needle):
  fits_in_itself = needle == "max_position_embeddings"
  if not fits_in_itself:
    # DecodeConfig refuses them on construction...
    with pytest.raises(ValueError, match=needle):
      DecodeConfig(**{**dict(gen_length=16, slot_size=4, block_size=8), **fields})
  # ...and generate re-checks an instance changed behind its back, before tracing.
  dc = _tampered(DecodeConfig(gen_length=16, slot_size=4, block_size=8), **fields)
  size = refusion.compiled_cache_size()
  ids, lens = _pad([[5, 6, 7]], 6)
  with pytest.raises(ValueError, match=needle):
    refusion.generate(eos_model, ids, lens, dc)
  assert refusion.compiled_cache_size() == size


def test_bad_inputs_fail_before_compiling(eos_model):
  dc = DecodeConfig(gen_length=16, slot_size=4, block_size=8)
  size = refusion.compiled_cache_size()
  ids, lens = _pad([[5, 6, 7]], 6)
  no_mask = _make_model(eos_id=_EOS_ID)
  no_mask.config = no_mask.config.replace(mask_token_id=None)
  with pytest.raises(ValueError, match="mask_token_id"):
    refusion.generate(no_mask, ids, lens, dc)
  with pytest.raises(ValueError, match="prompt_len_b"):
    refusion.generate(eos_model, ids, np.array([7]), dc)
  with pytest.raises(ValueError, match="prompt_len_b"):
    refusion.generate(eos_model, ids, np.array([0]), dc)
  with pytest.raises(ValueError, match="outside the vocabulary"):
    refusion.generate(eos_model, np.array([[5, VOCAB, 0]]), np.array([2]), dc)
  with pytest.raises(ValueError, match="method"):
    refusion.generate(eos_model, ids, lens, dc.replace(method="ar"))
  with pytest.raises(ValueError, match="temperature"):
    refusion.generate(eos_model, ids, lens, dc.replace(temperature=0.7))
  assert refusion.compiled_cache_size() == size


def test_temperature_is_reproducible_per_rng(eos_model):
  rs = np.random.RandomState(3)
  # Batch 8 with the shapes of the batch test: the greedy run reuses its program.
  ids, lens = _pad(_random_prompts(rs, 8, 6), 6)
  dc = DecodeConfig(gen_length=16, slot_size=4, block_size=8, slot_threshold=0.5,
                    token_threshold=0.3, temperature=1.5)
  a = refusion.generate(eos_model, ids, lens, dc, jax.random.PRNGKey(0))
  again = refusion.generate(eos_model, ids, lens, dc, jax.random.PRNGKey(0))
  others = [refusion.generate(eos_model, ids, lens, dc, jax.random.PRNGKey(s)) for s in (1, 2)]
  np.testing.assert_array_equal(a.tokens_bg, again.tokens_bg)
  np.testing.assert_array_equal(a.counters.nfe_b(), again.counters.nfe_b())
  assert any(not np.array_equal(a.tokens_bg, o.tokens_bg) for o in others)
  greedy = refusion.generate(eos_model, ids, lens, dc.replace(temperature=0.0))
  assert not np.array_equal(a.tokens_bg, greedy.tokens_bg)
  # Sampled output still obeys the output contract.
  for out in [a] + others:
    length = np.asarray(out.length_b)
    tokens = np.asarray(out.tokens_bg)
    for row in range(tokens.shape[0]):
      assert (tokens[row, length[row]:] == PAD_ID).all()
      assert (tokens[row, :length[row] - 1] != _EOS_ID).all()
    assert (np.asarray(out.counters.tokens_b) == length).all()


def test_prefill_matches_the_full_causal_call(eos_model):
  # Right-padded prompts: the cache holds exactly each row's prompt, and the last
  # logits are those of the plain causal call at the row's last prompt token (with
  # causal attention, the padding after it cannot change them).
  prompts = [[5, 9, 30, 7], [11], [8, 8, 60]]
  ids, lens = _pad(prompts, 5)
  cache = common.init_cache(eos_model.config, 3, 7)
  cache, last_bv = nnx.jit(common.prefill)(eos_model, cache, jnp.asarray(ids), jnp.asarray(lens))
  np.testing.assert_array_equal(cache.length_b, lens)
  positions = np.broadcast_to(np.arange(5), (3, 5))
  causal = np.broadcast_to(np.tril(np.ones((5, 5), bool)), (3, 5, 5))
  full = _full_call(eos_model, jnp.asarray(ids), jnp.asarray(positions), jnp.asarray(causal))
  for i, prompt in enumerate(prompts):
    np.testing.assert_allclose(last_bv[i], full[i, len(prompt) - 1], atol=1e-4, rtol=1e-4)
    np.testing.assert_array_equal(cache.positions_bs[i, :len(prompt)], np.arange(len(prompt)))
    assert (np.asarray(cache.positions_bs[i, len(prompt):]) == -1).all()


def test_left_to_right_samples_every_token_per_rng(deep_model):
  rs = np.random.RandomState(4)
  p, g, k, blk = _LTR_GROUPS[0]
  ids, lens = _pad(_random_prompts(rs, 6, p), p)
  dc = DecodeConfig(gen_length=g, slot_size=k, block_size=blk, left_to_right=True,
                    temperature=1.5)
  runs = [refusion.generate(deep_model, ids, lens, dc, jax.random.PRNGKey(s)) for s in (0, 0, 1, 2)]
  greedy = refusion.generate(deep_model, ids, lens, dc.replace(temperature=0.0))
  runs, greedy = jax.device_get((runs, greedy))
  np.testing.assert_array_equal(runs[0].tokens_bg, runs[1].tokens_bg)
  assert any(not np.array_equal(runs[0].tokens_bg, r.tokens_bg) for r in runs[2:])
  # Where a sampled text first leaves the greedy one: if only the planned first token
  # of each slot were sampled, that would always be a slot start.
  first_changes = set()
  for out in runs:
    for row in range(ids.shape[0]):
      diff = np.flatnonzero(out.tokens_bg[row] != greedy.tokens_bg[row])
      if diff.size:
        first_changes.add(int(diff[0]) % k)
      length = int(out.length_b[row])
      assert (out.tokens_bg[row, length:] == PAD_ID).all()
      assert (out.tokens_bg[row, :length - 1] != _DEEP_EOS_ID).all()
    assert (out.counters.nfe_b() == out.length_b).all()
  assert first_changes - {0}, first_changes
