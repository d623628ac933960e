"""Tiny BD3-LM baseline (block diffusion): each response block denoised given the clean
blocks before it (the two-half layout of ALGORITHM.md "Baselines", einsum attention)."""

from configs import common


def get_config():
  c = common.base_config()
  c.objective = "bd3lm"  # CE / t on masked tokens of each noised block, per-block t
  c.bd3lm_block_size = 8  # the paper's Table 2 block size; responses EOS-padded to whole blocks
  return c
