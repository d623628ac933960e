"""Rollouts: the policy's samples of a step's prompts, with what scoring them needs.

The engine decodes every rollout (continuous batching, the compiled ReFusion program)
at the decode config's temperature, the infill's drafts sampled too, and records for
each committed token the pass that decided it and its probability there (`decode.record`:
each result's `trace`, whose `p` are the per-token probabilities the sampler used), as
tunix's rollout returns completions with their per-token log-probabilities.
`Rollout.update_params` gives the sampler the trained parameters before each step.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np
from flax import nnx

from refusion_jax.decode import engine


@dataclasses.dataclass
class Rollouts:
  """One step's rollouts, in prompt order, `group_size` per prompt."""
  rows: list[dict]  # each rollout's training row (what its reward reads)
  prompts: list[list[int]]  # each rollout's prompt ids
  results: list  # the engine's results: tokens, counters and the decode's trace
  texts: list[str]  # each completion's text, up to its stop token
  seconds: float  # the decode's wall time


def draw_prompts(seed: int, step: int, num_rows: int, count: int) -> np.ndarray:
  """The indices of step `step`'s prompts, drawn from (seed, step): a step done again
  after a restart draws the same prompts."""
  return np.random.default_rng([seed, step]).choice(num_rows, size=count,
                                                    replace=num_rows < count)


def prompt_width(prompts, bucket: int) -> int:
  """The engine's prompt width: the longest prompt rounded up to a multiple of `bucket`."""
  return int(bucket) * max(1, -(-max(len(p) for p in prompts) // int(bucket)))


class Rollout:
  """The policy's sampler: the engine over `model` (whose weights `update_params` sets)
  with `rows` rows and prompts padded to `width`."""

  def __init__(self, model, decode_config, tokenizer, *, rows: int, width: int):
    self.model, self.decode_config, self.tokenizer = model, decode_config, tokenizer
    self.rows, self.width = int(rows), int(width)

  def update_params(self, params: dict) -> None:
    """The trained parts of `params`: the model's weights, the selection policy's weights
    (traced knobs of the decode: no recompile)."""
    if "model" in params:
      nnx.update(self.model, params["model"])
    if "selector" in params:
      weights = tuple(float(x) for x in np.asarray(params["selector"]))
      self.decode_config = self.decode_config.replace(plan_weights=weights)

  def generate(self, rows: list[dict], prompts: list[list[int]], rng, progress=None) -> Rollouts:
    """Decodes every prompt once with key `rng`; `progress.update(k)` is called as rollouts
    finish (it may raise to abandon the decode)."""
    start = time.perf_counter()
    decoder = engine.Decoder(self.model, self.decode_config, method="refusion")
    out = decoder.engine(self.rows, width=self.width).run(prompts, rng=rng, progress=progress)
    texts = [self.tokenizer.decode(r.tokens, skip_special_tokens=True) for r in out.results]
    return Rollouts(rows=rows, prompts=prompts, results=out.results, texts=texts,
                    seconds=time.perf_counter() - start)
