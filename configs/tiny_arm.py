"""Tiny ARM baseline: the same backbone, data and budget, plain next-token loss."""

from configs import common


def get_config():
  c = common.base_config()
  c.objective = "arm"  # next-token cross-entropy on the response
  return c
