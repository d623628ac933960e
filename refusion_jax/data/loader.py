"""The grain loader: tokenized samples, packed (or padded) into rows, batched, its position
saved and restored with the training checkpoint; and the loaders the training config asks
for."""

from __future__ import annotations

import dataclasses
import json
import threading
from typing import Any

import grain
import jax
import numpy as np
from jax.experimental import multihost_utils

from refusion_jax import objective, runtime
from refusion_jax.data.build import QueryResponse, prepare

ITERATOR_HANDLER = grain.checkpoint.CheckpointHandler
IteratorSave = grain.checkpoint.CheckpointSave
IteratorRestore = grain.checkpoint.CheckpointRestore
PACKINGS = objective.PACKINGS
# Rows packed at once by default (at least a batch): grain emits them together when a
# sample fits in none, so more of them leave less padding (benchmarks/packing.py).
DEFAULT_PACKING_BINS = 64


class IdentifiedSource:
  """A random-access source whose repr names exactly which data it holds.

  grain's iterator state records `repr(source)` and `set_state` refuses a
  state saved with another source; the identity (the build's content hash
  and the split) makes that check catch changed data files on resume.
  """

  def __init__(self, source, identity: str):
    self._source = source
    self.identity = identity

  def __len__(self) -> int:
    return len(self._source)

  def __getitem__(self, index):
    return self._source[index]

  def __repr__(self) -> str:
    return f"IdentifiedSource({self.identity!r}, num_records={len(self._source)})"


def source_of(builder: QueryResponse, split: str) -> IdentifiedSource:
  """`builder.as_data_source(split)`, identified by the build's hash and the split."""
  if split not in builder.info.splits:
    raise ValueError(f"split {split!r} is not in the build {builder.builder_config.name} "
                     f"(splits: {sorted(builder.info.splits)})")
  return IdentifiedSource(builder.as_data_source(split),
                          f"{builder.name}/{builder.builder_config.name}/{split}")


def _text(value: Any) -> str:
  # TFDS returns text features as bytes; plain Python sources give str.
  return value.decode("utf-8") if isinstance(value, bytes) else value


class DropCounter:
  """Counts over-long examples dropped in this process (thread-safe)."""

  def __init__(self):
    self._lock = threading.Lock()
    self.count = 0

  def add(self) -> int:
    with self._lock:
      self.count += 1
      return self.count

  def __getstate__(self):
    # Worker processes get their own counter; each logs its own drops.
    return {"count": 0}

  def __setstate__(self, state):
    self._lock = threading.Lock()
    self.count = state["count"]


class Tokenize(grain.transforms.Map):
  """Record -> {"prompt", "response" (with EOS) int32 ids, "source"}."""

  def __init__(self, tokenizer):
    self._tokenizer = tokenizer

  def map(self, record):
    query, response = _text(record["query"]), _text(record["response"])
    source = _text(record.get("source", "?"))
    prompt = self._tokenizer.encode_prompt(query)
    answer = self._tokenizer.encode(response) + [self._tokenizer.eos_id]
    return {"prompt": np.asarray(prompt, np.int32), "response": np.asarray(answer, np.int32),
            "source": source}


class _KeepFitting(grain.transforms.Filter):
  """Drops examples longer than seq_len (logging them), or raises."""

  def __init__(self, seq_len: int, drop: bool, counter: DropCounter):
    self._seq_len = seq_len
    self._drop = drop
    self._counter = counter

  def filter(self, element) -> bool:
    length = len(element["prompt"]) + len(element["response"])
    if length <= self._seq_len:
      return True
    message = (f"example {element['source']} has {length} tokens "
               f"(prompt {len(element['prompt'])} + response {len(element['response'])} "
               f"with EOS) > seq_len={self._seq_len}")
    if not self._drop:
      raise ValueError(message + "; raise seq_len or set drop_overlong=True to skip it")
    n = self._counter.add()
    # Log the first few and then every power of two, so a bad seq_len is loud
    # without flooding the log.
    if n <= 5 or not n & (n - 1):
      runtime.note("data", "dropped %d over-long example(s) so far; latest: %s", n, message)
    return False


