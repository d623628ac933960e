"""The TFDS builder of query/response files: built once per set of files, reused after."""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import io
import os
import shutil
import time
from typing import Iterator, Mapping, Sequence

import tensorflow_datasets as tfds
from etils import epath

from refusion_jax import runtime
from refusion_jax.data.files import files_digest, iter_examples, validate_files


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
    if builder.is_prepared():
      return builder
    splits = ", ".join(f"{split} ({len(ps)} file{'s' if len(ps) > 1 else ''})"
                       for split, ps in normalized)
    runtime.note("data", f"building the TFDS dataset of {splits} in {data_dir} (once; later "
                 "runs reuse it) ...")
    t0 = time.perf_counter()
    if runtime.libraries_quiet():  # TFDS's own bars and "Downloading and preparing" lines
      tfds.disable_progress_bar()
      with contextlib.redirect_stdout(io.StringIO()):
        builder.download_and_prepare()
    else:
      builder.download_and_prepare()
    runtime.note("data", f"built in {time.perf_counter() - t0:.1f}s")
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
    runtime.note("data", "cannot create the build lock %s (%s); building without it", path, e)
    yield False
    return
  with lock:
    try:
      fcntl.flock(lock, fcntl.LOCK_EX)
    except OSError as e:
      runtime.note("data", "cannot lock %s (%s); building without the lock", path, e)
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
    runtime.note("data", "removed %d unfinished dataset build(s) left by an interrupted run: %s",
                    len(removed), ", ".join(removed))
  return removed
