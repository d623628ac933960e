"""GRPO's pieces (refusion_jax.rl.grpo) by hand, and one policy step on the exact
log-probabilities of recorded rollouts (rl.replay) moving probability towards the
rewarded answer."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from refusion_jax.decode import engine
from refusion_jax.decode.settings import DecodeConfig
from refusion_jax.rl import grpo, replay
from tests.test_order_oracle import MASK, PROMPTS, _model


def test_group_advantages_by_hand():
  # Group (1, 0, 0, 1): mean 0.5, sample std (ddof 1) sqrt(1/3) = 0.5774.
  adv = grpo.group_advantages([1, 0, 0, 1, 2, 2, 2, 2], 4)
  s = math.sqrt(1 / 3)
  np.testing.assert_allclose(adv[:4], [0.5 / (s + 1e-6), -0.5 / (s + 1e-6)] * 1 + [
      -0.5 / (s + 1e-6), 0.5 / (s + 1e-6)], rtol=1e-9)
  np.testing.assert_allclose(adv[4:], 0.0)  # a group of equal rewards teaches nothing
  with pytest.raises(ValueError, match="group_size must be an int >= 2"):
    grpo.group_advantages([1.0], 1)
  with pytest.raises(ValueError, match="do not split into groups of 4"):
    grpo.group_advantages([1.0] * 6, 4)


def test_plackett_luce_by_hand():
  scores = np.log(np.array([1.0, 2.0, 3.0]))  # weights 1, 2, 3
  # order (2, 0, 1): 3/6 * 1/3 * 2/2
  got = float(grpo.plackett_luce_logprob(scores, [2, 0, 1]))
  assert got == pytest.approx(math.log(3 / 6 * 1 / 3), abs=1e-6)
  total = sum(math.exp(float(grpo.plackett_luce_logprob(scores, o)))
              for o in ((0, 1, 2), (0, 2, 1), (1, 0, 2), (1, 2, 0), (2, 0, 1), (2, 1, 0)))
  assert total == pytest.approx(1.0, abs=1e-6)


def test_policy_loss_by_hand():
  # One sequence, two tokens; old = ref = new, A = 2: loss = -(1 * 2) per token = -2, KL 0.
  lp = jnp.log(jnp.asarray([[0.5, 0.25]]))
  loss, m = grpo.policy_loss(lp, lp, lp, jnp.ones((1, 2), bool), jnp.asarray([2.0]))
  assert float(loss) == pytest.approx(-2.0) and float(m["kl"]) == pytest.approx(0.0)
  # The ratio 1.5 is clipped to 1.2 for a positive advantage: loss -1.2.
  new = jnp.log(jnp.asarray([[0.75]]))
  old = jnp.log(jnp.asarray([[0.5]]))
  loss, m = grpo.policy_loss(new, old, new, jnp.ones((1, 1), bool), jnp.asarray([1.0]),
                             epsilon=0.2, beta=0.0)
  assert float(loss) == pytest.approx(-1.2) and float(m["clip_fraction"]) == 1.0
  # k3 KL by hand: ref 0.5, new 0.75: d = log(2/3); exp(d) - d - 1.
  loss, m = grpo.policy_loss(new, new, old, jnp.ones((1, 1), bool), jnp.asarray([0.0]),
                             beta=0.5)
  d = math.log(0.5 / 0.75)
  assert float(m["kl"]) == pytest.approx(math.exp(d) - d - 1, rel=1e-6)
  assert float(loss) == pytest.approx(0.5 * (math.exp(d) - d - 1), rel=1e-6)
  with pytest.raises(ValueError, match="beta .* must be >= 0"):
    grpo.policy_loss(new, new, new, jnp.ones((1, 1), bool), jnp.asarray([0.0]), beta=-1.0)


def test_a_policy_step_moves_probability_towards_the_rewarded_rollout():
  model = _model()
  # One group of four rollouts of one prompt, every committed token a draw (recorded).
  dc = DecodeConfig(gen_length=12, slot_size=4, block_size=12, temperature=1.0,
                    slot_threshold=0.5, token_threshold=0.5, sample_drafts=True, record=True)
  prompt = PROMPTS[3]
  run = engine.Decoder(model, dc, method="refusion").engine(rows=4).run(
      [prompt] * 4, rng=jax.random.PRNGKey(5))
  assert len({tuple(r.tokens) for r in run.results}) > 1  # the group's samples differ
  batch = replay.pack([replay.layout(prompt, r.trace, 4, 12, MASK) for r in run.results])
  valid = jnp.asarray(batch["valid"])
  rewards = [1.0, 0.0, 0.0, 0.0]  # the first answer is "correct"
  adv = jnp.asarray(grpo.group_advantages(rewards, 4))
  graphdef, state = nnx.split(model)
  old = replay.logprobs(model, batch)

  def loss_fn(state):
    lp = replay.logprobs(nnx.merge(graphdef, state), batch)
    return grpo.policy_loss(lp, jax.lax.stop_gradient(old), old, valid, adv, beta=0.0)[0]

  tx = optax.adam(1e-5)  # one small step (the 60x head makes the loss steep)
  grads = jax.grad(loss_fn)(state)
  updates, _ = tx.update(grads, tx.init(state), state)
  new_state = optax.apply_updates(state, updates)
  new = replay.logprobs(nnx.merge(graphdef, new_state), batch)
  seq_old = (old * valid).sum(-1)
  seq_new = (new * valid).sum(-1)
  # The step moves log-likelihood towards the better-than-average samples: the
  # advantage-weighted sum of sequence log-probabilities rises, and the rewarded
  # sample gains more than the others on average.
  assert float((adv * seq_new).sum()) > float((adv * seq_old).sum())
  assert float(seq_new[0] - seq_old[0]) > float((seq_new - seq_old)[1:].mean())