class _PadResponse(grain.transforms.Map):
  """EOS-pads the response to at least `min_len` tokens (0: to the end of the row; None:
  no minimum), then to a multiple of `multiple` (0: none), never past the row: the MDM
  baseline's layout (LLaDA's SFT) and BD3-LM's whole blocks."""

  def __init__(self, seq_len: int, eos_id: int, min_len: int | None, multiple: int = 0):
    self._seq_len = seq_len
    self._eos_id = eos_id
    self._min_len = min_len
    self._multiple = multiple

  def map(self, element):
    prompt, response = element["prompt"], element["response"]
    room = self._seq_len - len(prompt)
    want = len(response) if self._min_len is None else (
        room if self._min_len == 0 else max(len(response), self._min_len))
    if self._multiple:
      want = -(-want // self._multiple) * self._multiple
    want = min(want, room)
    if want > len(response):
      response = np.concatenate(
          [response, np.full((want - len(response),), self._eos_id, np.int32)])
    return dict(element, response=response)


class _Row(grain.transforms.Map):
  """One sample right-padded to seq_len, in the packed format (one segment)."""

  def __init__(self, seq_len: int, pad_id: int):
    self._seq_len = seq_len
    self._pad_id = pad_id

  def map(self, element):
    p, r = len(element["prompt"]), len(element["response"])
    n, l = p + r, self._seq_len
    tokens = np.full((l,), self._pad_id, np.int32)
    tokens[:p] = element["prompt"]
    tokens[p:n] = element["response"]
    real = np.arange(l) < n
    return {"tokens": tokens, "segment_ids": real.astype(np.int32),
            "positions": np.where(real, np.arange(l), 0).astype(np.int32),
            "segment_prompt_len": np.where(real, p, 0).astype(np.int32),
            "segment_response_len": np.where(real, r, 0).astype(np.int32)}


class _Sequence(grain.transforms.Map):
  """A sample as per-token features for grain's packers (each one sample long)."""

  def map(self, element):
    p, r = len(element["prompt"]), len(element["response"])
    return {"tokens": np.concatenate([element["prompt"], element["response"]]).astype(np.int32),
            "segment_prompt_len": np.full((p + r,), p, np.int32),
            "segment_response_len": np.full((p + r,), r, np.int32)}


class _FromPacked(grain.transforms.Map):
  """grain's packed row -> the packed format (`tokens`' segment ids and positions)."""

  def map(self, element):
    return {"tokens": element["tokens"], "segment_ids": element["tokens_segment_ids"],
            "positions": element["tokens_positions"],
            "segment_prompt_len": element["segment_prompt_len"],
            "segment_response_len": element["segment_response_len"]}


class BatchIterator:
  """The loader's iterator: numpy batches in the packed format, and its position.

  `get_state()` / `set_state(state)` (bytes, what grain's orbax handler stores)
  record the position together with what the position means: the source (its
  build hash and split), seq_len, packing, seed and shard. Restoring a position
  saved for other data or other settings is an error naming the difference.
  """

  def __init__(self, iterator, identity: dict):
    self._iterator = iterator
    self._identity = identity

  def __iter__(self):
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    return next(self._iterator)

  def get_state(self) -> bytes:
    return json.dumps({"identity": self._identity,
                       "position": self._iterator.get_state()}).encode()

  def set_state(self, state: bytes) -> None:
    try:
      saved = json.loads(state)
      identity, position = saved["identity"], saved["position"]
    except (ValueError, TypeError, KeyError):
      raise ValueError("the saved data position is not one this loader wrote (an older "
                       "version of refusion_jax?); start a new workdir") from None
    if identity != self._identity:
      changed = [f"{k}: saved {identity.get(k)!r}, now {v!r}" for k, v in self._identity.items()
                 if identity.get(k) != v]
      raise ValueError("the saved data position belongs to other data or loader settings ("
                       + "; ".join(changed) + "); restore them or start a new workdir")
    self._iterator.set_state(position)

  def start_prefetch(self) -> None:
    """Called by grain's orbax handler after a restore; batches are read on demand."""


@dataclasses.dataclass
class Loader:
  """A seeded, sharded grain pipeline plus the count of over-long examples it dropped.

  Attributes:
    dataset: the grain `IterDataset` of numpy batches (`iter(loader)` wraps its
      iterator in a checkpointable `BatchIterator`).
    dropped: over-long examples dropped so far by this process; with
      worker_count > 0 the drops happen (and are logged) in the workers.
    num_records: examples in the source (before sharding and dropping).
    per_process_batch: rows of each batch this process yields.
    identity: what a saved position of this loader means (`BatchIterator`).
  """

  dataset: Any
  dropped: DropCounter
  num_records: int
  per_process_batch: int
  identity: dict

  def __iter__(self) -> BatchIterator:
    return BatchIterator(iter(self.dataset), self.identity)


def _check_int(name: str, value: Any, minimum: int):
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
    raise ValueError(f"make_loader: {name} must be an int >= {minimum}, got {value!r}")


def check_packing(packing: str, packing_bins: int, field: str = "packing") -> None:
  """Raises ValueError naming `field` for an unknown packing or a negative bin count."""
  if packing not in PACKINGS:
    raise ValueError(f"{field} must be one of {PACKINGS}, got {packing!r}")
  if isinstance(packing_bins, bool) or not isinstance(packing_bins, (int, np.integer)) \
      or packing_bins < 0:
    raise ValueError(f"{field}_bins must be an int >= 0 (0 = the default), got {packing_bins!r}")


def packing_bins_for(per_process_batch: int, packing_bins: int) -> int:
  """Rows grain packs at once: `packing_bins`, or by default the larger of the batch and
  DEFAULT_PACKING_BINS (more rows give a sample more places to fit, less padding)."""
  return int(packing_bins) if packing_bins else max(per_process_batch, DEFAULT_PACKING_BINS)


def packed(sequences, packing: str, *, seq_len: int, bins: int, seed: int, shuffle: bool,
            padding: dict):
  """grain's first-fit or best-fit packer over samples of per-token features (`padding`
  names them, with the value each pads with)."""
  packer = (grain.experimental.FirstFitPackIterDataset if packing == "first_fit"
            else grain.experimental.BestFitPackIterDataset)
  return packer(sequences, length_struct={k: seq_len for k in padding}, num_packing_bins=bins,
                seed=seed, shuffle_bins=shuffle, padding_struct=padding)


def make_loader(source, tokenizer, *, seq_len: int, batch_size: int, seed: int | None,
                shuffle: bool = True, num_epochs: int | None = None,
                drop_overlong: bool = True, process_index: int = 0, process_count: int = 1,
                worker_count: int = 0, drop_remainder: bool = True, packing: str = "none",
                packing_bins: int = 0, eos_pad_response_to: int | None = None,
                eos_pad_multiple: int = 0) -> Loader:
  """A seeded, sharded, checkpointable grain loader of token rows.

  Args:
    source: random-access source of {"query", "response"[, "source"]}
      records (str or UTF-8 bytes), e.g. `source_of(builder, "train")`.
    tokenizer: `refusion_jax.tokenizer.Tokenizer` (encode_prompt, encode,
      eos_id, pad_id).
    seq_len: length of every row; longer examples are dropped or rejected.
    batch_size: global batch size in rows; each process yields
      batch_size // process_count rows.
    seed: shuffle seed (a non-negative 32-bit int; required when shuffling).
      The same seed gives the same batches, drops included, since dropping
      depends only on the data.
    shuffle: global shuffle, redrawn each epoch.
    num_epochs: None repeats forever.
    drop_overlong: drop (and count, and log) examples longer than seq_len;
      False raises ValueError naming the example instead.
    process_index, process_count: this process's shard (defaults: one
      process). Each process reads a disjoint interleaved share of the
      examples in their shuffled order.
    worker_count: grain worker processes (0: read in this process). Workers
      need absl flags parsed (run under `absl.app.run`).
    drop_remainder: drop a last partial batch (keeps shapes static).
    packing: "none" (one sample per row, right-padded), "first_fit" or
      "best_fit" (grain's packers: samples share rows, each whole, in order of
      arrival into the first / the tightest row with room).
    packing_bins: rows packed at once (0: `packing_bins_for`'s default).
    eos_pad_response_to: None, or EOS-pad every response to at least this many
      tokens (0: to the end of its row), never past the row (the MDM baseline).
    eos_pad_multiple: > 0: then EOS-pad every response to a multiple of this many
      tokens, never past the row (BD3-LM's whole blocks).

  Returns:
    A `Loader`; its iterator yields numpy batches in the packed format of
    `objective.PACKED_KEYS`: int32 `[b, seq_len]` arrays "tokens",
    "segment_ids" (1, 2, ... for the samples of a row, 0 = padding),
    "positions" (within the sample), "segment_prompt_len" and
    "segment_response_len" (its sample's lengths, EOS included).
  """
  _check_int("seq_len", seq_len, 2)
  _check_int("batch_size", batch_size, 1)
  _check_int("process_count", process_count, 1)
  _check_int("worker_count", worker_count, 0)
  check_packing(packing, packing_bins, "make_loader: packing")
  if isinstance(process_index, bool) or not isinstance(process_index, (int, np.integer)) \
      or not 0 <= process_index < process_count:
    raise ValueError(f"make_loader: process_index must be in [0, {process_count}), "
                     f"got {process_index!r}")
  if batch_size % process_count:
    raise ValueError(f"make_loader: batch_size={batch_size} is not divisible by "
                     f"process_count={process_count}")
  if num_epochs is not None:
    _check_int("num_epochs", num_epochs, 1)
  if eos_pad_response_to is not None:
    _check_int("eos_pad_response_to", eos_pad_response_to, 0)
  _check_int("eos_pad_multiple", eos_pad_multiple, 0)
  if shuffle:
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) \
        or not 0 <= seed < 2**32:
      raise ValueError(f"make_loader: seed must be an int in [0, 2**32) when shuffle=True, "
                       f"got {seed!r}")
  for name in ("eos_id", "pad_id"):
    if not isinstance(getattr(tokenizer, name, None), (int, np.integer)):
      raise ValueError(f"make_loader: tokenizer.{name} must be an int, "
                       f"got {getattr(tokenizer, name, None)!r}")
  num_records = len(source)
  if num_records == 0:
    raise ValueError("make_loader: the data source is empty")
  per_process = batch_size // process_count
  seq_len = int(seq_len)
  counter = DropCounter()
  tokenize = Tokenize(tokenizer)
  if worker_count:
    tokenize.__getstate__()  # fail here, not inside a worker, when it cannot be shipped

  ds = grain.MapDataset.source(source)
  if shuffle:
    ds = ds.shuffle(seed=int(seed))
  # Each epoch is shuffled anew (repeat reseeds the shuffle); every process takes every
  # process_count-th example of that stream.
  ds = ds.repeat(num_epochs)[int(process_index)::int(process_count)]
  ds = ds.map(tokenize).filter(_KeepFitting(seq_len, bool(drop_overlong), counter))
  if eos_pad_response_to is not None or eos_pad_multiple:
    ds = ds.map(_PadResponse(
        seq_len, int(tokenizer.eos_id),
        None if eos_pad_response_to is None else int(eos_pad_response_to),
        int(eos_pad_multiple)))
  # Samples are read and tokenized in the thread that packs them (a tokenizer call is
  # ~0.1 ms; grain's read-ahead threads cost more than that to check on); the finished
  # batches are made ahead in one background thread (or worker processes) while the
  # accelerator runs a step.
  rows = ds.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
  if packing == "none":
    rows = rows.map(_Row(seq_len, int(tokenizer.pad_id)))
  else:
    rows = packed(rows.map(_Sequence()), packing, seq_len=seq_len,
                   bins=packing_bins_for(per_process, packing_bins), seed=int(seed or 0),
                   shuffle=shuffle, padding={"tokens": int(tokenizer.pad_id),
                                             "segment_prompt_len": 0, "segment_response_len": 0})
    rows = rows.map(_FromPacked())
  batches = rows.batch(per_process, drop_remainder=drop_remainder)
  if worker_count:
    batches = batches.mp_prefetch(grain.MultiprocessingOptions(num_workers=int(worker_count)))
  else:
    batches = grain.experimental.ThreadPrefetchIterDataset(batches, prefetch_buffer_size=2)
  identity = {"source": repr(source), "seq_len": seq_len, "batch": per_process,
              "shuffle": bool(shuffle), "seed": None if seed is None else int(seed),
              "num_epochs": num_epochs, "drop_overlong": bool(drop_overlong),
              "shard": [int(process_index), int(process_count)], "packing": packing,
              "packing_bins": packing_bins_for(per_process, packing_bins),
              "eos_pad_response_to": eos_pad_response_to}
  if eos_pad_multiple:  # (absent otherwise: positions saved before the field still match)
    identity["eos_pad_multiple"] = int(eos_pad_multiple)
  return Loader(batches, counter, num_records, per_process, identity)


