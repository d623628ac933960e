"""The bundled miniature suite (refusion_jax/tasks), scored by exact match.

  python -m refusion_jax.evaluate --config=configs/eval/synthetic.py \\
      --config.model_dir=W/models/refusion/final_model --config.output_dir=OUT

Accuracy through the continuous-batching engine, speed at batch 1 (the
`refusion_jax.evaluate` module docstring has the details).
"""

import ml_collections

from configs import common as train_common
from configs.eval import common


def get_config():
  c = ml_collections.ConfigDict()
  c.benchmark = "synthetic"  # the bundled suite (not an lm-eval task)
  c.model_dir = ""  # required: refusion_jax or HF model folder, or a shipped model (refusion_tiny)
  c.adapter_dir = ""  # a PEFT LoRA folder (a D2F adapter) merged into model_dir's weights
  c.tokenizer_dir = ""  # "" = model_dir's tokenizer.json, else the bundled tiny one when it fits
  c.data = train_common.TINY_TEST  # JSONL of {"query": ...} held-out problems
  c.output_dir = ""  # "" = print only; else results.json is written here
  c.per_task = 0  # problems per task (0 = all)
  c.batch_size = 16  # engine rows for accuracy
  c.speed_per_task = 20  # problems per task timed at batch 1 (0 = no timing)
  c.speed_repeats = 5  # decodes per timed problem, the fastest counted
  c.seed = 0  # rng for temperature > 0
  # Compiled programs kept here and loaded by the next run of the same shapes: "auto"
  # ($JAX_COMPILATION_CACHE_DIR, else ~/.cache/refusion_jax/jax), a folder, or "" (none)
  c.compile_cache_dir = "auto"
  c.decode = common.decode_fields(gen_length=128, slot_size=8, block_size=32)
  return c
