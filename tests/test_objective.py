"""Tests for refusion_jax/objective.py against plain-Python / numpy oracles."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.extend import core as jax_core

from refusion_jax import config as config_lib
from refusion_jax import objective as obj
from refusion_jax.model import Qwen3, Unembed

MASK = 3
PAD = 0
EOS = 1


# ---------------------------------------------------------------- oracles


def oracle_layout(tokens, p, r, k, masked_bits, order_keys, seq_len):
  """Plain-Python ReFusion layout of one example from explicit draws."""
  n_slots = math.ceil(r / k)
  slots = [(p + s * k, min(k, r - s * k)) for s in range(n_slots)]
  clean = [s for s in range(n_slots) if not masked_bits[s]]
  masked = [s for s in range(n_slots) if masked_bits[s]]
  clean.sort(key=lambda s: (order_keys[s], s))
  ids, pos, labels, kinds = [], [], [], []
  for i in range(p):
    ids.append(tokens[i]); pos.append(i); labels.append(PAD); kinds.append(0)
  for s in clean:
    start, length = slots[s]
    for j in range(length):
      ids.append(tokens[start + j]); pos.append(start + j)
      if j < length - 1:
        labels.append(tokens[start + j + 1]); kinds.append(1)
      else:
        labels.append(PAD); kinds.append(0)
  for s in masked:
    start, length = slots[s]
    for j in range(length):
      ids.append(MASK); pos.append(start + j); labels.append(tokens[start + j]); kinds.append(2)
  for i in range(p + r, seq_len):
    ids.append(PAD); pos.append(i); labels.append(PAD); kinds.append(0)
  return ids, pos, labels, kinds


def np_ce(logits_v, label):
  x = np.asarray(logits_v, np.float64)
  m = x.max()
  return float(m + np.log(np.exp(x - m).sum()) - x[label])


def random_batch(rng, batch, seq_len, vocab=50, min_resp=1):
  """Random right-padded batch with prompt + response <= seq_len."""
  tokens = np.full((batch, seq_len), PAD, np.int32)
  p = np.zeros(batch, np.int32)
  r = np.zeros(batch, np.int32)
  for b in range(batch):
    p[b] = rng.integers(0, seq_len - min_resp + 1)
    r[b] = rng.integers(min_resp, seq_len - p[b] + 1)
    tokens[b, :p[b] + r[b]] = rng.integers(4, vocab, p[b] + r[b])
  return tokens, p, r


@functools.cache
def corrupt_jit(slot_sizes):
  return jax.jit(functools.partial(obj.refusion_corrupt, mask_id=MASK, pad_id=PAD,
                                   slot_sizes=slot_sizes))


from_draws_jit = jax.jit(functools.partial(obj.refusion_corrupt_from_draws, mask_id=MASK,
                                           pad_id=PAD))
mdm_corrupt_jit = jax.jit(functools.partial(obj.mdm_corrupt, mask_id=MASK, eos_id=EOS,
                                            pad_id=PAD))


# ------------------------------------------------------- hand-worked cases


def make_draws(k, masked, keys, p=0.5):
  return obj.RefusionDraws(
      slot_size_b=jnp.array([k], jnp.int32), t_b=jnp.array([p], jnp.float32),
      p_b=jnp.array([p], jnp.float32), slot_masked_bs=jnp.array([masked], bool),
      slot_order_key_bs=jnp.array([keys], jnp.float32))


@pytest.mark.parametrize(
    "resp,masked,keys,want_ids,want_pos,want_labels,want_kind",
    [
        # Prompt [10, 11], response [20 21 | 22 23], k=2, slot 0 masked.
        ([20, 21, 22, 23], [True, False, False, False], [.1, .2, .3, .4],
         [10, 11, 22, 23, MASK, MASK, PAD, PAD], [0, 1, 4, 5, 2, 3, 6, 7],
         [PAD, PAD, 23, PAD, 20, 21, PAD, PAD], [0, 0, 1, 0, 2, 2, 0, 0]),
        # Both slots clean, keys put slot 1 first.
        ([20, 21, 22, 23], [False, False, False, False], [.9, .2, .3, .4],
         [10, 11, 22, 23, 20, 21, PAD, PAD], [0, 1, 4, 5, 2, 3, 6, 7],
         [PAD, PAD, 23, PAD, 21, PAD, PAD, PAD], [0, 0, 1, 0, 1, 0, 0, 0]),
        # Response of 5: slots [20 21][22 23][24]; the short last slot is clean
        # and comes first, slot 1 clean, slot 0 masked.
        ([20, 21, 22, 23, 24], [True, False, False, True], [.5, .6, .1, .0],
         [10, 11, 24, 22, 23, MASK, MASK, PAD], [0, 1, 6, 4, 5, 2, 3, 7],
         [PAD, PAD, PAD, 23, PAD, 20, 21, PAD], [0, 0, 0, 1, 0, 2, 2, 0]),
        # Everything masked: masked slots in original order.
        ([20, 21, 22, 23, 24], [True, True, True, False], [.5, .6, .1, .0],
         [10, 11, MASK, MASK, MASK, MASK, MASK, PAD], [0, 1, 2, 3, 4, 5, 6, 7],
         [PAD, PAD, 20, 21, 22, 23, 24, PAD], [0, 0, 2, 2, 2, 2, 2, 0]),
    ])
def test_hand_worked_layout(resp, masked, keys, want_ids, want_pos, want_labels, want_kind):
  tokens = np.full((1, 8), PAD, np.int32)
  tokens[0, :2 + len(resp)] = [10, 11] + resp
  c = from_draws_jit(tokens, np.array([2]), np.array([len(resp)]), make_draws(2, masked, keys))
  assert c.input_ids_bt[0].tolist() == want_ids
  assert c.positions_bt[0].tolist() == want_pos
  assert c.labels_bt[0].tolist() == want_labels
  assert c.kind_bt[0].tolist() == want_kind
  assert c.response_len_b.tolist() == [len(resp)]
  assert c.slot_size_b.tolist() == [2]


# --------------------------------------------- random draws vs the oracle


@pytest.mark.parametrize("slot_sizes,seq_len", [((1, 2, 3, 5), 20), ((4, 8, 16, 32), 48)])
def test_layout_matches_python_oracle(slot_sizes, seq_len):
  np_rng = np.random.default_rng(0)
  fn = corrupt_jit(slot_sizes)
  draw = jax.jit(functools.partial(obj.draw_refusion, batch_size=48, seq_len=seq_len,
                                   slot_sizes=slot_sizes))
  for seed in range(3):
    tokens, p, r = random_batch(np_rng, 48, seq_len)
    rng = jax.random.key(seed)
    c = jax.device_get(fn(tokens, p, r, rng))
    # Drawn under jit like the corruption, so p (hence the mask bits) rounds alike.
    d = jax.device_get(draw(rng))
    for b in range(48):
      ids, pos, labels, kinds = oracle_layout(
          tokens[b].tolist(), int(p[b]), int(r[b]), int(d.slot_size_b[b]),
          d.slot_masked_bs[b].tolist(), d.slot_order_key_bs[b].tolist(), seq_len)
      assert c.input_ids_bt[b].tolist() == ids, b
      assert c.positions_bt[b].tolist() == pos, b
      assert c.labels_bt[b].tolist() == labels, b
      assert c.kind_bt[b].tolist() == kinds, b
    np.testing.assert_array_equal(c.slot_size_b, d.slot_size_b)
    np.testing.assert_allclose(c.p_b, d.p_b)
    np.testing.assert_array_equal(c.response_len_b, r)


def test_structural_invariants_over_many_draws():
  """Checks the layout's properties from the output alone (no draw needed)."""
  seq_len, batch = 40, 64
  np_rng = np.random.default_rng(1)
  fn = corrupt_jit((2, 3, 4, 8))
  seen_masked = seen_clean = 0
  for seed in range(4):
    tokens, p, r = random_batch(np_rng, batch, seq_len)
    c = jax.device_get(fn(tokens, p, r, jax.random.key(100 + seed)))
    for b in range(batch):
      pb, rb, k = int(p[b]), int(r[b]), int(c.slot_size_b[b])
      ids, pos = c.input_ids_bt[b], c.positions_bt[b]
      labels, kind = c.labels_bt[b], c.kind_bt[b]
      live = pb + rb
      assert sorted(pos.tolist()) == list(range(seq_len))
      # Prompt and padding untouched, in place.
      assert pos[:pb].tolist() == list(range(pb)) and ids[:pb].tolist() == tokens[b, :pb].tolist()
      assert pos[live:].tolist() == list(range(live, seq_len))
      assert (ids[live:] == PAD).all() and (kind[:pb] == 0).all() and (kind[live:] == 0).all()
      # Multiset of (token, position) over non-pad input = the original's
      # (a masked token's identity is its label).
      restored = np.where(ids == MASK, labels, ids)
      got = sorted(zip(restored[:live].tolist(), pos[:live].tolist()))
      want = sorted(zip(tokens[b, :live].tolist(), range(live)))
      assert got == want
      # Response part: clean slots (contiguous, ordered), then masked slots.
      resp_ids, resp_pos = ids[pb:live], pos[pb:live]
      is_mask = resp_ids == MASK
      n_clean = int((~is_mask).sum())
      assert not is_mask[:n_clean].any() and is_mask[n_clean:].all()
      seen_masked += int(is_mask.sum())
      seen_clean += n_clean
      slot_of = (resp_pos - pb) // k
      i = 0
      while i < n_clean:  # walk the clean slots one by one
        s = int(slot_of[i])
        length = min(k, rb - s * k)
        assert resp_pos[i:i + length].tolist() == list(range(pb + s * k, pb + s * k + length))
        assert (slot_of[i:i + length] == s).all()
        assert kind[pb + i:pb + i + length].tolist() == [1] * (length - 1) + [0]
        i += length
      assert i == n_clean
      # Masked slots keep their original order and cover whole slots.
      masked_pos = resp_pos[n_clean:]
      assert (np.diff(masked_pos) > 0).all()
      for s in set(((masked_pos - pb) // k).tolist()):
        assert ((masked_pos - pb) // k == s).sum() == min(k, rb - s * k)
      assert (kind[pb + n_clean:live] == 2).all()
  assert seen_masked > 100 and seen_clean > 100


def test_masked_fraction_tracks_p_and_slot_size_is_uniform():
  batch, seq_len = 4096, 64
  tokens = np.full((batch, seq_len), 7, np.int32)
  p = np.zeros(batch, np.int32)
  r = np.full(batch, seq_len, np.int32)
  c = jax.device_get(corrupt_jit((4,))(tokens, p, r, jax.random.key(7)))
  frac = (c.kind_bt == 2).mean(axis=1)  # 16 slots of 4 per example
  pb = c.p_b
  assert pb.min() >= 1e-3 and pb.max() <= 1.0
  assert abs(float(np.mean(frac - pb))) < 0.01
  for lo in np.arange(0.0, 1.0, 0.2):
    sel = (pb >= lo) & (pb < lo + 0.2)
    assert sel.sum() > 500
    assert abs(frac[sel].mean() - pb[sel].mean()) < 0.03
  assert np.corrcoef(frac, pb)[0, 1] > 0.9
  # p itself is uniform on [eps, 1].
  assert abs(pb.mean() - 0.5) < 0.02

  sizes = (4, 8, 16, 32)
  c = jax.device_get(corrupt_jit(sizes)(tokens, p, r, jax.random.key(8)))
  counts = [int((c.slot_size_b == k).sum()) for k in sizes]
  assert sum(counts) == batch  # nothing outside the set
  for n in counts:  # expected 1024 each, std ~28
    assert abs(n - batch / 4) < 150, counts


# ----------------------------------------------------------------- losses


def np_refusion_loss(logits, c):
  logits, labels, kind = np.asarray(logits), np.asarray(c.labels_bt), np.asarray(c.kind_bt)
  ar_sum, ar_n, mdm = 0.0, 0, 0.0
  for b in range(labels.shape[0]):
    for i in range(labels.shape[1]):
      if kind[b, i] == 1:
        ar_sum += np_ce(logits[b, i], labels[b, i]); ar_n += 1
      elif kind[b, i] == 2:
        mdm += np_ce(logits[b, i], labels[b, i]) / float(c.p_b[b]) / int(c.response_len_b[b])
  ar = ar_sum / ar_n if ar_n else 0.0
  return ar + mdm / labels.shape[0], ar, mdm / labels.shape[0]


def test_refusion_loss_matches_numpy():
  np_rng = np.random.default_rng(3)
  tokens, p, r = random_batch(np_rng, 6, 24, vocab=11)
  c = corrupt_jit((2, 4))(tokens, p, r, jax.random.key(3))
  logits = np_rng.normal(size=(6, 24, 11)).astype(np.float32) * 3
  loss, m = jax.jit(obj.refusion_loss)(logits, c)
  want, ar, mdm = np_refusion_loss(logits, jax.device_get(c))
  np.testing.assert_allclose(float(loss), want, rtol=1e-5)
  np.testing.assert_allclose(float(m["ar_loss"]), ar, rtol=1e-5)
  np.testing.assert_allclose(float(m["mdm_loss"]), mdm, rtol=1e-5)
  assert float(m["ar_tokens"]) == int((np.asarray(c.kind_bt) == 1).sum()) > 0
  assert float(m["mdm_tokens"]) == int((np.asarray(c.kind_bt) == 2).sum()) > 0


def test_bfloat16_logits_give_float32_loss():
  np_rng = np.random.default_rng(4)
  tokens, p, r = random_batch(np_rng, 3, 16, vocab=9)
  c = corrupt_jit((2,))(tokens, p, r, jax.random.key(4))
  logits = jnp.asarray(np_rng.normal(size=(3, 16, 9)), jnp.bfloat16)
  loss, _ = jax.jit(obj.refusion_loss)(logits, c)
  assert loss.dtype == jnp.float32
  want, _, _ = np_refusion_loss(np.asarray(logits.astype(jnp.float32)), jax.device_get(c))
  np.testing.assert_allclose(float(loss), want, rtol=1e-5)


def test_all_masked_batch_gives_zero_ar_not_nan():
  tokens = np.arange(4 * 12, dtype=np.int32).reshape(4, 12) % 20 + 4
  p = np.array([2, 0, 5, 3], np.int32)
  r = np.array([10, 12, 7, 1], np.int32)
  s = obj.max_slots(12, (2,))
  draws = obj.RefusionDraws(
      slot_size_b=jnp.full((4,), 2, jnp.int32), t_b=jnp.ones((4,)), p_b=jnp.ones((4,)),
      slot_masked_bs=jnp.ones((4, s), bool), slot_order_key_bs=jnp.zeros((4, s)))
  c = from_draws_jit(tokens, p, r, draws)
  logits = jnp.asarray(np.random.default_rng(5).normal(size=(4, 12, 30)), jnp.float32)
  (loss, m), grad = jax.jit(jax.value_and_grad(obj.refusion_loss, has_aux=True))(logits, c)
  assert float(m["ar_loss"]) == 0.0 and float(m["ar_tokens"]) == 0.0
  assert float(m["mdm_tokens"]) == r.sum()
  assert np.isfinite(float(loss)) and np.isfinite(np.asarray(grad)).all()
  want, _, _ = np_refusion_loss(logits, jax.device_get(c))
  np.testing.assert_allclose(float(loss), want, rtol=1e-5)


def test_arm_loss_matches_numpy():
  np_rng = np.random.default_rng(6)
  tokens, p, r = random_batch(np_rng, 5, 16, vocab=13)
  p[0], r[0] = 0, 16  # no prompt: the first token has no predictor
  tokens[0] = np_rng.integers(4, 13, 16)
  logits = np_rng.normal(size=(5, 16, 13)).astype(np.float32)
  loss, m = jax.jit(obj.arm_loss)(logits, tokens, p, r)
  total, n = 0.0, 0
  for b in range(5):
    for j in range(max(int(p[b]), 1), int(p[b] + r[b])):  # response token j, predicted at j-1
      total += np_ce(logits[b, j - 1], tokens[b, j]); n += 1
  np.testing.assert_allclose(float(loss), total / n, rtol=1e-5)
  assert float(m["ar_tokens"]) == n and float(m["mdm_loss"]) == 0.0


def test_mdm_corrupt_and_loss_match_numpy():
  np_rng = np.random.default_rng(7)
  tokens, p, r = random_batch(np_rng, 8, 20, vocab=17)
  c = jax.device_get(mdm_corrupt_jit(tokens, p, r, jax.random.key(9)))
  np.testing.assert_array_equal(c.positions_bt, np.broadcast_to(np.arange(20), (8, 20)))
  np.testing.assert_array_equal(c.response_len_b, 20 - p)  # the EOS-padded length
  for b in range(8):
    live = p[b] + r[b]
    assert c.input_ids_bt[b, :p[b]].tolist() == tokens[b, :p[b]].tolist()  # prompt untouched
    assert (c.kind_bt[b, :p[b]] == 0).all()
    # The response runs to the row's end: the answer, then EOS in place of the padding.
    clean = np.concatenate([tokens[b, p[b]:live], np.full(20 - live, EOS)])
    resp = slice(p[b], 20)
    m = c.input_ids_bt[b, resp] == MASK
    assert (c.kind_bt[b, resp] == np.where(m, 2, 0)).all()
    assert (np.where(m, c.labels_bt[b, resp], c.input_ids_bt[b, resp]) == clean).all()
  logits = np_rng.normal(size=(8, 20, 17)).astype(np.float32)
  loss, _ = jax.jit(obj.mdm_loss)(logits, c)
  want = 0.0
  for b in range(8):
    for i in range(20):
      if c.kind_bt[b, i] == 2:
        want += np_ce(logits[b, i], c.labels_bt[b, i]) / float(c.p_b[b]) / int(20 - p[b])
  np.testing.assert_allclose(float(loss), want / 8, rtol=1e-5)


def test_mdm_masks_the_eos_padding_like_the_answer():
  # LLaDA's SFT: the positions after the answer are EOS tokens the model must learn to
  # produce, masked at the same rate as the answer. Without them the model never sees a
  # canvas longer than its answer and cannot tell where the answer ends.
  batch, seq_len, p, r = 2048, 64, 8, 6
  tokens = np.full((batch, seq_len), PAD, np.int32)
  tokens[:, :p + r] = 9
  c = jax.device_get(mdm_corrupt_jit(tokens, np.full(batch, p, np.int32),
                                     np.full(batch, r, np.int32), jax.random.key(11)))
  tail = slice(p + r, seq_len)
  assert ((c.kind_bt[:, tail] == 2) == (c.input_ids_bt[:, tail] == MASK)).all()
  assert (np.where(c.kind_bt[:, tail] == 2, c.labels_bt[:, tail], c.input_ids_bt[:, tail])
          == EOS).all()
  frac = (c.kind_bt[:, tail] == 2).mean(axis=1)
  assert abs(float(np.mean(frac - c.p_b))) < 0.01
  assert np.corrcoef(frac, c.p_b)[0, 1] > 0.9


def test_mdm_masked_fraction_tracks_t():
  batch, seq_len = 2048, 64
  tokens = np.full((batch, seq_len), 9, np.int32)
  c = jax.device_get(mdm_corrupt_jit(tokens, np.full(batch, 8, np.int32),
                                     np.full(batch, 56, np.int32), jax.random.key(11)))
  frac = (c.kind_bt == 2).sum(axis=1) / 56
  assert abs(float(np.mean(frac - c.p_b))) < 0.01
  assert np.corrcoef(frac, c.p_b)[0, 1] > 0.95


# ------------------------------------------------------ loss_fn with a model


@functools.cache  # models are only read here, never updated
def tiny_model(attention="causal", seed=0):
  cfg = config_lib.tiny(num_layers=1, vocab_size=64, hidden_size=32, num_heads=2,
                        num_kv_heads=1, head_dim=16, mlp_dim=64, attention=attention)
  return Qwen3(cfg, rngs=nnx.Rngs(seed))


@nnx.jit
def forward(model, ids_bt, positions_bt, mask_btt=None):
  return model(ids_bt, positions_bt, mask_btt)


@functools.partial(nnx.jit, static_argnames=("objective", "slot_sizes"))
def jit_loss_fn(model, batch, rng, objective, slot_sizes=(4, 8, 16, 32)):
  return obj.loss_fn(model, batch, rng, objective=objective, mask_id=MASK, pad_id=PAD,
                     slot_sizes=slot_sizes)


def small_batch(seed=12, batch=3, seq_len=16):
  tokens, p, r = random_batch(np.random.default_rng(seed), batch, seq_len, vocab=64)
  return {"tokens": tokens, "prompt_len": p, "response_len": r}


def test_loss_fn_refusion_and_arm_match_numpy_on_model_logits():
  model = tiny_model()
  batch = small_batch()
  rng = jax.random.key(21)
  loss, m = jit_loss_fn(model, batch, rng, "refusion", (2, 4))
  c = jax.device_get(corrupt_jit((2, 4))(batch["tokens"], batch["prompt_len"],
                                         batch["response_len"], rng))
  logits = np.asarray(forward(model, c.input_ids_bt, c.positions_bt))
  want, _, _ = np_refusion_loss(logits, c)
  np.testing.assert_allclose(float(loss), want, rtol=1e-5)
  assert set(m) == {"loss", "ar_loss", "mdm_loss", "ar_tokens", "mdm_tokens"}

  loss, _ = jit_loss_fn(model, batch, rng, "arm")
  tokens, p, r = batch["tokens"], batch["prompt_len"], batch["response_len"]
  logits = np.asarray(forward(model, tokens, np.broadcast_to(np.arange(16), tokens.shape)))
  terms = [np_ce(logits[b, j - 1], tokens[b, j])
           for b in range(3) for j in range(max(int(p[b]), 1), int(p[b] + r[b]))]
  np.testing.assert_allclose(float(loss), np.mean(terms), rtol=1e-5)


def test_loss_fn_mdm_trains_the_eos_tail_with_full_attention():
  model = tiny_model("bidirectional")
  batch = small_batch(seed=14, batch=4)
  key = jax.random.key(5)
  loss, m = jit_loss_fn(model, batch, key, "mdm")
  c = jax.device_get(mdm_corrupt_jit(batch["tokens"], batch["prompt_len"],
                                     batch["response_len"], key))
  # Oracle: every position attends to every other one (no key hidden) and the masked
  # positions of the EOS tail count like the answer's.
  logits = np.asarray(forward(model, c.input_ids_bt, c.positions_bt,
                              np.ones((4, 16, 16), bool)))
  want = 0.0
  for b in range(4):
    for i in range(16):
      if c.kind_bt[b, i] == 2:
        want += np_ce(logits[b, i], c.labels_bt[b, i]) / float(c.p_b[b]) / int(
            16 - batch["prompt_len"][b])
  np.testing.assert_allclose(float(loss), want / 4, rtol=1e-5)
  tail = np.arange(16)[None] >= (batch["prompt_len"] + batch["response_len"])[:, None]
  assert (c.kind_bt[tail] == 2).any()  # the draw does mask some EOS padding
  assert float(m["mdm_tokens"]) == int((c.kind_bt == 2).sum())
  # Whatever the padding held, the tail is EOS: its contents change nothing.
  noisy = dict(batch, tokens=np.where(tail, 41, batch["tokens"]))
  np.testing.assert_allclose(float(jit_loss_fn(model, noisy, key, "mdm")[0]), float(loss),
                             rtol=1e-6)


def test_loss_fn_grad_jits_once_per_shape():
  model = tiny_model()
  graphdef, state = nnx.split(model)
  traces = []

  @jax.jit
  def step(state, batch, rng):
    traces.append(1)
    return jax.value_and_grad(lambda s: obj.loss_fn(
        nnx.merge(graphdef, s), batch, rng, objective="refusion", mask_id=MASK, pad_id=PAD,
        slot_sizes=(2, 4))[0])(state)

  for seed in range(3):
    loss, grads = step(state, small_batch(seed), jax.random.key(seed))
    assert np.isfinite(float(loss)) and float(loss) > 0
    assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))
    assert any(np.abs(np.asarray(g)).max() > 0 for g in jax.tree.leaves(grads))
  assert len(traces) == 1


# ------------------------------------------- chunked cross-entropy (loss_chunk)


def random_unembed(rng, vocab, dim, vocab_axis, dtype=jnp.float32):
  shape = (vocab, dim) if vocab_axis == 0 else (dim, vocab)
  return Unembed(jnp.asarray(rng.normal(size=shape) * 0.5, dtype), vocab_axis)


chunked_ce_jit = jax.jit(obj.chunked_token_cross_entropy, static_argnums=3)


@pytest.mark.parametrize("vocab_axis", [0, 1])
@pytest.mark.parametrize("seq_len, chunk", [(12, 4), (13, 4), (13, 1), (5, 8)])
def test_chunked_cross_entropy_equals_full_logits(vocab_axis, seq_len, chunk):
  rng = np.random.default_rng(10 * seq_len + chunk + vocab_axis)
  h = jnp.asarray(rng.normal(size=(3, seq_len, 16)), jnp.float32)
  unembed = random_unembed(rng, 40, 16, vocab_axis)
  labels = jnp.asarray(rng.integers(0, 40, (3, seq_len)), jnp.int32)
  got = chunked_ce_jit(h, unembed, labels, chunk)
  want = obj.token_cross_entropy(unembed.project(h), labels)
  assert got.shape == (3, seq_len) and got.dtype == jnp.float32
  np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)
  logits = np.asarray(unembed.project(h))
  for b, i in ((0, 0), (2, seq_len - 1), (1, seq_len // 2)):
    np.testing.assert_allclose(float(got[b, i]), np_ce(logits[b, i], int(labels[b, i])),
                               atol=1e-5)

  # Gradients w.r.t. the hidden states and the weight (summed in another order: 1e-5).
  cot = jnp.asarray(rng.normal(size=(3, seq_len)), jnp.float32)

  def weighted(ce_fn):
    return jax.jit(jax.grad(lambda h, u: jnp.sum(ce_fn(h, u) * cot), argnums=(0, 1)))(
        h, unembed)

  got_g = weighted(lambda h, u: obj.chunked_token_cross_entropy(h, u, labels, chunk))
  want_g = weighted(lambda h, u: obj.token_cross_entropy(u.project(h), labels))
  np.testing.assert_allclose(got_g[0], want_g[0], atol=1e-5, rtol=0)
  np.testing.assert_allclose(got_g[1].w, want_g[1].w, atol=1e-5, rtol=0)


def test_chunked_cross_entropy_sums_bfloat16_weight_gradients_in_float32():
  # With bfloat16 compute the weight's gradient is one matmul over all tokens in the full
  # path (rounded once). Summing per-chunk gradients in a bfloat16 carry would round after
  # every chunk (~1.4x the error here); the float32 sum stays within 1.2x of the full path.
  rng = np.random.default_rng(1)
  h = jnp.asarray(rng.normal(size=(4, 512, 64)), jnp.float32)
  unembed = random_unembed(rng, 1000, 64, 0)
  labels = jnp.asarray(rng.integers(0, 1000, (4, 512)), jnp.int32)

  def grad_w(ce_fn, dtype):
    def total(w):
      return jnp.sum(ce_fn(h.astype(dtype), Unembed(w.astype(dtype), 0)))
    return np.asarray(jax.jit(jax.grad(total))(unembed.w), np.float64)

  def full(h, u):
    return obj.token_cross_entropy(u.project(h), labels)

  def chunked(h, u):
    return obj.chunked_token_cross_entropy(h, u, labels, 32)

  exact = grad_w(full, jnp.float32)
  # float32: the two sum 2,048 tokens in different orders (entries up to ~10 differ by
  # a few 1e-6 relative, by how the CPU's dot kernels split the sum); a lost or doubled
  # chunk would be off by O(1).
  np.testing.assert_allclose(grad_w(chunked, jnp.float32), exact, atol=1e-5, rtol=1e-5)
  err_full = np.linalg.norm(grad_w(full, jnp.bfloat16) - exact)
  err_chunked = np.linalg.norm(grad_w(chunked, jnp.bfloat16) - exact)
  assert 0 < err_chunked <= 1.2 * err_full, (err_chunked, err_full)


@functools.cache
def tiny_untied_model(attention="causal"):
  cfg = config_lib.tiny(num_layers=1, vocab_size=64, hidden_size=32, num_heads=2,
                        num_kv_heads=1, head_dim=16, mlp_dim=64, attention=attention,
                        tie_embeddings=False)
  return Qwen3(cfg, rngs=nnx.Rngs(1))


def loss_and_grads(model, batch, rng, objective, loss_chunk):
  graphdef, state = nnx.split(model)

  def loss(state):
    return obj.loss_fn(nnx.merge(graphdef, state), batch, rng, objective=objective,
                       mask_id=MASK, pad_id=PAD, slot_sizes=(2, 4), loss_chunk=loss_chunk)

  (value, metrics), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(state)
  return float(value), jax.device_get(metrics), nnx.to_pure_dict(jax.device_get(grads))


@pytest.mark.parametrize("objective, tied", [("refusion", True), ("refusion", False),
                                             ("arm", True), ("mdm", False)])
def test_loss_fn_loss_chunk_gives_the_same_loss_and_gradients(objective, tied):
  attention = obj.attention_for(objective)
  model = tiny_model(attention) if tied else tiny_untied_model(attention)
  batch = small_batch(seed=31, batch=4)
  rng = jax.random.key(8)
  want, want_m, want_g = loss_and_grads(model, batch, rng, objective, 0)
  # 16 tokens in chunks of 5: three scanned chunks and a 1-token remainder.
  got, got_m, got_g = loss_and_grads(model, batch, rng, objective, 5)
  assert abs(got - want) <= 1e-5 and want > 0
  for k in want_m:
    np.testing.assert_allclose(got_m[k], want_m[k], atol=1e-5, rtol=0, err_msg=k)
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(want_g)]
  assert ("['lm_head']" in paths) != tied
  for path, a, b in zip(paths, jax.tree.leaves(got_g), jax.tree.leaves(want_g)):
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=0, err_msg=path)
  head = want_g["embed"] if tied else want_g["lm_head"]
  assert np.abs(head).max() > 1e-3  # the output projection really gets a gradient