def split_source(data_config, split: str) -> IdentifiedSource:
  """The built source of `config.data.<split>_files` (building it once, on process 0 first)."""
  files = list(data_config[f"{split}_files"])
  if jax.process_count() > 1:
    # Several hosts share the build folder: process 0 builds, the others wait
    # for it and then find the finished build.
    if jax.process_index() == 0:
      prepare({split: files}, data_config["tfds_dir"])
    multihost_utils.sync_global_devices(f"refusion_jax.data.prepare.{split}")
  return source_of(prepare({split: files}, data_config["tfds_dir"]), split)


def loader_from_config(data_config, tokenizer, batch_size: int, split: str = "train",
                       process_index: int = 0, process_count: int = 1,
                       num_epochs: int | None = None, worker_count: int = 0,
                       eos_pad_response_to: int | None = None,
                       eos_pad_multiple: int = 0) -> Loader:
  """Builds (or reuses) the TFDS build of a split's files and returns its loader.

  Args:
    data_config: `config.data` with `train_files`, `eval_files` (lists of
      paths), `seq_len`, `tfds_dir`, `drop_overlong`, `shuffle_seed`, and
      optionally `packing` and `packing_bins` (default: no packing).
    split: "train" (shuffled, repeated unless num_epochs is set) or "eval"
      (file order, one pass, partial last batch kept).
    eos_pad_response_to, eos_pad_multiple: see `make_loader` (the MDM baseline's and
      BD3-LM's EOS padding).
  """
  files_field = {"train": "train_files", "eval": "eval_files"}.get(split)
  if files_field is None:
    raise ValueError(f"loader_from_config: split must be 'train' or 'eval', got {split!r}")
  for field in (files_field, "seq_len", "tfds_dir", "drop_overlong", "shuffle_seed"):
    if field not in data_config:
      raise ValueError(f"loader_from_config: config.data.{field} is missing")
  files = list(data_config[files_field])
  if not files:
    raise ValueError(f"loader_from_config: config.data.{files_field} is empty")
  if not data_config["tfds_dir"]:
    raise ValueError("loader_from_config: config.data.tfds_dir is empty; give a folder for "
                     "the TFDS build")
  packing = data_config.get("packing", "none")
  packing_bins = data_config.get("packing_bins", 0)
  check_packing(packing, packing_bins, "config.data.packing")
  source = split_source(data_config, split)
  training = split == "train"
  return make_loader(
      source, tokenizer, seq_len=data_config["seq_len"], batch_size=batch_size,
      seed=data_config["shuffle_seed"], shuffle=training,
      num_epochs=num_epochs if (training or num_epochs is not None) else 1,
      drop_overlong=data_config["drop_overlong"], process_index=process_index,
      process_count=process_count, worker_count=worker_count, drop_remainder=training,
      packing=packing, packing_bins=packing_bins, eos_pad_response_to=eos_pad_response_to,
      eos_pad_multiple=eos_pad_multiple)
