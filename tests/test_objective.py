"""Tests for refusion_jax/objective.py against plain-Python / numpy oracles.

The layouts of packed rows are checked against a plain-Python oracle that
lays out each sample on its own (dynamic shapes, explicit loops) from the very
draws the jitted layout reads; the losses against numpy; and packing itself
against not packing: the same samples with the same draws give the same loss
and gradients however they share rows.
"""

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
from refusion_jax import sharding
from refusion_jax.model import Transformer, Unembed

MASK = 3
PAD = 0
EOS = 1
EPS = 1e-3


# ---------------------------------------------------------------- oracles


def p_of(t):
  """p = (1 - eps) t + eps, rounded as float32 like the jitted layout."""
  return np.float32(1.0 - EPS) * np.float32(t) + np.float32(EPS)


def oracle_sample(tokens, p_len, r_len, draws, slot_sizes, boundary_label=False):
  """Plain-Python ReFusion layout of one sample, from the draws at its own tokens.

  `draws` = (size, t, mask, order) lists over the sample's tokens. Returns the
  sample's tokens in input order as (id, position, label, kind, mdm weight). With
  `boundary_label`, a clean slot's last token learns the response token after it.
  """
  size, t, mask, order = draws
  k = slot_sizes[min(int(math.floor(np.float32(size[0]) * len(slot_sizes))),
                     len(slot_sizes) - 1)]
  p = p_of(t[0])
  n_slots = math.ceil(r_len / k)
  slots = [(p_len + s * k, min(k, r_len - s * k)) for s in range(n_slots)]
  masked = [np.float32(mask[start]) < p for start, _ in slots]
  clean = sorted((s for s in range(n_slots) if not masked[s]),
                 key=lambda s: (np.float32(order[slots[s][0]]), s))
  out = [(tokens[i], i, PAD, 0, 0.0) for i in range(p_len)]
  for s in clean:
    start, length = slots[s]
    for j in range(length):
      last = j == length - 1
      if boundary_label:
        last = start + j + 1 == p_len + r_len  # only the response's last token
      out.append((tokens[start + j], start + j, PAD if last else tokens[start + j + 1],
                  0 if last else 1, 0.0))
  for s in range(n_slots):
    if masked[s]:
      start, length = slots[s]
      for j in range(length):
        out.append((MASK, start + j, tokens[start + j], 2, 1.0 / (float(p) * r_len)))
  return out


def oracle_row(samples, draws_row, slot_sizes, seq_len, boundary_label=False):
  """A packed row: each sample (start, tokens, P, R) laid out in its own range."""
  row = [(PAD, 0, PAD, 0, 0.0)] * seq_len
  for start, tokens, p_len, r_len in samples:
    n = p_len + r_len
    own = [list(np.asarray(d)[start:start + n]) for d in draws_row]
    row[start:start + n] = oracle_sample(tokens, p_len, r_len, own, slot_sizes, boundary_label)
  return [list(c) for c in zip(*row)]  # ids, positions, labels, kinds, weights


def np_ce(logits_v, label):
  x = np.asarray(logits_v, np.float64)
  m = x.max()
  return float(m + np.log(np.exp(x - m).sum()) - x[label])


def np_loss(logits, c, samples):
  """AR token mean + sum of MDM CE / (p R) over the batch's samples, by hand."""
  labels, kind = np.asarray(c.labels_bt), np.asarray(c.kind_bt)
  weight = np.asarray(c.mdm_weight_bt)
  ar_sum, ar_n, mdm = 0.0, 0, 0.0
  for b in range(labels.shape[0]):
    for i in range(labels.shape[1]):
      if kind[b, i] == 1:
        ar_sum += np_ce(logits[b, i], labels[b, i])
        ar_n += 1
      elif kind[b, i] == 2:
        mdm += np_ce(logits[b, i], labels[b, i]) * float(weight[b, i])
  ar = ar_sum / ar_n if ar_n else 0.0
  return ar + mdm / samples, ar, mdm / samples


# ------------------------------------------------------------ test data


def random_samples(rng, n, max_len, vocab=50, min_resp=1):
  """`n` samples (tokens, P, R) with P + R <= max_len and R >= min_resp."""
  samples = []
  for _ in range(n):
    total = int(rng.integers(min_resp, max_len + 1))
    p_len = int(rng.integers(0, total - min_resp + 1))
    samples.append((rng.integers(4, vocab, total).tolist(), p_len, total - p_len))
  return samples


def first_fit(samples, seq_len):
  """The test's own packer: each sample into the first row with room."""
  rows = []
  for i, (tokens, _, _) in enumerate(samples):
    for row in rows:
      if row[1] + len(tokens) <= seq_len:
        row[0].append((i, row[1]))
        row[1] += len(tokens)
        break
    else:
      rows.append([[(i, 0)], len(tokens)])
  return [row[0] for row in rows]


