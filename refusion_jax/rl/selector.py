"""The slot-selection policy's probabilities (`decode.planner = "policy"`).

At each plan step the decoder chooses each undecided slot s of the block with
probability pi_s = sigmoid(w . f_s + b) over its features f_s (`config.PLAN_FEATURES`,
computed in the plan pass: decode/refusion.py `plan_features`; the logit is its
`policy_logits`, used here too), independently; when it
draws none, the most likely slot is chosen. The chosen set's probability is therefore
the product of the Bernoulli terms, except for a single chosen slot a that is the most
likely: it is chosen either alone by the draws or by the fallback, with probability
pi_a prod_{s != a} (1 - pi_s) + prod_s (1 - pi_s) = prod_{s != a} (1 - pi_s).

`choice_logprobs` scores a rollout's recorded plan steps (`DecodeOutput.trace`:
`plan_feats`, `plan_fed`, `plan_chosen`) under any weights: the log-likelihood a
policy gradient needs, with the base model frozen (the features are constants of the
rollout). `choice_logprobs_plain` is the same in plain Python (the oracle).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from refusion_jax.decode import refusion


def _logits(weights, feats_btsf):
  """The decoder's logit of every slot, weights laid out as (w..., b)."""
  weights = jnp.asarray(weights, jnp.float32)
  return refusion.policy_logits(feats_btsf, weights[:-1], weights[-1])


def choice_logprobs(weights, feats_btsf, fed_bts, chosen_bts):
  """`(log P(chosen set) [B, T], valid [B, T])` of each plan step (jittable and
  differentiable in `weights` = (w..., b)); steps without a plan are not valid."""
  fed = jnp.asarray(fed_bts, bool)
  chosen = jnp.asarray(chosen_bts, bool) & fed
  logit = _logits(weights, feats_btsf)
  lp, lq = jax.nn.log_sigmoid(logit), jax.nn.log_sigmoid(-logit)
  normal = jnp.where(fed, jnp.where(chosen, lp, lq), 0.0).sum(-1)
  best = jnp.argmax(jnp.where(fed, logit, -jnp.inf), axis=-1)
  best_s = jax.nn.one_hot(best, fed.shape[-1], dtype=bool)
  single_best = (chosen.sum(-1) == 1) & (chosen & best_s).any(-1)
  fallback = jnp.where(fed & ~best_s, lq, 0.0).sum(-1)
  valid = fed.any(-1)
  return jnp.where(valid, jnp.where(single_best, fallback, normal), 0.0), valid


def plan_entropy(weights, feats_btsf, fed_bts):
  """Mean over plan steps of the summed Bernoulli entropies of the undecided slots (nats)."""
  fed = jnp.asarray(fed_bts, bool)
  logit = _logits(weights, feats_btsf)
  p = jax.nn.sigmoid(logit)
  h = -(p * jax.nn.log_sigmoid(logit) + (1 - p) * jax.nn.log_sigmoid(-logit))
  per_step = jnp.where(fed, h, 0.0).sum(-1)
  valid = fed.any(-1)
  return jnp.where(valid, per_step, 0.0).sum() / jnp.maximum(valid.sum(), 1)


def choice_logprobs_plain(weights, feats_tsf, fed_ts, chosen_ts) -> list[float]:
  """One rollout's plan steps in plain Python: the probability of the chosen set summed
  over every draw of the slots that yields it (the draws, and the fallback when none)."""
  w, b = [float(x) for x in weights[:-1]], float(weights[-1])
  out = []
  for feats, fed, chosen in zip(feats_tsf, fed_ts, chosen_ts):
    slots = [s for s in range(len(fed)) if fed[s]]
    if not slots:
      continue
    pi = {s: 1 / (1 + math.exp(-(sum(wi * fi for wi, fi in zip(w, feats[s])) + b)))
          for s in slots}
    best = max(slots, key=lambda s: (pi[s], -s))
    want = {s for s in slots if chosen[s]}
    total = 0.0
    for mask in range(1 << len(slots)):  # every draw
      drawn = {s for i, s in enumerate(slots) if mask >> i & 1}
      prob = np.prod([pi[s] if s in drawn else 1 - pi[s] for s in slots])
      if (drawn or {best}) == want:
        total += prob
    out.append(math.log(total))
  return out
