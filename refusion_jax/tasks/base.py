"""Task plumbing: the `Task` record, seeded generation, exact-match scoring.

Examples use the ReFusion release's data format, one dict per example:
`{"query": str, "response": str}`. Every query starts with its task's name, so
a mixed file can be scored without knowing which generator wrote each line.
"""

from __future__ import annotations

import dataclasses
import json
import random
from typing import Callable, Iterable, Mapping, Sequence

from refusion_jax import fileio


def normalize(text: str) -> str:
  """Collapses every run of whitespace to one space and strips the ends."""
  return " ".join(text.split())


@dataclasses.dataclass(frozen=True)
class Task:
  """One synthetic task.

  Attributes:
    name: registry key; also the first word of every query of the task.
    make: draws one example from `rng`; returns (query, reference answer).
    solve: computes the reference answer from the query text alone. Scoring
      uses it, so a response is judged without the generator's hidden state.
  """

  name: str
  make: Callable[[random.Random], tuple[str, str]]
  solve: Callable[[str], str]

  def example(self, rng: random.Random) -> dict[str, str]:
    query, response = self.make(rng)
    if not query.startswith(self.name + " "):
      raise AssertionError(f"task {self.name!r} made a query without its prefix: {query!r}")
    return {"query": query, "response": response}

  def score(self, query: str, response_text: str) -> bool:
    """Exact match of `response_text` against the answer, whitespace-normalised."""
    return normalize(response_text) == normalize(self.solve(query))


def task_of(query: str, tasks: Mapping[str, Task]) -> Task:
  """The task a query belongs to, found by its first word."""
  name = query.split(" ", 1)[0]
  if name not in tasks:
    raise ValueError(
        f"query {query[:60]!r} starts with {name!r}, which is not a task name "
        f"(known: {sorted(tasks)})")
  return tasks[name]


def generate(task_names: Sequence[str] | None, n: int, seed: int,
             tasks: Mapping[str, Task], exclude: Iterable[str] = ()) -> list[dict[str, str]]:
  """`n` distinct examples, tasks in equal shares, in a seeded random order.

  Args:
    task_names: names in `tasks`; None means all of them.
    n: number of examples (queries are unique within the result).
    seed: the result is a function of (task_names, n, seed, exclude) only.
    tasks: the registry to draw from.
    exclude: queries that must not appear (e.g. the train split, when making
      the held-out split).
  """
  if task_names is None:
    task_names = sorted(tasks)
  task_names = list(task_names)
  if not task_names:
    raise ValueError("generate: task_names is empty")
  unknown = [name for name in task_names if name not in tasks]
  if unknown:
    raise ValueError(f"generate: unknown task names {unknown}; known: {sorted(tasks)}")
  if not isinstance(n, int) or n < 0:
    raise ValueError(f"generate: n must be an int >= 0, got {n!r}")
  rng = random.Random(seed)
  seen = set(exclude)
  examples = []
  # A small task space runs out of fresh queries; fail instead of looping forever.
  max_tries = 200 * n + 1000
  tries = 0
  while len(examples) < n:
    task = tasks[task_names[len(examples) % len(task_names)]]
    example = task.example(rng)
    tries += 1
    if tries > max_tries:
      raise ValueError(
          f"generate: found only {len(examples)} of {n} distinct examples in {tries} draws; "
          f"task {task.name!r} has too few distinct queries left")
    if example["query"] in seen:
      continue
    seen.add(example["query"])
    examples.append(example)
  rng.shuffle(examples)
  return examples


def write_jsonl(path: str, examples: Iterable[Mapping[str, str]]):
  """Writes one JSON object per line, atomically (temp file renamed into place)."""
  lines = []
  for i, example in enumerate(examples):
    for field in ("query", "response"):
      if not isinstance(example.get(field), str):
        raise ValueError(f"write_jsonl: example {i} field {field!r} must be a str, "
                         f"got {example.get(field)!r}")
    lines.append(json.dumps({"query": example["query"], "response": example["response"]},
                            ensure_ascii=False) + "\n")
  fileio.write_text_atomic(path, "".join(lines), make_dirs=True)
