"""The training check: the Trainer's step for the slice, and the paper's run on it."""

from __future__ import annotations

import itertools
import math
import os

import ml_collections
import numpy as np

from refusion_jax import config as config_lib
from refusion_jax import data, sharding, tpu
from refusion_jax.aot.estimates import (
  PAPER_EPOCHS,
  PAPER_SAMPLES,
  Memory,
  compile_program,
  hbm_traffic,
  log,
  roofline,
  train_flops,
  xla_flops,
)
from refusion_jax.aot.report import program_entry
from refusion_jax.config import ModelConfig
from refusion_jax.training import settings
from refusion_jax.training import trainer as trainer_lib

# Shape of the synthetic length distribution behind a mean (benchmarks/packing.py's): a
# log-normal with this sigma, like chat-templated SFT data (median ~0.8 x mean, p90 ~1.9 x).
LENGTH_SIGMA, LENGTH_DRAWS = 0.68, 20_000


def train_model_config(config) -> tuple[ModelConfig, str]:
  """The ModelConfig the trainer would build, and where its shapes came from."""
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


def slice_trainer(config, tpu_slice: tpu.Slice, *, what: str, seq_len: int, name: str,
                   total_steps: int, prefix: str = "config."):
  """`(trainer, model config, its source, mesh sizes, devices)`: the training recipe
  `config`'s Trainer on the slice's chips (`config.mesh`), its model checked to hold
  `seq_len` positions (`name`: the field that asks for them)."""
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
  trainer, mc, source, sizes, devices = slice_trainer(
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
      "programs": [program_entry("train_step", memory, seconds)],
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


def sample_lengths(config, sample_tokens: int, sample_data: str | None) -> tuple[list[int], str]:
  """Token lengths of the samples a train step packs, and where they come from: a data file
  (tokenized with the config's tokenizer, as the trainer does) or a log-normal of mean
  `sample_tokens` (`LENGTH_SIGMA`), capped at seq_len."""
  seq_len = int(config.data.seq_len)
  if sample_data:
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
