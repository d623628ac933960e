"""The jitted plan-and-infill decoder against a plain-Python oracle.

The oracle below restates ALGORITHM.md "Decoding" with Python lists for one
prompt at a time. It has no KV cache: every pass calls the model's full
causal entry point `model(ids, positions, attention_mask)` on the committed
context followed by the pass's tokens. Each committed token remembers which
context entries it attended to when it was decided, and the explicit mask
reproduces exactly that, so the per-slot independence of the infill (and of
the cache entries it leaves behind) is rebuilt from scratch.
"""

import collections
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from refusion_jax import config as config_lib
from refusion_jax.config import DecodeConfig
from refusion_jax.decode import common, refusion
from refusion_jax.model import Qwen3

VOCAB = 96
MASK_ID = 3
PAD_ID = 0
SEED = 7


def _make_model(eos_id):
  cfg = config_lib.tiny(vocab_size=VOCAB, hidden_size=32, num_layers=1, num_heads=2,
                        num_kv_heads=1, head_dim=16, mlp_dim=64, tie_embeddings=False,
                        max_position_embeddings=128, eos_token_id=eos_id, mask_token_id=MASK_ID,
                        pad_token_id=PAD_ID, bos_token_id=2)
  model = Qwen3(cfg, rngs=nnx.Rngs(SEED))
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
  """Batch-1, dynamic-shape ReFusion decoding with explicit lists."""

  def __init__(self, model, dc: DecodeConfig, branches: collections.Counter):
    self.model = model
    self.dc = dc
    self.eos = model.config.eos_token_id
    self.mask = model.config.mask_token_id
    self.branches = branches

  # Committed context: parallel lists of token, position, and the context indices the
  # entry attended to when it was computed (itself included).
  def _run(self, tokens, positions, sees):
    """Logits of the pass tokens; `sees[a]` lists the pass tokens that token a sees."""
    n, t = len(self.ctx_tok), len(tokens)
    mask = np.zeros((n + t, n + t), bool)
    for i, vis in enumerate(self.ctx_vis):
      mask[i, vis] = True
    for a in range(t):
      mask[n + a, :n] = True
      for c in sees[a]:
        mask[n + a, n + c] = True
    # Padded to a fixed length (the padding is attended by nobody) only so that one
    # compiled forward serves every pass; the real tokens' logits are unaffected.
    width = _ORACLE_WIDTH
    assert n + t <= width
    ids = np.zeros((1, width), np.int32)
    pos = np.zeros((1, width), np.int32)
    full_mask = np.eye(width, dtype=bool)[None]
    ids[0, :n + t] = self.ctx_tok + list(tokens)
    pos[0, :n + t] = self.ctx_pos + list(positions)
    full_mask[0, :n + t, :n + t] = mask
    logits = _full_call(self.model, jnp.asarray(ids), jnp.asarray(pos), jnp.asarray(full_mask))
    return np.asarray(logits[0, n:n + t], np.float64)

  def _commit(self, tokens, positions, sees):
    n = len(self.ctx_tok)
    for a, (tok, pos) in enumerate(zip(tokens, positions)):
      self.ctx_tok.append(int(tok))
      self.ctx_pos.append(int(pos))
      self.ctx_vis.append(list(range(n)) + [n + c for c in sees[a]])
      self.canvas[pos - self.prompt_len] = int(tok)
      self.commit_step[pos - self.prompt_len] = self.step

  @staticmethod
  def _causal(t):
    return [list(range(a + 1)) for a in range(t)]

  def decode(self, prompt):
    dc, k = self.dc, self.dc.slot_size
    n_slots = dc.block_size // k
    self.prompt_len = len(prompt)
    self.ctx_tok, self.ctx_pos, self.ctx_vis = [], [], []
    self.canvas, self.commit_step = {}, {}
    self._commit_prompt(prompt)
    counts = collections.Counter()
    eos_found = False
    for blk in range(dc.num_blocks):
      def slot_positions(s):
        start = self.prompt_len + blk * dc.block_size + s * k
        return list(range(start, start + k))

      undecided = list(range(n_slots))
      while undecided:
        self.step = counts["steps"]
        counts["steps"] += 1
        # 1. Plan.
        positions = [p for s in undecided for p in slot_positions(s)]
        logits = self._run([self.mask] * len(positions), positions, self._causal(len(positions)))
        counts["plan"] += 1
        probs = _softmax(logits)
        draft = probs.argmax(-1)
        drafts, score = {}, {}
        for i, s in enumerate(undecided):
          drafts[s] = [int(x) for x in draft[i * k:(i + 1) * k]]
          score[s] = probs[i * k, draft[i * k]]
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
        # 2. Global verification over the concatenation.
        concat = [tok for s in chosen for tok in drafts[s]]
        positions = [p for s in chosen for p in slot_positions(s)]
        logits = self._run(concat, positions, self._causal(len(concat)))
        counts["global_verify"] += 1
        probs = _softmax(logits)
        prefix = len(concat)
        for j in range(len(concat)):
          if j % k == 0:
            continue  # first token of a slot: accepted unconditionally
          if not probs[j - 1, concat[j]] > dc.token_threshold:
            prefix = j
            break
        eos_at = next((j for j in range(prefix) if concat[j] == self.eos), None)
        if eos_at is not None:
          self._commit(concat[:eos_at + 1], positions[:eos_at + 1], self._causal(eos_at + 1))
          eos_slot = chosen[eos_at // k]
          done = set(chosen[:eos_at // k])
          undecided = [s for s in undecided if s < eos_slot and s not in done]
          eos_found = True
          self.branches["eos_in_global_verify"] += 1
          continue
        n_whole = prefix // k
        if n_whole:
          self._commit(concat[:n_whole * k], positions[:n_whole * k],
                       self._causal(n_whole * k))
          undecided = [s for s in undecided if s not in chosen[:n_whole]]
          self.branches["global_verify_whole_slots"] += 1
          continue
        # 3. Parallel infill, each chosen slot on its own.
        slots = {s: list(drafts[s]) for s in chosen}
        accepted = {s: 1 for s in chosen}
        accepted[chosen[0]] = prefix
        rounds = 0
        while rounds < k and any(accepted[s] < k for s in chosen):
          rounds += 1
          counts["draft"] += 1
          counts["verify"] += 1
          for s in chosen:
            if accepted[s] == k:
              continue
            a = accepted[s]
            inp = slots[s][:a] + [self.mask] * (k - a)
            d_logits = self._run(inp, slot_positions(s), self._causal(k))
            for j in range(a, k):
              slots[s][j] = int(d_logits[j].argmax())
          for s in chosen:
            if accepted[s] == k:
              continue
            v_probs = _softmax(self._run(slots[s], slot_positions(s), self._causal(k)))
            a = accepted[s] + 1  # the first unaccepted token is always accepted
            while a < k and v_probs[a - 1, slots[s][a]] > dc.token_threshold:
              a += 1
            accepted[s] = a
          eos_slot = next((s for s in chosen if self.eos in slots[s][:accepted[s]]), None)
          if eos_slot is not None:
            self.branches["eos_in_infill"] += 1
            if any(s < eos_slot and s not in chosen for s in undecided):
              self.branches["undecided_before_infill_eos"] += 1
            chosen = [s for s in chosen if s <= eos_slot]
            accepted[eos_slot] = k
            undecided = [s for s in undecided if s <= eos_slot]
            eos_found = True
        if rounds >= 2:
          self.branches["multi_round_infill"] += 1
        # 4. Commit in position order, cut after the first EOS.
        for s in chosen:
          toks = slots[s]
          if self.eos in toks:
            toks = toks[:toks.index(self.eos) + 1]
          self._commit(toks, slot_positions(s)[:len(toks)], self._causal(len(toks)))
          if self.eos in toks:
            break
        undecided = [s for s in undecided if s not in chosen]
      if eos_found:
        break
    return self._result(counts)

  def _commit_prompt(self, prompt):
    for i, tok in enumerate(prompt):
      self.ctx_tok.append(int(tok))
      self.ctx_pos.append(i)
      self.ctx_vis.append(list(range(i + 1)))

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
    return tokens, length, counts


# ----------------------------------------------------------------------------
# Tests.

# Static groups (one compile each): (padded prompt length, gen_length, slot, block),
# each with the EOS id of its model (the EOS id is part of the compiled model, so a
# per-group id costs no extra compile). The ids are tokens this random model emits
# now and then, picked so that some texts end early in every group.
_GROUPS = {(6, 16, 2, 4): 24, (6, 16, 4, 8): 43, (5, 24, 2, 12): 37, (6, 32, 4, 16): 73}
_CASES_PER_GROUP = 20
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
          "steps": int(c.steps_b[row])}


def test_matches_plain_python_oracle(models):
  start = time.time()
  compiled_before = refusion.compiled_cache_size()
  branches = collections.Counter()
  n_cases = eos_hits = 0
  for group, prompt, dc in _cases():
    model = models[_GROUPS[group]]
    oracle_tokens, oracle_len, oracle_counts = Oracle(model, dc, branches).decode(prompt)
    ids, lens = _pad([prompt], group[0])
    out = refusion.generate(model, ids, lens, dc)
    got = [int(x) for x in out.tokens_bg[0]]
    where = f"case {n_cases}: prompt={prompt} {dc}"
    assert got == oracle_tokens, where
    assert int(out.length_b[0]) == oracle_len, where
    assert int(out.counters.tokens_b[0]) == oracle_len, where
    assert int(out.counters.prefill_b[0]) == 1, where
    want = {name: oracle_counts[name] for name in ("plan", "global_verify", "draft", "verify",
                                                   "steps")}
    assert _counts_of(out, 0) == want, where
    # The trace view: the step at which each position was committed (-1 past the end).
    assert [int(x) for x in out.commit_step_bg[0]] == oracle_counts["commit_step"], where
    eos_hits += oracle_len < dc.gen_length
    n_cases += 1
  print(f"\n{n_cases} oracle cases, {eos_hits} ended by EOS, branches: {dict(branches)}, "
        f"{time.time() - start:.1f}s")
  assert n_cases >= 50
  for branch in ("plan_several_slots", "plan_fallback_single_best",
                 "global_verify_whole_slots", "multi_round_infill", "eos_in_global_verify",
                 "eos_in_infill", "undecided_before_infill_eos"):
    assert branches[branch] > 0, f"branch {branch} never happened: {dict(branches)}"
  # One program per static group, however many prompts and thresholds it ran.
  assert refusion.compiled_cache_size() - compiled_before <= len(_GROUPS)


def _random_prompts(rs, n, p):
  return [[int(x) for x in rs.randint(4, VOCAB, size=rs.randint(1, p + 1))] for _ in range(n)]


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