def layout(samples, placements, seq_len, rows=None):
  """Packed-format numpy batch of `samples` placed as `placements` [[(index, start)]]."""
  b = rows or len(placements)
  batch = {k: np.zeros((b, seq_len), np.int32) for k in obj.PACKED_KEYS}
  for r, row in enumerate(placements):
    for segment, (i, start) in enumerate(row, start=1):
      tokens, p_len, r_len = samples[i]
      span = slice(start, start + len(tokens))
      batch["tokens"][r, span] = tokens
      batch["segment_ids"][r, span] = segment
      batch["positions"][r, span] = np.arange(len(tokens))
      batch["segment_prompt_len"][r, span] = p_len
      batch["segment_response_len"][r, span] = r_len
  return batch


def one_per_row(samples, seq_len):
  return layout(samples, [[(i, 0)] for i in range(len(samples))], seq_len)


def sample_draws(rng, samples, t_low=0.0):
  """Per-sample draws (size, t, mask, order), each as long as the sample."""
  out = []
  for tokens, _, _ in samples:
    n = len(tokens)
    t = rng.uniform(t_low, 1.0, n)
    out.append(tuple(np.asarray(x, np.float32) for x in
                     (rng.uniform(size=n), t, rng.uniform(size=n), rng.uniform(size=n))))
  return out


def placed_draws(per_sample, placements, shape, rng):
  """`Draws` with each sample's draws at its place (padding: any values)."""
  arrays = [rng.uniform(size=shape).astype(np.float32) for _ in range(4)]
  for r, row in enumerate(placements):
    for i, start in row:
      for a, d in zip(arrays, per_sample[i]):
        a[r, start:start + len(d)] = d
  return obj.Draws(*(jnp.asarray(a) for a in arrays))


def rows_of(batch):
  return obj.packed_rows({k: jnp.asarray(v) for k, v in batch.items()})


def samples_in(batch):
  return int(np.sum((batch["segment_ids"] > 0) & (batch["positions"] == 0)))


@functools.cache
def refusion_jit(slot_sizes, boundary_label=False):
  return jax.jit(functools.partial(obj.refusion_corrupt, mask_id=MASK, pad_id=PAD,
                                   slot_sizes=slot_sizes, boundary_label=boundary_label))


mdm_jit = jax.jit(functools.partial(obj.mdm_corrupt, mask_id=MASK, pad_id=PAD))
arm_jit = jax.jit(functools.partial(obj.arm_corrupt, pad_id=PAD))


# ------------------------------------------------------- hand-worked cases


def slot_draws(seq_len, k_index, n_sizes, masked, keys, start=0, p_target=0.5):
  """Draws for one sample at `start`: slot size slot_sizes[k_index], p ~ p_target, and
  per-slot mask bits / order keys given at the slots' first tokens (`masked`, `keys`
  indexed by token offset from the sample's start)."""
  size = np.zeros(seq_len, np.float32)
  size[start] = (k_index + 0.5) / n_sizes
  t = np.full(seq_len, p_target, np.float32)
  mask = np.full(seq_len, 0.99, np.float32)
  order = np.zeros(seq_len, np.float32)
  for offset, m in masked.items():
    mask[start + offset] = 0.0 if m else 0.99
  for offset, key in keys.items():
    order[start + offset] = key
  return size, t, mask, order


def as_draws(*rows):
  return obj.Draws(*(jnp.asarray(np.stack(x)) for x in zip(*rows)))


@pytest.mark.parametrize(
    "resp,masked,keys,want_ids,want_pos,want_labels,want_kind",
    [
        # Prompt [10, 11], response [20 21 | 22 23], k=2, slot 0 masked.
        ([20, 21, 22, 23], {2: True}, {2: .1, 4: .3},
         [10, 11, 22, 23, MASK, MASK, PAD, PAD], [0, 1, 4, 5, 2, 3, 0, 0],
         [PAD, PAD, 23, PAD, 20, 21, PAD, PAD], [0, 0, 1, 0, 2, 2, 0, 0]),
        # Both slots clean, keys put slot 1 first.
        ([20, 21, 22, 23], {}, {2: .9, 4: .3},
         [10, 11, 22, 23, 20, 21, PAD, PAD], [0, 1, 4, 5, 2, 3, 0, 0],
         [PAD, PAD, 23, PAD, 21, PAD, PAD, PAD], [0, 0, 1, 0, 1, 0, 0, 0]),
        # Response of 5: slots [20 21][22 23][24]; the short last slot is clean
        # and comes first, slot 1 clean, slot 0 masked.
        ([20, 21, 22, 23, 24], {2: True}, {2: .5, 4: .1, 6: .0},
         [10, 11, 24, 22, 23, MASK, MASK, PAD], [0, 1, 6, 4, 5, 2, 3, 0],
         [PAD, PAD, PAD, 23, PAD, 20, 21, PAD], [0, 0, 0, 1, 0, 2, 2, 0]),
        # Everything masked: masked slots in original order.
        ([20, 21, 22, 23, 24], {2: True, 4: True, 6: True}, {},
         [10, 11, MASK, MASK, MASK, MASK, MASK, PAD], [0, 1, 2, 3, 4, 5, 6, 0],
         [PAD, PAD, 20, 21, 22, 23, 24, PAD], [0, 0, 2, 2, 2, 2, 2, 0]),
    ])
