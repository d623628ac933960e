"""GRPO on ReFusion-8B at the paper's scale (python -m refusion_jax.rl; aot --program=rl).

  python -m refusion_jax.rl --config=configs/qwen3_8b_refusion_rl.py \\
      --config.model_dir=/path/to/ReFusion-8B --config.train_file=data/gsm8k_train.jsonl \\
      --config.output_dir=OUT
  python -m refusion_jax.aot --program=rl --topology=v5p-128 \\
      --config=configs/qwen3_8b_refusion_rl.py

Rollouts decode as the paper's GSM8K row (Table 5: 512 tokens, slot 32, block 128,
tau_s 0.9, tau_t 0.4) at temperature 1.0 with sampled infill drafts; 64 prompts x 16
samples per step (1,024 rollouts); the policy step updates every parameter on 64
rollouts at a time (one per chip of a v5p-128 slice) with the KL to the starting model
(beta 0.04) at lr 1e-6 (the scale d1 and TraceRL train 7-8B diffusion models at). `train`
is the training recipe whose model, mesh and dtypes the policy step shares (the
compiled program of `aot --program=rl`); `layout_width` / `layout_tokens` bound a
rollout's training layout (entries: the prompt, the committed tokens and every
deciding pass's feed; tokens: the committed ones) for that program.
"""

from configs import qwen3_8b_refusion, rl_tiny


def get_config():
  c = rl_tiny.get_config()
  c.train_file = "data/gsm8k_train.jsonl"  # GSM8K's own rows: "question", "answer" ("#### N")
  c.reward = "gsm8k"
  c.reward_workers = 16
  c.steps = 500
  c.prompts_per_step = 64
  c.group_size = 16
  c.micro_batch = 64  # rollouts per policy-step program (one per chip on v5p-128)
  c.engine_rows = 128
  c.prompt_bucket = 256
  c.learning_rate = 1e-6
  c.beta = 0.04
  c.save_every = 25
  c.decode.gen_length = 512
  c.decode.slot_size = 32
  c.decode.block_size = 128
  c.decode.slot_threshold = 0.9
  c.decode.token_threshold = 0.4
  c.decode.temperature = 1.0
  c.mesh.shard = True  # FSDP over every chip, as the training recipe
  c.train = qwen3_8b_refusion.get_config()
  c.layout_width = 3072  # entries of one rollout's training layout (aot)
  c.layout_tokens = 512  # scored tokens per rollout (aot)
  return c
