"""The shipped ReFusion model: the miniature's ReFusion fine-tune, boundary label on.

  bash launch/train_refusion_tiny.sh   # fine-tune (~1.5 min on 2 CPU cores), export, checksum,
                                       # and its accuracy on the held-out split

The main job's `refusion_bl` model (configs/repro_tiny.py, repro.settings.MODELS):
ReFusion's objective with `boundary_label` (ALGORITHM.md "Past the paper"),
fine-tuned from the shipped base (refusion_jax/assets/base_tiny) for one epoch
of the 20,000 training samples in best-fit packed rows of 64 tokens. Exported
in HF layout to refusion_jax/assets/refusion_tiny (float32, ~3.5 MB) with a
SHA-256 checksum; `--config.model_dir=refusion_tiny` names it (sample, serve,
evaluate).
"""

from configs import common, repro_tiny
from refusion_jax import tokenizer


def get_config():
  c = repro_tiny.get_config().train  # the miniature's shared training settings
  c.objective = "refusion"
  c.boundary_label = True  # the last token of each clean slot learns the token after it
  c.model.attention = "causal"
  c.init_from_hf = common.BASE_TINY_DIR  # the shipped base, as every model of the miniature
  c.tokenizer_dir = tokenizer.TINY_TOKENIZER_DIR  # the base's HF folder holds no tokenizer
  c.progress_bar = True
  c.log_every_steps = 50  # the shipped training log (metrics.jsonl) every 50 steps
  return c
