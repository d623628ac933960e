"""Atomic file writes, a strict JSONL reader, a forgiving JSON reader and a check for
strings that UTF-8 cannot encode.

Writes go to a temporary file in the same folder, renamed into place: a crash
or an error mid-write leaves the old file (or none), never half a file.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any, Iterator


def write_text_atomic(path: str, text: str, make_dirs: bool = False) -> None:
  """Writes `text` to `path`; the folder must exist unless `make_dirs`."""
  path = os.path.abspath(path)
  folder = os.path.dirname(path)
  if make_dirs:
    os.makedirs(folder, exist_ok=True)
  elif not os.path.isdir(folder):
    raise FileNotFoundError(f"folder {folder} of {path} does not exist")
  fd, tmp = tempfile.mkstemp(prefix=".tmp_", dir=folder)
  try:
    with os.fdopen(fd, "w", encoding="utf-8") as f:
      f.write(text)
    # mkstemp makes the file 0600; the written one gets the mode any new file would.
    os.chmod(tmp, 0o666 & ~_umask())
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.remove(tmp)
    raise


def _umask() -> int:
  mask = os.umask(0)  # read by setting it: restored at once
  os.umask(mask)
  return mask


def write_json_atomic(path: str, value: Any) -> None:
  """Writes `value` as indented JSON (creating the folder)."""
  write_text_atomic(path, json.dumps(value, indent=1, ensure_ascii=False) + "\n", make_dirs=True)


def read_json(path: str) -> Any:
  """The JSON value in `path` (UTF-8).

  Raises:
    ValueError: `path: not valid JSON (...)`, also for a number too long to convert
      (over 4,300 digits) or nesting too deep to decode.
  """
  with open(path, encoding="utf-8") as f:
    try:
      return json.load(f)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError too
      raise ValueError(f"{path}: not valid JSON ({e})") from None


def read_json_or_none(path: str) -> Any:
  """The JSON value in `path`, or None when it is missing or not valid JSON.

  For markers and caches, whose absence (or damage) only means redoing the work.
  """
  try:
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  except (OSError, json.JSONDecodeError):
    return None


def not_unicode(x, path: str = ""):
  """(field path, character index) of the first string in a decoded JSON value that
  UTF-8 cannot encode (a lone surrogate such as "\\ud800", which JSON lets through), or
  None. Walks with a stack of its own, so any depth JSON decodes is fine."""
  stack = [(x, path)]
  while stack:
    value, where = stack.pop()
    if isinstance(value, str):
      try:
        value.encode("utf-8")
      except UnicodeEncodeError as e:
        return where, e.start
    elif isinstance(value, dict):
      for k, v in reversed(list(value.items())):  # popped in order: each key, its value
        name = str(k).encode("utf-8", "backslashreplace").decode("utf-8")  # printable
        inner = f"{where}.{name}" if where else name
        stack += [(v, inner), (k, inner)]
    elif isinstance(value, list):
      stack += [(v, f"{where}[{i}]") for i, v in reversed(list(enumerate(value)))]
  return None


def jsonl_rows(path: str) -> Iterator[tuple[str, Any]]:
  """`(where, value)` for each non-blank line of a JSONL file; `where` is 'path:line'.

  Raises:
    ValueError: `path:line: not valid JSON (...)` at the first malformed line, or
      `path:line: ... not valid Unicode` at the first holding a lone surrogate.
  """
  with open(path, encoding="utf-8") as f:
    for number, line in enumerate(f, 1):
      if not line.strip():
        continue
      where = f"{path}:{number}"
      try:
        value = json.loads(line)
      except ValueError as e:  # also a number too long to convert (> 4,300 digits)
        raise ValueError(f"{where}: not valid JSON ({e})") from None
      except RecursionError:
        raise ValueError(f"{where}: not valid JSON here (nested too deeply)") from None
      found = not_unicode(value)
      if found:
        raise ValueError(f"{where}: {found[0] or 'the line'} is not valid Unicode: a lone "
                         f"surrogate at character {found[1]}")
      yield where, value
