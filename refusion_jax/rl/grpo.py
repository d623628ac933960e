"""GRPO's pieces for ReFusion trajectories: group-relative advantages, the Plackett-Luce
probability of a slot order, and the clipped policy loss with a KL term.

The formulas and their names are tunix's (`google-tunix` 0.1.7, `tunix/rl/algo_core.py`:
`compute_advantages` "grpo", `grpo_loss_fn` with `epsilon` / `epsilon_high`, `beta`,
the "sequence-mean-token-mean" aggregation and the k3 KL estimator), so a figure from
one reads as one from the other (docs/DESIGN.md "RL on ReFusion" says why the trainer
is not tunix's). The log-probabilities come from `replay.logprobs` (the tokens) and
`plackett_luce_logprob` (a stochastic plan's slot choices).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def group_advantages(rewards, group_size: int) -> np.ndarray:
  """`(r - mean of its group) / (std of its group, ddof 1, + 1e-6)` for rewards laid out
  group after group (G consecutive samples of one prompt)."""
  r = np.asarray(rewards, np.float64)
  if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 2:
    raise ValueError(f"group_size must be an int >= 2 (a group-relative advantage compares "
                     f"samples of one prompt), got {group_size!r}")
  if r.ndim != 1 or r.size % group_size:
    raise ValueError(f"{r.size} rewards do not split into groups of {group_size}")
  g = r.reshape(-1, group_size)
  mean = g.mean(axis=1, keepdims=True)
  std = g.std(axis=1, ddof=1, keepdims=True)
  return ((g - mean) / (std + 1e-6)).reshape(-1)


def plackett_luce_logprob(scores, order):
  """log P(order) when each step draws the next slot with probability softmax(scores)
  over the slots not yet drawn (jittable; `scores [n]`, `order` a permutation)."""
  scores = jnp.asarray(scores, jnp.float32)
  order = jnp.asarray(order, jnp.int32)
  n = scores.shape[-1]
  ranked = scores[order]
  # Step j's normaliser runs over the slots drawn at j or later.
  later = jnp.arange(n)[None, :] >= jnp.arange(n)[:, None]
  norm = jax.nn.logsumexp(jnp.where(later, ranked[None, :], -jnp.inf), axis=-1)
  return jnp.sum(ranked - norm)


def policy_loss(logp_bt, old_logp_bt, ref_logp_bt, mask_bt, advantages_b, *,
                epsilon: float = 0.2, epsilon_high: float | None = None, beta: float = 0.04):
  """GRPO's clipped objective with a KL penalty, aggregated sequence-mean-token-mean.

  Per token: ratio r = exp(logp - old_logp); loss = -min(r A, clip(r, 1 - eps, 1 +
  eps_high) A) + beta KL, KL = exp(ref - logp) - (ref - logp) - 1 (k3, >= 0). Each
  sequence's masked tokens are averaged, then the sequences. Returns `(loss, metrics)`.
  """
  if not beta >= 0:
    raise ValueError(f"beta (the KL weight) must be >= 0, got {beta!r}")
  if not epsilon > 0:
    raise ValueError(f"epsilon must be > 0, got {epsilon!r}")
  high = epsilon if epsilon_high is None else epsilon_high
  mask = jnp.asarray(mask_bt, jnp.float32)
  adv = jnp.asarray(advantages_b, jnp.float32)[:, None]
  ratio = jnp.exp(logp_bt - old_logp_bt)
  unclipped = ratio * adv
  clipped = jnp.clip(ratio, 1.0 - epsilon, 1.0 + high) * adv
  per_token = -jnp.minimum(unclipped, clipped)
  diff = ref_logp_bt - logp_bt
  kl = jnp.exp(diff) - diff - 1.0
  per_token = per_token + beta * kl
  tokens_b = jnp.maximum(mask.sum(-1), 1.0)
  seq = (per_token * mask).sum(-1) / tokens_b
  loss = seq.mean()
  clipped_frac = ((unclipped != clipped) * mask).sum() / jnp.maximum(mask.sum(), 1.0)
  return loss, {"loss": loss, "kl": ((kl * mask).sum(-1) / tokens_b).mean(),
                "clip_fraction": clipped_frac}