def test_hand_worked_layout(resp, masked, keys, want_ids, want_pos, want_labels, want_kind):
  tokens = np.full((1, 8), PAD, np.int32)
  tokens[0, :2 + len(resp)] = [10, 11] + resp
  rows = obj.packed_rows({"tokens": tokens, "prompt_len": np.array([2]),
                          "response_len": np.array([len(resp)])})
  c = refusion_jit((2,))(rows, as_draws(slot_draws(8, 0, 1, masked, keys)))
  assert c.input_ids_bt[0].tolist() == want_ids
  assert c.positions_bt[0].tolist() == want_pos
  assert c.labels_bt[0].tolist() == want_labels
  assert c.kind_bt[0].tolist() == want_kind
  assert c.segment_ids_bt[0].tolist() == [1] * (2 + len(resp)) + [0] * (6 - len(resp))
  weight = 1.0 / (float(p_of(0.5)) * len(resp))
  np.testing.assert_allclose(c.mdm_weight_bt[0], np.where(np.array(want_kind) == 2, weight, 0),
                             rtol=1e-6)


@pytest.mark.parametrize(
    "resp,masked,keys,want_labels,want_kind",
    [
        # Prompt [10, 11], response [20 21 | 22 23], k=2, slot 0 masked: the clean slot's
        # last token is the response's last, so nothing changes.
        ([20, 21, 22, 23], {2: True}, {2: .1, 4: .3},
         [PAD, PAD, 23, PAD, 20, 21, PAD, PAD], [0, 0, 1, 0, 2, 2, 0, 0]),
        # Both slots clean, slot 1 first: slot 0's last token (21) learns 22, the token
        # at its position + 1, although slot 1 comes before it in the input.
        ([20, 21, 22, 23], {}, {2: .9, 4: .3},
         [PAD, PAD, 23, PAD, 21, 22, PAD, PAD], [0, 0, 1, 0, 1, 1, 0, 0]),
        # Slots [20 21][22 23][24], slot 0 masked: 23 learns 24 (its successor in the
        # short last slot); 24 ends the response and learns nothing.
        ([20, 21, 22, 23, 24], {2: True}, {2: .5, 4: .1, 6: .0},
         [PAD, PAD, PAD, 23, 24, 20, 21, PAD], [0, 0, 0, 1, 1, 2, 2, 0]),
    ])
def test_hand_worked_boundary_label(resp, masked, keys, want_labels, want_kind):
  tokens = np.full((1, 8), PAD, np.int32)
  tokens[0, :2 + len(resp)] = [10, 11] + resp
  rows = obj.packed_rows({"tokens": tokens, "prompt_len": np.array([2]),
                          "response_len": np.array([len(resp)])})
  draws = as_draws(slot_draws(8, 0, 1, masked, keys))
  c = refusion_jit((2,), True)(rows, draws)
  assert c.labels_bt[0].tolist() == want_labels
  assert c.kind_bt[0].tolist() == want_kind
  # Only labels and kinds change: the input is the release's.
  release = refusion_jit((2,))(rows, draws)
  for field in ("input_ids_bt", "positions_bt", "segment_ids_bt", "mdm_weight_bt"):
    np.testing.assert_array_equal(getattr(c, field), getattr(release, field))
  # The loss by hand: one more AR-labelled token in the mean (logits that make every
  # token's CE distinct, so a wrong label or count shows).
  logits = np.asarray(jax.random.normal(jax.random.key(1), (1, 8, 32)) * 3)
  loss, metrics = obj.loss_from_ce(obj.token_cross_entropy(jnp.asarray(logits), c.labels_bt),
                                   c, 1)
  want = np_loss(logits, c, 1)
  np.testing.assert_allclose([float(loss), float(metrics["ar_loss"])], want[:2], rtol=1e-5)
  assert float(metrics["ar_tokens"]) == sum(k == 1 for k in want_kind)


def test_hand_worked_packed_row():
  # Sample 1 at 0: prompt [10 11], response [20 21 | 22 23 | 24] with k=2, slot 1
  # masked, slots 0 and 2 clean with keys putting slot 2 first. Sample 2 at 7: prompt
  # [12], response [30 31 32] with k=4 (one short clean slot). Then padding.
  seq_len = 13
  batch = layout([([10, 11, 20, 21, 22, 23, 24], 2, 5), ([12, 30, 31, 32], 1, 3)],
                 [[(0, 0), (1, 7)]], seq_len)
  first = slot_draws(seq_len, 0, 2, {4: True}, {2: .8, 6: .2})
  second = slot_draws(seq_len, 1, 2, {}, {}, start=7)
  draws = [np.where(np.arange(seq_len) < 7, a, b) for a, b in zip(first, second)]
  c = jax.device_get(refusion_jit((2, 4))(rows_of(batch), as_draws(draws)))
  assert c.input_ids_bt[0].tolist() == [10, 11, 24, 20, 21, MASK, MASK, 12, 30, 31, 32, PAD,
                                        PAD]
  assert c.positions_bt[0].tolist() == [0, 1, 6, 2, 3, 4, 5, 0, 1, 2, 3, 0, 0]
  assert c.labels_bt[0].tolist() == [PAD, PAD, PAD, 21, PAD, 22, 23, PAD, 31, 32, PAD, PAD,
                                     PAD]
  assert c.kind_bt[0].tolist() == [0, 0, 0, 1, 0, 2, 2, 0, 1, 1, 0, 0, 0]
  assert c.segment_ids_bt[0].tolist() == [1] * 7 + [2] * 4 + [0, 0]


