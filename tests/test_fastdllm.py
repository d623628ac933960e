"""Fast-dLLM's approximate KV caches and its factor rule on the MDM decoder, against a
plain float64 numpy restatement.

The oracle is written from ALGORITHM.md "Table 1's baselines" alone: a numpy forward
of the model (embedding, RMSNorm, rotary q/k, grouped attention, SwiGLU) in which each
layer's keys and values of the positions a pass does not feed are taken from the last
full pass (the cache), and those of the fed positions are computed now. One row,
unpadded, dynamic shapes; decisions in float64.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from refusion_jax import config as config_lib
from refusion_jax.decode import engine, mdm
from refusion_jax.decode import program as program_lib
from refusion_jax.decode.settings import DecodeConfig
from refusion_jax.model import Transformer

GEN = 12
MASK = 3
PAD = 0
VOCAB = 48


def _config(**overrides):
  base = dict(num_layers=2, vocab_size=VOCAB, hidden_size=32, num_heads=4, num_kv_heads=2,
              head_dim=8, mlp_dim=48, tie_embeddings=False, eos_token_id=None,
              mask_token_id=MASK, pad_token_id=PAD, attention="bidirectional",
              model_type="llama", rope_theta=10000.0, max_position_embeddings=64)
  base.update(overrides)
  return config_lib.tiny(**base)


@functools.lru_cache(maxsize=None)
def _model(shift: bool = False, eos: int | None = None, seed: int = 0):
  cfg = _config(eos_token_id=eos, **({"model_type": "dream"}
                                     if shift else {}))
  model = Transformer(cfg, rngs=nnx.Rngs(seed))
  # Scaled-up random weights give peaked, varied predictions (std 0.02 is near uniform).
  nnx.update(model, jax.tree.map(lambda x: x * 3.0, nnx.state(model, nnx.Param)))
  return model


# --- the oracle ----------------------------------------------------------------------------


def _np(x):
  return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


def _params(model):
  layers = []
  for layer in model.layers:
    a = layer.attn
    layers.append(dict(
        n1=_np(layer.input_norm.scale[...]), n2=_np(layer.post_attn_norm.scale[...]),
        q=_np(a.q_proj[...]), k=_np(a.k_proj[...]), v=_np(a.v_proj[...]), o=_np(a.o_proj[...]),
        bias=(tuple(_np(b[...]) for b in (a.q_bias, a.k_bias, a.v_bias))
              if model.config.qkv_bias else None),
        gate=_np(layer.mlp.gate_proj[...]), up=_np(layer.mlp.up_proj[...]),
        down=_np(layer.mlp.down_proj[...])))
  return dict(embed=_np(model.embed[...]), layers=layers, norm=_np(model.final_norm.scale[...]),
              head=_np(model.lm_head[...]))


def _rms(x, w, eps):
  return w * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def _rope(x, pos, theta):
  h = x.shape[-1]
  inv = 1.0 / theta ** (np.arange(0, h, 2) / h)
  ang = pos[:, None] * inv[None]
  ang = np.concatenate([ang, ang], -1)[:, None, :]
  x1, x2 = x[..., :h // 2], x[..., h // 2:]
  return x * np.cos(ang) + np.concatenate([-x2, x1], -1) * np.sin(ang)


def _pass(P, cfg, ids, fed, cached, snap):
  """Hidden states of the fed columns, and their per-layer K/V: every fed column attends
  (both ways) to the fed columns' fresh K/V and to the `cached` columns' K/V in `snap`."""
  x = P["embed"][ids[fed]]
  pos = np.asarray(fed, np.float64)
  fresh = []
  for i, L in enumerate(P["layers"]):
    h = _rms(x, L["n1"], cfg.rms_eps)
    q, k, v = (np.einsum("td,dnh->tnh", h, L[n]) for n in "qkv")
    if L["bias"] is not None:
      q, k, v = q + L["bias"][0], k + L["bias"][1], v + L["bias"][2]
    q, k = _rope(q, pos, cfg.rope_theta), _rope(k, pos, cfg.rope_theta)
    fresh.append((k, v))
    keys = np.concatenate([snap[i][0][cached], k]) if cached else k
    vals = np.concatenate([snap[i][1][cached], v]) if cached else v
    group = cfg.num_heads // cfg.num_kv_heads
    kk, vv = np.repeat(keys, group, axis=1), np.repeat(vals, group, axis=1)
    s = np.einsum("tnh,snh->nts", q, kk) / np.sqrt(cfg.head_dim)
    s = np.exp(s - s.max(-1, keepdims=True))
    out = np.einsum("nts,snh->tnh", s / s.sum(-1, keepdims=True), vv)
    x = x + np.einsum("tnh,nhd->td", out, L["o"])
    h = _rms(x, L["n2"], cfg.rms_eps)
    g = h @ L["gate"]
    x = x + (g / (1 + np.exp(-g)) * (h @ L["up"])) @ L["down"]
  return _rms(x, P["norm"], cfg.rms_eps), fresh


def factor_count(sorted_conf, f):
  """Fast-dLLM's factor rule on confidences sorted high to low: the largest n with
  (n + 1)(1 - c_n) < f, the first always; a first failure at the last rank keeps all."""
  n = len(sorted_conf)
  for i, c in enumerate(sorted_conf):  # 0-based rank i is the (i + 1)-th
    if i > 0 and c < 1 - f / (i + 2):
      return n if i == n - 1 else i
  return n


def _oracle(model, prompt, cache, block, threshold=None, factor=None, per_step=1,
            refresh=0):
  """(tokens up to EOS, passes, full passes) of Fast-dLLM on one row."""
  cfg = model.config
  P = _params(model)
  shift = cfg.shift_logits
  plen = len(prompt)
  ids = np.asarray(list(prompt) + [MASK] * GEN)
  live = plen + GEN
  decided = np.zeros(GEN, bool)
  passes = fulls = 0
  snap = None
  for blk in range(GEN // block):
    start = plen + blk * block
    step = 0
    while not decided[blk * block:(blk + 1) * block].all():
      full = cache is None or step == 0 or (refresh and step % refresh == 0)
      cols = np.arange(start, start + block)
      if full:
        h, fresh = _pass(P, cfg, ids, list(range(live)), [], None)
        snap = fresh
        h_blk = h[cols - shift]
        fulls += cache is not None
      else:
        fed = list(range(start, live if cache == "prefix" else start + block))
        cached = [c for c in range(live) if c not in fed and (cache == "dual" or c < start)]
        h, _ = _pass(P, cfg, ids, fed, cached, snap)
        h_blk = h[np.clip(cols - shift - start, 0, None)]
      logits = h_blk @ P["head"]
      logits[:, MASK] = -np.inf
      p = np.exp(logits - logits.max(-1, keepdims=True))
      p /= p.sum(-1, keepdims=True)
      draft, conf = p.argmax(-1), p.max(-1)
      cand = [j for j in range(block) if not decided[blk * block + j]]
      order = sorted(cand, key=lambda j: (-conf[j], j))
      if cache is not None and shift and step == 0:
        chosen = [0]  # Dream's variant: the block's first position only
      elif factor is not None:
        chosen = order[:factor_count([conf[j] for j in order], factor)]
      elif threshold is not None:
        chosen = [j for j in order if conf[j] >= threshold] or order[:1]
      else:
        chosen = order[:per_step]
      for j in chosen:
        ids[start + j] = draft[j]
        decided[blk * block + j] = True
      passes += 1
      step += 1
      gen = ids[plen:]
      if cfg.eos_token_id is not None:
        eos = [i for i in range(GEN) if decided[i] and gen[i] == cfg.eos_token_id]
        if eos and decided[:eos[0]].all():
          return list(gen[:eos[0] + 1]), passes, fulls
  return list(ids[plen:]), passes, fulls


# --- the decoder against it -------------------------------------------------------------------

PROMPTS = [[5, 9, 17, 4], [11, 30, 2, 8, 21, 40, 7]]


def _decode(model, prompts, **dc):
  width = max(len(p) for p in prompts)
  ids = np.zeros((len(prompts), width), np.int32)
  for i, p in enumerate(prompts):
    ids[i, :len(p)] = p
  dcfg = DecodeConfig(method="mdm", gen_length=GEN, **dc)
  out = mdm.generate(model, jnp.asarray(ids), jnp.asarray([len(p) for p in prompts]), dcfg)
  return ([list(np.asarray(out.tokens_bg[i, :out.length_b[i]])) for i in range(len(prompts))],
          np.asarray(out.counters.nfe_b()), np.asarray(out.counters.refresh_b))


CASES = [
    # cache, block, threshold, factor, per_step, refresh, shifted model
    ("prefix", 4, 0.5, None, 1, 0, False),
    ("dual", 4, 0.5, None, 1, 0, False),
    ("prefix", 6, None, 1.0, 1, 0, False),
    ("dual", 12, None, 2.0, 1, 0, False),
    ("dual", 4, None, None, 2, 0, False),
    ("prefix", 12, 0.3, None, 1, 2, False),
    (None, 4, None, 1.5, 1, 0, False),
    ("prefix", 4, 0.5, None, 1, 0, True),
    ("dual", 6, None, None, 1, 0, True),
]


@pytest.mark.parametrize("cache, block, threshold, factor, per_step, refresh, shift", CASES)
def test_fastdllm_matches_the_plain_oracle(cache, block, threshold, factor, per_step, refresh,
                                           shift):
  model = _model(shift)
  tokens, nfe, fulls = _decode(
      model, PROMPTS, block_size=block, slot_size=block, mdm_cache=cache,
      mdm_threshold=threshold, mdm_factor=factor, mdm_tokens_per_step=per_step,
      mdm_cache_refresh=refresh)
  for i, prompt in enumerate(PROMPTS):
    want, passes, want_fulls = _oracle(model, prompt, cache, block, threshold, factor,
                                       per_step, refresh)
    assert tokens[i] == want, (i, tokens[i], want)
    assert (nfe[i], fulls[i]) == (passes, want_fulls)


def test_an_eos_ends_a_cached_row():
  model = _model(eos=7)
  for cache in ("prefix", "dual"):
    tokens, nfe, _ = _decode(model, PROMPTS, block_size=4, slot_size=4, mdm_cache=cache,
                             mdm_threshold=0.4)
    for i, prompt in enumerate(PROMPTS):
      want, passes, _ = _oracle(model, prompt, cache, 4, threshold=0.4)
      assert (tokens[i], nfe[i]) == (want, passes)


@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_refreshing_every_step_is_the_decoder_without_a_cache(cache):
  model = _model()
  base = dict(block_size=4, slot_size=4, mdm_threshold=0.5)
  tokens, nfe, _ = _decode(model, PROMPTS, **base)
  cached, cached_nfe, fulls = _decode(model, PROMPTS, mdm_cache=cache, mdm_cache_refresh=1,
                                      **base)
  assert tokens == cached and list(nfe) == list(cached_nfe) == list(fulls)


def test_rows_of_the_engine_decode_as_alone():
  """Rows at different blocks and steps share one program: each row's tokens and passes
  are those of the row decoded alone."""
  model = _model()
  prompts = PROMPTS + [[6, 6, 12], [44, 2, 19, 23, 1]]
  dcfg = DecodeConfig(method="mdm", gen_length=GEN, block_size=4, slot_size=4,
                                 mdm_cache="dual", mdm_threshold=0.6)
  run = engine.Engine(engine.Decoder(model, dcfg), rows=2).run(prompts)
  assert run.admissions > 1  # rows were refilled while others were inside a block
  for prompt, res in zip(prompts, run.results):
    want, passes, fulls = _oracle(model, prompt, "dual", 4, threshold=0.6)
    assert (res.tokens, res.counters["nfe_b"], res.counters["refresh_b"]) == (
        want, passes, fulls)


def test_factor_rule_by_hand():
  # f = 1: rank 2 needs c >= 1 - 1/3, rank 3 c >= 1 - 1/4, rank 4 c >= 0.8.
  assert factor_count([0.1], 1.0) == 1
  assert factor_count([0.9, 0.8, 0.7, 0.5], 1.0) == 2
  assert factor_count([0.9, 0.6, 0.5, 0.4], 1.0) == 1
  assert factor_count([0.9, 0.7, 0.5], 1.0) == 3  # the first failure is the last rank
  assert factor_count([0.99, 0.99, 0.99, 0.99], 1.0) == 4
  assert factor_count([0.9, 0.8, 0.7, 0.5], 2.0) == 4  # f = 2: 0.33, 0.5, 0.6


def test_the_decoders_factor_counts_are_the_rule():
  rng = np.random.default_rng(0)
  b, g = 64, 10
  conf = rng.uniform(0.3, 1.0, (b, g)).astype(np.float32)
  cand = rng.uniform(size=(b, g)) < 0.7
  rank = np.asarray(mdm.confidence_rank_bg(jnp.asarray(conf), jnp.asarray(cand)))
  for f in (0.5, 1.0, 3.0):
    got = np.asarray(mdm.factor_counts_b(jnp.asarray(conf), jnp.asarray(cand),
                                         jnp.asarray(rank), f))
    for i in range(b):
      want = factor_count(sorted(conf[i][cand[i]].tolist(), reverse=True), f) if cand[i].any() else 0
      assert got[i] == want, (i, f)


@pytest.mark.parametrize("changes, match", [
    (dict(mdm_cache="both"), "decode.mdm_cache must be one of"),
    (dict(mdm_cache="dual", method="refusion"), "needs decode.method='mdm'"),
    (dict(mdm_cache="dual", mdm_cfg_scale=1.0), "guidance"),
    (dict(mdm_cache_refresh=-1), "mdm_cache_refresh must be an int >= 0"),
    (dict(mdm_cache_refresh=2), "mdm_cache_refresh=2 refreshes a cache"),
    (dict(mdm_factor=0.0), "decode.mdm_factor must be a number > 0"),
    (dict(mdm_factor=1.0, mdm_threshold=0.9), "set one"),
    (dict(mdm_factor=1.0, mdm_steps=12), "set one"),
    (dict(mdm_factor=1.0, mdm_ranking="entropy", mdm_steps=None), "mdm_ranking='confidence'"),
])
def test_bad_settings_are_one_line(changes, match):
  base = dict(method="mdm", gen_length=GEN, block_size=4, slot_size=4)
  with pytest.raises(ValueError, match=match):
    DecodeConfig(**{**base, **changes})


def test_the_options_reach_the_entry_points_and_only_mdm_buckets():
  from configs import sample as sample_config  # pylint: disable=import-outside-toplevel
  from configs.eval import common as eval_common  # pylint: disable=import-outside-toplevel
  from refusion_jax.lmeval import model as lm_model  # pylint: disable=import-outside-toplevel
  from refusion_jax.serve import scheduler  # pylint: disable=import-outside-toplevel
  for decode in (sample_config.get_config().decode, eval_common.decode_fields()):
    fields = {**decode.to_dict(), "method": "mdm", "slot_size": 32, "block_size": 32}
    dc = DecodeConfig(**fields)
    assert (dc.mdm_cache, dc.mdm_cache_refresh, dc.mdm_factor) == (None, 0, None)
    dc = DecodeConfig(**{**fields, "mdm_cache": "dual", "mdm_factor": 1.0})
    assert program_lib.spec_of(dc).mdm_cache == "dual"
  lm = lm_model.RefusionLM(model=_model(), tokenizer=object(), method="mdm", gen_length=GEN,
                           slot_size=4, block_size=4, mdm_cache="prefix", mdm_factor="1.5",
                           mdm_cache_refresh="2", progress=False)
  assert (lm.decode_config.mdm_cache, lm.decode_config.mdm_factor,
          lm.decode_config.mdm_cache_refresh) == ("prefix", 1.5, 2)
  default = DecodeConfig(method="mdm", gen_length=16, slot_size=4, block_size=8,
                                    mdm_cache="dual", mdm_threshold=0.9, mdm_defer_stop=True)
  parsed = scheduler.parse_buckets("ar:16, refusion:16:4:8, mdm:32:4:8", default)
  assert [(d.method, d.mdm_cache, d.mdm_defer_stop) for d in parsed] == [
      ("mdm", "dual", True), ("ar", None, False), ("refusion", None, False),
      ("mdm", "dual", True)]
