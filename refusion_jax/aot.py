"""Will it fit? Compile a program for a Cloud TPU slice on any machine, without a TPU.

  python -m refusion_jax.aot --program=train --topology=v5p-128 \\
      --config=configs/qwen3_8b_refusion.py [--config.field=value ...]
  python -m refusion_jax.aot --program=decode --topology=v5litepod-8 --model=qwen3_8b \\
      --config=configs/sample.py --config.decode.method=refusion --batch=16 --prompt_len=1024
  python -m refusion_jax.aot --program=rl --topology=v5p-128 \\
      --config=configs/qwen3_8b_refusion_rl.py

`--topology` is a Cloud TPU accelerator type as gcloud names it (`v4-128`,
`v5p-128`, `v5litepod-256` or `v5e-256`, `v6e-256`) or a libtpu topology
(`v5p:4x4x4`); `--num_slices` compiles for that many such slices (multislice).
libtpu (requirements-tpu.txt) describes the slice and XLA compiles the real
program for it (`refusion_jax.tpu`):

* train: the Trainer's train step (`Trainer.lower_train_step`) with the
  config's mesh, global batch, sequence length, dtypes, remat and loss chunk;
  the model is the config's preset and overrides (with `init_from_hf`: that
  folder's config.json when it is here, else the preset with the two special
  tokens the trainer adds, Qwen3's tokenizer giving 151,671 rows);
* decode: the decode method's programs (`compiled_lib.lower_program`: the whole
  batch in one program, the engine's admit and its loop of passes) at
  `--batch` rows and prompts `--prompt_len` wide, for the model `--model` (a
  preset name, or a folder whose config.json or model_config.json alone is
  read), its parameters split over `--mesh` (data,fsdp,tensor) as the sharding
  rules say; then one pass of each width of `--pass_widths` over the KV cache
  (the pass ReFusion, AR and BD3-LM decode with; MDM: one denoising pass of the
  canvas).

* rl: the RL policy step of an RL config (`rl.learner.make_policy_step`:
  `micro_batch` rollouts' training layouts of `layout_width` entries, the
  reference's log-probabilities, GRPO's loss, the update) on the mesh and model
  of its `train` recipe; estimated per step and per group of `group_size`.

Printed per chip: argument, output, aliased and temporary bytes and the
program code, their total against the chip's HBM ("fits" / "does not fit by
X GiB"), compile seconds, and estimates: flops (a hand count, since XLA counts
a scanned layer once: 6 x matmul parameters x tokens + attention for a train
step, 2 x parameters per token for a decode pass, plus recomputation), HBM
bytes (`hlo_traffic`, counted from the compiled program: XLA's own "bytes
accessed" is not), and the roofline time max(flops / peak, bytes / bandwidth)
from the chip table in `tpu.py` -> tokens/s per chip and MFU for training;
per pass width for decoding, against the floor a pass cannot go below (the
weights each chip reads plus its KV cache). Collectives and overlap are not
modelled: every time is an estimate.

The last line of stdout is one JSON object with everything printed. Exit
status: 0 fits, 3 does not fit (the compiler's numbers are printed), 2 bad
flags or config (one line naming the problem). Progress goes to stderr.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import math
import os
import re
import sys
import time
from typing import TYPE_CHECKING

# Only the host CPU runs anything; libtpu serves as a compiler for the described slice.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import ml_collections  # noqa: E402
from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from refusion_jax import entry_flags, tpu  # noqa: E402
from refusion_jax import config as config_lib  # noqa: E402
from refusion_jax.config import DECODE_PROGRAMS, DecodeConfig, ModelConfig  # noqa: E402

# JAX, libtpu, the model, the decoders and the trainer are imported where they are used:
# a bad flag or config field is reported before any of them loads.
if TYPE_CHECKING:
  from refusion_jax.kv_cache import KVCache

GIB = 2**30
# The paper's run (ALGORITHM.md "Training in the paper"): 4 epochs over 3.7M samples of
# ~1.22B tokens, ~330 tokens each.
PAPER_SAMPLES, PAPER_EPOCHS, PAPER_SAMPLE_TOKENS = 3_700_000, 4, 330
# Shape of the synthetic length distribution behind a mean (benchmarks/packing.py's): a
# log-normal with this sigma, like chat-templated SFT data (median ~0.8 x mean, p90 ~1.9 x).
LENGTH_SIGMA, LENGTH_DRAWS = 0.68, 20_000
DEFAULT_WIDTHS = (1, 2, 4, 8, 16, 32, 64, 128)
EXIT_BAD_INPUT, EXIT_DOES_NOT_FIT = 2, 3


def log(message: str) -> None:
  print(f"[aot] {message}", file=sys.stderr, flush=True)


# --- memory --------------------------------------------------------------------------------


@dataclasses.dataclass
class Memory:
  """Per-chip bytes of one compiled program (XLA's buffer assignment)."""

  argument: int
  output: int
  alias: int  # outputs that reuse a (donated) argument's buffer
  temp: int
  code: int

  @property
  def total(self) -> int:
    return self.argument + self.output - self.alias + self.temp + self.code

  @classmethod
  def of(cls, compiled) -> "Memory":
    m = compiled.memory_analysis()
    return cls(argument=m.argument_size_in_bytes, output=m.output_size_in_bytes,
               alias=m.alias_size_in_bytes, temp=m.temp_size_in_bytes,
               code=m.generated_code_size_in_bytes)


class DoesNotFit(Exception):
  """The compiler refused the program for lack of HBM; `used` / `limit` are bytes (or None)."""

  def __init__(self, message: str, used: float | None, limit: float | None):
    super().__init__(message)
    self.used, self.limit = used, limit


_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def _bytes(number: str, unit: str) -> float:
  return float(number) * _UNITS[unit]


def compile_program(lowered, what: str):
  """`(compiled, seconds)`; raises DoesNotFit when XLA runs out of HBM while compiling."""
  log(f"compiling {what} ...")
  t = time.perf_counter()
  try:
    compiled = lowered.compile()
  except Exception as e:  # XLA's RESOURCE_EXHAUSTED arrives as a runtime error
    text = str(e)
    if "RESOURCE_EXHAUSTED" not in text and "out of memory" not in text.lower():
      raise
    first = next((line for line in text.splitlines() if "memory" in line.lower()),
                 text.splitlines()[0]).strip()
    # "... temporaries (35.35G) exceeds available HBM (15.75G)" or "Used 20G of 15.75G hbm".
    sizes = [_bytes(n, u) for n, u in re.findall(r"([0-9]+(?:\.[0-9]+)?)([KMGT])i?B?\b", first)]
    used, limit = (sizes[0], sizes[1]) if len(sizes) >= 2 else (None, None)
    raise DoesNotFit(f"{what}: {first}", used, limit) from None
  seconds = time.perf_counter() - t
  log(f"compiled {what} in {seconds:.1f}s")
  return compiled, seconds


def hbm_traffic(compiled, unknown_trips: int = 1) -> int:
  """`hlo_traffic`'s count; a loop whose trip count is traced runs `unknown_trips` times."""
  from refusion_jax import hlo_traffic  # pylint: disable=import-outside-toplevel
  return hlo_traffic.hbm_bytes(compiled.as_text(), unknown_trips=unknown_trips).total


def xla_flops(compiled) -> float | None:
  """XLA's own flop count (a loop body counted once: too low for scanned layers)."""
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  return float(cost["flops"]) if cost and "flops" in cost else None


def roofline(flops: float, nbytes: float, chip: tpu.Chip) -> float:
  """Estimated seconds: the slower of the chip's bf16 peak and its HBM bandwidth."""
  return max(flops / (chip.bf16_tflops * 1e12), nbytes / (chip.hbm_gbps * 1e9))


def per_chip_bytes(tree) -> int:
  """Bytes each chip holds of a tree of sharded `ShapeDtypeStruct`s (the largest shard)."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  total = 0
  for x in jax.tree.leaves(tree):
    shape = x.sharding.shard_shape(x.shape) if getattr(x, "sharding", None) else x.shape
    total += math.prod(shape) * jnp.dtype(x.dtype).itemsize
  return total


# --- flops by hand -------------------------------------------------------------------------


def layer_matmul_params(mc: ModelConfig) -> int:
  """Weights of the matrix products of all layers (projections and MLP)."""
  d, h = mc.hidden_size, mc.head_dim
  return mc.num_layers * (d * h * (2 * mc.num_heads + 2 * mc.num_kv_heads) + 3 * d * mc.mlp_dim)


def head_params(mc: ModelConfig) -> int:
  return mc.vocab_size * mc.hidden_size


def attention_flops(mc: ModelConfig, queries: int, keys: int) -> int:
  """Forward flops of scores and weighted values for `queries` x `keys` (all heads, layers)."""
  return 4 * mc.num_layers * mc.num_heads * mc.head_dim * queries * keys


def train_flops(mc: ModelConfig, rows: int, seq_len: int, loss_chunk: int,
                two_halves: bool = False) -> tuple[int, int]:
  """`(model flops, executed flops)` of one train step over `rows` x `seq_len` tokens.

  Model flops: 6 x matmul parameters (layers + LM head; the embedding lookup is
  not a product) x tokens, plus 3 x the attention forward. The einsum attention
  ("xla") computes every score of the square; the kernels ("splash", "cudnn")
  skip the masked half. Executed flops add what the backward pass recomputes:
  the layers' forward (remat "full") or attention (remat "save_dots"), and the
  logits of each chunk of a chunked loss. `two_halves` (BD3-LM): the layers run
  2 x seq_len tokens per row (its einsum mask over the square of them), the LM
  head only the noised half.
  """
  tokens = rows * seq_len
  layer_tokens = tokens * (2 if two_halves else 1)
  attn = rows * attention_flops(mc, layer_tokens // rows, layer_tokens // rows)
  if mc.attention_impl != "xla":
    attn //= 2
  model = 6 * (layer_matmul_params(mc) * layer_tokens + head_params(mc) * tokens) + 3 * attn
  recompute = 0
  if mc.remat == "full":
    recompute += 2 * layer_matmul_params(mc) * layer_tokens + attn
  elif mc.remat == "save_dots":
    recompute += attn
  if loss_chunk:
    recompute += 2 * head_params(mc) * tokens
  return model, model + recompute


def cached_pass_flops(mc: ModelConfig, rows: int, width: int, cache_len: int) -> int:
  """One decode pass of `width` tokens per row over a `cache_len`-entry KV buffer (the
  einsum attention reads every entry) plus the chunk itself, logits for every token."""
  return (2 * (layer_matmul_params(mc) + head_params(mc)) * rows * width
          + rows * attention_flops(mc, width, cache_len + width))


def canvas_pass_flops(mc: ModelConfig, rows: int, canvas: int, scored: int) -> int:
  """One MDM pass: the whole canvas through the layers, logits for the `scored` positions
  only (the current block's)."""
  return (2 * layer_matmul_params(mc) * rows * canvas + 2 * head_params(mc) * rows * scored
          + rows * attention_flops(mc, canvas, canvas))


# --- train ---------------------------------------------------------------------------------


def train_model_config(config) -> tuple[ModelConfig, str]:
  """The ModelConfig the trainer would build, and where its shapes came from."""
  from refusion_jax.training import settings  # pylint: disable=import-outside-toplevel
  if config.init_from_hf and os.path.isdir(config.init_from_hf):
    tokenizer = settings.load_tokenizer(config)
    mc = settings.build_model_config(config, tokenizer)
    settings.validate_model_config(config, mc, tokenizer)
    return mc, f"init_from_hf {config.init_from_hf}"
  plain = ml_collections.ConfigDict(config.to_dict())
  plain.init_from_hf = ""
  mc = settings.build_model_config(plain, None)
  source = f"preset {config.model.preset}"
  if config.init_from_hf:
    # The trainer adds <|beginoftext|> and <|mask|> from the HF folder's tokenizer;
    # Qwen3's gives the release's ids and 151,671 rows.
    if mc.vocab_size <= config_lib.REFUSION_MASK_ID:
      raise ValueError(f"config.init_from_hf={config.init_from_hf!r} is not on this machine and "
                       f"the preset {config.model.preset!r} is not a Qwen3 shape; point "
                       "init_from_hf at a folder with its config.json and tokenizer")
    mc = mc.replace(vocab_size=config_lib.REFUSION_MASK_ID + 1,
                    bos_token_id=config_lib.REFUSION_BOS_ID,
                    mask_token_id=config_lib.REFUSION_MASK_ID)
    source += (f" (init_from_hf {config.init_from_hf!r} is not here: its shapes with "
               "ReFusion's special tokens, vocabulary 151,671)")
  settings.check_objective_fits(config, mc)
  return mc, source


def _slice_trainer(config, tpu_slice: tpu.Slice, *, what: str, seq_len: int, name: str,
                   total_steps: int, prefix: str = "config."):
  """`(trainer, model config, its source, mesh sizes, devices)`: the training recipe
  `config`'s Trainer on the slice's chips (`config.mesh`), its model checked to hold
  `seq_len` positions (`name`: the field that asks for them)."""
  from refusion_jax import sharding  # pylint: disable=import-outside-toplevel
  from refusion_jax.training import settings  # pylint: disable=import-outside-toplevel
  from refusion_jax.training import trainer as trainer_lib  # pylint: disable=import-outside-toplevel
  devices = tpu.slice_devices(tpu_slice)
  n = config.mesh.num_devices
  if n:
    if n > len(devices):
      raise ValueError(f"{prefix}mesh.num_devices={n} but {tpu_slice.name} has "
                       f"{len(devices)} chips")
    devices = devices[:n]
  sizes = settings.validate_config(config, num_devices=len(devices), check_files=False)
  mc, source = train_model_config(config)
  if seq_len > mc.max_position_embeddings:
    raise ValueError(f"{name}={seq_len} exceeds the model's "
                     f"max_position_embeddings={mc.max_position_embeddings}")
  mesh = sharding.make_mesh(devices=devices, **sizes)
  log(f"{what} of {source}: {mc.num_params() / 1e9:.3g}B parameters, mesh {sizes}, "
      f"{len(devices)} chips")
  trainer = trainer_lib.Trainer(config, mc, mesh=mesh,
                                pad_id=mc.pad_token_id if mc.pad_token_id is not None else 0,
                                total_steps=total_steps)
  return trainer, mc, source, sizes, devices


def check_train(config, tpu_slice: tpu.Slice) -> dict:
  trainer, mc, source, sizes, devices = _slice_trainer(
      config, tpu_slice, what="train step", seq_len=config.data.seq_len,
      name="config.data.seq_len", total_steps=max(1, int(config.num_train_steps)))
  rows, seq_len = config.global_batch_size, config.data.seq_len
  lowered = trainer.lower_train_step(rows, seq_len)
  compiled, seconds = compile_program(lowered, f"train step for {tpu_slice.name}")
  memory = Memory.of(compiled)
  chips = len(devices)
  model_flops, executed = train_flops(mc, rows, seq_len, config.loss_chunk,
                                      two_halves=config.objective == "bd3lm")
  nbytes = hbm_traffic(compiled)
  chip = tpu_slice.chip
  estimated = roofline(executed / chips, nbytes, chip)
  return {
      "model": source, "params": mc.num_params(), "mesh": sizes,
      "programs": [_program_entry("train_step", memory, seconds)],
      "global_batch": rows, "seq_len": seq_len, "remat": mc.remat,
      "scan_layers": mc.scan_layers, "loss_chunk": config.loss_chunk,
      "flops": executed / chips, "model_flops": model_flops / chips, "bytes": nbytes,
      "xla_flops": xla_flops(compiled),
      "flops_source": "hand count per chip: 6 x matmul params x tokens + attention, "
                      "plus recomputation",
      "estimated_s": estimated,
      "estimated_tokens_per_s_per_chip": rows * seq_len / chips / estimated,
      "estimated_mfu": model_flops / chips / estimated / (chip.bf16_tflops * 1e12),
  }


def rl_flops(mc: ModelConfig, rows: int, width: int, tokens: int, reference: bool
             ) -> tuple[int, int]:
  """`(model flops, executed flops)` of one RL policy step: the replay of `rows` training
  layouts of `width` entries through the layers with the LM head on the `tokens` scored
  ones (forward and backward: 6 x parameters x tokens, + 3 x the einsum attention's
  square, every layout carrying its own mask), the reference's forward (2 x, + 1 x), and
  the backward pass's recomputation (remat)."""
  layer, head = layer_matmul_params(mc) * rows * width, head_params(mc) * rows * tokens
  attn = rows * attention_flops(mc, width, width)
  model = 6 * (layer + head) + 3 * attn
  executed = model + (2 * (layer + head) + attn if reference else 0)
  if mc.remat == "full":
    executed += 2 * layer + attn
  elif mc.remat == "save_dots":
    executed += attn
  return model, executed


def check_rl(config, tpu_slice: tpu.Slice) -> dict:
  """The RL policy step (`rl.learner.make_policy_step`) of `config.micro_batch` rollouts
  on the mesh and model of `config.train`, the reference's parameters beside the policy's."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import optax  # pylint: disable=import-outside-toplevel
  from flax import nnx  # pylint: disable=import-outside-toplevel

  from refusion_jax import sharding  # pylint: disable=import-outside-toplevel
  from refusion_jax.rl import learner as rl_learner  # pylint: disable=import-outside-toplevel
  from refusion_jax.rl import trainer as rl_trainer  # pylint: disable=import-outside-toplevel
  for name in ("train", "layout_width", "layout_tokens", "micro_batch", "group_size"):
    if name not in config:
      raise ValueError(f"--config has no {name!r}: --program=rl takes an RL config "
                       "(configs/qwen3_8b_refusion_rl.py)")
  width, tokens, rows = int(config.layout_width), int(config.layout_tokens), int(config.micro_batch)
  if min(width, tokens, rows) < 1 or tokens > width:
    raise ValueError(f"config.layout_width={width}, layout_tokens={tokens} and micro_batch="
                     f"{rows} must be positive, with layout_tokens <= layout_width")
  rl_trainer.check_config(config, need_model=False)
  if config.train_policy != "model":
    raise ValueError(f"--program=rl compiles the model's policy step (train_policy='model'); "
                     f"config.train_policy={config.train_policy!r} (the selector's step is a "
                     "handful of weights)")
  trainer, mc, source, sizes, devices = _slice_trainer(
      config.train, tpu_slice, what=f"RL policy step ({rows} rollouts of {width} entries)",
      seq_len=width, name="config.layout_width", total_steps=1, prefix="config.train.")
  mesh = trainer.mesh
  tx = rl_learner.make_optimizer(config)
  params = {"model": trainer.abstract_params}
  param_sh = {"model": trainer.param_shardings}
  abstract_opt = jax.eval_shape(tx.init, params)
  opt_sh = optax.tree_map_params(tx, lambda _, s: s, abstract_opt, param_sh,
                                 transform_non_params=lambda _: trainer.replicated)
  abstract_opt = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                              abstract_opt, opt_sh)
  reference = config.beta > 0
  step = rl_learner.make_policy_step(
      lambda p: nnx.merge(trainer.graphdef, p), tx, temperature=float(config.decode.temperature),
      epsilon=config.epsilon, epsilon_high=config.epsilon_high, beta=config.beta)
  shapes = {"ids": ((rows, width), jnp.int32), "positions": ((rows, width), jnp.int32),
            "attention": ((rows, width, width), jnp.bool_),
            "score_at": ((rows, tokens), jnp.int32), "targets": ((rows, tokens), jnp.int32),
            "valid": ((rows, tokens), jnp.bool_)}
  batch_sh = {k: sharding.data_sharding(mesh, trainer.rules, len(shp))
              for k, (shp, _) in shapes.items()}
  batch = {k: jax.ShapeDtypeStruct(shp, dt, sharding=batch_sh[k]) for k, (shp, dt) in shapes.items()}
  adv_sh = sharding.data_sharding(mesh, trainer.rules, 1)
  adv = jax.ShapeDtypeStruct((rows,), jnp.float32, sharding=adv_sh)
  ref_sh = param_sh if reference else None
  jitted = jax.jit(step, in_shardings=(param_sh, opt_sh, ref_sh, batch_sh, adv_sh),
                   out_shardings=(param_sh, opt_sh, trainer.replicated),
                   donate_argnums=(0, 1))
  with sharding.use_mesh(mesh, trainer.rules):
    lowered = jitted.lower(params, abstract_opt, params if reference else None, batch, adv)
  compiled, seconds = compile_program(lowered, f"RL policy step for {tpu_slice.name}")
  memory = Memory.of(compiled)
  chips = len(devices)
  model_flops, executed = rl_flops(mc, rows, width, tokens, reference)
  nbytes = hbm_traffic(compiled)
  estimated = roofline(executed / chips, nbytes, tpu_slice.chip)
  group = int(config.group_size)
  return {
      "model": source, "params": mc.num_params(), "mesh": sizes,
      "programs": [_program_entry("rl_step", memory, seconds)],
      "rollouts": rows, "layout_width": width, "layout_tokens": tokens,
      "reference": reference, "remat": mc.remat, "group_size": group,
      "flops": executed / chips, "model_flops": model_flops / chips, "bytes": nbytes,
      "xla_flops": xla_flops(compiled),
      "flops_source": "hand count per chip: 6 x matmul params x layout entries (LM head on "
                      "the scored tokens) + einsum attention, the reference's forward, "
                      "recomputation",
      "estimated_s": estimated,
      "estimated_s_per_group": estimated * group / rows,
  }


def sample_lengths(config, sample_tokens: int, sample_data: str | None) -> tuple[list[int], str]:
  """Token lengths of the samples a train step packs, and where they come from: a data file
  (tokenized with the config's tokenizer, as the trainer does) or a log-normal of mean
  `sample_tokens` (`LENGTH_SIGMA`), capped at seq_len."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  seq_len = int(config.data.seq_len)
  if sample_data:
    from refusion_jax import data  # pylint: disable=import-outside-toplevel
    from refusion_jax.training import settings  # pylint: disable=import-outside-toplevel
    data.validate_files([sample_data])
    tokenizer = settings.load_tokenizer(config)
    examples = list(itertools.islice(data.iter_examples([sample_data]), LENGTH_DRAWS))
    lengths = data.sample_lengths(examples, tokenizer, seq_len=seq_len,
                                  eos_pad_response_to=settings.eos_pad_response_to(config),
                                  eos_pad_multiple=settings.eos_pad_multiple(config))
    if not lengths:
      raise ValueError(f"--sample_data={sample_data!r}: no sample fits in config.data.seq_len="
                       f"{seq_len}")
    return lengths, f"{sample_data} ({len(lengths)} samples, mean {np.mean(lengths):.0f} tokens)"
  median = sample_tokens * math.exp(-LENGTH_SIGMA ** 2 / 2)
  draws = np.random.default_rng(0).lognormal(math.log(median), LENGTH_SIGMA, LENGTH_DRAWS)
  draws = np.maximum(np.round(draws), 1).astype(int)
  lengths = draws[draws <= seq_len].tolist()  # the trainer drops over-long samples
  if not lengths:
    raise ValueError(f"--sample_tokens={sample_tokens}: no sample of that length distribution "
                     f"fits in config.data.seq_len={seq_len}")
  dropped = f", {len(draws) - len(lengths)} over seq_len dropped" if len(lengths) < len(
      draws) else ""
  return lengths, (f"log-normal lengths of mean {sample_tokens} tokens (sigma {LENGTH_SIGMA}, "
                   f"{LENGTH_DRAWS} draws{dropped})")


def paper_run(config, report: dict, sample_tokens: int, sample_data: str | None) -> dict:
  """Samples and real tokens per step of the config's layout, and the paper's 4 epochs over
  3.7M samples on the slice at the estimated step time, packed and one sample per row."""
  from refusion_jax import data  # pylint: disable=import-outside-toplevel
  from refusion_jax.training import settings  # pylint: disable=import-outside-toplevel
  rows, seq_len = report["global_batch"], report["seq_len"]
  lengths, source = sample_lengths(config, sample_tokens, sample_data)
  packing = settings.packing(config)
  # Each host packs its own rows; Cloud TPU VMs hold 4 chips each (this sets only how many
  # rows are packed at once by default).
  hosts = max(1, report["chips"] // 4)
  layout = data.pack_lengths(lengths, seq_len=seq_len, packing=packing,
                             packing_bins=int(config.data.get("packing_bins", 0)),
                             batch_size=max(1, rows // hosts))
  samples_per_step = rows * layout.samples_per_row
  passes = PAPER_SAMPLES * PAPER_EPOCHS
  seconds = report["estimated_s"]
  hours = math.ceil(passes / samples_per_step) * seconds / 3600
  hours_padded = math.ceil(passes / rows) * seconds / 3600
  return {"packing": packing, "lengths_from": source,
          "samples_per_step": samples_per_step, "real_token_fraction": layout.real_token_fraction,
          "real_tokens_per_step": rows * seq_len * layout.real_token_fraction,
          "paper_run_steps": math.ceil(passes / samples_per_step),
          "paper_run_hours": hours, "paper_run_chip_hours": hours * report["chips"],
          "paper_run_hours_padded": hours_padded,
          "paper_run_chip_hours_padded": hours_padded * report["chips"]}


# --- decode --------------------------------------------------------------------------------


def decode_model_config(model: str, method: str) -> tuple[ModelConfig, str]:
  """A preset name or a folder (config.json or model_config.json read, nothing else)."""
  if model in config_lib.PRESETS:
    mc, source = config_lib.get_preset(model), f"preset {model}"
    if mc.mask_token_id is None and mc.vocab_size > config_lib.REFUSION_MASK_ID:
      mc = mc.replace(mask_token_id=config_lib.REFUSION_MASK_ID,
                      bos_token_id=config_lib.REFUSION_BOS_ID)
  elif os.path.isdir(model) and config_lib.is_model_dir(model):
    return config_lib.read_model_config(model), f"{model} (model_config.json)"
  elif os.path.isfile(os.path.join(model, "config.json")):
    mc, source = config_lib.from_hf_config(model), f"{model} (config.json)"
  elif os.path.isdir(model):
    raise ValueError(f"--model={model!r} has neither config.json nor model_config.json")
  else:
    raise ValueError(f"--model={model!r} is neither a preset {sorted(config_lib.PRESETS)} nor "
                     "a folder")
  if method in ("mdm", "d2f"):  # presets and HF config.json do not record it: an MDM
    mc = mc.replace(attention="bidirectional")
  return mc, source


def _abstract_sharded_model(mc: ModelConfig, mesh, rules):
  import jax  # pylint: disable=import-outside-toplevel
  from flax import nnx  # pylint: disable=import-outside-toplevel

  from refusion_jax import sharding  # pylint: disable=import-outside-toplevel
  from refusion_jax.model import Transformer  # pylint: disable=import-outside-toplevel
  graphdef, state = nnx.split(nnx.eval_shape(lambda: Transformer(mc, rngs=nnx.Rngs(0))))
  shardings = sharding.state_shardings(state, mesh, rules)
  state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                       state, shardings)
  return nnx.merge(graphdef, state)


def _cache_shapes(mc: ModelConfig, rows: int, max_len: int, mesh, rules,
                  chunk: int = 0) -> KVCache:
  import jax  # pylint: disable=import-outside-toplevel
  from jax.sharding import NamedSharding, PartitionSpec  # pylint: disable=import-outside-toplevel

  from refusion_jax import sharding  # pylint: disable=import-outside-toplevel
  from refusion_jax.kv_cache import KVCache  # pylint: disable=import-outside-toplevel,redefined-outer-name
  cache = jax.eval_shape(lambda: KVCache.init(mc, rows, max_len, chunk=chunk))
  axes = (("layers",) if cache.stacked else ()) + (None, "kv_heads", "cache_seq", "head_dim")

  def place(x, spec=PartitionSpec()):
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec))

  kv = lambda x: place(x, sharding.logical_to_physical(axes, rules, x.shape, mesh))  # noqa: E731
  return cache.map_kv(kv).replace(positions_bs=place(cache.positions_bs),
                                  length_b=place(cache.length_b))


def _pass_program(graphdef, params, cache, ids_bw, positions_bw, keys_bw2, temperature, *,
                  width: int, vocab_chunk: int):
  """One decode pass: every row feeds `width` tokens (one causal group) written into its
  cache after the prompt, as a ReFusion or AR pass does."""
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from flax import nnx  # pylint: disable=import-outside-toplevel

  from refusion_jax.decode import passes  # pylint: disable=import-outside-toplevel
  model = nnx.merge(graphdef, params)
  b = ids_bw.shape[0]
  zeros = jnp.zeros((b, width), jnp.int32)
  feed = passes.Feed(fed_bn=jnp.ones((b, width), bool), ids_bn=ids_bw, positions_bn=positions_bw,
                     group_bn=zeros, dest_bn=positions_bw, sample_bn=zeros > 0)
  return passes.run_pass(model, cache, feed, (width,), temperature=temperature,
                         keys_bn2=keys_bw2, vocab_chunk=vocab_chunk)


def _step_program(graphdef, params, state, knobs, *, spec):
  from flax import nnx  # pylint: disable=import-outside-toplevel

  from refusion_jax.decode import program as program_lib  # pylint: disable=import-outside-toplevel
  with program_lib.precision(spec):
    return program_lib.program(spec.method).step(nnx.merge(graphdef, params), spec, state, knobs)


@functools.cache
def _jitted():
  """(one pass, one mdm step), jitted once JAX is loaded."""
  import jax  # pylint: disable=import-outside-toplevel
  return (jax.jit(_pass_program, static_argnames=("graphdef", "width", "vocab_chunk"),
                  donate_argnames=("cache",)),
          jax.jit(_step_program, static_argnames=("graphdef", "spec"),
                  donate_argnames=("state",)))


def check_decode(decode_config: DecodeConfig, tpu_slice: tpu.Slice, *, model: str, batch: int,
                 prompt_len: int, mesh_sizes: dict, widths, programs,
                 scan_layers: bool | None) -> dict:
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from flax import nnx  # pylint: disable=import-outside-toplevel
  from jax.sharding import NamedSharding, PartitionSpec  # pylint: disable=import-outside-toplevel

  from refusion_jax import sharding  # pylint: disable=import-outside-toplevel
  from refusion_jax.decode import compiled as compiled_lib  # pylint: disable=import-outside-toplevel
  from refusion_jax.decode import engine  # pylint: disable=import-outside-toplevel
  from refusion_jax.decode import program as program_lib  # pylint: disable=import-outside-toplevel
  from refusion_jax.training import settings  # pylint: disable=import-outside-toplevel
  pass_jit, step_jit = _jitted()
  mc, source = decode_model_config(model, decode_config.method)
  if scan_layers is not None:
    mc = mc.replace(scan_layers=scan_layers)
  decode_config.check_fits(mc, prompt_len)
  devices = tpu.slice_devices(tpu_slice)
  try:
    sizes = settings.mesh_shape(ml_collections.ConfigDict(mesh_sizes), len(devices))
  except ValueError as e:
    raise ValueError(f"--mesh (data,fsdp,tensor) over {len(devices)} chips: {e}") from None
  mesh = sharding.make_mesh(devices=devices, **sizes)
  rules = sharding.ShardingRules()
  decoder = engine.Decoder(_abstract_sharded_model(mc, mesh, rules), decode_config)
  chip, chips = tpu_slice.chip, len(devices)
  options = ", ".join(f"{k}={v}" for k, v in decode_config.switches_on().items())
  log(f"{decode_config.method} decode of {source}: {mc.num_params() / 1e9:.3g}B parameters "
      f"({mc.param_dtype}, {'scanned' if mc.scan_layers else 'unrolled'} layers), mesh {sizes}, "
      f"{batch} rows, prompts of {prompt_len}, {decode_config.gen_length} generated"
      + (f" ({options})" if options else ""))
  entries = []
  for name in programs:
    with sharding.use_mesh(mesh, rules):
      lowered = compiled_lib.lower_program(decoder, name, batch, prompt_len)
    compiled, seconds = compile_program(lowered, f"{decode_config.method} {name} program")
    entries.append(_program_entry(name, Memory.of(compiled), seconds))
    del compiled
  result = {"model": source, "params": mc.num_params(), "mesh": sizes,
            "method": decode_config.method, "batch": batch, "prompt_len": prompt_len,
            "gen_length": decode_config.gen_length, "decode": decode_config.flat(),
            "scan_layers": mc.scan_layers,
            "kv_chunk": decoder.spec.kv_chunk, "programs": entries,
            "flops_source": "hand count per chip: 2 x matmul params per token + attention",
            "pass_width": None, "flops": None, "bytes": None, "estimated_s": None,
            "per_pass": []}
  if max(e["total"] for e in entries) > chip.hbm_gib * GIB:
    log("does not fit: no per-pass table")
    return result

  weights = decoder.params
  if not mc.tie_embeddings:  # a pass gathers a few rows of the input embedding, not all
    weights = {k: v for k, v in nnx.to_pure_dict(weights).items() if k != "embed"}
  weight_bytes = per_chip_bytes(weights)
  knobs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(
      jnp.shape(x), jnp.result_type(x), sharding=NamedSharding(mesh, PartitionSpec())),
      decoder.knobs)
  per_pass = []
  replicated = NamedSharding(mesh, PartitionSpec())
  kv_chunk = decoder.spec.kv_chunk

  def cached_pass(width: int, max_len: int, what: str) -> dict:
    """One pass of `width` tokens a row over a `max_len`-entry KV cache, compiled."""
    cache = _cache_shapes(mc, batch, max_len, mesh, rules, kv_chunk)
    kv_bytes = per_chip_bytes((cache.k, cache.v))
    # Attention reads the cache in kv_chunk pieces up to the longest row
    # (model.attend_live), a loop of traced length: counted here at a full buffer.
    kv_trips = -(-max_len // kv_chunk) if 0 < kv_chunk < max_len else 1
    shape = lambda s, dt: jax.ShapeDtypeStruct(s, dt, sharding=replicated)  # noqa: E731
    with sharding.use_mesh(mesh, rules):
      lowered = pass_jit.lower(
          decoder.graphdef, decoder.params, cache, shape((batch, width), jnp.int32),
          shape((batch, width), jnp.int32), shape((batch, width, 2), jnp.uint32),
          shape((), jnp.float32), width=width, vocab_chunk=decoder.spec.vocab_chunk)
    compiled, seconds = compile_program(lowered, what)
    nbytes = hbm_traffic(compiled, kv_trips)
    flops = cached_pass_flops(mc, batch, width, max_len) / chips
    return {"width": width, "bytes": nbytes, "bytes_floor": weight_bytes + kv_bytes,
            "flops": flops, "estimated_s": roofline(flops, nbytes, chip),
            "xla_flops": xla_flops(compiled), "compile_s": seconds}

  prog, max_len = program_lib.program(decode_config.method), prompt_len + decode_config.gen_length
  cached_widths = prog.pass_widths(decoder.spec)
  if prog.canvas_spec is not None:
    # Its steps feed prompt and canvas whole (with a cache, a block's first step): that
    # pass is one step of the program without its cache; its cached passes follow.
    plain = prog.canvas_spec(decoder.spec)
    state = compiled_lib.abstract_state(decoder, batch, prompt_len, spec=plain)
    with sharding.use_mesh(mesh, rules):
      lowered = step_jit.lower(decoder.graphdef, decoder.params, state, knobs, spec=plain)
    compiled, seconds = compile_program(
        lowered, f"one {decode_config.method} pass ({max_len} tokens per row)")
    nbytes = hbm_traffic(compiled)
    flops = canvas_pass_flops(mc, batch, max_len, decoder.spec.block_size) / chips
    per_pass.append({"width": max_len, "bytes": nbytes, "bytes_floor": weight_bytes,
                     "flops": flops, "estimated_s": roofline(flops, nbytes, chip),
                     "xla_flops": xla_flops(compiled), "compile_s": seconds})
    for width in cached_widths:
      per_pass.append(cached_pass(width, max_len, f"one cached {decode_config.method} pass "
                                                  f"({width} tokens per row)"))
    top = per_pass[-1]
  else:
    widest = max(cached_widths)
    for width in sorted(set(widths) | {widest}):
      if prompt_len + width > max_len:
        log(f"skipping pass width {width}: more than the {decode_config.gen_length} "
            "generated entries of the cache")
        continue
      per_pass.append(cached_pass(width, max_len, f"one pass of width {width}"))
    top = next(p for p in per_pass if p["width"] == widest)
  return dict(result, pass_width=top["width"], flops=top["flops"], bytes=top["bytes"],
              estimated_s=top["estimated_s"],
              per_pass=[{k: v for k, v in p.items() if k != "compile_s"} for p in per_pass],
              pass_compile_s=sum(p["compile_s"] for p in per_pass))


# --- report --------------------------------------------------------------------------------


def _program_entry(name: str, memory: Memory, seconds: float) -> dict:
  return {"name": name, "argument": memory.argument, "output": memory.output,
          "alias": memory.alias, "temp": memory.temp, "code": memory.code,
          "total": memory.total, "compile_s": seconds}


def finish(report: dict, tpu_slice: tpu.Slice) -> dict:
  """Adds the fit verdict and the slice's figures to a check's report."""
  hbm = tpu_slice.chip.hbm_gib
  per_chip = max(p["total"] for p in report["programs"]) / GIB
  return {"program": report.pop("kind"), "topology": tpu_slice.name,
          "libtpu_topology": tpu_slice.topology, "num_slices": tpu_slice.num_slices,
          "chip": tpu_slice.chip.name, "chips": tpu_slice.chips, "hbm_gib": hbm,
          "per_chip_gib": per_chip, "fits": per_chip <= hbm,
          "compile_s": sum(p["compile_s"] for p in report["programs"]), **report}


def _gib(n: float) -> str:
  return f"{n / GIB:.2f} GiB"


def render(r: dict) -> str:
  chip = tpu.CHIPS[r["chip"]]
  lines = [f"{r['program']} on {r['topology']} ({r['libtpu_topology']} x {r['num_slices']} "
           f"slice(s), {r['chips']} {r['chip']} chips of {r['hbm_gib']:g} GiB HBM, "
           f"{chip.bf16_tflops:g} TFLOP/s bf16, {chip.hbm_gbps:g} GB/s)",
           ]
  if "model" in r:
    lines.append(f"model: {r['model']}, {r['params'] / 1e9:.3f}B parameters, mesh {r['mesh']}")
  if r["programs"]:
    lines.append(f"{'program':12s}{'argument':>12s}{'output':>12s}{'aliased':>12s}"
                 f"{'temporary':>12s}{'code':>10s}{'total':>12s}{'compile':>9s}")
  for p in r["programs"]:
    lines.append(f"{p['name']:12s}{_gib(p['argument']):>12s}{_gib(p['output']):>12s}"
                 f"{_gib(p['alias']):>12s}{_gib(p['temp']):>12s}{_gib(p['code']):>10s}"
                 f"{_gib(p['total']):>12s}{p['compile_s']:>8.1f}s")
  if r["per_chip_gib"] is None:
    lines.append(f"per chip: more than {r['hbm_gib']:g} GiB: does not fit")
  else:
    verdict = ("fits" if r["fits"] else
               f"does not fit by {r['per_chip_gib'] - r['hbm_gib']:.2f} GiB")
    lines.append(f"per chip: {r['per_chip_gib']:.2f} of {r['hbm_gib']:g} GiB "
                 f"({100 * r['per_chip_gib'] / r['hbm_gib']:.0f}%): {verdict}")
  if r.get("compiler_error"):
    lines.append(f"the compiler: {r['compiler_error']}")
    if r.get("compiler_limit_gib"):
      lines.append(f"(the compiler's usable HBM per chip: {r['compiler_limit_gib']:.2f} GiB)")
  if r["flops"] is None:
    return "\n".join(lines)
  if r["program"] == "train":
    lines.append(
        f"estimate per chip per step ({r['global_batch']} x {r['seq_len']} tokens, remat "
        f"{r['remat']}): {r['flops'] / 1e12:.1f} TFLOP executed ({r['model_flops'] / 1e12:.1f} "
        f"model; {r['flops_source']}), {r['bytes'] / 1e9:.1f} GB HBM traffic (hlo_traffic)")
    lines.append(f"estimated step time {r['estimated_s']:.2f}s, "
                 f"{r['estimated_tokens_per_s_per_chip']:,.0f} tokens/s per chip, "
                 f"estimated MFU {100 * r['estimated_mfu']:.1f}% (roofline: "
                 "max(flops / peak, bytes / bandwidth), a bound: collectives, overlap and "
                 "kernel efficiency are not modelled)")
    if "samples_per_step" in r:
      lines.append(
          f"rows: data.packing={r['packing']!r}, {r['samples_per_step']:,.0f} samples and "
          f"{r['real_tokens_per_step']:,.0f} real tokens per step ({100 * r['real_token_fraction']:.1f}% "
          f"of row tokens), for {r['lengths_from']}")
      lines.append(
          f"the paper's run, {PAPER_EPOCHS} epochs over {PAPER_SAMPLES / 1e6:g}M samples "
          f"(estimates at the step time above): {r['paper_run_steps']:,} steps, "
          f"{r['paper_run_hours']:.1f} hours, {r['paper_run_chip_hours']:,.0f} chip-hours; one "
          f"sample per row: {r['paper_run_hours_padded']:.1f} hours, "
          f"{r['paper_run_chip_hours_padded']:,.0f} chip-hours")
  elif r["program"] == "rl":
    lines.append(
        f"estimate per chip per policy step ({r['rollouts']} rollouts, layouts of "
        f"{r['layout_width']} entries / {r['layout_tokens']} scored tokens, reference "
        f"{'on' if r['reference'] else 'off'}, remat {r['remat']}): {r['flops'] / 1e12:.1f} "
        f"TFLOP executed ({r['flops_source']}), {r['bytes'] / 1e9:.1f} GB HBM traffic "
        "(hlo_traffic)")
    lines.append(f"estimated policy step {r['estimated_s']:.2f}s, "
                 f"{r['estimated_s_per_group']:.3f}s per group of {r['group_size']} rollouts "
                 "(roofline: max(flops / peak, bytes / bandwidth); the rollouts' decode is "
                 "--program=decode's)")
  else:
    # (MDM's spec holds kv_chunk 0: its passes have no cache.)
    chunked = (f"; the cache read {r['kv_chunk']} entries at a time, counted over a full "
               "buffer" if 0 < r["kv_chunk"] < r["prompt_len"] + r["gen_length"] else "")
    lines.append(f"estimate per pass and chip ({r['batch']} rows, {r['flops_source']}; HBM "
                 f"bytes from hlo_traffic{chunked}; floor = weights a pass reads + KV cache "
                 "per chip):")
    lines.append(f"{'width':>7s}{'HBM GB':>10s}{'floor GB':>10s}{'x floor':>9s}{'GFLOP':>10s}"
                 f"{'est. ms':>10s}{'bound':>8s}")
    for p in r["per_pass"]:
      compute = p["flops"] / (chip.bf16_tflops * 1e12)
      lines.append(f"{p['width']:>7d}{p['bytes'] / 1e9:>10.3f}{p['bytes_floor'] / 1e9:>10.3f}"
                   f"{p['bytes'] / p['bytes_floor']:>8.2f}x{p['flops'] / 1e9:>10.1f}"
                   f"{1e3 * p['estimated_s']:>10.3f}"
                   f"{'flops' if compute >= p['estimated_s'] else 'HBM':>8s}")
  return "\n".join(lines)


def not_fitting_report(kind: str, tpu_slice: tpu.Slice, error: DoesNotFit, partial: dict) -> dict:
  """The report of a program the compiler refused for lack of HBM."""
  return {"program": kind, "topology": tpu_slice.name, "libtpu_topology": tpu_slice.topology,
          "num_slices": tpu_slice.num_slices, "chip": tpu_slice.chip.name,
          "chips": tpu_slice.chips, "hbm_gib": tpu_slice.chip.hbm_gib,
          "per_chip_gib": None if error.used is None else error.used / GIB,
          "fits": False, "compile_s": None,
          "compiler_error": str(error),
          "compiler_limit_gib": None if error.limit is None else error.limit / GIB, "flops": None, "bytes": None, "estimated_s": None,
          "programs": [], **partial}


# --- command line --------------------------------------------------------------------------


def define_flags():
  """The tool's flags (defined only when run as a program, as the other entry points do)."""
  return dict(
      config=config_flags.DEFINE_config_file(
          "config", None, "Training config (train) or sampling config (decode, its "
          "`decode` fields; configs/sample.py).", lock_config=True),
      program=flags.DEFINE_enum("program", None, ["train", "decode", "rl"], "What to compile "
                                "(rl: the RL policy step of an RL config)."),
      topology=flags.DEFINE_string("topology", None, "Cloud TPU accelerator type (v5p-128, "
                                   "v4-256, v5litepod-256, v6e-256) or libtpu topology."),
      num_slices=flags.DEFINE_integer("num_slices", 1, "Slices of --topology (multislice)."),
      model=flags.DEFINE_string("model", None, "decode: preset name (" + ", ".join(
          sorted(config_lib.PRESETS)) + ") or a model folder (its config.json only)."),
      batch=flags.DEFINE_integer("batch", 8, "decode: rows."),
      prompt_len=flags.DEFINE_integer("prompt_len", 128, "decode: prompt width."),
      mesh=flags.DEFINE_string("mesh", "1,1,-1", "decode: data,fsdp,tensor sizes (-1: the rest)."),
      scan_layers=flags.DEFINE_bool("scan_layers", None, "decode: layer layout (default: the "
                                    "model's; the config's scan_layers when it sets one)."),
      pass_widths=flags.DEFINE_string("pass_widths", ",".join(map(str, DEFAULT_WIDTHS)),
                                      "decode: widths of the per-pass table ('' = only the "
                                      "method's widest pass)."),
      decode_programs=flags.DEFINE_string("decode_programs", ",".join(DECODE_PROGRAMS),
                                          "decode: which programs to compile."),
      sample_tokens=flags.DEFINE_integer(
          "sample_tokens", PAPER_SAMPLE_TOKENS, "train: mean tokens per sample (the paper's "
          "1.22B / 3.7M) for samples per step and the paper's run, packed as the config packs."),
      sample_data=flags.DEFINE_string("sample_data", "", "train: a JSON/JSONL data file whose "
                                      "samples (tokenized with the config's tokenizer) replace "
                                      "--sample_tokens' distribution."),
  )


def _ints(text: str, name: str) -> list[int]:
  try:
    values = [int(t) for t in text.split(",") if t.strip()]
  except ValueError:
    raise ValueError(f"--{name}={text!r}: expected comma-separated ints") from None
  return values


def run(f: dict) -> tuple[dict, int]:
  """Runs the check the flags ask for; returns the report and the exit status."""
  config = f["config"].value
  if f["program"].value is None:
    raise ValueError("--program=train, --program=decode or --program=rl is required")
  if f["topology"].value is None:
    raise ValueError("--topology is required (e.g. v5p-128, v5litepod-8)")
  if config is None:
    raise ValueError("--config is required (a training config for train, configs/sample.py "
                     "for decode)")
  tpu_slice = tpu.parse_slice(f["topology"].value, f["num_slices"].value)
  kind = f["program"].value
  if kind == "train" and f["sample_tokens"].value < 1:
    raise ValueError(f"--sample_tokens must be >= 1, got {f['sample_tokens'].value}")
  try:
    if kind == "train":
      report = check_train(config, tpu_slice)
    elif kind == "rl":
      report = check_rl(config, tpu_slice)
    else:
      report = _run_decode(f, config, tpu_slice)
  except DoesNotFit as e:
    partial = {"global_batch": config.global_batch_size, "seq_len": config.data.seq_len,
               "estimated_mfu": None} if kind == "train" else (
                   {} if kind == "rl" else {"per_pass": []})
    return not_fitting_report(kind, tpu_slice, e, partial), EXIT_DOES_NOT_FIT
  report = finish(dict(report, kind=kind), tpu_slice)
  if kind == "train":
    report.update(paper_run(config, report, f["sample_tokens"].value,
                            f["sample_data"].value or None))
  return report, 0 if report["fits"] else EXIT_DOES_NOT_FIT


def _run_decode(f: dict, config, tpu_slice: tpu.Slice) -> dict:
  if f["model"].value is None:
    raise ValueError("--model is required with --program=decode (a preset such as qwen3_8b, "
                     "or a model folder)")
  if "decode" not in config:
    raise ValueError("--config has no `decode` fields; use configs/sample.py")
  for name in ("batch", "prompt_len"):
    if f[name].value < 1:
      raise ValueError(f"--{name} must be a positive int, got {f[name].value}")
  widths = _ints(f["pass_widths"].value, "pass_widths")
  if any(w < 1 for w in widths):
    raise ValueError(f"--pass_widths must be positive, got {widths}")
  mesh = _ints(f["mesh"].value, "mesh")
  if len(mesh) != 3:
    raise ValueError(f"--mesh={f['mesh'].value!r}: expected data,fsdp,tensor (e.g. 1,1,-1)")
  programs = [p.strip() for p in f["decode_programs"].value.split(",") if p.strip()]
  unknown = [p for p in programs if p not in DECODE_PROGRAMS]
  if unknown or not programs:
    raise ValueError(f"--decode_programs: {unknown or 'none'}; choose from "
                     f"{list(DECODE_PROGRAMS)}")
  try:
    decode_config = DecodeConfig(**config.decode.to_dict())
  except TypeError as e:
    raise ValueError(f"--config.decode: {e}") from None
  scan = f["scan_layers"].value
  if scan is None:
    scan = config.get("scan_layers")
  from refusion_jax import sharding  # pylint: disable=import-outside-toplevel
  return check_decode(decode_config, tpu_slice, model=f["model"].value,
                      batch=f["batch"].value, prompt_len=f["prompt_len"].value,
                      mesh_sizes=dict(zip(sharding.MESH_AXES, mesh)), widths=widths,
                      programs=programs, scan_layers=scan)


PROGRAM = "refusion_jax.aot"


def parse_flags(argv):
  """absl's parsing through the one error path of every entry point (entry_flags):
  a bad flag or --config override is one line, exit status 2."""
  with entry_flags.errors_reported(PROGRAM):
    return entry_flags.parse_flags(argv)


def main(argv, f):
  with entry_flags.errors_reported(PROGRAM, (ValueError, TypeError, FileNotFoundError)):
    if len(argv) > 1:
      raise entry_flags.InputError(f"unexpected arguments {argv[1:]}")
    report, status = run(f)
  print(render(report))
  print(json.dumps(report))
  sys.stdout.flush()
  sys.exit(status)


if __name__ == "__main__":
  _flags = define_flags()
  app.run(lambda argv: main(argv, _flags), flags_parser=parse_flags)