# --------------------------------------------- random draws vs the oracle


@pytest.mark.parametrize("slot_sizes,seq_len", [((1, 2, 3, 5), 20), ((4, 8, 16, 32), 48)])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("boundary_label", [False, True])
def test_layout_matches_python_oracle(slot_sizes, seq_len, packed, boundary_label):
  rng = np.random.default_rng(seq_len + packed)
  fn = refusion_jit(slot_sizes, boundary_label)
  for _ in range(3):
    samples = random_samples(rng, 40, seq_len if not packed else seq_len // 2)
    placements = (first_fit(samples, seq_len) if packed else
                  [[(i, 0)] for i in range(len(samples))])
    batch = layout(samples, placements, seq_len)
    per_sample = sample_draws(rng, samples)
    draws = placed_draws(per_sample, placements, batch["tokens"].shape, rng)
    c = jax.device_get(fn(rows_of(batch), draws))
    for r, row in enumerate(placements):
      if packed:
        assert len(row) > 1 or r == len(placements) - 1  # rows really are shared
      placed = [(start,) + samples[i] for i, start in row]
      ids, pos, labels, kinds, weights = oracle_row(
          placed, [np.asarray(getattr(draws, f))[r] for f in ("size_bt", "t_bt", "mask_bt",
                                                               "order_bt")],
          slot_sizes, seq_len, boundary_label)
      assert c.input_ids_bt[r].tolist() == ids, r
      assert c.positions_bt[r].tolist() == pos, r
      assert c.labels_bt[r].tolist() == labels, r
      assert c.kind_bt[r].tolist() == kinds, r
      np.testing.assert_allclose(c.mdm_weight_bt[r], weights, rtol=1e-6)
      np.testing.assert_array_equal(c.segment_ids_bt[r], batch["segment_ids"][r])


def test_masked_fraction_tracks_p_and_slot_size_is_uniform():
  batch, seq_len = 4096, 64
  rows = obj.packed_rows({"tokens": np.full((batch, seq_len), 7, np.int32),
                          "prompt_len": np.zeros(batch, np.int32),
                          "response_len": np.full(batch, seq_len, np.int32)})
  draws = jax.jit(obj.draw, static_argnums=1)(jax.random.key(7), (batch, seq_len))
  c = jax.device_get(refusion_jit((4,))(rows, draws))
  frac = (c.kind_bt == 2).mean(axis=1)  # 16 slots of 4 per example
  pb = np.asarray(p_of(np.asarray(draws.t_bt)[:, 0]))
  assert pb.min() >= 1e-3 and pb.max() <= 1.0
  assert abs(float(np.mean(frac - pb))) < 0.01
  for lo in np.arange(0.0, 1.0, 0.2):
    sel = (pb >= lo) & (pb < lo + 0.2)
    assert sel.sum() > 500
    assert abs(frac[sel].mean() - pb[sel].mean()) < 0.03
  assert np.corrcoef(frac, pb)[0, 1] > 0.9
  assert abs(pb.mean() - 0.5) < 0.02  # p itself is uniform on [eps, 1]

  sizes = (4, 8, 16, 32)
  c = jax.device_get(refusion_jit(sizes)(rows, draws))
  # The slot size shows in the first clean run of each row: a clean slot of k tokens has
  # k - 1 AR labels; rows with a clean first slot give its size exactly.
  k_of_row = np.floor(np.asarray(draws.size_bt)[:, 0] * 4).astype(int)
  counts = np.bincount(k_of_row, minlength=4)
  assert counts.sum() == batch
  for n in counts:  # expected 1024 each, std ~28
    assert abs(n - batch / 4) < 150, counts
  for r in range(64):
    kinds = c.kind_bt[r].tolist()
    if kinds[0] == 1:  # a clean slot leads the row: its run of AR labels is k - 1
      run = kinds.index(0)
      assert run == sizes[k_of_row[r]] - 1


# ----------------------------------------------------------------- losses


def test_loss_from_ce_matches_numpy_on_packed_rows():
  rng = np.random.default_rng(3)
  samples = random_samples(rng, 12, 12, vocab=11)
  placements = first_fit(samples, 24)
  batch = layout(samples, placements, 24)
  draws = placed_draws(sample_draws(rng, samples, t_low=0.2), placements,
                       batch["tokens"].shape, rng)
  c = refusion_jit((2, 4))(rows_of(batch), draws)
  logits = rng.normal(size=batch["tokens"].shape + (11,)).astype(np.float32) * 3
  ce = obj.token_cross_entropy(logits, c.labels_bt)
  n = samples_in(batch)
  assert n == 12 and len(placements) < 12
  loss, m = jax.jit(obj.loss_from_ce)(ce, c, n)
  want, ar, mdm = np_loss(logits, jax.device_get(c), n)
  np.testing.assert_allclose(float(loss), want, rtol=1e-5)
  np.testing.assert_allclose(float(m["ar_loss"]), ar, rtol=1e-5)
  np.testing.assert_allclose(float(m["mdm_loss"]), mdm, rtol=1e-5)
  assert float(m["ar_tokens"]) == int((np.asarray(c.kind_bt) == 1).sum()) > 0
  assert float(m["mdm_tokens"]) == int((np.asarray(c.kind_bt) == 2).sum()) > 0


def test_bfloat16_logits_give_float32_loss():
  rng = np.random.default_rng(4)
  samples = random_samples(rng, 3, 16, vocab=9)
  batch = one_per_row(samples, 16)
  c = refusion_jit((2,))(rows_of(batch), obj.draw(jax.random.key(4), (3, 16)))
  logits = jnp.asarray(rng.normal(size=(3, 16, 9)), jnp.bfloat16)
  loss, _ = obj.loss_from_ce(obj.token_cross_entropy(logits, c.labels_bt), c, 3)
  assert loss.dtype == jnp.float32
  want, _, _ = np_loss(np.asarray(logits.astype(jnp.float32)), jax.device_get(c), 3)
  np.testing.assert_allclose(float(loss), want, rtol=1e-5)


def test_all_masked_batch_gives_zero_ar_not_nan():
  tokens = np.arange(4 * 12, dtype=np.int32).reshape(4, 12) % 20 + 4
  p = np.array([2, 0, 5, 3], np.int32)
  r = np.array([10, 12, 7, 1], np.int32)
  rows = obj.packed_rows({"tokens": tokens, "prompt_len": p, "response_len": r})
  ones = jnp.ones((4, 12))
  draws = obj.Draws(size_bt=0 * ones, t_bt=ones, mask_bt=0 * ones, order_bt=0 * ones)
  c = refusion_jit((2,))(rows, draws)
  logits = jnp.asarray(np.random.default_rng(5).normal(size=(4, 12, 30)), jnp.float32)

  def loss(logits):
    return obj.loss_from_ce(obj.token_cross_entropy(logits, c.labels_bt), c, 4)

  (value, m), grad = jax.jit(jax.value_and_grad(loss, has_aux=True))(logits)
  assert float(m["ar_loss"]) == 0.0 and float(m["ar_tokens"]) == 0.0
  assert float(m["mdm_tokens"]) == r.sum()
  assert np.isfinite(float(value)) and np.isfinite(np.asarray(grad)).all()
  want, _, _ = np_loss(logits, jax.device_get(c), 4)
  np.testing.assert_allclose(float(value), want, rtol=1e-5)


def test_arm_layout_matches_numpy_on_packed_rows():
  rng = np.random.default_rng(6)
  samples = random_samples(rng, 10, 10, vocab=13)
  samples[0] = (rng.integers(4, 13, 7).tolist(), 0, 7)  # no prompt: no predictor of token 0
  placements = first_fit(samples, 16)
  batch = layout(samples, placements, 16)
  c = jax.device_get(arm_jit(rows_of(batch)))
  logits = rng.normal(size=batch["tokens"].shape + (13,)).astype(np.float32)
  loss, m = obj.loss_from_ce(obj.token_cross_entropy(logits, c.labels_bt), c,
                             samples_in(batch))
  total, n = 0.0, 0
  for r, row in enumerate(placements):
    for i, start in row:
      tokens, p_len, r_len = samples[i]
      for j in range(max(p_len, 1), p_len + r_len):  # response token j, predicted at j-1
        total += np_ce(logits[r, start + j - 1], tokens[j])
        n += 1
  np.testing.assert_allclose(float(loss), total / n, rtol=1e-5)
  assert float(m["ar_tokens"]) == n and float(m["mdm_loss"]) == 0.0
  np.testing.assert_array_equal(c.positions_bt, batch["positions"])


def test_mdm_layout_and_loss_match_numpy_on_packed_rows():
  rng = np.random.default_rng(7)
  samples = random_samples(rng, 10, 10, vocab=17)
  placements = first_fit(samples, 20)
  batch = layout(samples, placements, 20)
  per_sample = sample_draws(rng, samples, t_low=0.2)
  draws = placed_draws(per_sample, placements, batch["tokens"].shape, rng)
  c = jax.device_get(mdm_jit(rows_of(batch), draws))
  logits = rng.normal(size=batch["tokens"].shape + (17,)).astype(np.float32)
  want, seen = 0.0, 0
  for r, row in enumerate(placements):
    for i, start in row:
      tokens, p_len, r_len = samples[i]
      _, t, mask, _ = per_sample[i]
      p = p_of(t[0])
      for j in range(p_len + r_len):
        masked = j >= p_len and mask[j] < p
        assert c.input_ids_bt[r, start + j] == (MASK if masked else tokens[j])
        assert c.kind_bt[r, start + j] == (2 if masked else 0)
        if masked:
          assert c.labels_bt[r, start + j] == tokens[j]
          want += np_ce(logits[r, start + j], tokens[j]) / float(p) / r_len
          seen += 1
  assert seen > 10
  loss, _ = obj.loss_from_ce(obj.token_cross_entropy(logits, c.labels_bt), c,
                             samples_in(batch))
  np.testing.assert_allclose(float(loss), want / len(samples), rtol=1e-5)


def test_mdm_rows_fill_the_eos_tail_and_mask_it_like_the_answer():
  # LLaDA's SFT, unpacked: the positions after the answer are EOS tokens the model must
  # learn to produce, masked at the same rate as the answer, counted in R. Without them
  # the model never sees a canvas longer than its answer and cannot tell where it ends.
  batch, seq_len, p, r = 2048, 64, 8, 6
  tokens = np.full((batch, seq_len), PAD, np.int32)
  tokens[:, :p + r] = 9
  rows = obj.packed_rows({"tokens": tokens, "prompt_len": np.full(batch, p, np.int32),
                          "response_len": np.full(batch, r, np.int32)}, eos_fill_id=EOS)
  assert (np.asarray(rows.response_len_bt) == seq_len - p).all()
  assert (np.asarray(rows.segment_ids_bt) == 1).all()
  draws = obj.draw(jax.random.key(11), (batch, seq_len))
  c = jax.device_get(mdm_jit(rows, draws))
  tail = slice(p + r, seq_len)
  assert ((c.kind_bt[:, tail] == 2) == (c.input_ids_bt[:, tail] == MASK)).all()
  assert (np.where(c.kind_bt[:, tail] == 2, c.labels_bt[:, tail], c.input_ids_bt[:, tail])
          == EOS).all()
  pb = np.asarray(p_of(np.asarray(draws.t_bt)[:, 0]))
  frac = (c.kind_bt[:, tail] == 2).mean(axis=1)
  assert abs(float(np.mean(frac - pb))) < 0.01
  assert np.corrcoef(frac, pb)[0, 1] > 0.9
  np.testing.assert_allclose(c.mdm_weight_bt[:, tail].max(axis=1),
                             np.where((c.kind_bt[:, tail] == 2).any(axis=1),
                                      1 / (pb * (seq_len - p)), 0), rtol=1e-6)


# ------------------------------------------------------ loss_fn with a model


@functools.cache  # models are only read here, never updated
def tiny_model(attention="causal", seed=0):
  cfg = config_lib.tiny(num_layers=1, vocab_size=64, hidden_size=32, num_heads=2,
                        num_kv_heads=1, head_dim=16, mlp_dim=64, attention=attention)
  return Transformer(cfg, rngs=nnx.Rngs(seed))


@nnx.jit
def forward(model, ids_bt, positions_bt, mask_btt):
  return model(ids_bt, positions_bt, mask_btt)


@functools.partial(nnx.jit, static_argnames=("objective", "slot_sizes"))
def jit_loss_fn(model, batch, rng, objective, slot_sizes=(4, 8, 16, 32)):
  return obj.loss_fn(model, batch, rng, objective=objective, mask_id=MASK, pad_id=PAD,
                     slot_sizes=slot_sizes)


def small_batch(seed=12, batch=3, seq_len=16):
  """One sample per row, in the row format."""
  rng = np.random.default_rng(seed)
  samples = random_samples(rng, batch, seq_len, vocab=64)
  tokens = np.full((batch, seq_len), PAD, np.int32)
  for b, (t, _, _) in enumerate(samples):
    tokens[b, :len(t)] = t
  return {"tokens": tokens, "prompt_len": np.array([s[1] for s in samples], np.int32),
          "response_len": np.array([s[2] for s in samples], np.int32)}


def segment_mask(segment_ids, causal):
  """The test's own attention mask: same sample (and causal); padding sees itself."""
  seg = np.asarray(segment_ids)
  b, t = seg.shape
  mask = np.zeros((b, t, t), bool)
  for r in range(b):
    for i in range(t):
      for j in range(t):
        same = seg[r, i] == seg[r, j] and seg[r, i] > 0 and (j <= i or not causal)
        mask[r, i, j] = same or i == j
  return mask


def test_loss_fn_on_packed_rows_matches_numpy_on_model_logits():
  rng_np = np.random.default_rng(12)
  samples = random_samples(rng_np, 8, 8, vocab=64)
  placements = first_fit(samples, 16)
  batch = layout(samples, placements, 16)
  rng = jax.random.key(21)
  for objective in ("refusion", "arm"):
    loss, m = jit_loss_fn(tiny_model(), batch, rng, objective, (2, 4))
    c = jax.device_get(obj.corrupt(objective, rows_of(batch), rng, mask_id=MASK, pad_id=PAD,
                                   slot_sizes=(2, 4)))
    logits = np.asarray(forward(tiny_model(), c.input_ids_bt, c.positions_bt,
                                segment_mask(c.segment_ids_bt, causal=True)))
    want, _, _ = np_loss(logits, c, 8)
    np.testing.assert_allclose(float(loss), want, rtol=1e-5)
    assert set(m) == {"loss", "ar_loss", "mdm_loss", "ar_tokens", "mdm_tokens", "samples",
                      "real_tokens"}
    assert float(m["samples"]) == 8
    assert float(m["real_tokens"]) == sum(len(s[0]) for s in samples)


def test_loss_fn_mdm_trains_the_eos_tail_with_full_attention():
  model = tiny_model("bidirectional")
  batch = small_batch(seed=14, batch=4)
  key = jax.random.key(5)
  loss, m = jit_loss_fn(model, batch, key, "mdm")
  rows = obj.packed_rows(batch, eos_fill_id=EOS)
  c = jax.device_get(mdm_jit(rows, obj.draw(key, (4, 16))))
  # Oracle: every position attends to every other one (no key hidden) and the masked
  # positions of the EOS tail count like the answer's.
  logits = np.asarray(forward(model, c.input_ids_bt, c.positions_bt,
                              np.ones((4, 16, 16), bool)))
  want, _, _ = np_loss(logits, c, 4)
  np.testing.assert_allclose(float(loss), want, rtol=1e-5)
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

  rng_np = np.random.default_rng(0)
  for seed in range(3):
    samples = random_samples(rng_np, 6, 8, vocab=64)
    batch = layout(samples, first_fit(samples, 16), 16, rows=4)
    loss, grads = step(state, batch, jax.random.key(seed))
    assert np.isfinite(float(loss)) and float(loss) > 0
    assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))
    assert any(np.abs(np.asarray(g)).max() > 0 for g in jax.tree.leaves(grads))
  assert len(traces) == 1


