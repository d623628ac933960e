"""Llama-3-8B-Instruct (a HF folder) on one of the paper's benchmarks, decoded left to
right (greedy, one token a pass over a KV cache).

  python -m refusion_jax.evaluate --config=configs/eval/llama.py:gsm8k \\
      --config.model_dir=LLAMA_DIR --config.output_dir=OUT

The argument after ":" is the benchmark (refusion_jax/lmeval/benchmarks.py; default
gsm8k). ReFusion does not state how it decoded Llama-3; this is greedy decoding at the
benchmark's Table 5 answer length through the paper's harness, stopping at Llama-3's
EOS (<|eot_id|>, 128009) or <|end_of_text|> (128001), both read from the folder
(config.json and generation_config.json).
"""

from configs.eval import common


def get_config(benchmark: str = "gsm8k"):
  c = common.benchmark_config(benchmark or "gsm8k")
  c.enable_thinking = False  # Llama-3's template has no thinking switch
  c.decode.method = "ar"
  c.decode.temperature = 0.0
  return c
