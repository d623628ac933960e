"""ReFusion on Qwen3-0.6B: the paper's recipe scaled down for quick experiments.

Same objective, lr schedule, special-token initialisation and packed rows as
qwen3_8b_refusion.py; a quarter of the paper's batch: 16 packed rows of 4096
tokens (~140 samples at a mean of 460 tokens per sample, ~200 at 330), e.g. a
TPU v5p-32 / v4-32 slice (16 chips, one row each) or 8 GPUs with `fsdp=-1`
(two rows each). The step count is derived from samples (see the 8B recipe).
"""

from configs import common


def get_config():
  c = common.base_config()
  c.objective = "refusion"  # slot-permuted AR + masked-slot MDM
  c.slot_sizes = (4, 8, 16, 32)  # the paper's slot sizes
  c.model.preset = "qwen3_0_6b"  # documentation only: the shapes come from init_from_hf
  c.model.dtype = "bfloat16"  # bf16 compute
  c.model.param_dtype = "float32"  # float32 master weights and AdamW moments
  c.model.scan_layers = True  # one scanned layer body: TPU compiles in minutes, not tens
  c.loss_chunk = 256  # 1 row/chip: [1, 256, 151936] f32 logits = 0.16 GB, not 2.5 GB per pass
  c.init_from_hf = "Qwen3-0.6B"  # HF Qwen3-0.6B folder (weights + tokenizer); override per machine
  c.tokenizer_dir = ""  # "" = the tokenizer of init_from_hf (+ <|beginoftext|>, <|mask|>)

  c.data.train_files = ("data/refusion_train.jsonl",)  # query/response samples
  c.data.eval_files = ()  # add held-out files and set eval_every_steps to track eval loss
  c.data.seq_len = 4096  # the paper's sequence length
  c.data.tfds_dir = ""  # "" = <workdir>/tfds
  c.data.drop_overlong = True  # longer samples are dropped and counted
  c.data.packing = "best_fit"  # several whole samples per row
  c.data.packing_bins = 0  # rows packed at once (0 = max(rows per host, 64))

  c.global_batch_size = 16  # packed rows: ~140 samples per step (a quarter of the paper's)
  c.num_train_steps = 0  # 0: derived from num_epochs over samples
  c.num_epochs = 4  # the paper's epochs

  c.optimizer.learning_rate = 2e-5  # the paper's peak rate
  c.optimizer.warmup_steps = 0  # no warmup
  c.optimizer.end_lr_ratio = 0.0  # cosine down to 0
  c.optimizer.weight_decay = 0.0  # no weight decay
  c.optimizer.b1 = 0.9  # AdamW defaults of the HF Trainer
  c.optimizer.b2 = 0.999  # AdamW defaults of the HF Trainer
  c.optimizer.grad_clip_norm = 1.0  # HF Trainer's max_grad_norm

  c.mesh.data = 1  # no pure replicas
  c.mesh.fsdp = -1  # every device shards parameters and batch
  c.mesh.tensor = 1  # no tensor parallelism at this size

  c.checkpoint.every_steps = 1000  # checkpoint interval
  c.checkpoint.max_to_keep = 3  # newest checkpoints kept
  c.log_every_steps = 10  # metrics.jsonl / TensorBoard interval
  c.eval_every_steps = 0  # no periodic eval by default
  c.export_hf_dir = ""  # set to also write a HF folder at the end
  return c
