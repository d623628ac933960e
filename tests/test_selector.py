"""The slot-selection policy (decode.planner='policy', refusion_jax.rl.selector):
a sharp policy is the threshold rule token for token; the recorded plan choices' log-
probabilities equal a plain sum over every draw of the slots; bad weights are refused."""

import jax
import numpy as np
import pytest

from refusion_jax.decode import engine
from refusion_jax.decode.methods import PLAN_FEATURES
from refusion_jax.decode.settings import DecodeConfig
from refusion_jax.rl import selector
from tests.test_order_oracle import PROMPTS, _model

BASE = dict(gen_length=24, slot_size=4, block_size=12, slot_threshold=0.5, token_threshold=0.5)


def _run(model, rng=None, **kw):
  dc = DecodeConfig(**BASE, **kw)
  return engine.Decoder(model, dc, method="refusion").engine(rows=2).run(PROMPTS, rng=rng)


def test_a_sharp_policy_is_the_threshold_rule():
  model = _model()
  want = [r.tokens for r in _run(model).results]
  sharp = (1e4,) + (0.0,) * (len(PLAN_FEATURES) - 1) + (-0.5e4,)
  assert [r.tokens for r in _run(model, planner="policy", plan_weights=sharp).results] == want
  # The default weights are a soft threshold at slot_threshold.
  assert DecodeConfig(**BASE, planner="policy").plan_weights_on == (20.0, 0, 0, 0, 0, -10.0)


def test_recorded_choices_score_as_every_draw_summed():
  model = _model()
  weights = (6.0, 2.0, -3.0, 1.0, 0.5, -4.0)
  run = _run(model, rng=jax.random.PRNGKey(4), planner="policy", plan_sample=True,
             plan_weights=weights, temperature=1.0, sample_drafts=True, record=True)
  feats = np.stack([r.trace["plan_feats"] for r in run.results])
  fed = np.stack([r.trace["plan_fed"] for r in run.results])
  chosen = np.stack([r.trace["plan_chosen"] for r in run.results])
  lp, valid = selector.choice_logprobs(np.asarray(weights), feats, fed, chosen)
  lp, valid = np.asarray(lp), np.asarray(valid)
  sizes = set()
  for i in range(len(PROMPTS)):
    want = selector.choice_logprobs_plain(weights, feats[i], fed[i], chosen[i])
    np.testing.assert_allclose(lp[i][valid[i]], want, atol=1e-5)
    sizes |= {int(c.sum()) for c, v in zip(chosen[i], valid[i]) if v}
    # Every step's choice is a non-empty subset of the slots its plan fed.
    assert all(c[f].sum() == c.sum() >= 1 for c, f, v in zip(chosen[i], fed[i], valid[i]) if v)
  assert {1, 2} <= sizes  # fallbacks / single draws and several slots at once both occur
  grads = jax.grad(lambda w: selector.choice_logprobs(w, feats, fed, chosen)[0].sum())(
      np.asarray(weights, np.float32))
  assert np.all(np.isfinite(grads)) and np.abs(grads).max() > 0
  h = float(selector.plan_entropy(np.asarray(weights), feats, fed))
  assert 0 < h < len(PLAN_FEATURES) * np.log(2)


def test_bad_weights_are_one_line():
  with pytest.raises(ValueError, match="plan_weights must be \\(\\) or 6 finite numbers"):
    DecodeConfig(**BASE, planner="policy", plan_weights=(1.0, 2.0))
  with pytest.raises(ValueError, match="planner='policy' chooses ReFusion's slots"):
    DecodeConfig(**BASE, planner="policy", verify="correct")
