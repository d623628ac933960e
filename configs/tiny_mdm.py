"""Tiny MDM baseline (LLaDA-style): bidirectional attention, token-level masking."""

from configs import common


def get_config():
  c = common.base_config()
  c.objective = "mdm"  # masked-diffusion loss, CE / t on masked response tokens
  c.model.attention = "bidirectional"  # an MDM sees the whole sequence
  return c
