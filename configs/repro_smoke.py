"""A seconds-long reproduction (tests/test_reproduce.py): tiny model, few steps, few problems.

Checks the pipeline end to end, not the method: the numbers mean nothing.
"""

from configs import repro_tiny
from refusion_jax import tasks


def get_config():
  c = repro_tiny.get_config()
  c.train.model.num_layers = 2  # decoder layers
  c.train.model.hidden_size = 64  # model width
  c.train.model.num_heads = 2  # query heads
  c.train.model.num_kv_heads = 1  # key/value heads
  c.train.model.head_dim = 32  # per-head width
  c.train.model.mlp_dim = 128  # SwiGLU hidden width
  c.train.num_train_steps = 4  # optimizer steps per model
  c.base.pretrained = ""  # the shipped base has another shape: stage 1 trains one here
  c.base.num_train_steps = 4  # base ARM steps the three models start from
  c.select.per_task = 1  # validation problems per task per candidate setting
  c.train.global_batch_size = 8  # rows per step
  c.train.optimizer.warmup_steps = 1  # linear warmup steps
  c.train.checkpoint.every_steps = 2  # resume points
  c.train.checkpoint.async_save = False  # simpler to reason about in a test
  c.train.mesh.num_devices = 1  # one device: no sharding work in a smoke run
  c.eval.per_task = 2  # problems per task for accuracy
  c.eval.speed_per_task = 1  # problems per task timed at batch 1
  c.eval.speed_repeats = 2  # decodes per timed problem (the fastest counts)
  c.eval.batch_size = 1  # rows per accuracy batch (1: the timed program is reused)
  c.decode.gen_length = 16  # short answers only matter here
  for name in tasks.TASKS:
    c.decode.tasks[name].block_size = 16  # one block of gen_length
  c.sweep_grid.slot_size = (4,)  # smallest grid: thresholds are traced, no new compile
  c.sweep_grid.block_size = (16,)
  c.sweep_grid.slot_threshold = (0.5, 0.9)
  c.sweep_grid.token_threshold = (0.2, 0.4)
  c.sweep_grid.per_task = 1  # problems per task per sweep point
  # The paper's rows and one "Past the paper" row (its own model and validation search).
  c.eval.rows = ("ARM-AR", "MDM-LLaDA", "MDM-FastdLLM", "D2F", "BD3LM", "ReFusion",
                 "ReFusion-L2R", "ReFusion-recompute-KV", "ReFusion-BL-verify", "ReFusion-BL-RL",
                 "ReFusion-BL-drafter", "ReFusion-BL-planner")
  c.distill.steps, c.distill.batch_size, c.distill.seq_len = 2, 4, 48  # D2F: a few steps
  # RL: two steps of 2 prompts x 2 lossless rollouts.
  c.rl.steps, c.rl.prompts_per_step, c.rl.group_size = 2, 2, 2
  c.rl.micro_batch, c.rl.engine_rows = 4, 4
  # The drafter: two steps of 4 rows on 8 own answers; the planner: two steps as RL's.
  c.drafter.steps, c.drafter.batch_size, c.drafter.num_prompts = 2, 4, 8
  c.drafter.engine_rows, c.drafter.draft_rank = 4, 4
  c.planner.steps, c.planner.prompts_per_step, c.planner.group_size = 2, 2, 2
  c.planner.micro_batch, c.planner.engine_rows = 4, 4
  c.progress_bar = False  # quiet test output
  return c
