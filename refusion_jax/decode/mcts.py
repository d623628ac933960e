"""An MCTS slot planner for ReFusion (`decode.planner = "mcts"`).

ALGORITHM.md "Past the paper" ("Planning search and learning"). The decode is the
ordered fill (`ordered_fill`, the order oracle's: one slot committed per plan step; its
first token the argmax of a plan pass over its own masks, the rest one causal pass a
token, until the slot is full or ends in a stop token); the planner chooses which
undecided slot to commit next by a search:

* a node is the committed slots plus the moves of its path; a **move** commits one
  slot with its *draft* (the argmax at each of its masks, read in the parent's pass);
* **expanding** a node is one pass over every undecided slot's masks, each slot in its
  own attention group after the node's context (the committed slots causal in commit
  order, as the KV cache holds them): the **prior** of a move is its slot's first-token
  probability (normalised over the undecided slots), and the node's **value** the mean
  first-token probability of the moves on its path from the search's root and of the
  best move at the node (a path the model is sure of, start to end, scores high);
* selection is PUCT, `Q(a) + c P(a) sqrt(N) / (1 + N(a))`; `budget` simulations per
  plan step, run up to `batch` at a time as the rows of one batched forward (a virtual
  loss keeps a round's rows on different leaves; a round ends early where a selection
  reaches a leaf the round holds already);
* the most visited move's slot is committed, decoded by the real fill (not its draft).

With `budget = 1` the search expands the root only and commits the slot of highest
first-token probability. Batch 1 per prompt, host-driven, over one compiled forward of
`batch` rows (the rows of the search, not of a continuous-batching engine).
"""

from __future__ import annotations

import dataclasses
import math
import time
import types
from typing import Callable, Sequence

import jax.numpy as jnp
import numpy as np

from refusion_jax.decode import engine, ordered_fill


@dataclasses.dataclass
class Node:
  moves: tuple[int, ...]  # slots committed along the path from the root, in order
  drafts: dict[int, tuple[int, ...]]  # each move's slot tokens (its draft)
  move_p: tuple[float, ...]  # first-token probability of each move on the path
  prior: dict[int, float] | None = None  # None: not expanded
  value: float = 0.0  # set when expanded
  child_draft: dict[int, tuple[int, ...]] = dataclasses.field(default_factory=dict)
  child_p: dict[int, float] = dataclasses.field(default_factory=dict)
  n: dict[int, int] = dataclasses.field(default_factory=dict)
  w: dict[int, float] = dataclasses.field(default_factory=dict)
  children: dict[int, "Node"] = dataclasses.field(default_factory=dict)


def puct(node: Node, c: float) -> int:
  """The move PUCT selects at an expanded node (ties: the higher prior, then the lower
  slot)."""
  total = sum(node.n.values())
  best, best_key = None, None
  for a, p in node.prior.items():
    n = node.n.get(a, 0)
    q = node.w.get(a, 0.0) / n if n else 0.0
    key = (q + c * p * math.sqrt(total) / (1 + n), p, -a)
    if best_key is None or key > best_key:
      best, best_key = a, key
  return best


def search(root: Node, expand: Callable[[list[Node]], list[float]], *, budget: int, c: float,
           batch: int) -> Node:
  """Runs `budget` simulations from `root` (`expand(leaves)` sets each leaf's prior,
  children's drafts and probabilities, and returns its value); returns the root."""
  done = 0
  while done < budget:
    leaves, paths, again = [], [], []
    for _ in range(min(batch, budget - done)):
      node, path = root, []
      while node.prior:  # expanded, with moves left
        a = puct(node, c)
        path.append((node, a))
        node.n[a] = node.n.get(a, 0) + 1  # virtual loss until the backup
        if a not in node.children:
          node.children[a] = Node(moves=node.moves + (a,),
                                  drafts={**node.drafts, a: node.child_draft[a]},
                                  move_p=node.move_p + (node.child_p[a],))
        node = node.children[a]
      if any(node is x for x in leaves):
        # A leaf this round expands already: undo the virtual loss and end the round (its
        # rows are what the batch holds), without spending a simulation.
        for parent, a in path:
          parent.n[a] -= 1
        break
      if node.prior is not None:
        again.append((node, path))  # a terminal node: its value backs up again
      else:
        leaves.append(node)
        paths.append(path)
    if leaves:
      for node, value in zip(leaves, expand(leaves)):
        node.value = float(value)
    for node, path in list(zip(leaves, paths)) + again:
      for parent, a in path:
        parent.w[a] = parent.w.get(a, 0.0) + node.value
    done += len(leaves) + len(again)
  return root


