"""Settings shared by the evaluation configs (`python -m refusion_jax.evaluate`).

`configs/eval/<benchmark>.py` is one of the paper's seven benchmarks with its
Table 5 decoding settings (refusion_jax/lmeval/benchmarks.py);
`configs/eval/synthetic.py` is the bundled miniature suite. Any field can be
overridden on the command line, e.g. `--config.decode.method=ar`.
"""

import ml_collections
from ml_collections.config_dict import placeholder

from refusion_jax.decode import settings


def decode_fields(method: str = "refusion", gen_length: int = 512, slot_size: int = 32,
                  block_size: int = 128, slot_threshold: float = 0.9,
                  token_threshold: float = 0.4) -> ml_collections.ConfigDict:
  """Every decode field (refusion_jax/decode/methods.py), at a benchmark's Table 5
  settings; `--config.decode.method=ar` runs the same benchmark as Table 1's AR row."""
  return settings.config_dict(method=method, gen_length=gen_length, slot_size=slot_size,
                             block_size=block_size, slot_threshold=slot_threshold,
                             token_threshold=token_threshold)


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
