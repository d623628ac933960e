"""The MCTS slot planner (refusion_jax.decode.mcts): the search on a hand-made tree,
its budget-1 order against a plain re-computation, its answers against the order
oracle's fill of the same order, and its place in DecodeConfig and evaluate."""

import os

import numpy as np
import pytest

from configs.common import ASSETS_DIR, TINY_TEST
from refusion_jax import evaluate, loading
from refusion_jax.decode import engine, mcts, order_oracle, ordered_fill
from refusion_jax.decode.settings import DecodeConfig
from refusion_jax.tokenizer import Tokenizer
from tests.test_order_oracle import EOS, MASK, PROMPTS, _model


def _bandit(values, priors):
  """A two-level tree: moves 0 and 1 at the root, then the other one; a path's value is
  values[first move]."""
  calls = []

  def expand(nodes):
    out = []
    for node in nodes:
      calls.append(node.moves)
      left = [a for a in (0, 1) if a not in node.moves]
      node.prior = {a: priors[a] for a in left}
      node.child_draft = {a: (a,) for a in left}
      node.child_p = {a: priors[a] for a in left}
      out.append(values[node.moves[0]] if node.moves else 0.5)
    return out
  return expand, calls


@pytest.mark.parametrize("batch", [1, 4])
def test_the_search_finds_the_move_the_prior_hides(batch):
  expand, calls = _bandit(values={0: 0.1, 1: 0.9}, priors={0: 0.95, 1: 0.05})
  root = mcts.search(mcts.Node((), {}, ()), expand, budget=200, c=1.0, batch=batch)
  assert mcts.most_visited(root) == 1 and root.n[1] > root.n[0]
  # Every simulation is counted once, the first expanding the root (virtual losses are
  # visits the backups complete; a round ends at a leaf it holds already).
  assert sum(root.n.values()) == 200 - 1
  assert calls[0] == ()  # the root first
  # Budget 1 expands only the root: the prior's choice.
  expand, _ = _bandit(values={0: 0.1, 1: 0.9}, priors={0: 0.95, 1: 0.05})
  assert mcts.most_visited(mcts.search(mcts.Node((), {}, ()), expand, budget=1, c=1.0,
                                       batch=1)) == 0


def _greedy_order(model, prompt, gen_length, k):
  """Plain re-computation of budget 1: each step, every undecided slot planned alone over
  its own masks after the committed slots (float64 softmax); the most confident one is
  filled (its first token from that pass, the rest one causal pass a token, to a stop);
  until every position up to a committed EOS, or every slot, is committed."""
  fill = ordered_fill.OrderedFill(model, gen_length=gen_length, slot_size=k)
  p, n = len(prompt), gen_length // k

  def run(tokens, positions):
    return fill.causal(tokens, positions, p + 2 * gen_length)

  def dist(logits):
    x = np.array(logits, np.float64)
    x[MASK] = -np.inf
    q = np.exp(x - x.max())
    return q / q.sum()

  ctx, places, order, canvas = list(prompt), list(range(p)), [], {}
  while len(order) < n:
    best, best_p = None, -1.0
    for s in range(n):
      if s in order:
        continue
      q = dist(run(ctx + [MASK] * k, places + [p + s * k + j for j in range(k)])[len(ctx)])
      if q.max() > best_p:
        best, best_p = s, float(q.max())
    slot_pos = [p + best * k + j for j in range(k)]
    toks = [int(dist(run(ctx + [MASK] * k, places + slot_pos)[len(ctx)]).argmax())]
    while len(toks) < k and toks[-1] != EOS:
      toks.append(int(dist(run(ctx + toks, places + slot_pos[:len(toks)])[-1]).argmax()))
    ctx, places = ctx + toks, places + slot_pos[:len(toks)]
    order.append(best)
    canvas.update({best * k + j: t for j, t in enumerate(toks)})
    end = next((i for i in range(gen_length) if i not in canvas or canvas[i] == EOS), None)
    if end is not None and end in canvas:  # an EOS with every position before it committed
      break
  return tuple(order)


def test_budget_one_commits_the_most_confident_slot_and_fills_as_the_oracle():
  model = _model()
  planner = mcts.Planner(model, gen_length=12, slot_size=4, budget=1, c=1.0, batch=2)
  for prompt in PROMPTS:
    res = planner.decode(prompt)
    assert res.order == _greedy_order(model, prompt, 12, 4)


@pytest.mark.parametrize("budget, c", [(6, 1.0), (20, 0.5)])
def test_any_budget_answers_as_the_oracle_fills_its_order(budget, c):
  model = _model()
  planner = mcts.Planner(model, gen_length=12, slot_size=4, budget=budget, c=c, batch=4)
  for prompt in PROMPTS:
    res = planner.decode(prompt)
    order = res.order + tuple(s for s in range(3) if s not in res.order)
    want = order_oracle.all_orders(model, prompt, gen_length=12, slot_size=4, orders=[order])
    assert res.tokens == list(want[0].tokens)
    assert res.search_rows >= 1 and res.passes >= len(res.tokens) // 4


def test_decode_ignore_eos_leaves_every_slot_full():
  model = _model()
  dc = DecodeConfig(gen_length=12, slot_size=4, block_size=12, planner="mcts", mcts_budget=4)
  ended = [len(mcts.Decoder(model, dc).planner.decode(p).tokens) < 12 for p in PROMPTS]
  assert any(ended)  # some answers end at EOS
  ignoring = mcts.Decoder(model, dc.replace(ignore_eos=True))
  assert all(len(ignoring.planner.decode(p).tokens) == 12 for p in PROMPTS)


def test_the_planner_in_decode_config_and_evaluate():
  with pytest.raises(ValueError, match="planner must be one of"):
    DecodeConfig(planner="beam")
  with pytest.raises(ValueError, match="planner='mcts' searches ReFusion's slot order"):
    DecodeConfig(planner="mcts", left_to_right=True)
  with pytest.raises(ValueError, match="mcts_c .PUCT exploration. must be >= 0"):
    DecodeConfig(planner="mcts", mcts_c=-1.0)
  model = _model()
  dc = DecodeConfig(gen_length=12, slot_size=4, block_size=12, planner="mcts", mcts_budget=4)
  with pytest.raises(ValueError, match="host-driven search"):
    engine.Decoder(model, dc, method="refusion")
  # Off (the default planner), the compiled decoder's tokens are today's.
  assert DecodeConfig().planner == "threshold"


def test_evaluate_runs_the_mcts_planner():
  _, model = loading.load_model(os.path.join(ASSETS_DIR, "refusion_tiny"))
  tok = Tokenizer.tiny()
  problems = evaluate.read_problems(TINY_TEST, tok, per_task=1, task_names=["copy", "sort"])
  dc = DecodeConfig(gen_length=16, slot_size=4, block_size=16, planner="mcts", mcts_budget=4,
                    mcts_batch=4)
  r = evaluate.evaluate(model, tok, problems, dc, batch_size=2, speed_per_task=1,
                        speed_repeats=1, progress=False)
  assert set(r["per_task"]) == {"copy", "sort"}
  for m in r["per_task"].values():
    assert m["tokens_per_forward"] > 0 and m["tokens_per_sec"] > 0
  assert all(x["search_rows"] >= 1 for x in r["samples"])