def _array_sizes(jaxpr, sizes):
  """Element counts of every value the jaxpr (and each jaxpr nested in it) defines."""
  for eqn in jaxpr.eqns:
    sizes.extend(math.prod(v.aval.shape) for v in eqn.outvars if hasattr(v.aval, "shape"))
    for param in eqn.params.values():
      for sub in param if isinstance(param, (tuple, list)) else (param,):
        if isinstance(sub, jax_core.ClosedJaxpr):
          _array_sizes(sub.jaxpr, sizes)
        elif isinstance(sub, jax_core.Jaxpr):
          _array_sizes(sub, sizes)
  return sizes


def test_loss_chunk_never_builds_full_logits():
  batch_size, seq_len, vocab, chunk = 2, 256, 8192, 32
  cfg = config_lib.tiny(num_layers=1, vocab_size=vocab, hidden_size=32, num_heads=2,
                        num_kv_heads=1, head_dim=16, mlp_dim=64)
  graphdef, state = nnx.split(Qwen3(cfg, rngs=nnx.Rngs(0)))
  tokens, p, r = random_batch(np.random.default_rng(2), batch_size, seq_len, vocab=vocab,
                              min_resp=seq_len // 2)
  batch = {"tokens": tokens, "prompt_len": p, "response_len": r}
  largest, temp_bytes = {}, {}
  for loss_chunk in (0, chunk):
    grad_fn = jax.value_and_grad(lambda s, c=loss_chunk: obj.loss_fn(
        nnx.merge(graphdef, s), batch, jax.random.key(0), objective="refusion", mask_id=MASK,
        pad_id=PAD, loss_chunk=c)[0])
    largest[loss_chunk] = max(_array_sizes(jax.make_jaxpr(grad_fn)(state).jaxpr, []))
    compiled = jax.jit(grad_fn).lower(state).compile()
    temp_bytes[loss_chunk] = compiled.memory_analysis().temp_size_in_bytes
  # The full path does hold [B, T, V] (so the check can fail); the chunked one, in its
  # forward and backward, never more than one chunk's logits.
  assert largest[0] == batch_size * seq_len * vocab
  assert largest[chunk] == batch_size * chunk * vocab
  # The compiler's scratch memory agrees: the [B, T, V] logits and their gradient dominate
  # the full path (about 36 MiB here, 9 MiB chunked).
  assert temp_bytes[chunk] * 3 < temp_bytes[0], temp_bytes


# ---------------------------------------------------------- bad inputs


@pytest.mark.parametrize("bad", [(), [], (0,), (4, -2), (4.5,), ("4",), (True,), "48", None, 8])
def test_invalid_slot_sizes_raise(bad):
  with pytest.raises(ValueError, match="slot_sizes"):
    obj.loss_fn(tiny_model(), small_batch(), jax.random.key(0), objective="refusion",
                mask_id=MASK, pad_id=PAD, slot_sizes=bad)
  with pytest.raises(ValueError, match="slot_sizes"):
    obj.refusion_corrupt(np.zeros((1, 8), np.int32), np.array([0]), np.array([8]),
                         jax.random.key(0), mask_id=MASK, pad_id=PAD, slot_sizes=bad)


def test_bad_arguments_raise_before_compiling():
  model, batch, key = tiny_model(), small_batch(), jax.random.key(0)
  kw = dict(mask_id=MASK, pad_id=PAD)
  with pytest.raises(ValueError, match="objective"):
    obj.loss_fn(model, batch, key, objective="ar", **kw)
  with pytest.raises(ValueError, match="attention"):
    obj.loss_fn(model, batch, key, objective="mdm", **kw)
  with pytest.raises(ValueError, match="attention"):
    obj.loss_fn(tiny_model("bidirectional"), batch, key, objective="refusion", **kw)
  with pytest.raises(ValueError, match="eos_id"):
    obj.loss_fn(tiny_model("bidirectional"), batch, key, objective="mdm", eos_id=64, **kw)
  with pytest.raises(ValueError, match="mask_id"):
    obj.loss_fn(model, batch, key, objective="refusion", mask_id=64, pad_id=PAD)
  with pytest.raises(ValueError, match="eps"):
    obj.loss_fn(model, batch, key, objective="refusion", eps=0.0, **kw)
  for bad in (-1, 2.5, True, "8"):
    with pytest.raises(ValueError, match=f"loss_chunk must be a non-negative int.*{bad!r}"):
      obj.loss_fn(model, batch, key, objective="refusion", loss_chunk=bad, **kw)
  with pytest.raises(ValueError, match="chunk_len > 0"):
    obj.chunked_token_cross_entropy(jnp.zeros((1, 4, 32)), model.unembed(),
                                    jnp.zeros((1, 4), jnp.int32), 0)
  with pytest.raises(ValueError, match="response_len"):
    obj.loss_fn(model, {k: v for k, v in batch.items() if k != "response_len"}, key,
                objective="arm", **kw)
  with pytest.raises(ValueError, match="exceeds"):
    obj.loss_fn(model, dict(batch, response_len=batch["response_len"] + 16), key,
                objective="arm", **kw)
  with pytest.raises(ValueError, match="response_len"):
    obj.loss_fn(model, dict(batch, response_len=np.zeros(3, np.int32)), key,
                objective="arm", **kw)
  with pytest.raises(ValueError, match="prompt_len"):
    obj.loss_fn(model, dict(batch, prompt_len=np.zeros(2, np.int32)), key,
                objective="arm", **kw)
