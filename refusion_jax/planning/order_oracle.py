"""How much can the slot order matter? Every order, decoded, for tiny cases.

ALGORITHM.md "Past the paper" ("Planning search and learning"). ReFusion's decode
is a slot order plus, per slot, a first token and an autoregressive fill. This tool
fixes the fill (the left-to-right ablation's: a slot's first token is the argmax of a
plan pass over its own masks, the rest one causal pass a token, until the slot is
full or ends in EOS) and enumerates the order: every permutation of a response's
`gen_length / slot_size` slots, by depth-first search so that orders sharing a prefix
share its passes. With the position order it is `decode.left_to_right`, token for
token (tested); the spread over orders bounds what any planner (a learnt one, a search)
can reach with this fill, and how far the left-to-right order is from the best.

Batch 1, dynamic shapes, plain Python over one compiled forward: every pass runs the
model on [prompt, the committed slots in commit order, the pass's tokens] at their
true positions under a causal mask in that order. A committed token's K/V in the real
decoder were computed from exactly the entries before it in commit order, so this is
the KV cache's attention without a cache. Meant for tiny models and a few slots
(n slots: n! orders, about e n! slot decodes).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Sequence

import numpy as np

MAX_SLOTS = 7  # 5,040 orders


@dataclasses.dataclass(frozen=True)
class OrderResult:
  order: tuple[int, ...]  # slot indices in commit order
  tokens: tuple[int, ...]  # the response up to and including its first EOS
  passes: int  # plan passes + AR passes of the slots decoded in this order


def _forward(model, width: int) -> Callable:
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from flax import nnx  # pylint: disable=import-outside-toplevel
  graphdef, state = nnx.split(model)

  @jax.jit
  def call(state, ids, pos, n):
    causal = jnp.tril(jnp.ones((width, width), bool))
    live = jnp.arange(width) < n
    mask = (causal & live[None, :] & live[:, None]) | jnp.eye(width, dtype=bool)
    return nnx.merge(graphdef, state)(ids[None], pos[None], attention_mask_btt=mask[None])[0]

  def run(tokens: Sequence[int], positions: Sequence[int]) -> np.ndarray:
    n = len(tokens)
    if n > width:
      raise ValueError(f"order oracle: {n} entries exceed the width {width}")
    ids = np.zeros((width,), np.int32)
    pos = np.zeros((width,), np.int32)
    ids[:n], pos[:n] = tokens, positions
    return np.asarray(call(state, jnp.asarray(ids), jnp.asarray(pos), jnp.int32(n)))[:n]

  return run


def all_orders(model, prompt: Sequence[int], *, gen_length: int, slot_size: int,
               orders: Sequence[Sequence[int]] | None = None) -> list[OrderResult]:
  """Every slot order's response (greedy), or only `orders`' (each a permutation).

  The mask token is never picked; a slot stops at EOS; the response is the tokens up
  to its first EOS in position order (a slot after it is decoded and dropped)."""
  cfg = model.config
  if gen_length % slot_size:
    raise ValueError(f"gen_length={gen_length} must be a multiple of slot_size={slot_size}")
  n = gen_length // slot_size
  if not 1 <= n <= MAX_SLOTS:
    raise ValueError(f"order oracle: {n} slots; at most {MAX_SLOTS} ({math.factorial(MAX_SLOTS)} "
                     "orders)")
  if not prompt:
    raise ValueError("order oracle: the prompt is empty")
  if cfg.mask_token_id is None:
    raise ValueError("order oracle: the model has no mask_token_id")
  p, k, mask, eos = len(prompt), slot_size, cfg.mask_token_id, cfg.eos_token_id
  run = _forward(model, p + gen_length + k)
  wanted = None if orders is None else {tuple(o) for o in orders}
  for o in wanted or ():
    if sorted(o) != list(range(n)):
      raise ValueError(f"order oracle: {list(o)} is not a permutation of the {n} slots")

  def pick(logits_v) -> int:
    logits_v = np.array(logits_v, np.float64)
    logits_v[mask] = -np.inf
    return int(logits_v.argmax())

  def decode_slot(ctx_tok, ctx_pos, s):
    """Slot s's tokens and passes after the committed context."""
    pos = [p + s * k + j for j in range(k)]
    plan = run(ctx_tok + [mask] * k, ctx_pos + pos)
    toks, passes = [pick(plan[len(ctx_tok)])], 1
    while len(toks) < k and toks[-1] != eos:
      out = run(ctx_tok + toks, ctx_pos + pos[:len(toks)])
      toks.append(pick(out[-1]))
      passes += 1
    return toks, pos[:len(toks)], passes

  results: list[OrderResult] = []

  def explore(order, ctx_tok, ctx_pos, canvas, passes):
    if len(order) == n:
      if wanted is None or tuple(order) in wanted:
        answer = []
        for i in range(gen_length):
          if i not in canvas:
            break  # a slot ended in EOS before this position: only after an EOS
          answer.append(canvas[i])
          if canvas[i] == eos:
            break
        results.append(OrderResult(tuple(order), tuple(answer), passes))
      return
    for s in range(n):
      if s in order:
        continue
      nxt = tuple(order) + (s,)
      if wanted is not None and not any(w[:len(nxt)] == nxt for w in wanted):
        continue
      toks, pos, used = decode_slot(ctx_tok, ctx_pos, s)
      filled = dict(canvas)
      filled.update({q - p: t for q, t in zip(pos, toks)})
      explore(list(nxt), ctx_tok + toks, ctx_pos + pos, filled, passes + used)

  explore([], list(prompt), list(range(p)), {}, 0)
  return results


@dataclasses.dataclass(frozen=True)
class OrderSummary:
  orders: int
  correct: int  # orders whose answer scores
  left_to_right: bool  # the position order's answer scores
  distinct_answers: int


def summarize(results: Sequence[OrderResult], is_correct: Callable[[Sequence[int]], bool]
              ) -> OrderSummary:
  """How many orders answer correctly, and whether the position order does."""
  ltr = next(r for r in results if r.order == tuple(sorted(r.order)))
  return OrderSummary(orders=len(results), correct=sum(bool(is_correct(r.tokens))
                                                       for r in results),
                      left_to_right=bool(is_correct(ltr.tokens)),
                      distinct_answers=len({r.tokens for r in results}))
