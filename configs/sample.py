"""Sampling from a trained model: `python -m refusion_jax.sample --config=configs/sample.py`.

Override any field on the command line, e.g.
`--config.model_dir=DIR --config.prompt="What is 2+3?" --config.decode.method=ar`.
Exactly one of prompt / prompt_ids / prompts_file must be set.
"""

import ml_collections

from refusion_jax.decode import settings


def get_config():
  c = ml_collections.ConfigDict()
  c.model_dir = ""  # HF folder (config.json + safetensors) or a refusion_jax model folder
  c.adapter_dir = ""  # a PEFT LoRA folder (a D2F adapter) merged into model_dir's weights
  c.scan_layers = ml_collections.config_dict.placeholder(bool)  # layer layout: None = as saved;
  #   true = stacked layers run by a scan (one layer body per program: fast TPU compiles)
  c.tokenizer_dir = ""  # "" = model_dir if it has tokenizer.json, else the bundled tiny one when it fits
  c.prompt = ""  # one query, chat-templated with the tokenizer
  c.prompt_ids = ""  # one prompt as token ids "1,2,3" (no tokenizer needed)
  c.prompts_file = ""  # JSONL, one {"query": str} or {"prompt_ids": [int]} per line (a batch)
  c.batch_size = 8  # engine rows (continuous batching); fewer prompts: the next power of two
  c.prompt_bucket = 64  # prompt length is padded up to a multiple of this (reuses the program)
  c.seed = 0  # sampling rng (only used when decode.temperature > 0)
  c.warmup = False  # compile every engine program first, so "seconds" excludes compilation
  # Compiled programs kept here and loaded by the next run of the same shapes: "auto"
  # ($JAX_COMPILATION_CACHE_DIR, else ~/.cache/refusion_jax/jax), a folder, or "" (none)
  c.compile_cache_dir = "auto"

  # Decoding: "method" and its options, each method's by the same flat name everywhere
  # (refusion_jax/decode/methods.py declares and describes them; a field the method lacks
  # is ignored, or refused by name when it would switch something on). ReFusion's
  # defaults: 128 tokens, slots of 8 in blocks of 32, tau_s 0.9, tau_t 0.4, greedy.
  c.decode = settings.config_dict()

  c.output_json = "-"  # where the JSON list of results goes ("-" = stdout)
  c.trace = False  # print each response coloured by the step that committed each token (stderr)
  c.trace_html = ""  # write a self-contained HTML animation of the decoding order here ("" = none)
  return c
