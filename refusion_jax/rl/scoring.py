"""Scoring: each rollout's per-token log-probabilities under given parameters.

`micro_batches` lays a step's rollouts out for the forward (`rl.replay`: one
training layout per rollout, every pass that decided a token in one sequence, packed
`micro_batch` rollouts at a time; with the selection policy trained, each plan step's
features and choice too; a lossless rollout's layout is prompt and answer in one causal
run, its AR likelihood). `trajectory_logprobs` scores a micro-batch under the trained
parts of a parameter dict; `make_score` is what the trainer jits to score the rollouts
under the reference's weights and, with several updates per batch, the current ones
(GRPO's old log-probabilities), as tunix's RL cluster scores them for its learner.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from refusion_jax.rl import replay, selector
from refusion_jax.rl.rollout import Rollouts

# The record's fields the selection policy's log-likelihood reads (`selector.choice_logprobs`).
PLAN_KEYS = ("plan_feats", "plan_fed", "plan_chosen")


def micro_batches(rollouts: Rollouts, decode_config, mask_id: int, size: int,
                  with_plan: bool) -> list[dict]:
  """The rollouts' training layouts, packed `size` at a time at one bucketed width (one
  compiled program for every micro-batch of the step)."""
  dc = decode_config
  causal = dc.verify == "lossless"
  if causal:  # the answer's AR likelihood: one causal run
    layouts = [replay.causal_layout(p, r.tokens, r.trace["p"])
               for p, r in zip(rollouts.prompts, rollouts.results)]
  else:
    layouts = [replay.layout(p, r.trace, dc.slot_size, dc.block_size, mask_id)
               for p, r in zip(rollouts.prompts, rollouts.results)]
  width = replay.bucket(max(len(x.ids) for x in layouts), 32)
  tokens = replay.bucket(max(len(x.targets) for x in layouts), 16)
  batches = []
  for start in range(0, len(layouts), size):
    batch = replay.pack(layouts[start:start + size], width=width, tokens=tokens,
                        causal=causal)
    if with_plan:
      part = rollouts.results[start:start + size]
      for key in PLAN_KEYS:
        batch[key] = np.stack([r.trace[key] for r in part])
    batches.append(batch)
  return batches


def trajectory_logprobs(merge, p, batch, temperature: float, entropy: bool = False):
  """Each rollout's log-probabilities under the trained parts of `p`, concatenated along
  the last axis: `p["model"]` scores every committed token (`rl.replay`),
  `p["selector"]` every plan step's choice (`rl.selector`). Returns `(lp [B, T],
  valid [B, T], metrics)`."""
  parts, valids, metrics = [], [], {}
  if "model" in p:
    lp, ent = replay.logprobs(merge(p["model"]), batch, temperature, entropy=True)
    valid = jnp.asarray(batch["valid"])
    parts.append(lp)
    valids.append(valid)
    if entropy:
      v = valid.astype(jnp.float32)
      metrics["token_entropy"] = (ent * v).sum() / jnp.maximum(v.sum(), 1.0)
  if "selector" in p:
    lp, valid = selector.choice_logprobs(p["selector"], batch["plan_feats"], batch["plan_fed"],
                                         batch["plan_chosen"])
    parts.append(lp)
    valids.append(valid)
    if entropy:
      metrics["plan_entropy"] = selector.plan_entropy(p["selector"], batch["plan_feats"],
                                                      batch["plan_fed"])
  return jnp.concatenate(parts, -1), jnp.concatenate(valids, -1), metrics


def make_score(merge, temperature: float):
  """`score(p, batch) -> lp [B, T]`: `trajectory_logprobs` without the validity mask."""

  def score(p, batch):
    return trajectory_logprobs(merge, p, batch, temperature)[0]

  return score
