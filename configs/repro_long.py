"""The miniature reproduction with 4x the fine-tuning budget (~25 min on 2 CPU cores).

Same shipped base, suite, model, decoders, validation search and evaluation
as repro_tiny.py; only the fine-tune steps change: 4000 steps (4.1M tokens)
per model instead of 1000. It asks whether the gap to the paper's claim in
the 15-minute run is a matter of fine-tuning budget.

  bash launch/reproduce.sh --config=configs/repro_long.py   # workdir runs/repro_long
"""

from configs import repro_tiny


def get_config():
  c = repro_tiny.get_config()
  c.train.num_train_steps = 4000  # per model: 4000 x 16 x 64 = 4.1M tokens
  c.train.checkpoint.every_steps = 500  # resume points
  return c
