"""Query/response data: a TFDS builder for the release's JSON format and a grain loader.

Input files hold ReFusion's training format, `{"query": str, "response": str}`
per example, either as one JSON list (`[{...}, {...}]`) or as JSON lines.
Other fields are ignored.

  builder = prepare(["train.jsonl"], data_dir)      # validates, then builds once
  source = source_of(builder, "train")              # random access, no TensorFlow
  loader = make_loader(source, tokenizer, seq_len=256, batch_size=32, seed=0,
                       packing="first_fit")
  it = iter(loader)
  batch = next(it)   # {"tokens", "segment_ids", "positions", "segment_prompt_len",
                     #  "segment_response_len"}: int32 [b, seq_len] each

Each sample is `encode_prompt(query) + encode(response) + [eos]`. With
`packing="none"` every row holds one sample, right-padded with `pad_id`;
with "first_fit" / "best_fit" (grain's `FirstFitPackIterDataset` /
`BestFitPackIterDataset`) samples share rows, each whole and in its own
segment, padding after the last. Either way a batch is in the packed format
that `objective.loss_fn` reads (`objective.PACKED_KEYS`).

Checkpointing the data position: `it.get_state()` / `it.set_state(state)` on
the `BatchIterator`; resuming continues with exactly the batch that would have
come next, and a position saved for other data or settings is refused. For
orbax, grain 0.2.18 ships the handler `grain.checkpoint.CheckpointHandler`
with the args classes `grain.checkpoint.CheckpointSave` / `CheckpointRestore`;
this module exposes them as `ITERATOR_HANDLER`, `IteratorSave` and
`IteratorRestore`:

  manager = ocp.CheckpointManager(dir, item_handlers={
      "params": ocp.StandardCheckpointHandler(),
      "data": data.ITERATOR_HANDLER()})
  manager.save(step, args=ocp.args.Composite(
      params=ocp.args.StandardSave(params), data=data.IteratorSave(it)))
  manager.restore(step, args=ocp.args.Composite(
      params=ocp.args.StandardRestore(abstract), data=data.IteratorRestore(it)))

The handler writes one `process_<i>-of-<n>.json` per JAX process (the
indices come from `jax.process_index()` / `jax.process_count()`), so every
host saves and restores its own shard's position.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import shutil
import threading
from typing import Any, Iterable, Iterator, Mapping, Sequence

from absl import logging
from etils import epath
import grain
import jax
import numpy as np
import tensorflow_datasets as tfds

from refusion_jax import fileio, objective

ITERATOR_HANDLER = grain.checkpoint.CheckpointHandler
IteratorSave = grain.checkpoint.CheckpointSave
IteratorRestore = grain.checkpoint.CheckpointRestore

FIELDS = ("query", "response")
PACKINGS = objective.PACKINGS
# Rows packed at once by default (at least a batch): grain emits them together when a
# sample fits in none, so more of them leave less padding (benchmarks/packing.py).
DEFAULT_PACKING_BINS = 64
# Bump when the stored layout changes, so old builds are not reused.
_LAYOUT_VERSION = "2"  # 2: record keys independent of file paths
# Enough lines to fix a file in one go without flooding the terminal.
_MAX_REPORTED_PROBLEMS = 50


# ------------------------------------------------------------------ parsing

@dataclasses.dataclass(frozen=True)
class _Item:
  """One top-level element of a data file: its line and value, or why it is bad."""

  line: int
  value: Any = None
  problem: str | None = None


def _line_of(text: str, index: int) -> int:
  return text.count("\n", 0, index) + 1


def _malformed(e: Exception) -> str:
  """The problem of a JSON value the decoder refused: a syntax error, a number too long
  to convert (over 4,300 digits) or nesting too deep."""
  if isinstance(e, json.JSONDecodeError):
    return f"malformed JSON ({e.msg}, column {e.colno})"
  if isinstance(e, RecursionError):
    return "malformed JSON (nested too deeply)"
  return f"malformed JSON ({e})"


def _iter_json_list(text: str) -> Iterator[_Item]:
  """Elements of a JSON list with the line each starts on.

  json.loads would lose line numbers, so the list is walked element by
  element with `raw_decode`.
  """
  decoder = json.JSONDecoder()
  ws = " \t\n\r"
  i = text.index("[") + 1
  expect_value = True
  first = True
  while True:
    while i < len(text) and text[i] in ws:
      i += 1
    if i >= len(text):
      yield _Item(_line_of(text, i), problem="malformed JSON (the list is not closed with ']')")
      return
    if text[i] == "]" and (first or not expect_value):
      i += 1
      break
    if not expect_value:
      if text[i] != ",":
        yield _Item(_line_of(text, i),
                    problem=f"malformed JSON (expected ',' or ']' between elements, got {text[i]!r})")
        return
      i += 1
      expect_value = True
      continue
    try:
      value, end = decoder.raw_decode(text, i)
    except (ValueError, RecursionError) as e:
      line = e.lineno if isinstance(e, json.JSONDecodeError) else _line_of(text, i)
      yield _Item(line, problem=_malformed(e))
      return
    yield _Item(_line_of(text, i), value)
    i, first, expect_value = end, False, False
  if text[i:].strip():
    yield _Item(_line_of(text, i), problem="malformed JSON (extra data after the closing ']')")


# A UTF-8 byte order mark some editors write first: not part of the text (as the
# server's JSON bodies and Python's "utf-8-sig" codec take it).
_BOM = b"\xef\xbb\xbf"


def _is_json_list(path: str) -> bool:
  """Whether the first non-whitespace byte of the file (after a BOM) is '['."""
  with open(path, "rb") as f:
    for i, block in enumerate(iter(lambda: f.read(1 << 16), b"")):
      stripped = (block.removeprefix(_BOM) if i == 0 else block).lstrip(b" \t\r\n")
      if stripped:
        return stripped.startswith(b"[")
  return False


def _iter_file(path: str) -> Iterator[_Item]:
  """Elements of a JSON-list or JSONL file; a leading '[' means a JSON list.

  JSONL is streamed line by line, so a big file need not fit in memory; a
  JSON list is one document and is read whole. A leading UTF-8 BOM is skipped.
  """
  if _is_json_list(path):
    with open(path, "rb") as f:
      raw = f.read().removeprefix(_BOM)
    try:
      text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
      yield _Item(raw.count(b"\n", 0, e.start) + 1, problem=f"not UTF-8 text ({e.reason})")
      return
    yield from _iter_json_list(text)
    return
  with open(path, "rb") as f:
    for line_no, raw_line in enumerate(f, start=1):
      if line_no == 1:
        raw_line = raw_line.removeprefix(_BOM)
      try:
        line = raw_line.decode("utf-8")
      except UnicodeDecodeError as e:
        yield _Item(line_no, problem=f"not UTF-8 text ({e.reason})")
        continue
      if not line.strip():
        continue
      try:
        value = json.loads(line)
      except (ValueError, RecursionError) as e:
        yield _Item(line_no, problem=_malformed(e))
        continue
      yield _Item(line_no, value)


def _problem(value: Any) -> str | None:
  """Why `value` is not a usable example, or None."""
  if not isinstance(value, dict):
    return f"expected a JSON object with 'query' and 'response', got {type(value).__name__}"
  for field in FIELDS:
    if field not in value:
      return f"missing field {field!r}"
    if not isinstance(value[field], str):
      return (f"field {field!r} must be a string, got {type(value[field]).__name__} "
              f"{str(value[field])[:40]!r}")
    found = fileio.not_unicode(value[field])
    if found:
      return f"field {field!r} is not valid Unicode: a lone surrogate at character {found[1]}"
  if not value["response"].strip():
    return "empty response"
  return None


def iter_examples(paths: Sequence[str]) -> Iterator[dict[str, str]]:
  """Valid examples of `paths` in file order, each with `source` = 'file:line'.

  Bad elements are skipped here; `validate_files` reports them.
  """
  for path in paths:
    for item in _iter_file(path):
      if item.problem is None and _problem(item.value) is None:
        yield {"query": item.value["query"], "response": item.value["response"],
               "source": f"{path}:{item.line}"}


def validate_files(paths: Sequence[str]) -> int:
  """Checks every file; returns the number of examples.

  Raises:
    ValueError: listing every problem as `file:line: reason` (malformed
      JSON, a missing or non-string field, an empty response, a file without
      examples), or naming a file that does not exist.
  """
  if isinstance(paths, (str, bytes)) or not paths:
    raise ValueError(f"data files must be a non-empty list of paths, got {paths!r}")
  for path in paths:
    if not isinstance(path, str) or not os.path.isfile(path):
      raise ValueError(f"data file {path!r} does not exist (or is not a file)")
  # The trainer checks its files before any work and `prepare` checks them again: a
  # big file is read once while it is unchanged.
  key = tuple((os.path.abspath(p), os.stat(p).st_size, os.stat(p).st_mtime_ns) for p in paths)
  if key in _VALID_FILES:
    return _VALID_FILES[key]
  problems, count = [], 0
  for path in paths:
    in_file = 0
    for item in _iter_file(path):
      reason = item.problem or _problem(item.value)
      if reason is None:
        in_file += 1
      else:
        problems.append(f"{path}:{item.line}: {reason}")
    if in_file == 0 and not any(p.startswith(f"{path}:") for p in problems):
      problems.append(f"{path}:1: no examples in the file")
    count += in_file
  if len(problems) == 1:
    raise ValueError(f"data file {problems[0]}")
  if problems:
    shown = problems[:_MAX_REPORTED_PROBLEMS]
    more = len(problems) - len(shown)
    raise ValueError(f"{len(problems)} problem(s) in the data files:\n  " + "\n  ".join(shown)
                     + (f"\n  ... and {more} more" if more else ""))
  _VALID_FILES[key] = count
  return count


# (path, size, mtime) of each file of a validated list -> its example count.
_VALID_FILES: dict[tuple, int] = {}


def files_digest(paths: Sequence[str]) -> str:
  """A hash of the files' paths and contents, in order: same files, same build.

  The paths count because each stored example names its `file:line`.
  """
  digest = hashlib.sha256(f"layout {_LAYOUT_VERSION}\n".encode())
  for path in paths:
    digest.update(f"file {os.path.abspath(path)} {os.path.getsize(path)}\n".encode())
    with open(path, "rb") as f:
      for block in iter(lambda: f.read(1 << 20), b""):
        digest.update(block)
  return digest.hexdigest()


# -------------------------------------------------------------- TFDS builder

@dataclasses.dataclass(eq=False)
class QueryResponseConfig(tfds.core.BuilderConfig):
  """A build of some JSON files. `name` is derived from their contents' hash.

  Attributes:
    split_files: ((split name, (path, ...)), ...).
  """

  split_files: tuple[tuple[str, tuple[str, ...]], ...] = ()


class QueryResponse(tfds.core.GeneratorBasedBuilder):
  """ReFusion's query/response JSON data as a TFDS dataset (array_record, no TensorFlow).

  Features: `query`, `response` (text) and `source` ('file:line', for error
  messages downstream). Construct it through `prepare`, which validates the
  files first.
  """

  VERSION = tfds.core.Version("1.0.0")
  RELEASE_NOTES = {"1.0.0": "query/response/source text features."}
  BUILDER_CONFIGS = []  # one config per input hash, made by `prepare`
  # Set explicitly: TFDS's own lookup of the defining module needs the
  # `importlib_resources` backport, which is not a dependency of ours.
  code_path = epath.Path(os.path.abspath(__file__))

  def _info(self) -> tfds.core.DatasetInfo:
    # DatasetInfo directly: dataset_info_from_configs would look for metadata
    # files beside this module.
    return tfds.core.DatasetInfo(
        builder=self,
        description="Query/response pairs in the ReFusion release's JSON format.",
        features=tfds.features.FeaturesDict({
            "query": tfds.features.Text(),
            "response": tfds.features.Text(),
            "source": tfds.features.Text(),
        }),
    )

  def _split_generators(self, dl_manager):
    del dl_manager  # local files only
    return {split: self._generate_examples(paths)
            for split, paths in self.builder_config.split_files}

  def _generate_examples(self, paths):
    # TFDS orders the stored records by a hash of these keys, so they name an
    # example by its file's index in the split and its rank in that file, never
    # by the file's path: the same files give the same record order (hence the
    # same shuffled batches for a seed) wherever the checkout lives.
    for file_index, path in enumerate(paths):
      for rank, example in enumerate(iter_examples([path])):
        yield f"{file_index}:{rank}", example


def prepare(json_paths: Sequence[str] | Mapping[str, Sequence[str]],
            data_dir: str) -> QueryResponse:
  """Validates the JSON files and builds them into `data_dir` unless already built.

  Args:
    json_paths: a list of files (one split, "train") or {split: [files]}.
    data_dir: TFDS data directory; the build lands in
      `data_dir/query_response/<hash of the files>/1.0.0`, so changed files
      get a new build and unchanged files reuse the old one.

  Returns:
    The prepared builder; read it with `source_of(builder, split)` (a
    checkpoint-safe wrapper of `builder.as_data_source(split)`), or with
    `tfds.data_source` / `tfds.builder_from_directory(builder.data_dir)`.

  Raises:
    ValueError: every problem in the files as `file:line: reason`, raised
      before anything is written.

  TFDS writes into a temporary folder renamed into place when complete, so
  an interrupted build is never read as a dataset; its `incomplete.*`
  leftover is removed by the next build of the same files. Builds of the same
  files take a lock (`<data_dir>/query_response/<name>.lock`), so concurrent
  runs build once and the others reuse it. Hosts sharing one file system
  should build on process 0 first (then the others reuse it).
  """
  split_files = dict(json_paths) if isinstance(json_paths, Mapping) else {"train": json_paths}
  if not split_files:
    raise ValueError("prepare: json_paths names no split")
  normalized = []
  for split, paths in sorted(split_files.items()):
    if not isinstance(split, str) or not split.isidentifier():
      raise ValueError(f"prepare: split names must be identifiers, got {split!r}")
    if isinstance(paths, (str, bytes)) or not isinstance(paths, Sequence) or not paths:
      raise ValueError(f"prepare: files of split {split!r} must be a non-empty list of paths, "
                       f"got {paths!r}")
    normalized.append(
        (split, tuple(os.path.abspath(os.fspath(p)) if isinstance(p, (str, os.PathLike)) else p
                      for p in paths)))
  # All files at once, so one error lists every problem of every split.
  validate_files(list(dict.fromkeys(p for _, paths in normalized for p in paths)))
  digest = hashlib.sha256()
  for split, paths in normalized:
    digest.update(f"split {split} {files_digest(paths)}\n".encode())
  config = QueryResponseConfig(name=f"files_{digest.hexdigest()[:16]}",
                               description="splits: " + ", ".join(
                                   f"{s}={[os.path.basename(p) for p in ps]}"
                                   for s, ps in normalized),
                               split_files=tuple(normalized))
  data_dir = os.path.abspath(data_dir)
  if os.path.lexists(data_dir) and not os.path.isdir(data_dir):
    raise ValueError(f"TFDS data folder {data_dir!r} exists and is not a folder")
  # One build at a time per set of files: a second process (or run) waits for the
  # first and then finds its build. Under the lock no other build of these files is
  # running, so an `incomplete.*` folder beside the build is a killed build's leftover.
  with _build_lock(os.path.join(data_dir, QueryResponse.name, f"{config.name}.lock")) as locked:
    builder = QueryResponse(config=config, data_dir=data_dir, file_format="array_record")
    if locked and not builder.is_prepared():
      remove_incomplete_builds(os.path.dirname(os.fspath(builder.data_path)))
    builder.download_and_prepare()
  return builder


@contextlib.contextmanager
def _build_lock(path: str) -> Iterator[bool]:
  """Holds an exclusive lock on `path` (created) while inside; yields whether it could.

  A folder that cannot hold one (read-only with a finished build, or a file system
  without locks) still builds and reads, without the lock and without cleaning up.
  """
  try:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    lock = open(path, "a")  # pylint: disable=consider-using-with
  except OSError as e:
    logging.warning("cannot create the build lock %s (%s); building without it", path, e)
    yield False
    return
  with lock:
    try:
      fcntl.flock(lock, fcntl.LOCK_EX)
    except OSError as e:
      logging.warning("cannot lock %s (%s); building without the lock", path, e)
      yield False
      return
    try:
      yield True
    finally:
      fcntl.flock(lock, fcntl.LOCK_UN)


def remove_incomplete_builds(config_dir: str) -> list[str]:
  """Deletes the `incomplete.*` folders a killed TFDS build left in `config_dir`; returns them.

  Call it only while holding the build's lock (see `prepare`).
  """
  removed = []
  if not os.path.isdir(config_dir):
    return removed
  for name in sorted(os.listdir(config_dir)):
    path = os.path.join(config_dir, name)
    if name.startswith("incomplete.") and os.path.isdir(path) and not os.path.islink(path):
      shutil.rmtree(path)
      removed.append(path)
  if removed:
    logging.warning("removed %d unfinished dataset build(s) left by an interrupted run: %s",
                    len(removed), ", ".join(removed))
  return removed


# --------------------------------------------------------------- grain loader

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


class _Tokenize(grain.transforms.Map):
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
      logging.warning("dropped %d over-long example(s) so far; latest: %s", n, message)
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


def _packed(sequences, packing: str, *, seq_len: int, bins: int, seed: int, shuffle: bool,
            padding: dict):
  """grain's first-fit or best-fit packer over samples of per-token features (`padding`
  names them, with the value each pads with)."""
  packer = (grain.experimental.FirstFitPackIterDataset if packing == "first_fit"
            else grain.experimental.BestFitPackIterDataset)
  return packer(sequences, length_struct={k: seq_len for k in padding}, num_packing_bins=bins,
                seed=seed, shuffle_bins=shuffle, padding_struct=padding)


def pack_lengths(lengths: Sequence[int], *, seq_len: int, packing: str,
                 packing_bins: int = 0, batch_size: int = 1) -> Layout:
  """The rows grain's packer (as `make_loader` runs it) makes of samples of these token
  lengths, in this order: a layout estimate from lengths alone, without text."""
  check_packing(packing, packing_bins)
  if packing == "none":
    return Layout(rows=len(lengths), samples=len(lengths), real_tokens=int(sum(lengths)),
                  seq_len=seq_len)
  sequences = grain.MapDataset.source([int(n) for n in lengths]).map(
      lambda n: {"tokens": np.ones((n,), np.int32)}).to_iter_dataset(
          grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
  rows = _packed(sequences, packing, seq_len=seq_len, bins=packing_bins_for(batch_size,
                                                                            packing_bins),
                 seed=0, shuffle=False, padding={"tokens": 0})
  return layout_of(({"segment_ids": row["tokens_segment_ids"][None],
                     "positions": row["tokens_positions"][None]} for row in rows), seq_len)


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
  tokenize = _Tokenize(tokenizer)
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
    rows = _packed(rows.map(_Sequence()), packing, seq_len=seq_len,
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
  loader = make_loader(source, tokenizer, seq_len=seq_len, batch_size=1, seed=seed,
                       shuffle=shuffle, num_epochs=1, drop_overlong=drop_overlong,
                       eos_pad_response_to=eos_pad_response_to,
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
  loader = make_loader(source, tokenizer, seq_len=seq_len, batch_size=batch_size, seed=seed,
                       shuffle=shuffle, num_epochs=1, drop_overlong=drop_overlong,
                       drop_remainder=False, packing=packing, packing_bins=packing_bins,
                       eos_pad_response_to=eos_pad_response_to,
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
  tokenize = _Tokenize(tokenizer)
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
  tokenize = _Tokenize(tokenizer)
  n = 0
  for i in range(len(source)):
    element = tokenize.map(source[i])
    n += len(element["prompt"]) + len(element["response"]) > seq_len
  return n


# ----------------------------------------------------------------- config glue

def split_source(data_config, split: str) -> IdentifiedSource:
  """The built source of `config.data.<split>_files` (building it once, on process 0 first)."""
  files = list(data_config[f"{split}_files"])
  if jax.process_count() > 1:
    # Several hosts share the build folder: process 0 builds, the others wait
    # for it and then find the finished build.
    from jax.experimental import multihost_utils
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
