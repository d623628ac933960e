"""D2F's pipelined decoder against a plain-Python loop without a KV cache.

The oracle is written from ALGORITHM.md "Table 1's baselines" (D2F): every iteration
runs the model over the prompt and every appended block under the block-causal mask
(no cache: finished blocks are recomputed, which the cache must equal), then appends,
activates and commits by the same rules on one unpadded row.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from refusion_jax import config as config_lib
from refusion_jax import masks
from refusion_jax.decode import d2f, engine
from refusion_jax.decode.settings import DecodeConfig
from refusion_jax.model import Transformer

GEN = 16
MASK = 3
PAD = 0
WIDTH = 8


def _config(**overrides):
  base = dict(num_layers=2, vocab_size=48, hidden_size=32, num_heads=4, num_kv_heads=2,
              head_dim=8, mlp_dim=48, tie_embeddings=False, eos_token_id=None,
              mask_token_id=MASK, pad_token_id=PAD, attention="bidirectional",
              model_type="llama", rope_theta=10000.0, max_position_embeddings=64)
  base.update(overrides)
  return config_lib.tiny(**base)


@functools.lru_cache(maxsize=None)
def _model(eos=None, seed=0, shift=False):
  model = Transformer(_config(eos_token_id=eos, **({"model_type": "dream"} if shift else {})),
                rngs=nnx.Rngs(seed))
  nnx.update(model, jax.tree.map(lambda x: x * 3.0, nnx.state(model, nnx.Param)))
  return model


def block_causal_mask(prompt_len: int, block: int, total: int) -> np.ndarray:
  """D2F's attention over [prompt, blocks]: the prompt sees the prompt; a token of block
  j sees the prompt, blocks before j and all of block j."""
  block_of = np.full((total,), -1)
  block_of[prompt_len:] = np.arange(total - prompt_len) // block
  bq, bk = block_of[:, None], block_of[None, :]
  return np.where(bq < 0, bk < 0, bk <= bq)


def test_block_causal_mask_by_hand():
  # prompt 3, blocks of 2, 7 positions: P P P | a a | b b
  want = np.array([[1, 1, 1, 0, 0, 0, 0],
                   [1, 1, 1, 0, 0, 0, 0],
                   [1, 1, 1, 0, 0, 0, 0],
                   [1, 1, 1, 1, 1, 0, 0],
                   [1, 1, 1, 1, 1, 0, 0],
                   [1, 1, 1, 1, 1, 1, 1],
                   [1, 1, 1, 1, 1, 1, 1]], bool)
  np.testing.assert_array_equal(block_causal_mask(3, 2, 7), want)
  np.testing.assert_array_equal(np.asarray(masks.block_causal_tt(3, 2, 7)), want)


@functools.partial(jax.jit, static_argnums=0)
def _full_call(graphdef, state, ids_bt, mask_btt):
  positions = jnp.broadcast_to(jnp.arange(ids_bt.shape[1])[None], ids_bt.shape)
  return nnx.merge(graphdef, state)(ids_bt, positions, attention_mask_btt=mask_btt)


def oracle(model, prompt, block, add, act, conf, window):
  """(response up to the first stop token, passes) of D2F on one row, no cache."""
  graphdef, state = nnx.split(model)
  eos = model.config.eos_token_id
  k_blocks = GEN // block
  length = WIDTH + GEN  # one compiled call: shorter sequences are padded, masked out
  gen = [None] * GEN
  added = cached = 0
  complete = [False] * k_blocks
  stop_seen = False
  passes = 0
  frac = lambda j: sum(gen[i] is not None for i in range(j * block, (j + 1) * block)) / block
  while True:
    # Cached: the run of finished blocks before the first unfinished one (their K/V are
    # final under the mask; the cache holds them from the pass after they finished).
    if added < k_blocks and not stop_seen and (added == 0 or frac(added - 1) >= add) and (
        added - cached < window):
      added += 1
    for j in range(added):
      complete[j] = complete[j] or (j == 0 or frac(j - 1) >= act)
    n = len(prompt) + added * block
    ids = np.full((1, length), PAD, np.int32)
    ids[0, :len(prompt)] = prompt
    ids[0, len(prompt):n] = [MASK if t is None else t for t in gen[:added * block]]
    mask = np.zeros((1, length, length), bool)
    mask[0, :n, :n] = block_causal_mask(len(prompt), block, n)
    mask[0] |= np.eye(length, dtype=bool)
    logits = np.array(_full_call(graphdef, state, jnp.asarray(ids), jnp.asarray(mask))[0],
                      np.float64)
    passes += 1
    logits[:, MASK] = -np.inf
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    # Finished blocks fed this pass enter the cache: `cached` runs over them.
    while cached < added and all(gen[i] is not None for i in range(cached * block,
                                                                      (cached + 1) * block)):
      cached += 1
    for j in range(cached, added):
      cand = [i for i in range(j * block, (j + 1) * block) if gen[i] is None]
      # A shifted model (Dream) reads position i from the output at i - 1.
      col = lambda i: len(prompt) + i - int(model.config.shift_logits)
      order = sorted(cand, key=lambda i: (-p[col(i)].max(), i))
      chosen = [i for i in order if p[col(i)].max() > conf]
      if complete[j] and not chosen and order:
        chosen = order[:1]
      for i in chosen:
        gen[i] = int(p[col(i)].argmax())
        stop_seen |= gen[i] == eos
    first = next((i for i in range(GEN) if gen[i] is not None and gen[i] == eos), None)
    if first is not None and all(t is not None for t in gen[:first]):
      return gen[:first + 1], passes
    if all(t is not None for t in gen):
      return gen, passes


def _decode(model, prompts, **dc):
  ids = np.zeros((len(prompts), WIDTH), np.int32)
  for i, p in enumerate(prompts):
    ids[i, :len(p)] = p
  dcfg = DecodeConfig(method="d2f", gen_length=GEN, slot_size=1, **dc)
  out = d2f.generate(model, jnp.asarray(ids), jnp.asarray([len(p) for p in prompts]), dcfg)
  return ([[int(t) for t in out.tokens_bg[i, :out.length_b[i]]] for i in range(len(prompts))],
          [int(x) for x in out.counters.nfe_b()])


PROMPTS = [[5, 9, 17, 4], [11, 30, 2, 8, 21, 40, 7]]
CASES = [  # block, tau_add, tau_act, tau_conf, window
    (4, 0.1, 0.95, 0.9, 4),
    (4, 0.5, 0.5, 0.5, 4),
    (4, 0.25, 0.75, 0.3, 2),
    (2, 0.5, 0.9, 0.6, 8),
    (8, 1.0, 1.0, 1.0, 2),
    (4, 0.1, 0.1, 0.7, 1),
]


@pytest.mark.parametrize("block, add, act, conf, window, shift",
                         [c + (False,) for c in CASES]
                         + [(4, 0.25, 0.75, 0.3, 2, True), (2, 0.5, 0.5, 0.5, 8, True)])
def test_d2f_matches_the_plain_oracle(block, add, act, conf, window, shift):
  model = _model(shift=shift)
  tokens, nfe = _decode(model, PROMPTS, block_size=block, d2f_add_threshold=add,
                        d2f_act_threshold=act, d2f_conf_threshold=conf, d2f_window=window)
  for i, prompt in enumerate(PROMPTS):
    want, passes = oracle(model, prompt, block, add, act, conf, min(window, GEN // block))
    assert tokens[i] == want, (i, tokens[i], want)
    assert nfe[i] == passes


def test_a_stop_token_ends_the_row():
  model = _model(eos=7)
  hits = 0
  for conf in (0.3, 0.6):
    tokens, nfe = _decode(model, PROMPTS + [[7, 7, 1]], block_size=4, d2f_add_threshold=0.25,
                          d2f_act_threshold=0.5, d2f_conf_threshold=conf)
    for i, prompt in enumerate(PROMPTS + [[7, 7, 1]]):
      want, passes = oracle(model, prompt, 4, 0.25, 0.5, conf, 4)
      assert (tokens[i], nfe[i]) == (want, passes)
      hits += want[-1] == 7 and len(want) < GEN
  assert hits  # some answer ended at its EOS


def test_rows_of_the_engine_decode_as_alone():
  model = _model()
  prompts = PROMPTS + [[6, 6, 12], [44, 2, 19, 23, 1], [8]]
  dcfg = DecodeConfig(method="d2f", gen_length=GEN, slot_size=1, block_size=4,
                                 d2f_add_threshold=0.5, d2f_act_threshold=0.5,
                                 d2f_conf_threshold=0.5)
  run = engine.Engine(engine.Decoder(model, dcfg), rows=2).run(prompts)
  assert run.admissions > 1
  for prompt, res in zip(prompts, run.results):
    want, passes = oracle(model, prompt, 4, 0.5, 0.5, 0.5, 4)
    assert (res.tokens, res.counters["nfe_b"], res.counters["prefill_b"]) == (want, passes, 1)


@pytest.mark.parametrize("changes, match", [
    (dict(d2f_add_threshold=0.0), r"d2f_add_threshold must lie in \(0, 1\]"),
    (dict(d2f_act_threshold=1.5), r"d2f_act_threshold must lie in \(0, 1\]"),
    (dict(d2f_conf_threshold=-0.1), r"d2f_conf_threshold must lie in \(0, 1\]"),
    (dict(d2f_window=0), "d2f_window must be a positive int"),
])
def test_bad_thresholds_are_one_line(changes, match):
  with pytest.raises(ValueError, match=match):
    DecodeConfig(method="d2f", gen_length=GEN, block_size=4, slot_size=1, **changes)


@pytest.mark.parametrize("overrides, match", [
    (dict(attention="causal"), "needs an MDM"),
])
def test_models_d2f_cannot_decode_are_refused(overrides, match):
  model = Transformer(_config(**overrides), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=match):
    engine.Decoder(model, DecodeConfig(method="d2f", gen_length=GEN, block_size=4,
                                                  slot_size=1))


def test_mdm_samplers_are_refused():
  with pytest.raises(ValueError, match="decode.mdm_ranking='entropy' is one of MDM's options; "
                     r"it needs decode.method='mdm' \(decode.method='d2f' has none\)"):
    DecodeConfig(method="d2f", gen_length=GEN, block_size=4, mdm_ranking="entropy")
