"""Input files: ReFusion's training format, `{"query": str, "response": str}` per example,
as one JSON list or as JSON lines; every problem named with its file and line."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Any, Iterator, Sequence

from refusion_jax import fileio

FIELDS = ("query", "response")
# Bump when the stored layout changes, so old builds are not reused (part of a build's name).
_LAYOUT_VERSION = "2"  # 2: record keys independent of file paths
# Enough lines to fix a file in one go without flooding the terminal.
_MAX_REPORTED_PROBLEMS = 50


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
