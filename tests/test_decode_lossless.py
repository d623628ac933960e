"""Lossless ReFusion decoding (decode.verify='lossless', decode/lossless.py).

* A plain-Python, dynamic-shape oracle (lists, no KV cache: every pass calls the
  model's full causal entry point on the prompt, the final tokens and the pass's feed)
  restates the module docstring; the jitted program matches its tokens and its pass
  and correction counts, greedy and sampled, EOS inside the window included.
* Greedy: token-identical to decode.method='ar' over a grid of slot sizes, windows and
  thresholds, on random models and on the shipped trained one; sampled: identical to
  AR's tokens with the same rng (each index draws from its own key), and the answers'
  distribution is the model's exact AR distribution (enumerated on a small vocabulary),
  which the release's sampler at the same settings is not.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs.common import TINY_TEST
from refusion_jax import config as config_lib
from refusion_jax import evaluate, loading
from refusion_jax.decode import engine, heads
from refusion_jax.decode import live as live_lib
from refusion_jax.decode import program as program_lib
from refusion_jax.decode.settings import DecodeConfig
from refusion_jax.model import Transformer
from tests.conftest import drive_live_batch
from tests.test_decode_refusion import MASK_ID, PAD_ID, _full_call, _make_model, _pad

_WIDTH = 64  # the oracle's padded call (one compiled forward for every pass)


def _pick(logits, index, dc, key):
  """The AR decoder's pick at response index `index` (temperature: Gumbel noise from the
  index's key, the same per-column draw `heads` makes)."""
  logits = np.asarray(logits, np.float64)
  if dc.temperature <= 0:
    return int(logits.argmax())
  k = jax.random.fold_in(jax.random.fold_in(jax.random.key_data(key), index), 0)
  noise = np.asarray(heads._noise(k[None, None], 0, logits.shape[-1])[0, 0],  # pylint: disable=protected-access
                     np.float64)
  return int((logits / dc.temperature + noise).argmax())


def _probs(logits):
  x = np.asarray(logits, np.float64)
  e = np.exp(x - x.max())
  return e / e.sum()


