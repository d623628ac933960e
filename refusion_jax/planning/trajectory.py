"""Exact log-probabilities of ordered-slot trajectories, in one forward pass.

A trajectory of the ordered fill (`order_oracle`: slots committed in an order, each
slot's first token drawn from a plan pass over its own masks, the rest drawn
autoregressively) has an exact probability: each token under the pass that decided it.
Because ReFusion's cache is causal in commit order, every one of those passes fits in
one sequence (the training layout of this fill):

    [prompt | committed slots in commit order | slot pi_1's masks | ... | slot pi_n's masks]

with true positions, where the prompt and the committed slots attend causally in that
order (the cache as it was built), and the masks of the j-th slot committed attend to
the prompt, the slots committed before it and, causally, to themselves (its plan
pass). A slot's first token is scored at its first mask, every later token at the
entry of the token before it. `logprobs` does this for a batch of trajectories in one
forward of the model (differentiable: an RL objective's log-likelihood);
`logprobs_stepwise` replays the same trajectory pass by pass in plain Python (the
oracle). Both read `log_softmax(logits / temperature)` with the mask token left out
(it is never drawn).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class Trajectory:
  prompt: tuple[int, ...]
  order: tuple[int, ...]  # slot indices in commit order
  slots: tuple[tuple[int, ...], ...]  # slots[s]: slot s's tokens (shorter when it ends in EOS)
  slot_size: int

  def check(self) -> None:
    n = len(self.slots)
    if sorted(self.order) != list(range(n)):
      raise ValueError(f"trajectory: order {list(self.order)} is not a permutation of its {n} "
                       "slots")
    for s, toks in enumerate(self.slots):
      if not 1 <= len(toks) <= self.slot_size:
        raise ValueError(f"trajectory: slot {s} has {len(toks)} tokens, not 1 to "
                         f"{self.slot_size}")
    if not self.prompt:
      raise ValueError("trajectory: the prompt is empty")


def layout(t: Trajectory, mask_id: int):
  """`(ids, positions, attention [L, L] bool, score_at [T], targets [T])`: the one-pass
  layout and, for each of the trajectory's tokens in commit order, the entry whose
  output scores it and the token."""
  t.check()
  p, k = len(t.prompt), t.slot_size
  ids, pos = list(t.prompt), list(range(p))
  slot_entries: dict[int, list[int]] = {}
  for s in t.order:
    slot_entries[s] = list(range(len(ids), len(ids) + len(t.slots[s])))
    ids += list(t.slots[s])
    pos += [p + s * k + j for j in range(len(t.slots[s]))]
  c = len(ids)
  mask_entries: dict[int, int] = {}
  for s in t.order:
    mask_entries[s] = len(ids)
    ids += [mask_id] * k
    pos += [p + s * k + j for j in range(k)]
  n = len(ids)
  att = np.zeros((n, n), bool)
  att[:c, :c] = np.tril(np.ones((c, c), bool))
  seen = list(range(p))
  for s in t.order:
    m = mask_entries[s]
    for j in range(k):
      att[m + j, seen] = True
      att[m + j, m:m + j + 1] = True
    seen = seen + slot_entries[s]
  score_at, targets = [], []
  for s in t.order:
    for j, tok in enumerate(t.slots[s]):
      score_at.append(mask_entries[s] if j == 0 else slot_entries[s][j - 1])
      targets.append(tok)
  return (np.asarray(ids, np.int32), np.asarray(pos, np.int32), att,
          np.asarray(score_at, np.int32), np.asarray(targets, np.int32))


def logprobs(model, trajectories: Sequence[Trajectory], temperature: float = 1.0):
  """Per-token log-probabilities `[B, T]` (0 past a trajectory's tokens) and the token
  mask `[B, T]`, every trajectory in one forward of `model` (`replay.pack` and
  `replay.logprobs` over these layouts; jittable in the model's parameters: the layouts
  are built on the host)."""
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  from refusion_jax.rl import replay  # pylint: disable=import-outside-toplevel
  mask_id = model.config.mask_token_id
  if mask_id is None:
    raise ValueError("trajectory log-probabilities need the model's mask_token_id")
  if not temperature > 0:
    raise ValueError(f"temperature must be > 0, got {temperature!r}")
  layouts = []
  for t in trajectories:
    ids, pos, att, at, tgt = layout(t, mask_id)
    layouts.append(replay.Layout(ids=ids, positions=pos, attention=att, score_at=at,
                                 targets=tgt, index=np.arange(len(tgt), dtype=np.int32),
                                 p_recorded=np.zeros(len(tgt), np.float32)))
  batch = replay.pack(layouts, width=max(len(x.ids) for x in layouts),
                      tokens=max(len(x.targets) for x in layouts))
  return replay.logprobs(model, batch, temperature), jnp.asarray(batch["valid"])


def logprobs_stepwise(model, t: Trajectory, temperature: float = 1.0) -> list[float]:
  """The oracle: the trajectory replayed pass by pass (a plan pass over each slot's own
  masks after the slots committed before it, then one causal pass a token), float64
  log-softmax; the log-probabilities in commit order."""
  from refusion_jax.planning import order_oracle  # pylint: disable=import-outside-toplevel
  t.check()
  mask_id = model.config.mask_token_id
  p, k = len(t.prompt), t.slot_size
  run = order_oracle._forward(model, p + len(t.slots) * k + k)  # pylint: disable=protected-access

  def logp(logits_v, token):
    x = np.array(logits_v, np.float64)
    x[mask_id] = -np.inf
    x = x / temperature
    x = x - x.max()
    return float(x[token] - np.log(np.exp(x).sum()))

  ctx_tok, ctx_pos, out = list(t.prompt), list(range(p)), []
  for s in t.order:
    positions = [p + s * k + j for j in range(k)]
    toks = list(t.slots[s])
    plan = run(ctx_tok + [mask_id] * k, ctx_pos + positions)
    out.append(logp(plan[len(ctx_tok)], toks[0]))
    for j in range(1, len(toks)):
      step = run(ctx_tok + toks[:j], ctx_pos + positions[:j])
      out.append(logp(step[-1], toks[j]))
    ctx_tok, ctx_pos = ctx_tok + toks, ctx_pos + positions[:len(toks)]
  return out
