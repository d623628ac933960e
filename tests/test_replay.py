"""Exact log-probabilities of ReFusion's parallel decode (refusion_jax.rl.replay):
the one-forward training layout of a recorded rollout against the decoder's own
probabilities and against each deciding pass run alone; the record and the sampled
drafts leave the release's tokens alone when off."""

import jax
import numpy as np
import pytest
from flax import nnx

from refusion_jax.decode import engine
from refusion_jax.decode.settings import DecodeConfig
from refusion_jax.rl import replay
from tests.test_order_oracle import MASK, PROMPTS, _model

GEN, K, BLOCK = 24, 4, 12


def _rollouts(model, temperature=1.0, **kw):
  dc = DecodeConfig(gen_length=GEN, slot_size=K, block_size=BLOCK, temperature=temperature,
                    sample_drafts=True, record=True, **kw)
  run = engine.Decoder(model, dc, method="refusion").engine(rows=2).run(
      PROMPTS, rng=jax.random.PRNGKey(3))
  return [replay.layout(p, r.trace, K, BLOCK, MASK) for p, r in zip(PROMPTS, run.results)], run


@pytest.mark.parametrize("thresholds, recompute", [((0.9, 0.9), False), ((0.2, 0.3), True),
                                                   ((0.0, 0.0), False)])
def test_one_forward_equals_the_decoder_and_each_pass_alone(thresholds, recompute):
  model = _model()
  lays, run = _rollouts(model, slot_threshold=thresholds[0], token_threshold=thresholds[1],
                        recompute_kv=recompute)
  batch = replay.pack(lays)
  lp = np.asarray(replay.logprobs(model, batch, 1.0))
  kinds = set()
  for i, (lay, res) in enumerate(zip(lays, run.results)):
    got = lp[i][batch["valid"][i]]
    # Every committed token is scored once, the text's included.
    assert set(lay.index.tolist()) >= set(range(len(res.tokens)))
    np.testing.assert_allclose(got, np.log(lay.p_recorded), atol=1e-5)
    np.testing.assert_allclose(got, replay.logprobs_stepwise(model, lay, 1.0), atol=1e-5)
    t = res.trace
    kinds |= {("draft" if r >= 0 else "plan", bool(c))
              for r, c, s in zip(t["round"], t["chain"], t["step"]) if s >= 0}
  # Each kind of deciding pass and committed K/V the layout tells apart occurs here.
  want = {(0.9, 0.9): {("draft", False), ("plan", False)},
          (0.2, 0.3): {("draft", False), ("draft", True), ("plan", False), ("plan", True)},
          (0.0, 0.0): {("plan", True)}}[thresholds]
  assert kinds == want


def test_at_a_temperature_and_the_gradient():
  model = _model()
  lays, _ = _rollouts(model, temperature=0.7, slot_threshold=0.5, token_threshold=0.5)
  batch = replay.pack(lays)
  lp = np.asarray(replay.logprobs(model, batch, 0.7))
  np.testing.assert_allclose(lp[0][batch["valid"][0]],
                             replay.logprobs_stepwise(model, lays[0], 0.7), atol=1e-5)
  graphdef, params = nnx.split(model, nnx.Param)

  def total(p):
    return replay.logprobs(nnx.merge(graphdef, p), batch, 0.7).sum()

  grads = jax.grad(total)(params)
  norms = [float(np.abs(np.asarray(g)).max()) for g in jax.tree.leaves(grads)]
  assert all(np.isfinite(norms)) and max(norms) > 0


def test_options_off_keep_the_release_tokens():
  model = _model()
  base = dict(gen_length=GEN, slot_size=K, block_size=BLOCK, slot_threshold=0.5,
              token_threshold=0.5)
  for temperature in (0.0, 0.8):
    outs = []
    for extra in ({}, {"record": True}, {"sample_drafts": temperature == 0.0}):
      dc = DecodeConfig(temperature=temperature, **base, **extra)
      out = engine.Decoder(model, dc, method="refusion").engine(rows=2).run(
          PROMPTS, rng=jax.random.PRNGKey(1))
      outs.append([r.tokens for r in out.results])
    assert outs[0] == outs[1] == outs[2]


def test_bad_input():
  with pytest.raises(ValueError, match="decode.record=True records ReFusion's parallel"):
    DecodeConfig(gen_length=GEN, slot_size=K, block_size=BLOCK, record=True, verify="correct")
  with pytest.raises(ValueError, match="sample_drafts=True samples ReFusion"):
    DecodeConfig(method="mdm", gen_length=GEN, slot_size=K, block_size=BLOCK, sample_drafts=True)
  model = _model()
  lays, run = _rollouts(model)
  with pytest.raises(ValueError, match="4-token prompt, not this one of 3"):
    replay.layout([1, 2, 3], run.results[0].trace, K, BLOCK, MASK)
  with pytest.raises(ValueError, match="the batch holds"):
    replay.pack(lays, width=8)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_a_lossless_rollout_scores_as_its_ar_likelihood_in_one_causal_forward(temperature):
  """Lossless rollouts are the model's AR samples: one causal forward over prompt and
  answer gives each token's log-probability, equal to the decoder's recorded one and to
  a plain float64 log-softmax of the model's own causal logits over the whole vocabulary
  (the mask token included: here it carries real mass, so leaving it out would show)."""
  model = _model()
  model.lm_head[...] = model.lm_head[...].at[:, MASK].set(model.lm_head[...][:, 5])
  dc = DecodeConfig(gen_length=GEN, slot_size=K, block_size=8, slot_threshold=0.0,
                    temperature=temperature, verify="lossless", record=True)
  run = engine.Decoder(model, dc, method="refusion").engine(rows=2).run(
      PROMPTS, rng=jax.random.PRNGKey(5))
  lays = [replay.causal_layout(p, r.tokens, r.trace["p"]) for p, r in zip(PROMPTS, run.results)]
  batch = replay.pack(lays, causal=True)
  lp = np.asarray(replay.logprobs(model, batch, temperature))
  parallel = np.asarray(replay.logprobs(model, dict(batch, scored_mask=np.bool_(False)),
                                        temperature))
  valid = batch["valid"]
  # Leaving the mask token out (the parallel decode's rule) would show: 10x the tolerance.
  assert np.abs(parallel[valid] - lp[valid]).max() > 1e-4
  for i, (p, res) in enumerate(zip(PROMPTS, run.results)):
    got = lp[i][valid[i]]
    assert len(got) == len(res.tokens) > 0
    np.testing.assert_allclose(got, np.log(res.trace["p"][:len(res.tokens)]), atol=1e-5)
    ids = np.asarray(p + res.tokens, np.int32)
    logits = np.asarray(model(jax.numpy.asarray(ids)[None], jax.numpy.arange(len(ids))[None])[0],
                        np.float64) / temperature
    logits = logits[len(p) - 1:len(ids) - 1]
    ref = logits[np.arange(len(res.tokens)), res.tokens] - np.log(
        np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) - logits.max(-1)
    np.testing.assert_allclose(got, ref, atol=1e-5)
  with pytest.raises(ValueError, match="the answer is empty"):
    replay.causal_layout([1, 2], [], [])
