"""Draft adapters for the miniature's ReFusion, trained for acceptance (python -m refusion_jax.drafter).

  python -m refusion_jax.drafter --config=configs/drafter_tiny.py \\
      --config.model_dir=runs/repro_tiny/models/refusion_bl/final_model --config.output_dir=OUT

The model's greedy answers to the training split's first prompts, then the drafts' loss
on them (masks after a random cut, as a lossless pass feeds them) with only the draft
adapters trained (refusion_jax/drafter.py).
"""

import ml_collections

from configs.common import TINY_TRAIN


def get_config():
  c = ml_collections.ConfigDict()
  c.model_dir = ""  # required: the ReFusion model folder (refusion_jax or HF)
  c.tokenizer_dir = ""  # "" = model_dir's tokenizer (loading's rule)
  c.output_dir = ""  # required: answers.jsonl, checkpoints/, final_model/, metrics.jsonl
  # Compiled programs kept here and loaded by the next run of the same shapes: "auto"
  # ($JAX_COMPILATION_CACHE_DIR, else ~/.cache/refusion_jax/jax), a folder, or "" (none)
  c.compile_cache_dir = "auto"
  c.train_file = TINY_TRAIN  # JSONL of {"query"}: the prompts the model answers
  c.num_prompts = 4000  # its first prompts, answered greedily by the model itself
  c.gen_length = 24  # the longest answer decoded
  c.engine_rows = 32  # rows of the engine that decodes them
  c.draft_rank = 32  # rank of each layer's MLP adapter (ModelConfig.draft_rank)
  c.window = 8  # a training row's head and the masks after it: the lossless window
  c.steps = 1000
  c.batch_size = 32
  c.learning_rate = 1e-3
  c.b1, c.b2 = 0.9, 0.99
  c.grad_clip = 1.0
  c.save_every = 250
  c.seed = 0
  return c
