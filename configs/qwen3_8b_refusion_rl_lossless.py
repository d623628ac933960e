"""GRPO on ReFusion-8B's lossless sampler (python -m refusion_jax.rl; aot --program=rl).

  python -m refusion_jax.rl --config=configs/qwen3_8b_refusion_rl_lossless.py \\
      --config.model_dir=/path/to/ReFusion-8B --config.train_file=data/gsm8k_train.jsonl \\
      --config.output_dir=OUT
  python -m refusion_jax.aot --program=rl --topology=v5p-128 \\
      --config=configs/qwen3_8b_refusion_rl_lossless.py

configs/qwen3_8b_refusion_rl.py with the rollouts decoded losslessly: each is the model's
AR sample at temperature 1, decoded in ReFusion's fused passes (window 16: on a TPU a pass
of up to 16 tokens costs the weight read, so the widest window the cost allows; slot 4,
every slot drafted), and its log-probability is one causal forward of prompt and answer.
The policy step's layout is therefore the prompt (up to 256 tokens) and the 512-token
answer: 768 entries, a quarter of the replay layout's 3,072.
"""

from configs import qwen3_8b_refusion_rl


def get_config():
  c = qwen3_8b_refusion_rl.get_config()
  c.decode.verify = "lossless"
  c.decode.block_size = 16
  c.decode.slot_size = 4
  c.decode.slot_threshold = 0.0
  c.layout_width = 768  # the prompt bucket (256) and the answer (512): one causal run
  c.layout_tokens = 512
  return c
