"""Dream-7B (Dream-v0-Instruct-7B, a HF folder) on one of the paper's benchmarks, decoded
as Dream decodes: the whole answer canvas at once on its linear schedule.

  python -m refusion_jax.evaluate --config=configs/eval/dream.py:gsm8k \\
      --config.model_dir=DREAM_DIR --config.output_dir=OUT [--config.decode.mdm_ranking=origin]

The argument after ":" is the benchmark (refusion_jax/lmeval/benchmarks.py; default
gsm8k). What the paper ran for Dream is not known here: its table's row is "Dream w/
D2F", Dream decoded with discrete diffusion forcing, which this codebase does not
implement. These are Dream's own `diffusion_generate` settings at the paper's answer
length: gen_length 512 (Table 5), steps = gen_length (one token a step on average),
alg "entropy", greedy (the paper times greedy decoding; Dream's examples sample at
temperature 0.2 with top_p 0.95, and top_p is not implemented here).
"""

from configs.eval import common


def get_config(benchmark: str = "gsm8k"):
  c = common.benchmark_config(benchmark or "gsm8k")
  c.decode.method = "mdm"  # a Dream folder is bidirectional, its logits shifted by one
  c.decode.block_size = c.decode.gen_length  # one block: the whole canvas, as Dream decodes
  c.decode.slot_size = c.decode.gen_length  # unused by MDM (block_size must be its multiple)
  c.decode.mdm_ranking = "entropy"  # Dream's alg: maskgit_plus, topk_margin, entropy, origin
  c.decode.mdm_steps = c.decode.gen_length  # Dream's `steps` (paper's value not known)
  c.decode.temperature = 0.0  # greedy
  return c
