"""Sampling from a trained model: `python -m refusion_jax.sample --config=configs/sample.py`.

Override any field on the command line, e.g.
`--config.model_dir=DIR --config.prompt="What is 2+3?" --config.decode.method=ar`.
Exactly one of prompt / prompt_ids / prompts_file must be set.
"""

import ml_collections


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

  c.decode = ml_collections.ConfigDict()
  c.decode.method = "refusion"  # "refusion", "ar", "mdm" (a bidirectional model) or "bd3lm"
  c.decode.gen_length = 128  # response tokens to generate at most (EOS stops earlier)
  c.decode.slot_size = 8  # ReFusion: tokens per slot
  c.decode.block_size = 32  # tokens per serial block (ReFusion, MDM: a multiple of slot_size)
  c.decode.slot_threshold = 0.9  # ReFusion tau_s: plan picks slots above this first-token prob
  c.decode.token_threshold = 0.4  # ReFusion tau_t: verification accepts tokens above this prob
  c.decode.temperature = 0.0  # 0 = greedy; > 0 samples (Gumbel noise for the diffusion drafts)
  c.decode.mdm_tokens_per_step = 1  # MDM / BD3-LM (LLaDA): tokens unmasked per step
  c.decode.mdm_threshold = ml_collections.config_dict.placeholder(float)  # MDM / BD3-LM (Fast-dLLM): unmask all above it
  # MDM: which masked positions a step unmasks: "confidence" (LLaDA) or Dream's samplers
  # "maskgit_plus", "topk_margin", "entropy", "origin" (random; needs mdm_steps)
  c.decode.mdm_ranking = "confidence"
  # MDM: a schedule of this many steps in all (a multiple of the blocks; block_size =
  # gen_length: one canvas, as Dream decodes); unset: mdm_tokens_per_step a step
  c.decode.mdm_steps = ml_collections.config_dict.placeholder(int)
  # MDM: "llada" (a block's tokens split evenly over its steps) or "dream" (its linear
  # schedule); unset: LLaDA's with mdm_ranking "confidence", else Dream's
  c.decode.mdm_schedule = ml_collections.config_dict.placeholder(str)
  c.decode.mdm_ban_eos = False  # MDM (LLaDA's logits_eos_inf): EOS is never drafted
  c.decode.mdm_defer_stop = False  # MDM (LLaDA's confidence_eos_eot_inf): EOS / EoT drafts wait
  c.decode.mdm_cfg_scale = 0.0  # MDM: classifier-free guidance scale (the prompt masked; 0: off)
  # MDM, Fast-dLLM: its "prefix" or "dual" KV cache (unset: none); with a cache, a full pass
  # also every N steps of a block (0: at block starts only); the factor rule's f (unset: off)
  c.decode.mdm_cache = ml_collections.config_dict.placeholder(str)
  c.decode.mdm_cache_refresh = 0
  c.decode.mdm_factor = ml_collections.config_dict.placeholder(float)
  c.decode.d2f_add_threshold = 0.1  # D2F tau_add: a block is appended when the last is this decoded
  c.decode.d2f_act_threshold = 0.95  # D2F tau_act: fully activated when its predecessor is
  c.decode.d2f_conf_threshold = 0.9  # D2F tau_conf: tokens above it are committed
  c.decode.d2f_window = 4  # D2F: blocks in flight at most
  c.decode.left_to_right = False  # ReFusion ablation: one slot at a time, one token per pass
  c.decode.recompute_kv = False  # ReFusion ablation: recompute infilled slots' KV causally
  # ReFusion past the paper (docs/ALGORITHM.md; off = the release): "correct" / "exact" check
  # drafts against the causal argmax a pass computed and correct the first that fails
  c.decode.verify = "off"
  c.decode.boundary_check = True  # with verify: slot-first tokens too (a train.boundary_label model)
  c.decode.remask = False  # re-check a slot committed before its left neighbour, mask its tail again
  c.decode.remask_threshold = 0.5  # tau_remask: masked again from the first token at most this
  c.decode.planner = "threshold"  # ReFusion's slot choice: "threshold" (tau_s) or "policy"
  c.decode.plan_weights = ()  # planner "policy": w then b (refusion_jax.rl's plan_weights.json)
  c.decode.ignore_eos = False  # EOS ends nothing: every answer is gen_length tokens (load tests)
  # KV entries attention reads at a time, up to the longest row's live part (0: the whole
  # buffer at once; unset: 64 on CPU, 512 on TPU, 0 on GPU)
  c.decode.kv_chunk = ml_collections.config_dict.placeholder(int)
  # float32 matrix products: "default", "high" or "highest" (unset: "highest" on GPUs, whose
  # default TF32 can make a greedy answer depend on what it is batched with; JAX's elsewhere)
  c.decode.matmul_precision = ml_collections.config_dict.placeholder(str)

  c.output_json = "-"  # where the JSON list of results goes ("-" = stdout)
  c.trace = False  # print each response coloured by the step that committed each token (stderr)
  c.trace_html = ""  # write a self-contained HTML animation of the decoding order here ("" = none)
  return c