class Oracle:
  """Batch-1 lossless decoding with lists (decode/lossless.py's docstring)."""

  def __init__(self, model, dc: DecodeConfig, key):
    self.model, self.dc, self.key = model, dc, key
    cfg = model.config
    self.stops = {cfg.eos_token_id} | set(getattr(cfg, "stop_token_ids", ()))

  def _call(self, ids, positions, hidden=()):
    """Logits of a causal run over `ids`, except that no entry of `hidden` (pairs of
    entry indices: (who, whom)) sees the other."""
    n = len(ids)
    assert n <= _WIDTH
    a = np.zeros((1, _WIDTH), np.int32)
    p = np.zeros((1, _WIDTH), np.int32)
    a[0, :n], p[0, :n] = ids, positions
    mask = np.tril(np.ones((_WIDTH, _WIDTH), bool))[None]
    for who, whom in hidden:
      mask[0, who, whom] = False
    return np.asarray(_full_call(self.model, jnp.asarray(a), jnp.asarray(p), jnp.asarray(mask))[0],
                      np.float64)

  def _p(self, logits):
    """The distribution a pick is drawn from: softmax(logits / T) (T 0: the plain one)."""
    return _probs(logits / self.dc.temperature if self.dc.temperature > 0 else logits)

  def _chosen(self, masks, probs, final, step):
    """Mask indices kept as drafts: every mask of a chosen slot (`final` tokens are
    final, at the row's pass `step`: the selection policy's inputs)."""
    del final, step
    k = self.dc.slot_size
    first = {}
    for i in masks:
      first.setdefault(i // k, i)
    leftmost = min((i // k for i in masks), default=None)
    chosen = {s for s, i in first.items() if probs[i] > self.dc.slot_threshold or s == leftmost}
    return {i for i in masks if i // k in chosen}

  def decode(self, prompt):
    dc, g = self.dc, self.dc.gen_length
    w = min(dc.block_size, g)
    plen = len(prompt)
    # The prefill: the prompt, then the first window's masks (index 0 included).
    logits = self._call(list(prompt) + [MASK_ID] * w, list(range(plen + w)))
    final = [_pick(logits[plen - 1], 0, dc, self.key)]
    picks = {i: _pick(logits[plen + i], i, dc, self.key) for i in range(1, w)}
    probs = {i: self._p(logits[plen + i])[picks[i]] for i in range(1, w)}
    drafts = {i: picks[i] for i in self._chosen(list(range(1, w)), probs, 1, 0)}
    passes, corrected, fresh = 1, 0, False
    done = final[0] in self.stops or g <= 1
    while not done:
      f = len(final)
      window = range(f - 1, min(f - 1 + w, g))
      toks = [f - 1] + [i for i in window if i >= f and i in drafts]
      # A fresh pass (after a correction) plans every index afresh, its masks seeing
      # the final context and each other only.
      masks = [i for i in window if i >= f and (fresh or i not in drafts)]
      ids = list(prompt) + final[:-1] + [final[-1]] + [drafts[i] for i in toks[1:]] + [
          MASK_ID] * len(masks)
      positions = list(range(plen + f - 1)) + [plen + i for i in toks + masks]
      base = plen + f - 1
      hidden = [(base + len(toks) + m, base + t) for m in range(len(masks))
                for t in range(1, len(toks))] if fresh else []
      logits = self._call(ids, positions, hidden)[base:]
      passes += 1
      # The causal pick after each token entry, the pick at each mask.
      nxt = {i: _pick(logits[j], i + 1, dc, self.key) for j, i in enumerate(toks)}
      mpick = {i: _pick(logits[len(toks) + j], i, dc, self.key) for j, i in enumerate(masks)}
      mprob = {i: self._p(logits[len(toks) + j])[mpick[i]] for j, i in enumerate(masks)}
      # Check the chain.
      i = f
      while i in drafts and i - 1 in nxt and drafts[i] == nxt[i - 1] and i < g:
        final.append(drafts[i])
        if drafts[i] in self.stops:
          done = True
          break
        i += 1
      if done:
        break
      fixed = i in drafts  # the new head replaces a draft that failed
      if i < g:
        final.append(nxt[i - 1])
        corrected += fixed
        done = final[-1] in self.stops
      done = done or len(final) >= g
      if done:
        break
      chosen = self._chosen(masks, mprob, f, passes - 1)
      new = {}
      for j in range(i + 1, min(f - 1 + w + 1, g)):
        if j - 1 in nxt and not (fixed and fresh):
          new[j] = nxt[j - 1]  # its slot's next token (a stale one after a correction)
        elif j in chosen:
          new[j] = mpick[j]
        elif j in drafts:
          new[j] = drafts[j]
      drafts = new
      fresh = fixed and not fresh
    return final, passes, corrected


class PolicyOracle(Oracle):
  """The selection policy's plan (decode.planner='policy'): the window's slots, counted
  from the head's, each with its features (lossless.plan_features), chosen when drawn
  (plan_sample: uniform 1 + s of the row's pass) or above one half, the most likely when
  none is; every plan kept in `self.plans` as (features {slot: [...]}, chosen slots)."""

  def __init__(self, model, dc, key):
    super().__init__(model, dc, key)
    weights = [float(x) for x in dc.plan_weights_on]
    self.w, self.b = weights[:-1], weights[-1]
    self.plans = []

  def _chosen(self, masks, probs, final, step):
    k, g = self.dc.slot_size, self.dc.gen_length
    w = min(self.dc.block_size, g)
    n = (w + k - 2) // k + 1
    head = final - 1
    by_slot = {}
    for i in sorted(masks):
      by_slot.setdefault(i // k - head // k, []).append(i)
    if not by_slot:
      self.plans.append(({}, set()))
      return set()
    leftmost = min(by_slot)
    feats, logit = {}, {}
    for s, idx in by_slot.items():
      feats[s] = [probs[idx[0]], float(np.mean([probs[i] for i in idx])), (s - leftmost) / n,
                  float(idx[0] - 1 not in masks), final / g]
      logit[s] = sum(a * b for a, b in zip(self.w, feats[s])) + self.b
    raw = jax.random.key_data(self.key)
    if self.dc.plan_sample:
      u = {s: float(jax.random.uniform(jax.random.fold_in(jax.random.fold_in(raw, step),
                                                          1 + s))) for s in by_slot}
      chosen = {s for s in by_slot if u[s] < 1 / (1 + np.exp(-logit[s]))}
    else:
      chosen = {s for s in by_slot if logit[s] > 0}
    if not chosen:
      chosen = {max(sorted(by_slot), key=lambda s: logit[s])}
    self.plans.append((feats, chosen))
    return {i for s in chosen for i in by_slot[s]}


def _grid():
  for k, blk, tau_s in itertools.product((1, 2, 4), (4, 8), (0.0, 0.7)):
    if blk % k == 0:
      yield k, blk, tau_s


@pytest.fixture(scope="module")
def model():
  return _make_model(eos_id=71, num_layers=2)  # EOS often inside the window (seed 1's prompts)


def _prompts(n, p, seed=0):
  rs = np.random.RandomState(seed)
  return [[int(x) for x in rs.randint(4, 96, size=int(rs.randint(1, p + 1)))]
          for _ in range(n)]


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_matches_the_plain_python_oracle(model, temperature):
  prompts = _prompts(6, 6, seed=1)
  ids, lens = _pad(prompts, 6)
  key = jax.random.key(5)
  ended_early = 0
  for k, blk, tau_s in _grid():
    dc = DecodeConfig(gen_length=16, slot_size=k, block_size=blk, slot_threshold=tau_s,
                      verify="lossless", temperature=temperature)
    out = engine.Decoder(model, dc).generate(ids, lens, key)
    for row, prompt in enumerate(prompts):
      pkey = jax.random.fold_in(key, row)  # the engine's key of prompt `row`
      tokens, passes, corrected = Oracle(model, dc, pkey).decode(prompt)
      where = f"k={k} block={blk} tau_s={tau_s} T={temperature} prompt={prompt}"
      n = int(out.length_b[row])
      assert [int(x) for x in out.tokens_bg[row, :n]] == tokens, where
      assert int(out.counters.nfe_b()[row]) == int(out.counters.fused_b[row]) == passes, where
      assert int(out.counters.corrected_b[row]) == corrected, where
      ended_early += n < 16
  assert ended_early > 0  # EOS came inside some window


@pytest.mark.parametrize("temperature,plan_sample", [(0.0, True), (0.9, False)])
def test_the_policy_planner_matches_the_plain_python_oracle_and_answers_as_ar(
    model, temperature, plan_sample):
  """decode.planner='policy' under lossless decoding: the window's slots chosen by the
  selection policy (random weights: every kind of choice), recorded as the decoder made
  them; the tokens are AR's whatever it chooses, the passes the oracle's."""
  prompts = _prompts(6, 6, seed=1)
  ids, lens = _pad(prompts, 6)
  key = jax.random.key(7)
  ar = engine.Decoder(model, DecodeConfig(method="ar", gen_length=16, temperature=temperature)
                      ).generate(ids, lens, key)
  rs = np.random.RandomState(0)
  passes_seen = set()
  for k, weights in ((2, tuple(rs.normal(0, 3, 6))), (4, tuple(rs.normal(0, 3, 6))),
                     (4, (0.0,) * 5 + (-1.0,))):
    dc = DecodeConfig(gen_length=16, slot_size=k, block_size=8, verify="lossless",
                      temperature=temperature, planner="policy", plan_weights=weights,
                      plan_sample=plan_sample, record=True)
    out = engine.Decoder(model, dc).generate(ids, lens, key)
    for row, prompt in enumerate(prompts):
      oracle = PolicyOracle(model, dc, jax.random.fold_in(key, row))
      tokens, passes, _ = oracle.decode(prompt)
      where = f"k={k} weights={weights} prompt={prompt}"
      n = int(out.length_b[row])
      assert [int(x) for x in out.tokens_bg[row, :n]] == tokens, where
      assert tokens == [int(x) for x in ar.tokens_bg[row, :int(ar.length_b[row])]], where
      assert int(out.counters.nfe_b()[row]) == passes, where
      passes_seen.add((k, weights[0], row, passes))
      fed, chosen = out.trace["plan_fed"][row], out.trace["plan_chosen"][row]
      feats = out.trace["plan_feats"][row]
      for t, (want_feats, want_chosen) in enumerate(oracle.plans):
        assert {int(s) for s in np.flatnonzero(fed[t])} == set(want_feats), (where, t)
        assert {int(s) for s in np.flatnonzero(chosen[t])} == want_chosen, (where, t)
        for s_, f in want_feats.items():
          np.testing.assert_allclose(feats[t, s_], f, atol=1e-5, err_msg=f"{where} {t}")
  # Different plans took different numbers of passes somewhere (the choice matters).
  by_row = {}
  for k, _, row, passes in passes_seen:
    by_row.setdefault((k, row), set()).add(passes)
  assert any(len(v) > 1 for v in by_row.values())


def _decode(model, prompts, dc, key=None, width=None):
  ids, lens = _pad(prompts, width or max(map(len, prompts)))
  out = engine.Decoder(model, dc).generate(ids, lens, key if key is not None
                                           else jax.random.key(0))
  return [[int(x) for x in out.tokens_bg[r, :int(out.length_b[r])]]
          for r in range(len(prompts))], out


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_answer_is_ar_decodings_on_a_random_model(model, temperature):
  prompts = _prompts(8, 6, seed=1)
  key = jax.random.key(2)
  want, _ = _decode(model, prompts, DecodeConfig(method="ar", gen_length=24,
                                                 temperature=temperature), key)
  for k, blk, tau_s in ((1, 8, 0.0), (4, 8, 0.9), (4, 24, 0.3), (8, 8, 1.0), (3, 12, 0.5)):
    got, out = _decode(model, prompts, DecodeConfig(
        gen_length=24, slot_size=k, block_size=blk, slot_threshold=tau_s,
        token_threshold=0.9, verify="lossless", temperature=temperature), key)
    assert got == want, (k, blk, tau_s)
  assert any(len(a) < 24 for a in want)  # some answers end at EOS


def test_the_answer_is_ar_decodings_on_the_trained_model_in_fewer_passes():
  _, trained = loading.load_model("refusion_tiny")
  tok = loading.load_tokenizer("refusion_tiny", trained.config)
  prompts = [p.prompt_ids for p in evaluate.read_problems(TINY_TEST, tok, per_task=2)]
  want, ar = _decode(trained, prompts, DecodeConfig(method="ar", gen_length=32))
  for k, blk, tau_s in ((4, 16, 0.0), (8, 32, 0.9), (2, 8, 0.5)):
    got, out = _decode(trained, prompts, DecodeConfig(
        gen_length=32, slot_size=k, block_size=blk, slot_threshold=tau_s, verify="lossless"))
    assert got == want, (k, blk, tau_s)
    # Drafts pass: fewer passes than tokens (AR's nfe).
    assert int(out.counters.nfe_b().sum()) < 0.7 * int(ar.counters.nfe_b().sum())


def test_rows_decode_as_they_do_alone(model):
  prompts = _prompts(5, 6, seed=3)
  dc = DecodeConfig(gen_length=16, slot_size=2, block_size=8, verify="lossless")
  together, _ = _decode(model, prompts, dc, width=6)
  for row, prompt in enumerate(prompts):
    alone, _ = _decode(model, [prompt], dc, width=6)
    assert alone[0] == together[row], row


def test_the_engine_admits_rows_mid_run_and_answers_as_ar(model):
  # 7 prompts through 3 engine rows: each admitted as a row frees (continuous batching).
  prompts = _prompts(7, 6, seed=1)
  want, _ = _decode(model, prompts, DecodeConfig(method="ar", gen_length=16), width=6)
  dc = DecodeConfig(gen_length=16, slot_size=2, block_size=8, verify="lossless")
  res = engine.Decoder(model, dc).engine(rows=3).run(prompts)
  assert [[int(x) for x in r.tokens] for r in res.results] == want


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_servers_live_batch_answers_as_ar(model, temperature):
  """The server's path (decode/live.py): prompts join rows as they free up, a few passes
  at a time; each answer is AR's with the same prompt key, its text a growing prefix."""
  prompts = _prompts(5, 6, seed=1)
  rng = jax.random.key(3)
  want, _ = _decode(model, prompts, DecodeConfig(method="ar", gen_length=16,
                                                 temperature=temperature), rng, width=6)
  dc = DecodeConfig(gen_length=16, slot_size=2, block_size=8, verify="lossless",
                    temperature=temperature)

  def streamed_prefixes(snap, jobs):  # what a stream may send: final tokens, never revised
    for r, i in enumerate(jobs):
      if i is not None:
        prefix = [int(t) for t in snap.tokens_bg[r, :snap.prefix_b()[r]]]
        assert prefix == want[i][:len(prefix)], (i, prefix)

  got = drive_live_batch(live_lib.LiveBatch(engine.Decoder(model, dc), 2, 8), prompts,
                         program_lib.raw_key(rng), 1, streamed_prefixes)
  assert got == dict(enumerate(want))


def test_a_clashing_option_is_one_line_before_compiling():
  with pytest.raises(ValueError, match=r"decode.verify='lossless' checks every token causally "
                     r".*; got left_to_right=True"):
    DecodeConfig(gen_length=16, slot_size=2, block_size=8, verify="lossless",
                 left_to_right=True)


def _enumerate_ar(model, prompt, gen_length, temperature, stops):
  """The AR distribution over every answer (a dict answer -> probability)."""
  dist = {(): 1.0}
  out = {}
  while dist:
    nxt = {}
    for prefix, p in dist.items():
      ids = list(prompt) + list(prefix)
      n = len(ids)
      a = np.zeros((1, _WIDTH), np.int32)
      a[0, :n] = ids
      pos = np.arange(_WIDTH, dtype=np.int32)[None]
      mask = np.tril(np.ones((_WIDTH, _WIDTH), bool))[None]
      logits = np.asarray(_full_call(model, jnp.asarray(a), jnp.asarray(pos),
                                     jnp.asarray(mask))[0, n - 1], np.float64)
      q = _probs(logits / temperature)
      for t in np.nonzero(q > 1e-12)[0]:
        ans = prefix + (int(t),)
        if int(t) in stops or len(ans) >= gen_length:
          out[ans] = out.get(ans, 0.0) + p * q[t]
        else:
          nxt[ans] = p * q[t]
    dist = nxt
  return out


def _small_model():
  cfg = config_lib.tiny(vocab_size=8, hidden_size=32, num_layers=1, num_heads=2,
                        num_kv_heads=1, head_dim=16, mlp_dim=64, tie_embeddings=False,
                        max_position_embeddings=64, eos_token_id=4, mask_token_id=MASK_ID,
                        pad_token_id=PAD_ID, bos_token_id=2)
  m = Transformer(cfg, rngs=nnx.Rngs(11))
  m.lm_head[...] = m.lm_head[...] * 6.0  # spread the probabilities over (0, 1)
  return m


def _chi2_sigmas(counts, probs):
  """Pearson's statistic of observed counts against probabilities (outcomes of small
  expectation pooled), in standard deviations above its mean (chi-square with df
  degrees of freedom: mean df, variance 2 df)."""
  n = sum(counts.values())
  keys = sorted(probs, key=lambda a: -probs[a])
  obs, exp, pool_o, pool_e = [], [], 0, 0.0
  for a in keys:
    if n * probs[a] >= 5:
      obs.append(counts.get(a, 0))
      exp.append(n * probs[a])
    else:
      pool_o += counts.get(a, 0)
      pool_e += n * probs[a]
  pool_o += sum(c for a, c in counts.items() if a not in probs)
  if pool_e > 0:
    obs.append(pool_o)
    exp.append(pool_e)
  obs, exp = np.asarray(obs, np.float64), np.asarray(exp)
  stat, df = float(((obs - exp) ** 2 / exp).sum()), len(obs) - 1
  return (stat - df) / np.sqrt(2 * df)


def test_sampled_answers_follow_the_exact_ar_distribution_and_the_releases_do_not():
  m = _small_model()
  prompt, g, t = [5, 6, 7], 3, 1.0
  exact = _enumerate_ar(m, prompt, g, t, {4})
  assert abs(sum(exact.values()) - 1) < 1e-9
  n = 4000
  def sample(**fields):
    answers, _ = _decode(m, [prompt] * n, DecodeConfig(gen_length=g, temperature=t,
                                                       **fields), jax.random.key(1))
    counts = {}
    for a in answers:
      counts[tuple(a)] = counts.get(tuple(a), 0) + 1
    return counts
  lossless_counts = sample(slot_size=1, block_size=3, slot_threshold=0.0, verify="lossless")
  assert _chi2_sigmas(lossless_counts, exact) < 5
  release = sample(slot_size=1, block_size=3, slot_threshold=0.0)
  assert _chi2_sigmas(release, exact) > 20


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_recorded_probabilities_are_the_answers_ar_likelihood(model, temperature):
  """decode.record: each final token's probability under softmax(logits / T); their log
  sum is the answer's AR log-likelihood at T from one independent causal forward."""
  prompts = _prompts(4, 6, seed=1)
  got, out = _decode(model, prompts, DecodeConfig(
      gen_length=16, slot_size=2, block_size=8, verify="lossless", temperature=temperature,
      record=True), jax.random.key(4), width=6)
  p = np.asarray(out.trace["p"], np.float64)
  for row, (prompt, answer) in enumerate(zip(prompts, got)):
    ids = list(prompt) + answer
    n = len(ids)
    a = np.zeros((1, _WIDTH), np.int32)
    a[0, :n] = ids
    mask = np.tril(np.ones((_WIDTH, _WIDTH), bool))[None]
    logits = np.asarray(_full_call(model, jnp.asarray(a), jnp.asarray(np.arange(_WIDTH)[None]),
                                   jnp.asarray(mask))[0], np.float64)
    want = sum(np.log(_probs(logits[len(prompt) - 1 + i] / temperature)[t])
               for i, t in enumerate(answer))
    assert abs(np.log(p[row, :len(answer)]).sum() - want) < 1e-4 * max(1, len(answer)), row
    assert (p[row, len(answer):] == 1).all()
