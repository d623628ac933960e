"""What packing makes of a data set: samples and real tokens per row, lengths, over-long
samples (for the checks before training and for `aot`'s estimates)."""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Mapping, Sequence

import grain
import numpy as np

from refusion_jax.data import loader as loader_lib


@dataclasses.dataclass(frozen=True)
class Layout:
  """What rows a loader made: counts over the batches it yielded."""

  rows: int
  samples: int
  real_tokens: int
  seq_len: int

  @property
  def real_token_fraction(self) -> float:
    """Share of row tokens that belong to a sample (the rest is padding)."""
    return self.real_tokens / max(self.rows * self.seq_len, 1)

  @property
  def samples_per_row(self) -> float:
    return self.samples / max(self.rows, 1)


def layout_of(batches: Iterable[Mapping[str, np.ndarray]], seq_len: int,
              max_samples: int | None = None) -> Layout:
  """Counts rows, samples and real tokens of packed-format `batches` (all of them, or
  until at least `max_samples` samples)."""
  rows = samples = real = 0
  for batch in batches:
    segment_ids = np.asarray(batch["segment_ids"])
    rows += segment_ids.shape[0]
    samples += int(np.sum((segment_ids > 0) & (np.asarray(batch["positions"]) == 0)))
    real += int(np.sum(segment_ids > 0))
    if max_samples is not None and samples >= max_samples:
      break
  return Layout(rows=rows, samples=samples, real_tokens=real, seq_len=seq_len)


def sample_lengths(source, tokenizer, *, seq_len: int, seed: int = 0, shuffle: bool = True,
                   drop_overlong: bool = True,
                   eos_pad_response_to: int | None = None,
                   eos_pad_multiple: int = 0) -> list[int]:
  """Tokens of each sample of one (shuffled) epoch of `source`, in the loader's order, as
  `make_loader` lays them out (over-long ones dropped, any EOS padding included)."""
  loader = loader_lib.make_loader(
      source, tokenizer, seq_len=seq_len, batch_size=1, seed=seed, shuffle=shuffle,
      num_epochs=1, drop_overlong=drop_overlong, eos_pad_response_to=eos_pad_response_to,
      eos_pad_multiple=eos_pad_multiple)
  return [int(np.sum(batch["segment_ids"] > 0)) for batch in loader]


def measure_layout(source, tokenizer, *, seq_len: int, packing: str, packing_bins: int = 0,
                   batch_size: int, seed: int, drop_overlong: bool = True,
                   eos_pad_response_to: int | None = None, eos_pad_multiple: int = 0,
                   max_samples: int | None = None, shuffle: bool = True) -> Layout:
  """The rows `make_loader` makes of `source` with these settings, counted over one
  (shuffled) epoch (or its first `max_samples` samples), read as one process.

  Every argument means what it does in `make_loader`; `batch_size` is the rows of
  one batch (it sets the default number of packing bins). The last partial batch
  is counted.
  """
  loader = loader_lib.make_loader(
      source, tokenizer, seq_len=seq_len, batch_size=batch_size, seed=seed, shuffle=shuffle,
      num_epochs=1, drop_overlong=drop_overlong, drop_remainder=False, packing=packing,
      packing_bins=packing_bins, eos_pad_response_to=eos_pad_response_to,
      eos_pad_multiple=eos_pad_multiple)
  return layout_of(iter(loader), seq_len, max_samples)


def check_lengths(examples: Iterable[Mapping[str, Any]], tokenizer, seq_len: int, *,
                  drop_overlong: bool, what: str, min_fitting: int = 1,
                  full: bool = False) -> int:
  """Checks, before any training, that `examples` give batches; returns the fitting ones seen.

  `examples` are records with "query", "response" and "source" ('file:line'), e.g.
  `iter_examples(files)` (nothing is built or written) or a built source. With
  `drop_overlong=False` every example is tokenised and the first one longer than
  `seq_len` is an error naming its `file:line` (the loader would stop on it
  mid-run). With `drop_overlong=True` the pass stops as soon as `min_fitting`
  examples fit (unless `full`), and fewer is an error: a loader that drops every
  example would wait forever for a batch.

  Raises:
    ValueError: naming `what` (e.g. "config.data.train_files"), the example or
      the count, and seq_len.
  """
  tokenize = loader_lib.Tokenize(tokenizer)
  fitting, seen, longest, shortest = 0, 0, 0, None
  for record in examples:
    seen += 1
    element = tokenize.map(record)
    length = len(element["prompt"]) + len(element["response"])
    if length <= seq_len:
      fitting += 1
      if fitting >= min_fitting and drop_overlong and not full:
        return fitting
      continue
    if not drop_overlong:
      raise ValueError(
          f"{what}: example {element['source']} has {length} tokens (prompt "
          f"{len(element['prompt'])} + response {len(element['response'])} with EOS) > "
          f"config.data.seq_len={seq_len}; raise seq_len or set config.data.drop_overlong=True "
          "to skip it")
    longest = max(longest, length)
    shortest = length if shortest is None else min(shortest, length)
  if fitting < min_fitting:
    dropped = seen - fitting
    detail = (f"; the {dropped} over-long ones have {shortest} to {longest} tokens"
              if dropped else "")
    raise ValueError(
        f"{what}: only {fitting} of {seen} example(s) fit in config.data.seq_len="
        f"{seq_len} (prompt + response + EOS), {min_fitting} needed{detail}; raise seq_len")
  return fitting


def count_overlong(source, tokenizer, seq_len: int) -> int:
  """Examples of `source` that exceed seq_len (a full pass; for reports and tests)."""
  tokenize = loader_lib.Tokenize(tokenizer)
  n = 0
  for i in range(len(source)):
    element = tokenize.map(source[i])
    n += len(element["prompt"]) + len(element["response"]) > seq_len
  return n


def pack_lengths(lengths: Sequence[int], *, seq_len: int, packing: str,
                 packing_bins: int = 0, batch_size: int = 1) -> Layout:
  """The rows grain's packer (as `make_loader` runs it) makes of samples of these token
  lengths, in this order: a layout estimate from lengths alone, without text."""
  loader_lib.check_packing(packing, packing_bins)
  if packing == "none":
    return Layout(rows=len(lengths), samples=len(lengths), real_tokens=int(sum(lengths)),
                  seq_len=seq_len)
  sequences = grain.MapDataset.source([int(n) for n in lengths]).map(
      lambda n: {"tokens": np.ones((n,), np.int32)}).to_iter_dataset(
          grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
  bins = loader_lib.packing_bins_for(batch_size, packing_bins)
  rows = loader_lib.packed(sequences, packing, seq_len=seq_len, bins=bins,
                           seed=0, shuffle=False, padding={"tokens": 0})
  return layout_of(({"segment_ids": row["tokens_segment_ids"][None],
                     "positions": row["tokens_positions"][None]} for row in rows), seq_len)
