"""Settings shared by the evaluation configs (`python -m refusion_jax.evaluate`).

`configs/eval/<benchmark>.py` is one of the paper's seven benchmarks with its
Table 5 decoding settings (refusion_jax/lmeval/benchmarks.py);
`configs/eval/synthetic.py` is the bundled miniature suite. Any field can be
overridden on the command line, e.g. `--config.decode.method=ar`.
"""

import ml_collections
from ml_collections.config_dict import placeholder


def decode_fields(method: str = "refusion", gen_length: int = 512, slot_size: int = 32,
                  block_size: int = 128, slot_threshold: float = 0.9,
                  token_threshold: float = 0.4) -> ml_collections.ConfigDict:
  d = ml_collections.ConfigDict()
  d.method = method  # "refusion", "ar" (the AR row of Table 1), "mdm" or "bd3lm"
  d.gen_length = gen_length  # response tokens at most (EOS stops earlier)
  d.slot_size = slot_size  # ReFusion k: tokens per slot
  d.block_size = block_size  # b: tokens per serial block (multiple of slot_size)
  d.slot_threshold = slot_threshold  # tau_s: plan picks slots above this first-token prob
  d.token_threshold = token_threshold  # tau_t: verification accepts tokens above this prob
  d.temperature = 0.0  # 0 = greedy (the paper)
  d.mdm_tokens_per_step = 1  # MDM (LLaDA): tokens unmasked per step
  d.mdm_threshold = placeholder(float)  # MDM (Fast-dLLM): unmask every token above it
  d.mdm_ranking = "confidence"  # MDM: "confidence" (LLaDA) or Dream's "maskgit_plus",
  #   "topk_margin", "entropy", "origin" (decode/mdm.py)
  d.mdm_steps = placeholder(int)  # MDM: a schedule of this many steps in all
  d.mdm_schedule = placeholder(str)  # MDM: "llada" or "dream" (unset: by mdm_ranking)
  d.mdm_ban_eos = False  # MDM (LLaDA's logits_eos_inf): EOS is never drafted
  d.mdm_defer_stop = False  # MDM (LLaDA's confidence_eos_eot_inf): EOS / EoT drafts wait
  d.mdm_cfg_scale = 0.0  # MDM: classifier-free guidance scale (0: off)
  d.mdm_cache = placeholder(str)  # MDM (Fast-dLLM): "prefix" or "dual" KV cache
  d.mdm_cache_refresh = 0  # with mdm_cache: a full pass also every N steps of a block
  d.mdm_factor = placeholder(float)  # MDM (Fast-dLLM): factor rule f
  d.d2f_add_threshold = 0.1  # D2F tau_add: a block is appended when the last is this decoded
  d.d2f_act_threshold = 0.95  # D2F tau_act: fully activated when its predecessor is
  d.d2f_conf_threshold = 0.9  # D2F tau_conf: tokens above it are committed
  d.d2f_window = 4  # D2F: blocks in flight at most
  d.left_to_right = False  # ReFusion ablation: one slot at a time, one token per pass
  d.planner = "threshold"  # ReFusion: "threshold" (tau_s), "policy" or "mcts" (a search)
  d.mcts_budget = 16  # planner "mcts": simulations per plan step
  d.mcts_c = 1.0  # planner "mcts": PUCT exploration
  d.mcts_batch = 8  # planner "mcts": simulations per batched forward
  d.plan_weights = ()  # planner "policy": w then b (refusion_jax.rl's plan_weights.json)
  d.recompute_kv = False  # ReFusion ablation: recompute infilled slots' KV causally
  # ReFusion past the paper (docs/ALGORITHM.md; off = the release): "correct" / "exact" check
  # drafts against the causal argmax a pass computed and correct the first that fails
  d.verify = "off"
  d.boundary_check = True  # with verify: slot-first tokens too (a train.boundary_label model)
  d.remask = False  # re-check a slot committed before its left neighbour, mask its tail again
  d.remask_threshold = 0.5  # tau_remask: masked again from the first token at most this
  # KV entries attention reads at a time, up to the longest row's live part (0: the whole
  # buffer at once; unset: 64 on CPU, 512 on TPU, 0 on GPU)
  d.kv_chunk = placeholder(int)
  # float32 matrix products: "default", "high" or "highest" (unset: "highest" on GPUs, whose
  # default TF32 can make a greedy answer depend on what it is batched with; JAX's elsewhere)
  d.matmul_precision = placeholder(str)
  return d


def benchmark_config(name: str) -> ml_collections.ConfigDict:
  """One of the paper's benchmarks, run as the paper ran it."""
  from refusion_jax.lmeval import benchmarks  # pylint: disable=import-outside-toplevel
  b = benchmarks.get(name)
  c = ml_collections.ConfigDict()
  c.benchmark = b.name  # which benchmark (refusion_jax/lmeval/benchmarks.py)
  c.model_dir = ""  # required unless `completions`: refusion_jax or HF folder, or a shipped model
  c.adapter_dir = ""  # a PEFT LoRA folder (a D2F adapter) merged into model_dir's weights
  c.tokenizer_dir = ""  # "" = model_dir's tokenizer.json (else the bundled tiny one when it fits)
  c.output_dir = ""  # required: results.json and samples.jsonl are written here
  c.data_dir = ""  # local copies of the hub datasets, DATA_DIR/<owner>/<name>; "" = the HF hub
  c.limit = placeholder(int)  # only the first N documents (of each subtask of a group)
  c.completions = ""  # JSONL of {"task_id" or "doc_id", "completion"}: score these, no model
  c.batch_size = 1  # engine rows; the paper times batch 1 (answers do not depend on it)
  c.enable_thinking = True  # chat template argument (the release evaluates with thinking on)
  c.seed = 0  # decode rng (only used when decode.temperature > 0)
  # Compiled programs kept here and loaded by the next run of the same shapes: "auto"
  # ($JAX_COMPILATION_CACHE_DIR, else ~/.cache/refusion_jax/jax), a folder, or "" (none)
  c.compile_cache_dir = "auto"
  c.distributed = False  # jax.distributed.initialize() first; processes split the requests
  c.progress = True  # progress bars on stderr
  c.sandbox_allow_network = False  # code benchmarks: run samples WITHOUT a network namespace
  # Code benchmarks, where unprivileged user namespaces are disabled: run samples with
  # resource limits only (no namespaces: they can read and write what this user can).
  c.sandbox_allow_no_namespaces = False
  c.sandbox_wall_seconds = 10.0  # code benchmarks: wall-clock limit per program
  c.decode = decode_fields(gen_length=b.gen_length, slot_size=b.slot_size,
                           block_size=b.block_size, slot_threshold=b.slot_threshold,
                           token_threshold=b.token_threshold)
  return c
