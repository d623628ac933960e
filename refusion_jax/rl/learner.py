"""The learner: GRPO's loss and the optimizer's update over a step's scored rollouts.

The loss is `rl.grpo.policy_loss` (tunix's clipped ratio with `epsilon` /
`epsilon_high` and the k3 KL to the reference) over each rollout's log-probabilities
(`scoring.trajectory_logprobs`). `Learner.update` makes `num_iterations` optimizer steps
on one batch of rollouts, each from gradients accumulated over its micro-batches.
`make_policy_step` is the same gradient and update for one micro-batch in one program
(what `aot --program=rl` compiles).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from refusion_jax.rl import grpo, scoring


def make_optimizer(c):
  """AdamW after global-norm clipping, at a constant rate."""
  return optax.chain(optax.clip_by_global_norm(c.grad_clip),
                     optax.adamw(c.learning_rate, b1=c.b1, b2=c.b2, weight_decay=c.weight_decay))


def make_loss(merge, *, temperature: float, epsilon: float, epsilon_high: float, beta: float):
  """GRPO's loss of a packed batch of rollouts under parameters `p` (a dict of the
  trained parts, `scoring.trajectory_logprobs`; `merge(p["model"])`: the model):
  `loss_of(p, batch, old_lp, ref_lp, adv) -> (loss, metrics)`; an `old_lp` or `ref_lp` of
  None is the current log-probabilities, constant (one update per batch of rollouts; no
  reference)."""

  def loss_of(p, batch, old_lp, ref_lp, adv):
    lp, valid, extra = scoring.trajectory_logprobs(merge, p, batch, temperature, entropy=True)
    old = jax.lax.stop_gradient(lp) if old_lp is None else old_lp
    ref = jax.lax.stop_gradient(lp) if ref_lp is None else ref_lp
    loss, metrics = grpo.policy_loss(lp, old, ref, valid, adv, epsilon=epsilon,
                                     epsilon_high=epsilon_high, beta=beta)
    return loss, dict(metrics, **extra)

  return loss_of


def make_policy_grads(merge, **loss_kwargs):
  """`grads(p, batch, old_lp, ref_lp, adv) -> ((loss, metrics), gradients)` of
  `make_loss`'s loss (the learner accumulates them over micro-batches)."""
  return jax.value_and_grad(make_loss(merge, **loss_kwargs), has_aux=True)


def make_apply(tx):
  """`apply(params, opt_state, grads) -> (params, opt_state, gradient norm)`."""

  def apply(params, opt_state, grads):
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, optax.tree.norm(grads)

  return apply


def make_policy_step(merge, tx, **loss_kwargs):
  """One policy update on one batch of rollouts, the reference's log-probabilities
  computed in it: `step(params, opt_state, ref_params, batch, adv) -> (params,
  opt_state, metrics)` over parameter dicts (`scoring.trajectory_logprobs`; `ref_params`
  None: no KL). The learner's gradient and update (`make_policy_grads`, `make_apply`) in
  one program, for one micro-batch."""
  grads_of, apply = make_policy_grads(merge, **loss_kwargs), make_apply(tx)

  def step(params, opt_state, ref_params, batch, adv):
    ref_lp = None
    if ref_params is not None:
      ref_lp = jax.lax.stop_gradient(scoring.trajectory_logprobs(
          merge, ref_params, batch, loss_kwargs["temperature"])[0])
    (_, metrics), grads = grads_of(params, batch, None, ref_lp, adv)
    params, opt_state, norm = apply(params, opt_state, grads)
    return params, opt_state, dict(metrics, grad_norm=norm)

  return step


class Learner:
  """GRPO's updates, jitted by `placement` (`loop.Placement`: on the parameters' mesh)."""

  def __init__(self, merge, tx, placement, *, num_iterations: int, **loss_kwargs):
    self.num_iterations = int(num_iterations)
    self._grads = placement.jit(make_policy_grads(merge, **loss_kwargs))
    self._apply = placement.jit(make_apply(tx))

  def update(self, params, opt_state, batches: list[dict], advantages: list, old_lps: list,
             ref_lps: list | None):
    """`num_iterations` optimizer steps on `batches` (a step's micro-batches, with their
    advantages and, per batch, the old log-probabilities or None (the current ones) and the
    reference's, or no list: no KL). Returns `(params, opt_state, metrics)`: the loss's
    metrics averaged over micro-batches and iterations, the last gradient's norm."""
    totals, norm = {}, None
    count = len(batches) * self.num_iterations
    for _ in range(self.num_iterations):
      summed = None
      for j, batch in enumerate(batches):
        (_, metrics), grads = self._grads(params, batch, old_lps[j],
                                          None if ref_lps is None else ref_lps[j], advantages[j])
        summed = grads if summed is None else jax.tree.map(jnp.add, summed, grads)
        for k, v in metrics.items():
          totals[k] = totals.get(k, 0.0) + float(v) / count
      mean = jax.tree.map(lambda x: x / len(batches), summed)
      params, opt_state, norm = self._apply(params, opt_state, mean)
    return params, opt_state, dict(totals, grad_norm=float(norm))
