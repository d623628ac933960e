"""MATH as the paper ran it (Table 1; decoding settings of its Table 5).

  python -m refusion_jax.evaluate --config=configs/eval/math.py \\
      --config.model_dir=DIR --config.output_dir=OUT [--config.decode.method=ar]
"""

from configs.eval import common


def get_config():
  return common.benchmark_config("math")
