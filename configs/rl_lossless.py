"""GRPO on the lossless sampler (python -m refusion_jax.rl).

  python -m refusion_jax.rl --config=configs/rl_lossless.py \\
      --config.model_dir=runs/repro_tiny/models/refusion_bl/final_model --config.output_dir=OUT

configs/rl_tiny.py with the rollouts decoded losslessly (`decode.verify='lossless'`):
each rollout is the model's AR sample at the temperature, decoded in ReFusion's fused
passes (window 8, slot 4, every slot drafted), and its log-probability is the answer's AR
likelihood (one causal forward). What RL raises is the causal head; the decode's speed
is the drafter's and changes no answer.
"""

from configs import rl_tiny


def get_config():
  c = rl_tiny.get_config()
  c.decode.verify = "lossless"
  c.decode.slot_size = 4
  c.decode.block_size = 8
  c.decode.slot_threshold = 0.0
  return c
