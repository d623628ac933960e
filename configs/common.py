"""Defaults shared by every training config; each file overrides what differs.

`python -m refusion_jax.train --config=configs/<name>.py --workdir=W` loads a
file's `get_config()`; any field can be overridden on the command line, e.g.
`--config.model.num_layers=2 --config.optimizer.learning_rate=1e-3`.
"""

import os

import ml_collections
from ml_collections.config_dict import placeholder

import refusion_jax

ASSETS_DIR = os.path.join(os.path.dirname(refusion_jax.__file__), "assets")
TINY_TRAIN = os.path.join(ASSETS_DIR, "data", "tiny_train.jsonl")
TINY_TEST = os.path.join(ASSETS_DIR, "data", "tiny_test.jsonl")
TINY_VALID = os.path.join(ASSETS_DIR, "data", "tiny_valid.jsonl")
BASE_TINY_DIR = os.path.join(ASSETS_DIR, "base_tiny")  # the shipped pretrained base (HF layout)


def base_config() -> ml_collections.ConfigDict:
  """The tiny ReFusion run on the bundled data; the other files start from here."""
  c = ml_collections.ConfigDict()
  c.distributed = False  # jax.distributed.initialize() first (multi-host pods / GPU clusters)
  c.seed = 0  # parameter init and per-step rng: fold_in(key(seed), step)
  # Compiled programs kept here and loaded by the next run of the same shapes (a resumed
  # run compiles nothing): "auto" ($JAX_COMPILATION_CACHE_DIR, else
  # ~/.cache/refusion_jax/jax), a folder, or "" (none)
  c.compile_cache_dir = "auto"
  c.objective = "refusion"  # "refusion" (slot AR + MDM), "arm", "mdm" or "bd3lm"
  c.slot_sizes = (4, 8, 16, 32)  # ReFusion draws each example's slot size from these
  c.eps = 1e-3  # mask probability floor: p = (1 - eps) * t + eps
  c.boundary_label = False  # ReFusion: the last token of each clean slot also learns the
  #                           token after it (ALGORITHM.md "Past the paper"); False: the release
  c.loss_chunk = 0  # cross-entropy over this many tokens of a row at a time (0 = full logits)
  c.mdm_response_len = 0  # MDM baseline: EOS-pad each response to this many tokens (the
  #                         decoder's gen_length, LLaDA's SFT); 0 = to the end of its row
  c.bd3lm_block_size = 8  # BD3-LM: response blocks (the paper's Table 2 uses 8); each
  #                         response is EOS-padded to whole blocks
  c.bd3lm_eps_min = 1e-3  # BD3-LM: each block's noise level t ~ U(eps_min, eps_max)
  c.bd3lm_eps_max = 1.0

  c.model = ml_collections.ConfigDict()
  c.model.preset = "tiny"  # refusion_jax.config preset; model.* fields not None override it
  c.model.dtype = "float32"  # compute dtype of activations ("bfloat16" for big runs)
  c.model.param_dtype = "float32"  # parameter / optimizer state dtype (keep float32)
  c.model.remat = "none"  # backward-pass memory: "none", "full" (layer inputs only), "save_dots"
  c.model.scan_layers = False  # stacked layers run by lax.scan (one layer body: fast compiles)
  c.model.attention_impl = "xla"  # training attention: "xla", "splash" (TPU), "cudnn" (GPU)
  c.model.model_type = placeholder(str)  # "qwen3", "qwen2" (Qwen2.5) layers (None = preset's)
  c.model.attention = placeholder(str)  # "causal" or "bidirectional" (None = preset's)
  c.model.num_layers = placeholder(int)  # decoder layers (None = preset's)
  c.model.hidden_size = placeholder(int)  # model width (None = preset's)
  c.model.num_heads = placeholder(int)  # query heads (None = preset's)
  c.model.num_kv_heads = placeholder(int)  # key/value heads, GQA (None = preset's)
  c.model.head_dim = placeholder(int)  # per-head width (None = preset's)
  c.model.mlp_dim = placeholder(int)  # SwiGLU hidden width (None = preset's)
  c.model.vocab_size = placeholder(int)  # embedding rows (None = preset's)
  c.model.tie_embeddings = placeholder(bool)  # share embedding and output head (None = preset's)
  c.model.max_position_embeddings = placeholder(int)  # longest sequence (None = preset's)
  c.model.mask_token_id = placeholder(int)  # <|mask|> id (None = preset's)
  c.init_from_hf = ""  # HF Qwen3 folder or a shipped model (base_tiny) ("" = random init)
  c.tokenizer_dir = ""  # "" = init_from_hf's tokenizer.json, else the bundled tiny one when it fits

  c.data = ml_collections.ConfigDict()
  c.data.train_files = (TINY_TRAIN,)  # JSON / JSONL files of {"query", "response"}
  c.data.eval_files = (TINY_TEST,)  # held-out files for the periodic eval loss
  c.data.seq_len = 128  # tokens per row (each sample: prompt + response + EOS)
  c.data.packing = "none"  # "none" (a sample per row, right-padded), "first_fit", "best_fit"
  c.data.packing_bins = 0  # rows packed at once (0 = max(rows per process, 64))
  c.data.tfds_dir = ""  # where the TFDS build goes ("" = <workdir>/tfds)
  c.data.drop_overlong = True  # drop (and count) rows longer than seq_len instead of failing
  c.data.shuffle_seed = 0  # data order; the same seed gives the same batches

  c.global_batch_size = 16  # rows per step over all devices and processes (packed: several
  #                           samples each; metrics log samples and real tokens per step)
  c.num_train_steps = 600  # optimizer steps; <= 0 derives them from num_epochs
  c.num_epochs = 0  # used only when num_train_steps <= 0: epochs over train_files

  c.optimizer = ml_collections.ConfigDict()
  c.optimizer.learning_rate = 3e-3  # peak learning rate (AdamW)
  c.optimizer.warmup_steps = 30  # linear warmup from 0 (0 = start at the peak)
  c.optimizer.end_lr_ratio = 0.0  # cosine decays to peak * end_lr_ratio at the last step
  c.optimizer.weight_decay = 0.01  # decoupled AdamW decay (on every parameter)
  c.optimizer.b1 = 0.9  # Adam first-moment decay
  c.optimizer.b2 = 0.95  # Adam second-moment decay
  c.optimizer.eps = 1e-8  # Adam denominator floor
  c.optimizer.grad_clip_norm = 1.0  # global gradient-norm clip (<= 0 disables)

  c.mesh = ml_collections.ConfigDict()
  c.mesh.data = 1  # pure data-parallel replicas (-1 = the remaining devices)
  c.mesh.fsdp = -1  # parameter-sharded data parallelism (-1 = the remaining devices)
  c.mesh.tensor = 1  # tensor parallelism over heads / mlp / vocab
  c.mesh.num_devices = 0  # 0 = every device; n > 0 = the first n (one-process debugging)

  c.checkpoint = ml_collections.ConfigDict()
  c.checkpoint.every_steps = 200  # save every this many steps (and always at the end)
  c.checkpoint.max_to_keep = 3  # newest checkpoints kept in <workdir>/checkpoints
  c.checkpoint.async_save = True  # write in the background while training continues

  c.log_every_steps = 1  # metrics.jsonl / TensorBoard interval
  c.eval_every_steps = 200  # eval loss interval (0 = never; also run at the end when > 0)
  c.eval_batches = 8  # full batches of eval_files per evaluation (0 = all)
  c.export_hf_dir = ""  # also write a HF Qwen3 folder here at the end ("" = skip; new, empty or
  #                       this run's earlier export only: other files are never replaced)
  c.progress_bar = True  # tqdm bar on process 0
  return c
