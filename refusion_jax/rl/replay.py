"""Exact log-probabilities of ReFusion's parallel decode, from its rollout record.

A rollout decoded with `decode.record` (and `decode.sample_drafts`, so that every
committed token is a draw) carries, per committed token, the pass that drafted it
(`DecodeOutput.trace`): the plan of its step, or infill draft round r of its slot with
the slot's first m tokens kept. The decoder's passes are causal over a KV cache, so
each of those passes fits in one sequence beside the others (the training layout):

    [prompt | every committed token | one group per deciding pass]

with true positions. A committed token sees the prompt, the tokens committed in earlier
steps and, of its own step, the tokens before it in one causal run (global
verification, recompute_kv: `chain`) or in its own slot (the infill's slot-local K/V).
A plan group holds its step's undecided slots as masks, causal among themselves; a
draft group its slot's kept tokens then masks (each cut after its last scored entry,
which causal attention makes exact); each sees the prompt and what was committed
before its step. Every committed token is scored at its own entry of the
group that drafted it, under `log_softmax(logits / T)` with the mask token left out
(the decoder's Gumbel draw samples exactly that distribution).

`layout` builds one rollout's arrays on the host; `pack` pads a batch to static sizes;
`logprobs` scores a packed batch in one forward (jittable, differentiable in the
model's parameters). `logprobs_stepwise` is the oracle: each deciding pass run alone,
on exactly what it saw, in float64 log-softmax. The decoder's own probabilities
(`trace["p"]`, at temperature 1) are the third check.

A rollout of lossless decoding (`decode.verify='lossless'`) is distributed as the
model's AR sampling, each token drawn from its causal softmax over the whole vocabulary
(the mask token included): its layout is `causal_layout`, prompt and answer in one causal
run, each token scored at the entry before it (one causal forward: the AR likelihood),
packed with `pack(..., causal=True)` so that `logprobs` keeps the mask token in the softmax.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Layout:
  ids: np.ndarray  # [L] int32
  positions: np.ndarray  # [L] int32
  attention: np.ndarray  # [L, L] bool (query, key)
  score_at: np.ndarray  # [T] entry whose output scores each committed token
  targets: np.ndarray  # [T] the token
  index: np.ndarray  # [T] its generated index
  p_recorded: np.ndarray  # [T] the decoder's probability of it (un-noised softmax)


def _check(prompt, trace, slot_size, block_size):
  p = len(prompt)
  if p == 0:
    raise ValueError("replay: the prompt is empty")
  if int(trace["prompt_len"]) != p:
    raise ValueError(f"replay: the record was decoded after a {int(trace['prompt_len'])}-token "
                     f"prompt, not this one of {p}")
  g = len(trace["tokens"])
  if g % block_size or block_size % slot_size:
    raise ValueError(f"replay: {g} generated positions do not split into blocks of "
                     f"{block_size} and slots of {slot_size}")
  if not (np.asarray(trace["step"]) >= 0).any():
    raise ValueError("replay: the record commits no token")


def layout(prompt, trace: dict, slot_size: int, block_size: int, mask_id: int) -> Layout:
  """One rollout's training layout (module docstring)."""
  _check(prompt, trace, slot_size, block_size)
  k, blk, p = slot_size, block_size, len(prompt)
  tokens = np.asarray(trace["tokens"], np.int64)
  step = np.asarray(trace["step"], np.int64)
  rnd = np.asarray(trace["round"], np.int64)
  prefix = np.asarray(trace["prefix"], np.int64)
  chain = np.asarray(trace["chain"], bool)
  plan_fed = np.asarray(trace["plan_fed"], bool)
  plan_block = np.asarray(trace["plan_block"], np.int64)
  committed = [int(g) for g in np.lexsort((np.arange(len(step)), step)) if step[g] >= 0]

  ids, pos, ent_step = list(prompt), list(range(p)), [-1] * p
  entry = {}
  for g in committed:
    entry[g] = len(ids)
    ids.append(int(tokens[g]))
    pos.append(p + g)
    ent_step.append(int(step[g]))
  # Deciding passes: (step, -1, -1) a plan, (step, slot, round) an infill draft.
  groups: dict[tuple[int, int, int], list[int]] = {}
  for g in committed:
    key = (int(step[g]), -1, -1) if rnd[g] < 0 else (int(step[g]), g // k, int(rnd[g]))
    groups.setdefault(key, []).append(g)
  group_rows = []  # (step, [(id, gen index)])
  for (t, slot, _), members in sorted(groups.items()):
    if slot < 0:
      b = int(plan_block[t])
      if b < 0:
        raise ValueError(f"replay: step {t} commits plan drafts but records no plan")
      gens = [b * blk + s * k + j for s in np.flatnonzero(plan_fed[t]) for j in range(k)]
      feed = [(mask_id, x) for x in gens]
    else:
      m = {int(prefix[g]) for g in members}
      if len(m) != 1:
        raise ValueError(f"replay: slot {slot}'s draft round at step {t} kept {sorted(m)} tokens")
      m = m.pop()
      gens = [slot * k + j for j in range(k)]
      feed = [(int(tokens[x]) if j < m else mask_id, x) for j, x in enumerate(gens)]
    missing = [g for g in members if g not in gens]
    if missing:
      raise ValueError(f"replay: positions {missing} were drafted by a pass at step {t} "
                       "that did not feed them")
    # Causal within the group: the entries after its last scored one change nothing.
    last = max(gens.index(g) for g in members)
    group_rows.append((t, feed[:last + 1], members))
  c = len(ids)
  score = {}
  spans = []
  for t, feed, members in group_rows:
    start = len(ids)
    for tok, x in feed:
      ids.append(tok)
      pos.append(p + x)
    spans.append((t, start, len(ids)))
    where = {x: start + j for j, (_, x) in enumerate(feed)}
    for g in members:
      score[g] = where[g]
  n = len(ids)
  ent_step_a = np.asarray(ent_step)
  att = np.zeros((n, n), bool)
  att[:p, :p] = np.tril(np.ones((p, p), bool))
  for g in committed:
    e, t = entry[g], int(step[g])
    att[e, :p] = True
    att[e, :c] |= (ent_step_a < t) & (ent_step_a >= 0)
    for h in committed:
      if step[h] == t and h <= g and (chain[g] or h // k == g // k):
        att[e, entry[h]] = True
  for t, a, z in spans:
    att[a:z, :p] = True
    att[a:z, :c] |= ((ent_step_a < t) & (ent_step_a >= 0))[None]
    att[a:z, a:z] = np.tril(np.ones((z - a, z - a), bool))
  order = sorted(score)
  return Layout(ids=np.asarray(ids, np.int32), positions=np.asarray(pos, np.int32),
                attention=att, score_at=np.asarray([score[g] for g in order], np.int32),
                targets=np.asarray([tokens[g] for g in order], np.int32),
                index=np.asarray(order, np.int32),
                p_recorded=np.asarray([trace["p"][g] for g in order], np.float32))


def causal_layout(prompt, tokens, p_recorded) -> Layout:
  """A lossless rollout's layout: `[prompt | answer]` under a causal mask at true positions,
  answer token i scored at the entry before it (the AR likelihood of the answer);
  `p_recorded` is the decoder's probability of each token (`trace["p"]`)."""
  p, t = len(prompt), len(tokens)
  if p == 0:
    raise ValueError("replay: the prompt is empty")
  if t == 0:
    raise ValueError("replay: the answer is empty")
  if len(p_recorded) < t:
    raise ValueError(f"replay: {len(p_recorded)} recorded probabilities for {t} tokens")
  ids = np.asarray(list(prompt) + list(tokens[:-1]), np.int32)  # the last token feeds nothing
  n = len(ids)
  return Layout(ids=ids, positions=np.arange(n, dtype=np.int32),
                attention=np.tril(np.ones((n, n), bool)),
                score_at=np.arange(p - 1, p - 1 + t, dtype=np.int32),
                targets=np.asarray(tokens, np.int32), index=np.arange(t, dtype=np.int32),
                p_recorded=np.asarray(p_recorded[:t], np.float32))


def bucket(n: int, step: int) -> int:
  return max(step, -(-n // step) * step)


def pack(layouts, width: int | None = None, tokens: int | None = None,
         width_step: int = 32, tokens_step: int = 16, causal: bool = False) -> dict:
  """A batch of layouts padded to `width` entries and `tokens` scored tokens (default:
  the longest, rounded up to the steps, so that similar batches share one program);
  `causal`: lossless rollouts (`causal_layout`), scored with the mask token in the
  softmax (`scored_mask`)."""
  b = len(layouts)
  need_w = max(len(x.ids) for x in layouts)
  need_t = max(len(x.targets) for x in layouts)
  width = bucket(need_w, width_step) if width is None else width
  tokens = bucket(need_t, tokens_step) if tokens is None else tokens
  if need_w > width or need_t > tokens:
    raise ValueError(f"replay: a rollout needs {need_w} entries and {need_t} tokens; the batch "
                     f"holds {width} and {tokens}")
  out = dict(ids=np.zeros((b, width), np.int32), positions=np.zeros((b, width), np.int32),
             attention=np.broadcast_to(np.eye(width, dtype=bool), (b, width, width)).copy(),
             score_at=np.zeros((b, tokens), np.int32), targets=np.zeros((b, tokens), np.int32),
             valid=np.zeros((b, tokens), bool), scored_mask=np.bool_(causal))
  for i, x in enumerate(layouts):
    n, t = len(x.ids), len(x.targets)
    out["ids"][i, :n], out["positions"][i, :n] = x.ids, x.positions
    out["attention"][i, :n, :n] |= x.attention
    out["score_at"][i, :t], out["targets"][i, :t], out["valid"][i, :t] = (
        x.score_at, x.targets, True)
  return out


def logprobs(model, batch: dict, temperature: float = 1.0, entropy: bool = False):
  """Per-token log-probabilities `[B, T]` of a packed batch (0 where not valid), in one
  forward of `model` (jittable); with `entropy`, also each scored distribution's entropy
  `[B, T]` (nats)."""
  mask_id = model.config.mask_token_id
  if mask_id is None:
    raise ValueError("replay log-probabilities need the model's mask_token_id")
  h = model.hidden(jnp.asarray(batch["ids"]), jnp.asarray(batch["positions"]),
                   attention_mask_btt=jnp.asarray(batch["attention"]))
  # Only the scored entries are projected onto the vocabulary.
  h = jnp.take_along_axis(h, jnp.asarray(batch["score_at"])[:, :, None], axis=1)
  logits = model.unembed().logits(h)
  # The parallel decoder never draws the mask token (left out of the softmax); a causal
  # pick may (a lossless rollout's batch: `scored_mask`).
  leave_out = (jnp.arange(logits.shape[-1]) == mask_id) & ~jnp.asarray(
      batch.get("scored_mask", False))
  read = jnp.where(leave_out, -jnp.inf, logits) / temperature
  lp = jax.nn.log_softmax(read, axis=-1)
  out = jnp.take_along_axis(lp, jnp.asarray(batch["targets"])[:, :, None], axis=-1)[..., 0]
  valid = jnp.asarray(batch["valid"])
  out = jnp.where(valid, out, 0.0)
  if not entropy:
    return out
  ent = -jnp.sum(jnp.where(jnp.isfinite(lp), jnp.exp(lp) * lp, 0.0), axis=-1)
  return out, jnp.where(valid, ent, 0.0)


def logprobs_stepwise(model, x: Layout, temperature: float = 1.0) -> list[float]:
  """The oracle: for each scored token, the pass that drafted it run alone (only the
  entries it saw, in their order), read in float64."""
  mask_id = model.config.mask_token_id
  out = []
  for at, tok in zip(x.score_at, x.targets):
    seen = np.flatnonzero(x.attention[at])  # its context, then its group up to itself
    sub = x.attention[np.ix_(seen, seen)]
    logits = model(jnp.asarray(x.ids[seen])[None], jnp.asarray(x.positions[seen])[None],
                   attention_mask_btt=jnp.asarray(sub)[None])[0, -1]
    v = np.array(logits, np.float64)
    v[mask_id] = -np.inf
    v = v / temperature
    v = v - v.max()
    out.append(float(v[tok] - np.log(np.exp(v).sum())))
  return out