# -------------------------------------------- packed = unpacked, every path


def _model(attention, impl="xla", scan=False, remat="none", seed=0):
  cfg = config_lib.tiny(num_layers=2, vocab_size=64, hidden_size=32, num_heads=2,
                        num_kv_heads=1, head_dim=16, mlp_dim=64, attention=attention,
                        attention_impl=impl, scan_layers=scan, remat=remat)
  return Transformer(cfg, rngs=nnx.Rngs(seed))


def _loss_and_grads(model, batch, draws, objective, loss_chunk, mesh):
  graphdef, state = nnx.split(model)
  rules = sharding.ShardingRules()

  @jax.jit
  def run(state, batch, draws):
    with sharding.use_mesh(mesh, rules):
      rows = obj.packed_rows(batch)
      if objective in ("refusion", "refusion_bl"):
        c = obj.refusion_corrupt(rows, draws, mask_id=MASK, pad_id=PAD, slot_sizes=(2, 4, 8),
                                 boundary_label=objective == "refusion_bl")
      elif objective == "mdm":
        c = obj.mdm_corrupt(rows, draws, mask_id=MASK, pad_id=PAD)
      elif objective == "bd3lm":
        c = obj.bd3lm_corrupt(rows, draws, mask_id=MASK, pad_id=PAD, block_size=4)
      else:
        c = obj.arm_corrupt(rows, pad_id=PAD)

      def loss(s):
        return obj.model_loss(nnx.merge(graphdef, s), c, obj.num_samples(rows),
                              loss_chunk=loss_chunk)

      return jax.value_and_grad(loss, has_aux=True)(state)

  (value, metrics), grads = run(state, batch, draws)
  return float(value), jax.device_get(metrics), jax.device_get(nnx.to_pure_dict(grads))


