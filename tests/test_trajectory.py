"""Exact trajectory log-probabilities (refusion_jax.planning.trajectory): the one-pass
training layout against the pass-by-pass replay, on the order oracle's own answers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from refusion_jax.planning import order_oracle, trajectory
from tests.test_order_oracle import PROMPTS, _model


def _trajectories(model, gen_length=12, slot_size=4):
  out = []
  for prompt in PROMPTS:
    for r in order_oracle.all_orders(model, prompt, gen_length=gen_length, slot_size=slot_size,
                                     orders=[(0, 1, 2), (2, 0, 1), (1, 2, 0)]):
      # Rebuild each slot's tokens from the answer (slots after an EOS are left out of it:
      # keep the trajectories whose answers run to the end).
      if len(r.tokens) == gen_length:
        out.append(trajectory.Trajectory(tuple(prompt), r.order, tuple(
            tuple(r.tokens[s * slot_size:(s + 1) * slot_size]) for s in range(3)), slot_size))
  return out


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_one_pass_equals_the_pass_by_pass_replay(temperature):
  model = _model()
  trajs = _trajectories(model)
  assert len(trajs) >= 6
  got, valid = trajectory.logprobs(model, trajs, temperature)
  for i, t in enumerate(trajs):
    want = trajectory.logprobs_stepwise(model, t, temperature)
    np.testing.assert_allclose(np.asarray(got[i])[np.asarray(valid[i])], want, atol=1e-5)
  # Greedy answers: every token is its pass's argmax, so its probability is the largest.
  assert float(got[valid].min()) > np.log(1 / 96)


def test_short_slots_and_the_gradient():
  model = _model()
  t = trajectory.Trajectory((5, 9, 17), (1, 0), ((20, 21), (30, 31, 32)), 3)
  got, valid = trajectory.logprobs(model, [t])
  np.testing.assert_allclose(np.asarray(got[0])[np.asarray(valid[0])],
                             trajectory.logprobs_stepwise(model, t), atol=1e-5)
  assert int(valid.sum()) == 5
  graphdef, state = nnx.split(model)

  def total(state):
    lp, _ = trajectory.logprobs(nnx.merge(graphdef, state), [t])
    return lp.sum()

  grads = jax.grad(total)(state)
  assert float(jnp.abs(grads["lm_head"][...]).sum()) > 0


def test_bad_trajectories_are_refused():
  model = _model()
  with pytest.raises(ValueError, match="not a permutation"):
    trajectory.logprobs(model, [trajectory.Trajectory((5,), (0, 0), ((1,), (2,)), 2)])
  with pytest.raises(ValueError, match="slot 1 has 3 tokens"):
    trajectory.logprobs(model, [trajectory.Trajectory((5,), (0, 1), ((1,), (2, 3, 4)), 2)])
  with pytest.raises(ValueError, match="temperature must be > 0"):
    trajectory.logprobs(model, [trajectory.Trajectory((5,), (0,), ((1,),), 2)], 0.0)
