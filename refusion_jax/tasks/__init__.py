"""Miniature synthetic task suite in the ReFusion release's JSON format.

  examples = generate(["arith", "sort"], n=100, seed=0)
  write_jsonl("train.jsonl", examples)
  score(example["query"], decoded_text)  # exact match, whitespace-normalised
"""

from __future__ import annotations

import os
from typing import Iterable, Sequence

from refusion_jax.tasks import base
from refusion_jax.tasks.base import Task, normalize, write_jsonl
from refusion_jax.tasks.synthetic import TASKS

__all__ = ["TASKS", "TINY_TEST_FILE", "TINY_TRAIN_FILE", "Task", "generate", "normalize",
           "score", "task_of", "write_jsonl"]

# The bundled splits written by scripts/make_tiny_data.py.
_DATA_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                         "assets", "data")
TINY_TRAIN_FILE = os.path.join(_DATA_DIR, "tiny_train.jsonl")
TINY_TEST_FILE = os.path.join(_DATA_DIR, "tiny_test.jsonl")


def generate(task_names: Sequence[str] | None, n: int, seed: int,
             exclude: Iterable[str] = ()) -> list[dict[str, str]]:
  """`n` distinct {"query", "response"} dicts from `task_names` (None: all tasks).

  The same arguments always give the same list. Pass the train queries as
  `exclude` (and a different seed) to make a disjoint held-out split.
  """
  return base.generate(task_names, n, seed, TASKS, exclude)


def task_of(query: str) -> Task:
  """The registered task whose name is the first word of `query`."""
  return base.task_of(query, TASKS)


def score(query: str, response_text: str) -> bool:
  """True when `response_text` is the exact answer to `query` (whitespace-normalised)."""
  return task_of(query).score(query, response_text)
