"""GRPO on the miniature (python -m refusion_jax.rl).

  python -m refusion_jax.rl --config=configs/rl_tiny.py \\
      --config.model_dir=runs/repro_tiny/models/refusion/final_model --config.output_dir=OUT

The fine-tuned miniature ReFusion, trained further on the training split's exact-match
rewards. Rollouts decode as the miniature's ReFusion rows do (slot 4, one block of 24,
tau_s 0.9, tau_t 0.4) at temperature 1.0 with sampled infill drafts.
"""

import ml_collections

from configs import tiny_refusion
from configs.common import TINY_TRAIN


def get_config():
  c = ml_collections.ConfigDict()
  c.model_dir = ""  # required: the ReFusion model folder (refusion_jax or HF) to train
  c.tokenizer_dir = ""  # "" = model_dir's tokenizer.json, else the bundled tiny one
  c.output_dir = ""  # required: checkpoints/, final_model/, metrics.jsonl
  # Compiled programs kept here and loaded by the next run of the same shapes (a resumed
  # run compiles nothing): "auto" ($JAX_COMPILATION_CACHE_DIR, else
  # ~/.cache/refusion_jax/jax), a folder, or "" (none)
  c.compile_cache_dir = "auto"
  c.train_file = TINY_TRAIN  # JSONL rows the reward reads ({"query"} for "tasks")
  c.train_policy = "model"  # "model" (every parameter), "selector" (the slot-selection
  #                           policy, decode.planner='policy', base frozen) or "both"
  c.reward = "tasks"  # "tasks" (exact match), "gsm8k", "math", "humaneval", "mbpp"
  c.reward_timeout = 30.0  # seconds per reward; past it the sample scores 0 (logged)
  c.reward_workers = 4  # rewards scored at once (code: sandboxed subprocesses)
  c.speed_weight = 0.0  # reward = correct * (1 + speed_weight * tokens per forward)
  c.steps = 60
  c.prompts_per_step = 8
  c.group_size = 8  # G samples per prompt (>= 2)
  c.micro_batch = 16  # rollouts per gradient forward (divides prompts_per_step x group_size)
  c.engine_rows = 16  # rows of the rollout engine (continuous batching)
  c.prompt_bucket = 16  # prompts padded to a multiple of this (one program per bucket)
  c.num_iterations = 1  # optimizer steps per batch of rollouts (GRPO's mu)
  c.epsilon = 0.2  # clipped ratio: [1 - epsilon, 1 + epsilon_high]
  c.epsilon_high = 0.28
  c.beta = 0.04  # KL weight to the starting model (0: no reference forward)
  c.learning_rate = 1e-5
  c.b1, c.b2 = 0.9, 0.99
  c.weight_decay = 0.0
  c.grad_clip = 1.0
  c.save_every = 20
  c.mesh = ml_collections.ConfigDict()
  c.mesh.shard = False  # True: parameters, rollouts and the policy step on a device mesh
  c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 1, -1, 1  # its axes (-1: the other devices)
  c.seed = 0
  c.decode = ml_collections.ConfigDict()
  c.decode.gen_length = 24
  c.decode.slot_size = 4
  c.decode.block_size = 24
  c.decode.slot_threshold = 0.9
  c.decode.token_threshold = 0.4
  c.decode.temperature = 1.0
  c.decode.recompute_kv = False
  c.decode.verify = "off"  # "lossless": the model's AR samples (configs/rl_lossless.py)
  c.decode.plan_weights = ()  # the selection policy's start ((): a soft slot_threshold)
  # aot --program=rl: the training recipe whose model, mesh and dtypes the policy step
  # shares, and the size of a rollout's training layout (entries, scored tokens).
  c.train = tiny_refusion.get_config()
  c.layout_width = 128
  c.layout_tokens = 32
  return c
