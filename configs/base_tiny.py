"""The shipped miniature base: a causal ARM pretrained once on the suite's distribution.

  bash launch/train_base.sh      # data, training (~36 min on 2 quiet CPU cores), export, checksum

It plays Qwen3-8B's part in the miniature: ARM, MDM and ReFusion are all
fine-tuned from it (configs/repro_tiny.py). The corpus is a 70,000-example
draw from the task generators that shares no query with the validation and
test splits (scripts/make_tiny_data.py --base_out); 10,000 steps of 32 rows x
64 tokens = 20.5M tokens, ~4.5 epochs. The weights are exported in HF layout to
refusion_jax/assets/base_tiny (float32, ~3.5 MB) with a SHA-256 checksum.
"""

import os

from configs import common

BASE_CORPUS = os.path.join("runs", "base_tiny", "base_train.jsonl")  # made by launch/train_base.sh


def get_config():
  c = common.base_config()
  c.objective = "arm"  # next-token loss on the response, as a pretrained AR model
  c.model.attention = "causal"
  c.model.num_layers = 4  # the tiny preset: d=128, 4 query / 2 KV heads, vocab 512
  c.data.train_files = (BASE_CORPUS,)
  c.data.eval_files = (common.TINY_VALID,)  # validation split (never the test split)
  c.data.seq_len = 64  # longest example is 58 tokens
  c.global_batch_size = 32
  c.num_train_steps = 10000
  c.optimizer.learning_rate = 3e-3
  c.optimizer.warmup_steps = 300
  c.optimizer.end_lr_ratio = 0.02
  c.eval_every_steps = 2000
  c.eval_batches = 0  # the whole validation split
  c.checkpoint.every_steps = 1000
  c.log_every_steps = 50
  return c