def most_visited(root: Node) -> int:
  return max(root.prior, key=lambda a: (root.n.get(a, 0), root.prior[a], -a))


@dataclasses.dataclass
class Result:
  tokens: list[int]  # the response up to and including its first stop token
  order: tuple[int, ...]  # slots in commit order
  passes: int  # fill passes + search rounds (one batched forward each)
  search_rows: int  # simulations run (rows of the search's forwards)
  seconds: float


class Planner:
  """MCTS-planned ordered fill of one model (compiled forwards shared by every prompt)."""

  def __init__(self, model, *, gen_length: int, slot_size: int, budget: int, c: float,
               batch: int, ignore_eos: bool = False):
    self.fill = ordered_fill.OrderedFill(model, gen_length=gen_length, slot_size=slot_size,
                                         ignore_eos=ignore_eos, what="the MCTS planner")
    self.g, self.k, self.n_slots = gen_length, slot_size, self.fill.n_slots
    self.budget, self.c, self.batch = budget, c, batch
    self.mask = self.fill.mask_id
    self.stops = self.fill.stops

  def _layouts(self, prompt, committed, nodes):
    """One row per node: [prompt | committed slots, then the node's moves, causal in
    commit order | each undecided slot's masks, slot-local]."""
    p, k = len(prompt), self.k
    width = ordered_fill.bucket(p) + 2 * self.g  # one compiled forward per prompt bucket
    rows = max(self.batch, len(nodes))
    ids = np.zeros((rows, width), np.int32)
    pos = np.zeros((rows, width), np.int32)
    att = np.broadcast_to(np.eye(width, dtype=bool), (rows, width, width)).copy()
    where = []
    for r, node in enumerate(nodes):
      toks, places = list(prompt), list(range(p))
      for s, slot_toks in list(committed) + [(a, node.drafts[a]) for a in node.moves]:
        toks += list(slot_toks)
        places += [p + s * k + j for j in range(len(slot_toks))]
      c = len(toks)
      att[r, :c, :c] |= np.tril(np.ones((c, c), bool))
      done = {s for s, _ in committed} | set(node.moves)
      at = {}
      for s in range(self.n_slots):
        if s in done:
          continue
        at[s] = len(toks)
        toks += [self.mask] * k
        places += [p + s * k + j for j in range(k)]
        a = at[s]
        att[r, a:a + k, :c] = True
        att[r, a:a + k, a:a + k] |= np.tril(np.ones((k, k), bool))
      ids[r, :len(toks)], pos[r, :len(toks)] = toks, places
      where.append(at)
    return ids, pos, att, where, width, rows

  def _expander(self, prompt, committed, stats):
    def expand(nodes):
      ids, pos, att, where, width, rows = self._layouts(prompt, committed, nodes)
      logits = self.fill.forward(ids, pos, att)
      stats["rounds"] += 1
      stats["rows"] += len(nodes)
      values = []
      for r, node in enumerate(nodes):
        prior, best = {}, 0.0
        for s, a in where[r].items():
          probs = [self.fill.probs(logits[r, a + j]) for j in range(self.k)]
          draft = tuple(int(pr.argmax()) for pr in probs)
          # A draft ends at its first stop token (the fill would stop there).
          cut = next((j + 1 for j, t in enumerate(draft) if t in self.stops), self.k)
          node.child_draft[s] = draft[:cut]
          node.child_p[s] = float(probs[0].max())
          prior[s] = node.child_p[s]
          best = max(best, node.child_p[s])
        total = sum(prior.values())
        node.prior = {s: v / total for s, v in prior.items()} if total > 0 else prior
        path = list(node.move_p) + ([best] if prior else [])
        values.append(float(np.mean(path)) if path else 0.0)
      return values
    return expand

  def decode(self, prompt: Sequence[int]) -> Result:
    if not prompt:
      raise ValueError("the MCTS planner: the prompt is empty")
    t0 = time.perf_counter()
    committed: list[tuple[int, tuple[int, ...]]] = []
    passes, stats = 0, {"rounds": 0, "rows": 0}
    while len(committed) < self.n_slots:
      left = self.n_slots - len(committed)
      if left == 1:
        slot = next(s for s in range(self.n_slots) if s not in {t for t, _ in committed})
      else:
        root = Node(moves=(), drafts={}, move_p=())
        search(root, self._expander(prompt, committed, stats), budget=self.budget, c=self.c,
               batch=self.batch)
        slot = most_visited(root)
      toks, used = self.fill.fill(prompt, committed, slot)
      passes += used
      committed.append((slot, toks))
      if self.fill.response(committed)[1]:
        break
    return Result(tokens=self.fill.response(committed)[0], order=tuple(s for s, _ in committed),
                  passes=passes + stats["rounds"], search_rows=stats["rows"],
                  seconds=time.perf_counter() - t0)


