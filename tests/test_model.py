"""Qwen3 backbone vs Hugging Face transformers, and the KV-cache chunk path.

The oracle is the committed fixture tests/fixtures/hf_tiny (random tiny
Qwen3ForCausalLM models and their transformers logits, written by
scripts/make_hf_fixture.py), so no torch is needed here.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from refusion_jax import hf, masks
from refusion_jax.config import tiny
from refusion_jax.kv_cache import KVCache
from refusion_jax.model import Transformer, attend

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "hf_tiny")
# Qwen3, Qwen2 (Qwen2.5) and Llama (Llama-3; llama31: 3.1's RoPE scaling) layouts.
NAMES = ("gqa", "tied", "qwen2_gqa", "qwen2_tied", "llama_gqa", "llama31")


@pytest.fixture(scope="module", params=NAMES)
def fixture(request):
  folder = os.path.join(FIXTURES, request.param)
  config, model = hf.load(folder)
  golden = dict(np.load(os.path.join(folder, "golden.npz")))
  return request.param, config, model, golden


@pytest.mark.parametrize("kind", ["seq", "perm"])
def test_logits_match_transformers(fixture, kind):
  name, config, model, golden = fixture
  logits = np.asarray(model(golden["input_ids"], golden[f"positions_{kind}"]))
  assert logits.shape == golden[f"logits_{kind}"].shape
  delta = np.abs(logits - golden[f"logits_{kind}"]).max()
  assert delta <= 1e-4, f"{name}/{kind}: max |delta| {delta}"


def test_permuted_positions_change_logits(fixture):
  # Guards the oracle itself: if positions were ignored both goldens would agree.
  _, _, _, golden = fixture
  assert np.abs(golden["logits_seq"] - golden["logits_perm"]).max() > 1e-2


def _chunk(model, ids_bt, positions_bt, cache):
  b, t = ids_bt.shape
  mask = jnp.broadcast_to(masks.causal_tt(t)[None], (b, t, t))
  return model.forward_chunk(jnp.asarray(ids_bt), jnp.asarray(positions_bt), cache, mask)


def _attend_reference(q, k, v, chunk_mask, ck, cv, length):
  """A plain softmax over [cache keys, chunk keys], one query and head at a time."""
  b, t, n, h = q.shape
  g = n // k.shape[2]
  valid = np.arange(ck.shape[2])[None] < np.asarray(length)[:, None]
  want = np.zeros((b, t, n, h), np.float32)
  for bi in range(b):
    for ti in range(t):
      for head in range(n):
        j = head // g
        keys = np.concatenate([ck[bi, j], k[bi, :, j]])
        vals = np.concatenate([cv[bi, j], v[bi, :, j]])
        seen = np.concatenate([valid[bi], chunk_mask[bi, ti]])
        logits = np.where(seen, keys @ q[bi, ti, head] / np.sqrt(h), -1e30)
        w = np.exp(logits - logits.max())
        want[bi, ti, head] = (w / w.sum()) @ vals
  return want


def _attend_inputs(b, t, s, n=4, kv=2, h=8, seed=0):
  rs = np.random.RandomState(seed)
  q = rs.randn(b, t, n, h).astype(np.float32)
  k, v = rs.randn(b, t, kv, h).astype(np.float32), rs.randn(b, t, kv, h).astype(np.float32)
  ck, cv = rs.randn(b, kv, s, h).astype(np.float32), rs.randn(b, kv, s, h).astype(np.float32)
  return q, k, v, ck, cv


def test_attend_with_cache_equals_one_softmax_over_both_key_sets():
  # The cache's and the chunk's score blocks are exponentiated and multiplied apart and
  # normalised once; a plain softmax over [cache keys, chunk keys] is the reference,
  # including a query that sees nothing (uniform weights over every key, no NaN).
  b, t, s = 2, 3, 5
  q, k, v, ck, cv = _attend_inputs(b, t, s)
  chunk_mask = np.tril(np.ones((t, t), bool))[None].repeat(b, 0)
  length = np.array([3, 0])  # row 1 has an empty cache
  chunk_mask[1, 0, 0] = False  # row 1, query 0 sees nothing at all
  got = np.asarray(attend(*map(jnp.asarray, (q, k, v, chunk_mask, ck, cv, length))))
  assert np.isfinite(got).all()
  np.testing.assert_allclose(got, _attend_reference(q, k, v, chunk_mask, ck, cv, length),
                             rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv_chunk", [1, 4, 5, 7])
def test_attend_over_the_live_prefix_in_chunks_equals_one_softmax(kv_chunk):
  # kv_chunk < s reads the cache kv_chunk entries at a time up to the longest live row;
  # 7 does not divide 16, so the last chunk overlaps the one before it.
  b, t, s = 4, 3, 16
  q, k, v, ck, cv = _attend_inputs(b, t, s, seed=1)
  chunk_mask = np.tril(np.ones((t, t), bool))[None].repeat(b, 0)
  for length in ([16, 0, 5, 9], [3, 1, 0, 2], [0, 0, 0, 0], [13, 16, 12, 14]):
    args = map(jnp.asarray, (q, k, v, chunk_mask, ck, cv, np.array(length)))
    got = np.asarray(jax.jit(attend, static_argnums=7)(*args, kv_chunk))
    np.testing.assert_allclose(got, _attend_reference(q, k, v, chunk_mask, ck, cv, length),
                               rtol=1e-5, atol=1e-5, err_msg=f"lengths {length}")


def test_attend_live_row_is_bit_exact_whatever_the_other_rows_hold():
  # A row's result must not depend on how far the loop runs for the longest row: the
  # chunks past its own live prefix are exact no-ops. Row 0 (7 live entries, chunks of 4)
  # beside a row with 0, 7 or 32 live entries, and alone: the same bits.
  t, s, c = 3, 32, 4
  q, k, v, ck, cv = _attend_inputs(2, t, s, seed=2)
  chunk_mask = np.tril(np.ones((t, t), bool))[None].repeat(2, 0)
  run = jax.jit(attend, static_argnums=7)
  alone = np.asarray(run(*map(jnp.asarray, (q[:1], k[:1], v[:1], chunk_mask[:1], ck[:1], cv[:1],
                                            np.array([7]))), c))[0]
  for other in (0, 7, 32):
    got = np.asarray(run(*map(jnp.asarray, (q, k, v, chunk_mask, ck, cv, np.array([7, other]))),
                         c))
    np.testing.assert_array_equal(got[0], alone, err_msg=f"beside a row of {other}")
  # What it stands for: entries past the longest row's live prefix are never read (NaN
  # there changes nothing), while a whole-buffer product multiplies them by zero weights.
  poisoned_k, poisoned_v = ck.copy(), cv.copy()
  poisoned_k[:, :, 8:], poisoned_v[:, :, 8:] = np.nan, np.nan
  args = (q, k, v, chunk_mask, poisoned_k, poisoned_v, np.array([7, 8]))
  got = np.asarray(run(*map(jnp.asarray, args), c))
  np.testing.assert_array_equal(got[0], alone)
  assert np.isfinite(got).all()
  assert np.isnan(np.asarray(run(*map(jnp.asarray, args), 0))).any()


@pytest.mark.parametrize("scan_layers", [False, True])
def test_cache_write_places_entries_per_layer_and_drops_out_of_range(scan_layers):
  config = tiny(num_layers=2, num_kv_heads=2, head_dim=4, scan_layers=scan_layers)
  cache = KVCache.init(config, batch=2, max_len=3)
  if scan_layers:  # one stacked buffer, sliced per layer by the model's scan
    assert cache.stacked and cache.k.shape == (2, 2, 2, 3, 4)
  else:
    assert len(cache.k) == 2 and cache.k[0].shape == (2, 2, 3, 4)
  assert cache.num_layers == 2 and cache.max_len == 3 and cache.batch == 2
  # Chunk K/V in the model's [layers, B, T, heads, H] layout; value = 100 l + 10 t + head.
  l_, t_, k_ = np.meshgrid(np.arange(2), np.arange(2), np.arange(2), indexing="ij")
  val = (100 * l_ + 10 * t_ + k_).astype(np.float32)  # [layers, T, heads]
  k_lbtkh = jnp.asarray(np.broadcast_to(val[:, None, :, :, None], (2, 2, 2, 2, 4)))
  rows = jnp.asarray([[1, 1], [0, 2]])  # row 2 does not exist: dropped
  dest = jnp.asarray([[2, 0], [3, 1]])  # entry 3 is past max_len: dropped
  out = cache.write(rows, dest, k_lbtkh, -k_lbtkh, jnp.asarray([[7, 8], [9, 5]]))
  for layer in range(2):
    k = np.asarray(out.layer(layer)[0])
    for head in range(2):
      assert list(k[1, head, :, 0]) == [100 * layer + 10 + head, 0, 100 * layer + head]
      assert list(k[0, head, :, 0]) == [0, 0, 0]
    np.testing.assert_array_equal(np.asarray(out.layer(layer)[1]), -k)
  assert np.asarray(out.positions_bs).tolist() == [[-1, -1, -1], [8, -1, 7]]
  assert np.asarray(out.length_b).tolist() == [0, 0]  # lengths are the caller's to raise


@pytest.mark.parametrize("shuffle_commit", [False, True])
def test_chunk_against_cache_equals_full_call(fixture, shuffle_commit):
  name, config, model, golden = fixture
  ids_bt, positions_bt = golden["input_ids"], golden["positions_perm"]
  b, t = ids_bt.shape
  split = 7
  cache = KVCache.init(config, b, max_len=16)
  # Prefix: its own causal chunk over an empty cache, then committed.
  logits_prefix, k, v = _chunk(model, ids_bt[:, :split], positions_bt[:, :split], cache)
  pos = jnp.asarray(positions_bt[:, :split])
  if shuffle_commit:
    # Commit the prefix entries in a scrambled order, in two commits, so the
    # buffer order is neither the input order nor the position order.
    order = np.random.default_rng(0).permutation(split)
    k, v, pos = k[:, :, order], v[:, :, order], pos[:, order]
    first = np.zeros((b, split), bool)
    first[:, :3] = True
    cache = cache.commit(k, v, pos, jnp.asarray(first))
    cache = cache.commit(k, v, pos, jnp.asarray(~first))
    np.testing.assert_array_equal(np.asarray(cache.positions_bs[:, :split]),
                                  positions_bt[:, :split][:, order])
  else:
    cache = cache.commit(k, v, pos, jnp.ones((b, split), bool))
  assert np.asarray(cache.length_b).tolist() == [split] * b
  logits_suffix, _, _ = _chunk(model, ids_bt[:, split:], positions_bt[:, split:], cache)
  full = np.asarray(model(ids_bt, positions_bt))
  np.testing.assert_allclose(np.asarray(logits_prefix), full[:, :split], atol=1e-5)
  np.testing.assert_allclose(np.asarray(logits_suffix), full[:, split:], atol=1e-5)
  assert np.abs(np.asarray(logits_suffix) - golden["logits_perm"][:, split:]).max() <= 1e-4


def test_cache_entries_beyond_length_are_ignored(fixture):
  # Garbage in the unused part of the buffer must not leak into attention.
  _, config, model, golden = fixture
  ids_bt, positions_bt = golden["input_ids"], golden["positions_seq"]
  b = ids_bt.shape[0]
  cache = KVCache.init(config, b, max_len=16)
  _, k, v = _chunk(model, ids_bt[:, :5], positions_bt[:, :5], cache)
  cache = cache.commit(k, v, jnp.asarray(positions_bt[:, :5]), jnp.ones((b, 5), bool))
  noisy = cache.replace(k=tuple(x.at[:, :, 5:].set(7.0) for x in cache.k),
                        v=tuple(x.at[:, :, 5:].set(-7.0) for x in cache.v))
  clean_logits, _, _ = _chunk(model, ids_bt[:, 5:], positions_bt[:, 5:], cache)
  noisy_logits, _, _ = _chunk(model, ids_bt[:, 5:], positions_bt[:, 5:], noisy)
  np.testing.assert_array_equal(np.asarray(clean_logits), np.asarray(noisy_logits))
  assert np.abs(np.asarray(clean_logits) - golden["logits_seq"][:, 5:]).max() <= 1e-4


@pytest.mark.parametrize("name", NAMES)
def test_bfloat16_model_is_close(name):
  folder = os.path.join(FIXTURES, name)
  config, model = hf.load(folder, dtype="bfloat16")
  assert config.param_dtype == "bfloat16" and config.dtype == "bfloat16"
  assert model.embed[...].dtype == jnp.bfloat16
  golden = np.load(os.path.join(folder, "golden.npz"))
  logits = model(golden["input_ids"], golden["positions_perm"])
  assert logits.dtype == jnp.bfloat16
  delta = np.abs(np.asarray(logits.astype(jnp.float32)) - golden["logits_perm"]).max()
  # bf16 keeps ~3 significant digits; logits here are O(1).
  assert delta < 0.1, delta
  assert np.isfinite(np.asarray(logits.astype(jnp.float32))).all()


@pytest.mark.parametrize("changes, message", [
    (dict(num_heads=3, num_kv_heads=2), "num_heads=3 must be a multiple of num_kv_heads=2"),
    (dict(head_dim=15), "head_dim must be even"),
    (dict(vocab_size=0), "vocab_size must be a positive int"),
    (dict(hidden_size=64.0), "hidden_size must be a positive int"),
    (dict(mask_token_id=512), "mask_token_id=512 is outside the vocabulary"),
    (dict(dtype="float8"), "dtype must be one of"),
    (dict(attention="sliding"), "attention must be one of"),
    (dict(rope_theta=0.0), "rope_theta must be > 0"),
])
def test_config_validation(changes, message):
  with pytest.raises(ValueError, match=message):
    tiny(**changes)


def test_model_rejects_mismatched_positions():
  config = tiny(num_layers=1, vocab_size=32, hidden_size=16, num_heads=2, num_kv_heads=1,
                head_dim=8, mlp_dim=32)
  # Abstract parameters suffice: the check runs before any computation.
  model = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
  with pytest.raises(ValueError, match=r"input_ids \(2, 5\) and positions \(2, 4\)"):
    model(jnp.zeros((2, 5), jnp.int32), jnp.zeros((2, 4), jnp.int32))
  with pytest.raises(ValueError, match="must both be"):
    model(jnp.zeros((5,), jnp.int32), jnp.zeros((5,), jnp.int32))


def test_remat_gives_the_same_loss_and_gradients():
  """Rematerialisation trades compute for memory and must not change the math."""

  def loss_and_grads(remat):
    cfg = tiny(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
               mlp_dim=96, vocab_size=128, remat=remat)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    ids = jax.random.randint(jax.random.key(1), (2, 12), 0, 128)
    pos = jnp.broadcast_to(jnp.arange(12), (2, 12))

    def loss(m):
      return jnp.mean(jax.nn.log_softmax(m(ids, pos))[..., 0])

    value, grads = nnx.value_and_grad(loss)(model)
    return value, jax.tree.leaves(nnx.state(grads, nnx.Param))

  plain, plain_grads = loss_and_grads("none")
  for policy in ("full", "save_dots", True):  # True: a model_config.json of before the policies
    remat, remat_grads = loss_and_grads(policy)
    np.testing.assert_allclose(remat, plain, rtol=1e-6)
    for a, b in zip(remat_grads, plain_grads):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)
  with pytest.raises(ValueError, match=r"ModelConfig\.remat must be one of .* got 'some'"):
    tiny(remat="some")


def test_unembed_of_hidden_equals_the_logits(fixture):
  # Decoders reduce over the vocabulary from `forward_hidden` + `unembed()`, reading the
  # output projection in its stored layout (LM head [D, V] for "gqa", tied [V, D]).
  name, config, model, golden = fixture
  ids, positions = jnp.asarray(golden["input_ids"]), jnp.asarray(golden["positions_seq"])
  b, t = ids.shape
  mask = jnp.broadcast_to(masks.causal_tt(t)[None], (b, t, t))
  cache = KVCache.init(config, b, max_len=4)
  want, _, _ = model.forward_chunk(ids, positions, cache, mask)
  h, _, _ = model.forward_hidden(ids, positions, cache, mask)
  unembed = model.unembed()
  assert unembed.vocab_axis == (0 if config.tie_embeddings else 1), name
  assert unembed.vocab_size == config.vocab_size
  np.testing.assert_allclose(np.asarray(unembed.logits(h)), np.asarray(want, np.float32),
                             rtol=1e-6, atol=1e-6)
  part = unembed.columns(jnp.int32(3), 5).logits(h)
  np.testing.assert_allclose(np.asarray(part), np.asarray(want, np.float32)[..., 3:8],
                             rtol=1e-6, atol=1e-6)