# Every attention path and layout, each objective at least once, 8 devices twice.
PACKED_CASES = [
    ("refusion", "xla", False, "none", 0, False),
    ("arm", "xla", False, "none", 0, False),
    ("mdm", "xla", False, "none", 0, False),
    ("refusion", "xla", True, "full", 24, True),
    ("mdm", "xla", True, "save_dots", 0, True),
    ("refusion", "splash", False, "none", 0, False),
    ("arm", "splash", True, "full", 48, False),
    ("mdm", "splash", False, "save_dots", 48, True),
    # ReFusion with the boundary label (train.boundary_label).
    ("refusion_bl", "splash", True, "full", 24, True),
]


@pytest.mark.parametrize("objective,impl,scan,remat,loss_chunk,eight", PACKED_CASES)
def test_packed_rows_give_the_unpacked_loss_and_gradients(objective, impl, scan, remat,
                                                          loss_chunk, eight):
  seq_len = 128  # splash's tile
  rng = np.random.default_rng(hash((objective, impl, scan, loss_chunk)) % 2**32)
  samples = random_samples(rng, 8, 60, vocab=64, min_resp=4)
  per_sample = sample_draws(rng, samples, t_low=0.3)
  packed_rows_ = first_fit(samples, seq_len)
  assert len(packed_rows_) < 8  # samples do share rows
  unpacked_rows = [[(i, 0)] for i in range(8)]
  batches = {}
  for name, placements in (("packed", packed_rows_), ("unpacked", unpacked_rows)):
    batch = layout(samples, placements, seq_len, rows=8 if name == "unpacked" else 4)
    draws = placed_draws(per_sample, placements, batch["tokens"].shape, rng)
    batches[name] = (batch, draws)
  mesh = sharding.make_mesh(1, 4, 2) if eight else None
  model = _model(obj.attention_for(objective.removesuffix("_bl")), impl, scan, remat)
  got = {name: _loss_and_grads(model, batch, draws, objective, loss_chunk, mesh)
         for name, (batch, draws) in batches.items()}
  (loss_p, m_p, g_p), (loss_u, m_u, g_u) = got["packed"], got["unpacked"]
  assert loss_u > 0.5
  assert abs(loss_p - loss_u) <= 1e-5 * max(1.0, loss_u), (loss_p, loss_u)
  for k in ("ar_loss", "mdm_loss", "ar_tokens", "mdm_tokens"):
    assert abs(m_p[k] - m_u[k]) <= 1e-5 * max(1.0, abs(m_u[k])), (k, m_p[k], m_u[k])
  leaves_u = jax.tree_util.tree_leaves_with_path(g_u)
  for (path, a), b in zip(leaves_u, jax.tree.leaves(g_p)):
    np.testing.assert_allclose(b, a, atol=1e-5, rtol=1e-5, err_msg=jax.tree_util.keystr(path))
  assert max(np.abs(a).max() for _, a in leaves_u) > 1e-3


