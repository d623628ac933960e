"""The miniature reproduction with 4x the training budget (~35 min on 2 CPU cores).

Same suite, model, decoders and evaluation as repro_tiny.py; only the
number of steps changes: 8000 base steps (8.2M tokens) and 4000 fine-tune
steps (4.1M tokens) per model. It asks whether the gap to the paper's claim
in the 15-minute run is a matter of training budget.

  bash launch/reproduce.sh --config=configs/repro_long.py   # workdir runs/repro_long
"""

from configs import repro_tiny


def get_config():
  c = repro_tiny.get_config()
  c.base.num_train_steps = 8000  # 8000 x 16 x 64 = 8.2M tokens
  c.train.num_train_steps = 4000  # per model: 4000 x 16 x 64 = 4.1M tokens
  c.train.checkpoint.every_steps = 500  # resume points
  return c
