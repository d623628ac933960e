"""How much can the slot order matter? Every order, decoded, for tiny cases.

ALGORITHM.md "Past the paper" ("Planning search and learning"). ReFusion's decode
is a slot order plus, per slot, a first token and an autoregressive fill. This tool
fixes the fill (`ordered_fill`: the left-to-right ablation's, a slot's first token the
argmax of a plan pass over its own masks, the rest one causal pass a token, until the
slot is full or ends in a stop token) and enumerates the order: every permutation of a
response's `gen_length / slot_size` slots, by depth-first search so that orders
sharing a prefix share its passes. With the position order it is
`decode.left_to_right`, token for token (tested); the spread over orders bounds what
any planner (a learnt one, a search) can reach with this fill, and how far the
left-to-right order is from the best.

Meant for tiny models and a few slots (n slots: n! orders, about e n! slot decodes).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Sequence

from refusion_jax.decode import ordered_fill

MAX_SLOTS = 7  # 5,040 orders


@dataclasses.dataclass(frozen=True)
class OrderResult:
  order: tuple[int, ...]  # slot indices in commit order
  tokens: tuple[int, ...]  # the response up to and including its first stop token
  passes: int  # plan passes + AR passes of the slots decoded in this order


def all_orders(model, prompt: Sequence[int], *, gen_length: int, slot_size: int,
               orders: Sequence[Sequence[int]] | None = None,
               ignore_eos: bool = False) -> list[OrderResult]:
  """Every slot order's response (greedy), or only `orders`' (each a permutation).

  A slot stops at a stop token (`ordered_fill.stop_ids`); the response is the tokens up
  to its first stop token in position order (a slot after it is decoded and dropped)."""
  fill = ordered_fill.OrderedFill(model, gen_length=gen_length, slot_size=slot_size,
                                  ignore_eos=ignore_eos, what="order oracle")
  n = fill.n_slots
  if not 1 <= n <= MAX_SLOTS:
    raise ValueError(f"order oracle: {n} slots; at most {MAX_SLOTS} ({math.factorial(MAX_SLOTS)} "
                     "orders)")
  if not prompt:
    raise ValueError("order oracle: the prompt is empty")
  wanted = None if orders is None else {tuple(o) for o in orders}
  for o in wanted or ():
    if sorted(o) != list(range(n)):
      raise ValueError(f"order oracle: {list(o)} is not a permutation of the {n} slots")

  results: list[OrderResult] = []

  def explore(committed, passes):
    order = tuple(s for s, _ in committed)
    if len(order) == n:
      if wanted is None or order in wanted:
        results.append(OrderResult(order, tuple(fill.response(committed)[0]), passes))
      return
    for s in range(n):
      if s in order:
        continue
      nxt = order + (s,)
      if wanted is not None and not any(w[:len(nxt)] == nxt for w in wanted):
        continue
      tokens, used = fill.fill(prompt, committed, s)
      explore(committed + [(s, tokens)], passes + used)

  explore([], 0)
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
