"""D2F distillation of the miniature's MDM (python -m refusion_jax.distill).

  python -m refusion_jax.distill --config=configs/d2f_tiny.py \\
      --config.base_dir=runs/repro_tiny/models/mdm/final_model --config.output_dir=OUT

D2F's recipe (ALGORITHM.md "Table 1's baselines") at the miniature's scale: LoRA rank
and alpha as D2F's ratio (alpha / r = 1), attention projections only, blocks of the
miniature's MDM block (8 tokens; D2F's 16 at 8B), mask ratios rising block by block in
[0.2, 0.7], AdamW (0.9, 0.95), weight decay 0.05, clipping at 1.0 (D2F's); the learning
rate and steps are the miniature's (D2F: 1e-5 for 50000 steps on LLaDA-8B).
"""

import ml_collections

from configs.common import TINY_TRAIN


def get_config():
  c = ml_collections.ConfigDict()
  c.base_dir = ""  # required: the MDM model folder (refusion_jax or HF) to adapt
  c.tokenizer_dir = ""  # "" = base_dir's tokenizer.json, else the bundled tiny one
  c.output_dir = ""  # required: checkpoints/, adapter/ (the PEFT folder), metrics.jsonl
  # Compiled programs kept here and loaded by the next run of the same shapes (a resumed
  # run compiles nothing): "auto" ($JAX_COMPILATION_CACHE_DIR, else
  # ~/.cache/refusion_jax/jax), a folder, or "" (none)
  c.compile_cache_dir = "auto"
  c.train_files = (TINY_TRAIN,)  # JSONL of {"query", "response"}
  c.seq_len = 64  # tokens per row: prompt, answer, EOS padding to the end
  c.block_size = 8  # D2F's block (its inference block may differ)
  c.p_min = 0.2  # block 0's mask ratio ~ U(p_min, p_max); later blocks never lower
  c.p_max = 0.7
  c.lora_rank = 16
  c.lora_alpha = 16.0
  c.lora_dropout = 0.0  # D2F: 0.1
  c.steps = 600
  c.batch_size = 16
  c.learning_rate = 1e-3
  c.b1, c.b2 = 0.9, 0.95
  c.weight_decay = 0.05
  c.grad_clip = 1.0
  c.save_every = 200  # steps between checkpoints (the last step always saves)
  c.seed = 0
  return c
