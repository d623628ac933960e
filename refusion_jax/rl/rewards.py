"""Verifiable rewards for RL: a completion's text against its example, in [0, 1].

Kinds (`--config.reward`):

* `tasks`: the bundled tasks' exact match (`refusion_jax.tasks.score`; rows `{"query"}`).
* `gsm8k`: the last number of the completion equals the number after `####` in the
  row's `answer` (lm-eval's gsm8k "flexible-extract", commas and a trailing period
  dropped).
* `math`: the last `\\boxed{...}` of the completion is equivalent to the row's `answer`
  (or the boxed part of its `solution`) under lm-eval's Minerva MATH normalisation.
* `humaneval` / `mbpp`: the row's tests pass on the completion, run by the sandbox
  (`refusion_jax.lmeval.sandbox`: a subprocess with time and memory limits and no
  network, never in the trainer's process); rows as the benchmarks' (`prompt`, `test`,
  `entry_point`; `test_list`, `test_setup_code`).

A row without `query` is read with its benchmark's own question field (`QUERY_FIELDS`:
GSM8K's "question", MATH's "problem", HumanEval's "prompt", MBPP's "text"), so the
datasets' rows train as they come.

`score_all` never raises for a bad completion: a reward that raises, or does not return
within its time limit, is a zero and one logged line (a hung one is left to a daemon
thread, which never holds the run); only a broken setup (the sandbox
cannot run here) stops the run, before any rollout.
"""

from __future__ import annotations

import re
import threading
import time
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from refusion_jax import tasks
from refusion_jax.lmeval import code, sandbox

KINDS = ("tasks", "gsm8k", "math", "humaneval", "mbpp")
_NUMBER = re.compile(r"-?[$0-9.,]{1,}")


def _number(text: str) -> str | None:
  found = [m for m in _NUMBER.findall(text) if any(ch.isdigit() for ch in m)]
  if not found:
    return None
  return found[-1].replace(",", "").replace("$", "").rstrip(".")


def gsm8k_reward(row: Mapping[str, Any], text: str) -> float:
  gold = str(row["answer"]).split("####")[-1].strip()
  got = _number(text)
  return float(got is not None and got == _number(gold))


def math_reward(row: Mapping[str, Any], text: str) -> float:
  from lm_eval.tasks.minerva_math import utils  # lm-eval (the eval extra): MATH only
  boxed = utils.last_boxed_only_string(text)
  if boxed is None:
    return 0.0
  gold = row.get("answer")
  if gold is None:
    gold = utils.remove_boxed(utils.last_boxed_only_string(row["solution"]))
  got = utils.normalize_final_answer(utils.remove_boxed(boxed))
  return float(utils.is_equiv(got, utils.normalize_final_answer(str(gold))))


def tasks_reward(row: Mapping[str, Any], text: str) -> float:
  return float(tasks.score(row["query"], text))


def _code_reward(kind: str, limits) -> Callable[[Mapping[str, Any], str], float]:

  def reward(row, text):
    program = (code.humaneval_program(row, text) if kind == "humaneval"
               else code.mbpp_program(row, text))
    outcome = sandbox.run_program(program, limits)
    if outcome.status == "timeout":
      raise TimeoutError(f"the tests ran past the sandbox's limits ({outcome.detail[-120:]!r})")
    return float(outcome.passed)
  return reward


def reward_fn(kind: str, sandbox_limits=None) -> Callable[[Mapping[str, Any], str], float]:
  if kind not in KINDS:
    raise ValueError(f"--config.reward must be one of {KINDS}, got {kind!r}")
  if kind in ("humaneval", "mbpp"):
    sandbox.check_platform()  # a sandbox that cannot run here stops the run now
    return _code_reward(kind, sandbox_limits or sandbox.Limits())
  return {"tasks": tasks_reward, "gsm8k": gsm8k_reward, "math": math_reward}[kind]


# The field a benchmark's own rows hold the question in, read as `query` when a row has no
# `query` (GSM8K's "question", MATH's "problem", HumanEval's "prompt", MBPP's "text").
QUERY_FIELDS = {"tasks": (), "gsm8k": ("question",), "math": ("problem",),
                "humaneval": ("prompt",), "mbpp": ("text",)}


def with_query(kind: str, row: Mapping[str, Any]) -> Mapping[str, Any]:
  """`row` with its `query` (its benchmark's question field when it has none)."""
  if "query" in row:
    return row
  for name in QUERY_FIELDS[kind]:
    if name in row:
      return dict(row, query=row[name])
  return row


def check_row(kind: str, row: Mapping[str, Any], where: str) -> None:
  """The fields a reward kind reads, checked when the data is loaded."""
  need = {"tasks": ("query",), "gsm8k": ("query", "answer"), "math": ("query",),
          "humaneval": ("query", "prompt", "test", "entry_point"),
          "mbpp": ("query", "test_list", "test_setup_code")}[kind]
  missing = [f for f in need if f not in row]
  if kind == "math" and "answer" not in row and "solution" not in row:
    missing.append("answer (or solution)")
  if missing:
    raise ValueError(f"{where}: reward {kind!r} needs the fields {missing}")


def score_all(fn, rows: Sequence[Mapping[str, Any]], texts: Sequence[str], *,
              timeout: float, workers: int = 4, log: Callable[[str], None] = print
              ) -> tuple[np.ndarray, int]:
  """`(rewards [N] float32, failures)`: each reward in a daemon thread (`workers` at a
  time), at most `timeout` seconds from its start; one that raises or times out scores 0
  and logs a line. A reward still running past its time is left behind (a daemon: it
  never holds the run or its exit)."""
  n = len(texts)
  out = np.zeros((n,), np.float32)
  done: list[tuple[str, Any] | None] = [None] * n
  failures = 0

  def work(i):
    try:
      done[i] = ("ok", float(fn(rows[i], texts[i])))
    except Exception as e:  # pylint: disable=broad-except
      done[i] = ("raised", e)

  for first in range(0, n, max(1, workers)):
    started = []
    for i in range(first, min(n, first + max(1, workers))):
      thread = threading.Thread(target=work, args=(i,), daemon=True, name=f"reward-{i}")
      thread.start()
      started.append((i, thread, time.monotonic()))
    for i, thread, t0 in started:
      thread.join(max(0.0, timeout - (time.monotonic() - t0)))
      result = done[i]
      if result is None:
        failures += 1
        log(f"reward: sample {i} timed out after {timeout} s; scored 0")
      elif result[0] == "raised":
        failures += 1
        e = result[1]
        log(f"reward: sample {i} raised {type(e).__name__}: {e}; scored 0")
      elif not np.isfinite(result[1]):
        failures += 1
        log(f"reward: sample {i} is {result[1]}; scored 0")
      else:
        out[i] = result[1]
  return out, failures
