"""Per-row decode counters shared by every decoder (so all compare in one harness).

Every forward pass is counted (ALGORITHM.md "Honest speed counters"): a pass
counts for a row when that row took part in it (rows that are done are frozen
and stop counting).
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np


@flax.struct.dataclass
class DecodeCounters:
  plan_b: jax.Array  # ReFusion plan (diffusion) passes; MDM denoising passes
  global_verify_b: jax.Array  # ReFusion global verification passes
  draft_b: jax.Array  # ReFusion infill draft passes
  verify_b: jax.Array  # ReFusion infill verify passes
  prefill_b: jax.Array  # prompt passes (not part of NFE, reported apart)
  tokens_b: jax.Array  # generated tokens committed, up to and including EOS
  steps_b: jax.Array  # outer loop iterations
  # ReFusion with recompute_kv: causal passes that recompute the KV of slots
  # committed from a parallel infill. Last, with a zero default, so that code
  # building counters field by field for another decoder needs no change.
  recompute_b: jax.Array = 0
  # The paper's TPF (ALGORITHM.md "Honest speed counters"): the sum over steps of
  # (tokens committed in the step) / (forward passes in the step); `tpf_paper_b`
  # divides it by the number of steps.
  step_tpf_sum_b: jax.Array = 0.0
  # Single-token autoregressive passes: every pass of the AR decoder (its first
  # token is read from the prefill and counts one), and the further tokens of a
  # slot in ReFusion's left-to-right ablation.
  ar_b: jax.Array = 0
  # ReFusion's verified infill (decode.verify): tokens a causal argmax replaced (a draft
  # that failed, or a slot's first token that its left neighbour's prediction corrected),
  # and infill verify passes a row ran only to feed corrected tokens (their K/V; counted
  # in verify_b too). MDM with Fast-dLLM's cache: refresh_b counts its full passes
  # (counted in plan_b too).
  corrected_b: jax.Array = 0
  refresh_b: jax.Array = 0
  # Sub-slot re-masking (decode.remask): passes run only to re-check a slot (a re-check
  # that rides on a plan pass costs none), slots masked again and their tokens.
  recheck_b: jax.Array = 0
  remasked_b: jax.Array = 0
  remasked_tokens_b: jax.Array = 0
  # Lossless decoding (decode.verify='lossless'): its fused passes (check, make final and
  # draft in one forward; the first token, read from the prefill, counts one).
  fused_b: jax.Array = 0

  @classmethod
  def zeros(cls, batch: int) -> "DecodeCounters":
    z = jnp.zeros((batch,), jnp.int32)
    return cls(plan_b=z, global_verify_b=z, draft_b=z, verify_b=z, prefill_b=z, tokens_b=z,
               steps_b=z, recompute_b=z, step_tpf_sum_b=jnp.zeros((batch,), jnp.float32),
               ar_b=z, corrected_b=z, refresh_b=z, recheck_b=z, remasked_b=z,
               remasked_tokens_b=z, fused_b=z)

  def _xp(self):
    """numpy for counters read back to the host (no device op per field), else jnp."""
    return np if isinstance(self.plan_b, np.ndarray) else jnp

  def tpf_paper_b(self) -> jax.Array:
    """The paper's TPF per row: the mean over steps of tokens / passes in the step."""
    xp = self._xp()
    # float32 / float32, as JAX promotes int32 with float32 (numpy would go to float64).
    return self.step_tpf_sum_b / xp.maximum(self.steps_b, 1).astype(xp.float32)

  def add_step_tpf(self, active_b: jax.Array, tokens_b: jax.Array,
                   passes_b: jax.Array) -> "DecodeCounters":
    """Adds one step's tokens / passes to the rows where `active_b` is set."""
    ratio_b = tokens_b.astype(jnp.float32) / jnp.maximum(passes_b, 1).astype(jnp.float32)
    return self.replace(step_tpf_sum_b=self.step_tpf_sum_b + jnp.where(active_b, ratio_b, 0.0))

  def nfe_b(self) -> jax.Array:
    """Forward passes over generated content (plan + global verification + draft
    + infill verify + KV recomputation + single-token AR passes + re-checks + lossless
    fused passes)."""
    return (self.plan_b + self.global_verify_b + self.draft_b + self.verify_b
            + self.recompute_b + self.ar_b + self.recheck_b + self.fused_b)

  def add(self, active_b: jax.Array, **increments) -> "DecodeCounters":
    """Adds each increment (scalar or [B]) to the rows where `active_b` is set."""
    active = active_b.astype(jnp.int32)
    changes = {name: getattr(self, name) + active * jnp.asarray(inc, jnp.int32)
               for name, inc in increments.items()}
    return self.replace(**changes)

  def as_dict(self) -> dict:
    d = {k: getattr(self, k) for k in ("plan_b", "global_verify_b", "draft_b", "verify_b",
                                       "prefill_b", "tokens_b", "steps_b")}
    # [B] even where the field kept its scalar default.
    xp = self._xp()
    d["recompute_b"] = xp.zeros_like(self.plan_b) + self.recompute_b
    for name in ("ar_b", "corrected_b", "refresh_b", "recheck_b", "remasked_b",
                 "remasked_tokens_b", "fused_b"):
      d[name] = xp.zeros_like(self.plan_b) + getattr(self, name)
    d["nfe_b"] = self.nfe_b()
    d["tpf_paper_b"] = self.tpf_paper_b()
    return d


@flax.struct.dataclass
class DecodeOutput:
  """What every decoder returns (one row per prompt)."""

  tokens_bg: jax.Array  # generated tokens in position order; pad id after the end
  length_b: jax.Array  # generated tokens per row, up to and including EOS
  counters: DecodeCounters
  commit_step_bg: jax.Array  # loop step at which each position was committed (-1: never)
  # ReFusion with decode.record: each committed token's deciding pass (rl.replay)
  trace: dict | None = None
