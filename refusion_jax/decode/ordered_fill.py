"""The ordered fill: ReFusion's slots decoded one at a time, in a chosen order.

ALGORITHM.md "Past the paper" ("Planning search and learning"). A slot committed
after others is decoded by the left-to-right ablation's fill: its first token is the
argmax of a plan pass over its own masks, the rest one causal pass a token, until the
slot is full or ends in a stop token (EOS or one of `ModelConfig.stop_token_ids`; none
under `ignore_eos`, as the engine's decoders stop). The mask token is never picked.

Every pass runs the model on [prompt, the committed slots in commit order, the pass's
tokens] at their true positions under a causal mask in that order: a committed
token's K/V in the real decoder were computed from exactly the entries before it in
commit order, so this is the KV cache's attention without a cache. Batch 1, dynamic
lengths padded to a static width, plain Python over compiled forwards (one program
per width and row count, shared by every prompt of that width). The order oracle
(`order_oracle`: every order) and the MCTS planner (`mcts`: a searched order) both
decode with it; the planner's search runs its own layouts through the same forwards.
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

WIDTH_STEP = 16  # prompt lengths are rounded up to this, so prompts share programs


def bucket(n: int, step: int = WIDTH_STEP) -> int:
  return -(-n // step) * step


def stop_ids(model_config, ignore_eos: bool = False) -> frozenset[int]:
  """The ids a slot's fill ends at: EOS and the model's other stop ids, none under
  `ignore_eos` (`DecodeConfig.ignore_eos`)."""
  if ignore_eos:
    return frozenset()
  eos = () if model_config.eos_token_id is None else (model_config.eos_token_id,)
  return frozenset(int(t) for t in (*eos, *model_config.stop_token_ids))


class OrderedFill:
  """The ordered fill of one model with a response of `gen_length` tokens in slots of
  `slot_size` (module docstring)."""

  def __init__(self, model, *, gen_length: int, slot_size: int, ignore_eos: bool = False,
               what: str = "the ordered fill"):
    cfg = model.config
    if cfg.mask_token_id is None:
      raise ValueError(f"{what} needs the model's mask_token_id")
    if gen_length % slot_size:
      raise ValueError(f"gen_length={gen_length} must be a multiple of slot_size={slot_size}")
    self.model = model
    self.gen_length, self.slot_size = gen_length, slot_size
    self.n_slots = gen_length // slot_size
    self.mask_id = cfg.mask_token_id
    self.stops = stop_ids(cfg, ignore_eos)
    self._graphdef, self._state = nnx.split(model)
    self._programs: dict[tuple[int, int], Callable] = {}

  def forward(self, ids_rw, positions_rw, attention_rww) -> np.ndarray:
    """Logits `[rows, width, vocab]` (float32) of rows laid out by the caller (one
    compiled program per `(width, rows)`)."""
    shape = tuple(np.shape(ids_rw))
    if shape not in self._programs:
      graphdef = self._graphdef

      @jax.jit
      def call(state, ids, positions, attention):
        return nnx.merge(graphdef, state)(ids, positions, attention_mask_btt=attention)
      self._programs[shape] = call
    out = self._programs[shape](self._state, jnp.asarray(ids_rw), jnp.asarray(positions_rw),
                                jnp.asarray(attention_rww))
    return np.asarray(out, np.float32)

  def causal(self, tokens: Sequence[int], positions: Sequence[int], width: int) -> np.ndarray:
    """Logits `[len(tokens), vocab]` of `tokens` at `positions`, causal in their order,
    padded to `width` entries."""
    n = len(tokens)
    if n > width:
      raise ValueError(f"the ordered fill: {n} entries exceed the width {width}")
    ids = np.zeros((1, width), np.int32)
    pos = np.zeros((1, width), np.int32)
    ids[0, :n], pos[0, :n] = tokens, positions
    att = np.eye(width, dtype=bool)[None].copy()  # a padding entry sees itself only
    att[0, :n, :n] |= np.tril(np.ones((n, n), bool))
    return self.forward(ids, pos, att)[0, :n]

  def probs(self, logits_v) -> np.ndarray:
    """The next-token distribution (float64 softmax) with the mask token left out."""
    x = np.array(logits_v, np.float64)
    x[self.mask_id] = -np.inf
    x = np.exp(x - x.max())
    return x / x.sum()

  def pick(self, logits_v) -> int:
    return int(self.probs(logits_v).argmax())

  def slot_positions(self, prompt_len: int, slot: int) -> list[int]:
    k = self.slot_size
    return [prompt_len + slot * k + j for j in range(k)]

  def context(self, prompt: Sequence[int], committed) -> tuple[list[int], list[int]]:
    """`(tokens, positions)` of the prompt and the `committed` slots (`[(slot, tokens)]`
    in commit order)."""
    p = len(prompt)
    tokens, positions = list(prompt), list(range(p))
    for slot, slot_tokens in committed:
      tokens += list(slot_tokens)
      positions += self.slot_positions(p, slot)[:len(slot_tokens)]
    return tokens, positions

  def fill(self, prompt: Sequence[int], committed, slot: int) -> tuple[tuple[int, ...], int]:
    """Slot `slot`'s tokens after the `committed` slots, and the passes they took."""
    k = self.slot_size
    width = bucket(len(prompt)) + self.gen_length + k
    tokens, positions = self.context(prompt, committed)
    slot_pos = self.slot_positions(len(prompt), slot)
    plan = self.causal(tokens + [self.mask_id] * k, positions + slot_pos, width)
    got, passes = [self.pick(plan[len(tokens)])], 1
    while len(got) < k and got[-1] not in self.stops:
      out = self.causal(tokens + got, positions + slot_pos[:len(got)], width)
      got.append(self.pick(out[-1]))
      passes += 1
    return tuple(got), passes

  def response(self, committed) -> tuple[list[int], bool]:
    """The response in position order up to and including its first stop token, and
    whether it is final: every position up to that stop token (or every position) is
    committed. A slot after the stop token is left out."""
    k = self.slot_size
    canvas = {slot * k + j: t for slot, toks in committed for j, t in enumerate(toks)}
    out = []
    for i in range(self.gen_length):
      if i not in canvas:
        return out, False
      out.append(canvas[i])
      if canvas[i] in self.stops:
        return out, True
    return out, True