class Decoder:
  """`decode.planner = "mcts"` behind the interface `evaluate` drives (`engine(rows)` with
  `warm_up` and `run`, and `generate`): each prompt decoded by `Planner`, one at a time."""

  def __init__(self, model, decode_config):
    dc = decode_config
    if dc.planner != "mcts":
      raise ValueError(f"mcts.Decoder runs decode.planner='mcts', got {dc.planner!r}")
    self.planner = Planner(model, gen_length=dc.gen_length, slot_size=dc.slot_size,
                           budget=dc.mcts_budget, c=dc.mcts_c, batch=dc.mcts_batch,
                           ignore_eos=dc.ignore_eos)

  def engine(self, rows: int, **_):
    del rows
    return self

  def warm_up(self, lengths: Sequence[int] = ()) -> None:
    del lengths

  def _result(self, i: int, res: Result):
    n = len(res.tokens)
    counters = {"nfe_b": float(res.passes), "tokens_b": float(n),
                "tpf_paper_b": n / max(res.passes, 1), "steps_b": float(len(res.order)),
                "search_rows_b": float(res.search_rows)}
    return engine.PromptResult(index=i, tokens=list(res.tokens), counters=counters,
                               commit_steps=[], seconds=res.seconds)

  def run(self, prompts: Sequence[Sequence[int]], rng=None, *, progress=None):
    del rng  # greedy: the search draws nothing
    t0 = time.perf_counter()
    results, passes = [], 0
    for i, p in enumerate(prompts):
      res = self.planner.decode(list(p))
      passes += res.passes
      results.append(self._result(i, res))
      if progress is not None:
        progress.update(1)
    return engine.EngineRun(results=results, passes=passes,
                            seconds=time.perf_counter() - t0, admissions=len(prompts))

  def generate(self, prompt_ids_bp, prompt_len_b, rng=None):
    del rng
    lengths = []
    for ids, n in zip(np.asarray(prompt_ids_bp), np.asarray(prompt_len_b)):
      lengths.append(len(self.planner.decode([int(x) for x in ids[:int(n)]]).tokens))
    return types.SimpleNamespace(length_b=jnp.asarray(lengths))  # what evaluate's timing reads
