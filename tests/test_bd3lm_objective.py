"""Tests for BD3-LM's training objective (objective.bd3lm_corrupt, masks.block_diffusion_btt).

The two-half layout and its attention are checked against a plain-Python oracle
that lays out each sample on its own from the very draws the jitted layout
reads (explicit loops, the rules of ALGORITHM.md "Baselines" written out), a
hand-worked row, the model itself (a change outside what a token may see changes
none of its logits), and packing against not packing on every einsum layout
(unrolled and scanned layers, remat, chunked loss, 8 devices).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from refusion_jax import config as config_lib
from refusion_jax import masks
from refusion_jax import objective as obj
from refusion_jax import sharding
from refusion_jax.model import Transformer
from tests.test_objective import (_loss_and_grads, first_fit, layout, placed_draws,
                                  random_samples, sample_draws)

MASK = 3
PAD = 0
EOS = 1
EPS = (1e-3, 1.0)


# ---------------------------------------------------------------- oracle


def oracle_visible(q, k, b):
  """Whether token q may attend to token k; each is (sample, noised, offset, P) or None."""
  if q is None or k is None or q[0] != k[0]:
    return False
  _, q_noised, q_pos, p = q
  _, k_noised, k_pos, _ = k
  q_blk = (q_pos - p) // b if q_pos >= p else -1
  k_blk = (k_pos - p) // b if k_pos >= p else -1
  if q_noised:
    if k_noised:
      return k_blk == q_blk
    return k_blk < q_blk
  if k_noised:
    return False
  if q_blk == -1:
    return k_blk == -1 and k_pos <= q_pos
  return k_blk <= q_blk


def oracle_row(samples, placements, draws_row, seq_len, b):
  """One row's two halves, laid out sample by sample (dynamic shapes, loops).

  Returns ids, labels, weights (lists of 2L) and the 2L x 2L mask.
  """
  ids = [None] * (2 * seq_len)
  labels = [PAD] * (2 * seq_len)
  weights = [0.0] * (2 * seq_len)
  who = [None] * (2 * seq_len)
  t_u, mask_u = draws_row
  for sample_no, (i, start) in enumerate(placements, start=1):
    tokens, p, r = samples[i]
    for j, tok in enumerate(tokens):
      who[seq_len + start + j] = (sample_no, False, j, p)
      ids[seq_len + start + j] = tok
      if j < p:
        continue
      block_first = start + p + ((j - p) // b) * b
      t = EPS[0] + (EPS[1] - EPS[0]) * float(t_u[block_first])
      masked = float(mask_u[start + j]) < t
      who[start + j] = (sample_no, True, j, p)
      ids[start + j] = MASK if masked else tok
      if masked:
        labels[start + j] = tok
        weights[start + j] = 1.0 / (t * r)
  n = 2 * seq_len
  mask = np.zeros((n, n), bool)
  for a in range(n):
    for c in range(n):
      mask[a, c] = a == c or oracle_visible(who[a], who[c], b)
  return ids, labels, weights, mask


def bd3(batch, draws, b):
  rows = obj.packed_rows({k: jnp.asarray(v) for k, v in batch.items()})
  c = obj.bd3lm_corrupt(rows, draws, mask_id=MASK, pad_id=PAD, block_size=b, eps_min=EPS[0],
                        eps_max=EPS[1])
  m = masks.block_diffusion_btt(c.segment_ids_bt, c.block_bt, c.noised_bt, c.positions_bt)
  return jax.device_get(c), np.asarray(m)


# ---------------------------------------------------------------- layout


def test_hand_worked_row():
  # A prompt of 2, an answer of 4 + EOS EOS-padded to two blocks of 4, then padding.
  batch = {"tokens": np.array([[10, 11, 20, 21, 22, 23, EOS, 0, 0, 0, 0, 0]], np.int32),
           "prompt_len": np.array([2], np.int32), "response_len": np.array([5], np.int32)}
  rows = obj.packed_rows({k: jnp.asarray(v) for k, v in batch.items()}, eos_fill_id=EOS,
                         eos_fill_multiple=4)
  np.testing.assert_array_equal(rows.tokens_bt[0], [10, 11, 20, 21, 22, 23, 1, 1, 1, 1, 0, 0])
  assert int(rows.response_len_bt[0, 0]) == 8
  t_u = np.zeros((1, 12), np.float32)
  t_u[0, 2], t_u[0, 6] = 0.2, 0.9  # block 0: t = 0.2008, block 1: t = 0.9001
  mask_u = np.ones((1, 12), np.float32)
  mask_u[0, 2:10] = [0.1, 0.5, 0.19, 0.3, 0.95, 0.0, 0.8, 0.95]
  draws = obj.Draws(jnp.zeros((1, 12)), jnp.asarray(t_u), jnp.asarray(mask_u),
                    jnp.zeros((1, 12)))
  c = jax.device_get(obj.bd3lm_corrupt(rows, draws, mask_id=MASK, pad_id=PAD, block_size=4))
  t0, t1 = 1e-3 + 0.999 * 0.2, 1e-3 + 0.999 * 0.9
  m, e = MASK, EOS
  np.testing.assert_array_equal(c.input_ids_bt[0, 2:10], [m, 21, m, 23, e, m, m, e])
  np.testing.assert_array_equal(c.input_ids_bt[0, 12:24], rows.tokens_bt[0])
  np.testing.assert_array_equal(c.labels_bt[0, 2:10], [20, PAD, 22, PAD, PAD, e, e, PAD])
  np.testing.assert_array_equal(c.kind_bt[0], [0, 0, 2, 0, 2, 0, 0, 2, 2] + [0] * 15)
  np.testing.assert_allclose(c.mdm_weight_bt[0, [2, 4, 7, 8]],
                             [1 / (t0 * 8), 1 / (t0 * 8), 1 / (t1 * 8), 1 / (t1 * 8)], rtol=1e-6)
  np.testing.assert_array_equal(c.positions_bt[0], [0, 0, 2, 3, 4, 5, 6, 7, 8, 9, 0, 0,
                                                    0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 0])
  mask = np.asarray(masks.block_diffusion_btt(c.segment_ids_bt, c.block_bt, c.noised_bt,
                                              c.positions_bt))[0]
  seen = lambda q: sorted(np.nonzero(mask[q])[0].tolist())  # noqa: E731
  # Noised block 0 (3): the clean prompt (12, 13) and its own noised block (2..5).
  assert seen(3) == [2, 3, 4, 5, 12, 13]
  # Noised block 1 (6): the clean prompt and clean block 0 (12..17), its noised block.
  assert seen(6) == [6, 7, 8, 9, 12, 13, 14, 15, 16, 17]
  # Clean prompt: causal. Clean block 0 (14): prompt and its whole block. Block 1: all.
  assert seen(12) == [12] and seen(13) == [12, 13]
  assert seen(14) == [12, 13, 14, 15, 16, 17]
  assert seen(21) == list(range(12, 22))
  # The noised half's prompt places and padding: themselves only, seen by no one.
  for q in (0, 1, 10, 11, 22, 23):
    assert seen(q) == [q]
    assert mask[:, q].sum() == 1


@pytest.mark.parametrize("b,seq_len", [(2, 24), (4, 40), (8, 40)])
@pytest.mark.parametrize("packed", [False, True])
def test_layout_and_mask_match_python_oracle(b, seq_len, packed):
  rng = np.random.default_rng(b * 100 + seq_len + packed)
  samples = random_samples(rng, 6, seq_len // 2 if packed else seq_len, vocab=50)
  placements = first_fit(samples, seq_len) if packed else [[(i, 0)] for i in range(6)]
  if packed:
    assert len(placements) < 6
  batch = layout(samples, placements, seq_len)
  draws = placed_draws(sample_draws(rng, samples), placements, batch["tokens"].shape, rng)
  c, mask = bd3(batch, draws, b)
  for r, row in enumerate(placements):
    ids, labels, weights, want_mask = oracle_row(
        samples, row, (np.asarray(draws.t_bt[r]), np.asarray(draws.mask_bt[r])), seq_len, b)
    real = [i for i, v in enumerate(ids) if v is not None]
    np.testing.assert_array_equal(c.input_ids_bt[r, real], [ids[i] for i in real])
    np.testing.assert_array_equal(c.labels_bt[r], labels)
    np.testing.assert_array_equal(c.kind_bt[r] == obj.KIND_MDM, np.asarray(weights) > 0)
    np.testing.assert_allclose(c.mdm_weight_bt[r], weights, rtol=1e-5)
    np.testing.assert_array_equal(mask[r], want_mask)


def test_response_padding_to_whole_blocks_stops_at_the_row():
  batch = {"tokens": np.array([[5, 6, 7, 8, EOS, 0, 0], [5, 6, 7, 8, 9, 10, EOS]], np.int32),
           "prompt_len": np.array([2, 1], np.int32), "response_len": np.array([3, 6], np.int32)}
  rows = jax.device_get(obj.packed_rows({k: jnp.asarray(v) for k, v in batch.items()},
                                        eos_fill_id=EOS, eos_fill_multiple=4))
  # Row 0: 3 -> 4 response tokens; row 1: 6 -> 8 would pass the row's end, so 6.
  np.testing.assert_array_equal(rows.tokens_bt[0], [5, 6, 7, 8, EOS, EOS, 0])
  assert rows.response_len_bt[0, 0] == 4 and rows.response_len_bt[1, 0] == 6


def test_noise_levels_are_per_block_and_clipped():
  rng = np.random.default_rng(0)
  samples = [(rng.integers(4, 50, 66).tolist(), 2, 64) for _ in range(64)]
  batch = layout(samples, [[(i, 0)] for i in range(64)], 66)
  draws = obj.draw(jax.random.key(3), (64, 66))
  rows = obj.packed_rows({k: jnp.asarray(v) for k, v in batch.items()})
  c = jax.device_get(obj.bd3lm_corrupt(rows, draws, mask_id=MASK, pad_id=PAD, block_size=8,
                                       eps_min=0.3, eps_max=0.8))
  masked = c.kind_bt[:, 2:66] == obj.KIND_MDM
  per_block = masked.reshape(64, 8, 8).mean(axis=-1)
  assert 0.5 < per_block.mean() < 0.6  # E[t] = 0.55
  # Every masked token of a block has the block's t: one weight per block.
  w = c.mdm_weight_bt[:, 2:66].reshape(64, 8, 8)
  t = 1.0 / np.where(w > 0, w * 64, 1.0)
  for blk_t, blk_m in zip(t.reshape(-1, 8), masked.reshape(-1, 8)):
    if blk_m.any():
      assert np.ptp(blk_t[blk_m]) < 1e-5 and 0.3 - 1e-6 <= blk_t[blk_m][0] <= 0.8 + 1e-6


# ---------------------------------------------------------------- through the model


def _model(impl="xla", scan=False, remat="none", seed=0):
  cfg = config_lib.tiny(num_layers=2, vocab_size=64, hidden_size=32, num_heads=2,
                        num_kv_heads=1, head_dim=16, mlp_dim=64, attention="causal",
                        attention_impl=impl, scan_layers=scan, remat=remat,
                        mask_token_id=MASK, eos_token_id=EOS, pad_token_id=PAD)
  return Transformer(cfg, rngs=nnx.Rngs(seed))


def test_loss_matches_numpy_on_the_oracle_mask():
  rng = np.random.default_rng(5)
  samples = random_samples(rng, 5, 20, vocab=64, min_resp=3)
  placements = first_fit(samples, 32)
  batch = layout(samples, placements, 32)
  draws = placed_draws(sample_draws(rng, samples), placements, batch["tokens"].shape, rng)
  model = _model()
  c, _ = bd3(batch, draws, 4)
  rows = obj.packed_rows({k: jnp.asarray(v) for k, v in batch.items()})
  loss, metrics = obj.model_loss(model, c, obj.num_samples(rows))
  total = 0.0
  for r, row in enumerate(placements):
    ids, labels, weights, mask = oracle_row(
        samples, row, (np.asarray(draws.t_bt[r]), np.asarray(draws.mask_bt[r])), 32, 4)
    ids = np.asarray([PAD if v is None else v for v in ids], np.int32)[None]
    logits = np.asarray(model(jnp.asarray(ids), jnp.asarray(c.positions_bt[r:r + 1]),
                              jnp.asarray(mask[None])), np.float64)[0]
    top = logits.max(-1, keepdims=True)
    logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
    for i, w in enumerate(weights):
      if w:
        total += -logp[i, labels[i]] * w
  want = total / len(samples)
  assert float(metrics["ar_loss"]) == 0.0
  np.testing.assert_allclose(float(loss), want, rtol=2e-5)


def test_no_token_sees_past_its_rule():
  # Changing a token changes the logits only of the tokens allowed to see it.
  rng = np.random.default_rng(7)
  samples = [(rng.integers(4, 60, 14).tolist(), 3, 11), (rng.integers(4, 60, 10).tolist(), 2, 8)]
  batch = layout(samples, [[(0, 0), (1, 14)]], 28)
  draws = placed_draws(sample_draws(rng, samples, t_low=0.5), [[(0, 0), (1, 14)]], (1, 28), rng)
  c, mask = bd3(batch, draws, 4)
  model = _model()
  fwd = jax.jit(lambda ids: model(ids, jnp.asarray(c.positions_bt), jnp.asarray(mask)))
  base = np.asarray(fwd(jnp.asarray(c.input_ids_bt)))
  # Reach of a change: what sees it, what sees those, ... (attention over layers).
  reach = mask[0].T.astype(int)
  closure = np.eye(56, dtype=int)
  for _ in range(2):  # two layers
    closure = ((closure + closure @ reach) > 0).astype(int)
  for k in (3, 9, 14 + 5, 28 + 4, 28 + 8, 28 + 14 + 3):
    ids = np.array(c.input_ids_bt)
    ids[0, k] = (ids[0, k] + 7) % 60 + 4
    out = np.asarray(fwd(jnp.asarray(ids)))
    changed = np.abs(out - base).max(-1)[0] > 1e-6
    may = closure[k] > 0
    assert not (changed & ~may).any(), (k, np.nonzero(changed & ~may))
    assert changed[k]
    # The other sample never moves.
    other = (c.segment_ids_bt[0] > 0) & (c.segment_ids_bt[0] != c.segment_ids_bt[0, k])
    assert not changed[other].any()


@pytest.mark.parametrize("scan,remat,loss_chunk,eight", [
    (False, "none", 0, False), (True, "full", 24, True), (False, "save_dots", 16, False)])
def test_packed_rows_give_the_unpacked_loss_and_gradients(scan, remat, loss_chunk, eight):
  seq_len = 48
  rng = np.random.default_rng(hash((scan, remat, loss_chunk)) % 2**32)
  samples = random_samples(rng, 8, 22, vocab=64, min_resp=4)
  per_sample = sample_draws(rng, samples, t_low=0.3)
  packed = first_fit(samples, seq_len)
  assert len(packed) < 8
  got = {}
  for name, placements, n_rows in (("packed", packed, 4), ("unpacked",
                                                           [[(i, 0)] for i in range(8)], 8)):
    batch = layout(samples, placements, seq_len, rows=n_rows)
    draws = placed_draws(per_sample, placements, batch["tokens"].shape, rng)
    mesh = sharding.make_mesh(1, 4, 2) if eight else None
    got[name] = _loss_and_grads(_model(scan=scan, remat=remat), batch, draws, "bd3lm",
                                loss_chunk, mesh)  # its layout with blocks of 4
  (loss_p, m_p, g_p), (loss_u, m_u, g_u) = got["packed"], got["unpacked"]
  assert loss_u > 0.5
  assert abs(loss_p - loss_u) <= 1e-5 * loss_u, (loss_p, loss_u)
  assert m_p["mdm_tokens"] == m_u["mdm_tokens"] > 0
  leaves_u = jax.tree_util.tree_leaves_with_path(g_u)
  for (path, a), g in zip(leaves_u, jax.tree.leaves(g_p)):
    np.testing.assert_allclose(g, a, atol=1e-5, rtol=1e-5, err_msg=jax.tree_util.keystr(path))
  assert max(np.abs(a).max() for _, a in leaves_u) > 1e-3


def test_loss_fn_pads_unpacked_rows_to_whole_blocks():
  model = _model()
  batch = {"tokens": np.array([[10, 11, 20, 21, 22, EOS, 0, 0, 0, 0]], np.int32),
           "prompt_len": np.array([2], np.int32), "response_len": np.array([4], np.int32)}
  packed = obj.packed_batch(batch, eos_fill_id=EOS, eos_fill_multiple=4)
  key = jax.random.key(4)
  a = obj.loss_fn(model, batch, key, objective="bd3lm", mask_id=MASK, pad_id=PAD,
                  bd3lm_block_size=4)
  b = obj.loss_fn(model, packed, key, objective="bd3lm", mask_id=MASK, pad_id=PAD,
                  bd3lm_block_size=4)
  assert float(a[0]) == float(b[0]) and float(a[1]["real_tokens"]) == 6


@pytest.mark.parametrize("kwargs, message", [
    ({"bd3lm_block_size": 0}, "bd3lm_block_size must be a positive int"),
    ({"bd3lm_block_size": 2.0}, "bd3lm_block_size must be a positive int"),
    ({"bd3lm_eps": (0.0, 1.0)}, "bd3lm_eps_min must be a float in"),
    ({"bd3lm_eps": (0.5, 0.2)}, "bd3lm_eps_min=0.5 exceeds bd3lm_eps_max=0.2"),
])
def test_bad_settings_raise(kwargs, message):
  batch = {"tokens": np.array([[10, 11, 20, EOS]], np.int32),
           "prompt_len": np.array([2], np.int32), "response_len": np.array([2], np.int32)}
  with pytest.raises(ValueError, match=message):
    obj.loss_fn(_model(), batch, jax.random.key(0), objective="bd3lm", mask_id=MASK,
                pad_id=PAD, **kwargs)


def test_bidirectional_model_is_refused():
  cfg = config_lib.tiny(num_layers=1, vocab_size=64, hidden_size=32, num_heads=2,
                        num_kv_heads=1, head_dim=16, mlp_dim=64, attention="bidirectional",
                        eos_token_id=EOS)
  batch = {"tokens": np.array([[10, 11, 20, EOS]], np.int32),
           "prompt_len": np.array([2], np.int32), "response_len": np.array([2], np.int32)}
  with pytest.raises(ValueError, match="needs a model with attention='causal'"):
    obj.loss_fn(Transformer(cfg, rngs=nnx.Rngs(0)), batch, jax.random.key(0), objective="bd3lm",
                mask_id=MASK, pad_id=PAD)