@pytest.mark.parametrize("impl", ["xla", "splash"])
@pytest.mark.parametrize("attention", ["causal", "bidirectional"])
def test_no_attention_across_segments(impl, attention):
  # Changing one sample's tokens changes no logit of another sample of the row.
  rng = np.random.default_rng(1)
  samples = random_samples(rng, 6, 50, vocab=64)
  placements = first_fit(samples, 128)
  batch = layout(samples, placements, 128)
  model = _model(attention, impl)
  graphdef, state = nnx.split(model)
  run = jax.jit(lambda s, ids, pos, seg: nnx.merge(graphdef, s)(ids, pos, segment_ids_bt=seg))
  before = np.asarray(run(state, batch["tokens"], batch["positions"], batch["segment_ids"]))
  changed = dict(batch, tokens=batch["tokens"].copy())
  row = next(r for r, p in enumerate(placements) if len(p) > 1)
  seg = batch["segment_ids"][row]
  changed["tokens"][row, seg == 1] = rng.integers(4, 64, int((seg == 1).sum()))
  after = np.asarray(run(state, changed["tokens"], batch["positions"], batch["segment_ids"]))
  assert not np.allclose(after[row, seg == 1], before[row, seg == 1])
  np.testing.assert_array_equal(after[row, seg > 1], before[row, seg > 1])
  others = np.arange(len(placements)) != row
  np.testing.assert_array_equal(after[others], before[others])


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
  return Transformer(cfg, rngs=nnx.Rngs(1))


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
  graphdef, state = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
  samples = random_samples(np.random.default_rng(2), batch_size, seq_len, vocab=vocab,
                           min_resp=seq_len // 2)
  batch = one_per_row(samples, seq_len)
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
  rows = obj.packed_rows(small_batch())
  with pytest.raises(ValueError, match="slot_sizes"):
    obj.refusion_corrupt(rows, obj.draw(jax.random.key(0), (3, 16)), mask_id=MASK, pad_id=PAD,
                         slot_sizes=bad)


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
  with pytest.raises(ValueError, match="boundary_label must be a bool"):
    obj.loss_fn(model, batch, key, objective="refusion", boundary_label="yes", **kw)
  with pytest.raises(ValueError, match="boundary_label=True labels ReFusion"):
    obj.loss_fn(model, batch, key, objective="arm", boundary_label=True, **kw)
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


def _packed_example():
  samples = [([5, 6, 7, 8], 1, 3), ([9, 10, 11], 2, 1), ([12, 13], 1, 1)]
  return layout(samples, [[(0, 0), (1, 4), (2, 7)]], 10)


@pytest.mark.parametrize("change, message", [
    (lambda b: b["positions"].__setitem__((0, 4), 1), "position 0"),
    (lambda b: b["positions"].__setitem__((0, 2), 5), "count up by 1"),
    (lambda b: b["segment_response_len"].__setitem__((0, 5), 2), "constant within a sample"),
    (lambda b: (b["segment_response_len"].__setitem__((0, slice(4, 7)), 0),
                b["segment_prompt_len"].__setitem__((0, slice(4, 7)), 3)), "response_len >= 1"),
    (lambda b: (b["segment_prompt_len"].__setitem__((0, slice(0, 4)), 2)), "exactly"),
    (lambda b: b["segment_ids"].__setitem__((0, slice(4, 7)), 1), "count up by 1"),
    (lambda b: b["segment_ids"].__setitem__((0, 0), -1), ">= 0"),
    (lambda b: b["segment_ids"].__setitem__((0, slice(7, 9)), 1), "used by two samples"),
    (lambda b: b.pop("positions"), "missing"),
    (lambda b: b.__setitem__("positions", b["positions"][:, :5]), "shape"),
])
def test_bad_packed_batches_are_named(change, message):
  batch = _packed_example()
  obj.check_batch(batch)  # the example itself is well formed
  change(batch)
  with pytest.raises(ValueError, match=message):
    obj.loss_fn(tiny_model(), batch, jax.random.key(0), objective="arm", mask_id=MASK,
                pad_id=PAD)
