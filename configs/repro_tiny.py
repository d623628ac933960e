"""The paper's tables in miniature: `python -m refusion_jax.reproduce --config=configs/repro_tiny.py`.

Two stages, as in the paper (ReFusion is fine-tuned from a pretrained AR
model, Qwen3-8B): (1) one causal ARM "base" trains on the bundled tiny tasks
(`base.*`) and is exported in HF layout; (2) ARM, MDM and ReFusion are each
fine-tuned from that base for the same number of tokens (train.* is shared;
the objective and, for MDM, bidirectional attention are set per model by
reproduce.py), then every decoder is scored on the held-out split.
`--config.base.num_train_steps=0` trains the three from scratch instead.
Sized for ~15 minutes on 2 CPU cores, set-up included: 2000 base + 3 x 1000
fine-tune steps of a 4-layer d=128 model measured 484-521 s of training on a
quiet machine (~11k tokens/s), and evaluation ~50 s.
"""

import ml_collections

from configs import common

TASK_NAMES = ("copy", "reverse", "sort", "lookup", "arith", "fib", "template")


def decode_settings(slot_size, block_size, slot_threshold, token_threshold):
  """ReFusion's per-task knobs, the paper's Table 5 columns."""
  d = ml_collections.ConfigDict()
  d.slot_size = slot_size  # k: tokens per slot
  d.block_size = block_size  # b: tokens per serial block (multiple of k)
  d.slot_threshold = slot_threshold  # tau_s: plan picks slots above this first-token prob
  d.token_threshold = token_threshold  # tau_t: verification accepts tokens above this prob
  return d


def get_config():
  c = ml_collections.ConfigDict()

  # Training, shared by the three models (same data, size, steps, tokens).
  c.train = common.base_config()
  c.train.model.num_layers = 4  # d=128, 4 layers (the tiny preset)
  c.train.data.seq_len = 64  # longest bundled example is 58 tokens (prompt + answer + EOS)
  c.train.slot_sizes = (2, 4, 8)  # the paper's 4..32 for 512-token answers, scaled to <= 17
  c.train.global_batch_size = 16  # rows per step
  c.train.num_train_steps = 1000  # fine-tune: 1000 x 16 x 64 = 1.02M tokens per model
  c.train.optimizer.learning_rate = 3e-3  # fine-tune peak AdamW rate, half the base's
  c.train.eval_every_steps = 0  # no periodic eval loss: the table is the evaluation
  c.train.checkpoint.every_steps = 100  # resume points if the run is interrupted
  c.models = ("arm", "mdm", "refusion")  # objectives to train (reproduce.py knows each)

  # Stage 1 (the paper starts ReFusion from a pretrained AR model, Qwen3-8B): one causal
  # ARM "base" trains first and is exported in HF layout; stage 2 fine-tunes each of
  # c.models from it with config.train (MDM switching to bidirectional attention).
  c.base = ml_collections.ConfigDict()
  c.base.num_train_steps = 2000  # 2000 x 16 x 64 = 2.05M tokens (0 = no base: from scratch)
  c.base.learning_rate = 6e-3  # base peak AdamW rate

  # Held-out evaluation.
  c.eval = ml_collections.ConfigDict()
  c.eval.data = common.TINY_TEST  # JSONL of held-out {"query", "response"}
  c.eval.per_task = 0  # problems per task scored for accuracy (0 = all, 30 each)
  c.eval.speed_per_task = 20  # problems per task timed one at a time (batch 1)
  c.eval.speed_repeats = 5  # decodes per timed problem; the fastest counts (drops load pauses)
  c.eval.batch_size = 15  # rows per batched accuracy decode (30 problems per task: 2 batches)
  c.eval.prompt_bucket = 16  # prompts padded to one width, a multiple of this
  c.eval.rows = ("ARM-AR", "MDM-LLaDA", "MDM-FastdLLM", "ReFusion", "ReFusion-L2R",
                 "ReFusion-recompute-KV")  # decoders in the table (see reproduce.ROWS)

  # Decoding.
  c.decode = ml_collections.ConfigDict()
  c.decode.gen_length = 24  # every answer (at most 16 tokens + EOS) fits
  c.decode.mdm_block_size = 8  # MDM semi-autoregressive block (LLaDA-style)
  c.decode.mdm_tokens_per_step = 1  # LLaDA: tokens unmasked per denoising step
  c.decode.mdm_threshold = 0.9  # Fast-dLLM: unmask every token above this confidence
  c.decode.tasks = ml_collections.ConfigDict()  # ReFusion per task (paper's Table 5)
  for name in TASK_NAMES:
    c.decode.tasks[name] = decode_settings(slot_size=4, block_size=24, slot_threshold=0.9,
                                           token_threshold=0.4)

  # Optional sweep (the paper's Figure 4): ReFusion over slot size and thresholds.
  c.sweep = False  # also run the sweep and write sweep_*.png
  c.sweep_grid = ml_collections.ConfigDict()
  c.sweep_grid.slot_size = (2, 4, 8)  # varied with the thresholds at the task's setting
  c.sweep_grid.slot_threshold = (0.5, 0.7, 0.9)  # varied alone
  c.sweep_grid.token_threshold = (0.1, 0.4, 0.7, 0.9)  # varied alone
  c.sweep_grid.per_task = 10  # problems per task (accuracy and batch-1 speed)

  c.seed = 0  # decode rng (only used at temperature > 0)
  c.progress_bar = True  # tqdm bars for training, evaluation and the sweep
  return c
