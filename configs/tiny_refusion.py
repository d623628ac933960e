"""Tiny ReFusion (4 layers, d=128) on the bundled tiny tasks; a few minutes on a CPU."""

from configs import common


def get_config():
  c = common.base_config()
  c.objective = "refusion"  # slot-permuted AR + masked-slot MDM (ALGORITHM.md)
  return c
