"""Scoring given completions through lm-eval, without a model.

A completions file (JSONL) holds one answer per line:

  {"task_id": "HumanEval/0", "completion": "    return sorted(x)\\n"}
  {"doc_id": 17, "task": "mmlu_pro_law", "completion": "... the answer is (C)."}

`task_id` is the document's own `task_id` field (HumanEval's "HumanEval/0",
MBPP's integer id); `doc_id` is lm-eval's document index (its logged samples'
`doc_id`). `task` names the subtask for the groups (mmlu_pro, minerva_math);
it may be omitted for single-task benchmarks. A document may have several
lines: its score is then the mean over them (pass@1 from n samples) and the
benchmark's accuracy the mean of these per-document scores.

`score_completions` answers lm-eval's generate_until requests with these
texts (`ReplayLM`), so a completion goes through the task's own filters and
metrics exactly as a generated answer would. Completions are taken as final
answers (after the model's answer handling: stop sequences cut, code fences
removed).
"""

from __future__ import annotations

import collections
from typing import Any, Mapping, Sequence

import lm_eval
import lm_eval.tasks
from lm_eval.api.model import LM

from refusion_jax import fileio
from refusion_jax.lmeval import GenerativeOnlyError
from refusion_jax.lmeval import benchmarks as benchmarks_lib


class ReplayLM(LM):
  """An lm-eval model that answers each generate_until request with a given completion.

  `completions` maps `(task name, doc_id)` to the text. When the evaluation
  selects documents with simple_evaluate's `samples={task: [doc ids]}`,
  lm-eval numbers the selected documents 0, 1, ... in the requests it sends;
  pass the same `samples` here to translate those numbers back to doc ids.
  """

  def __init__(self, completions: Mapping[tuple[str, int], str],
               samples: Mapping[str, Sequence[int]] | None = None) -> None:
    super().__init__()
    self.completions = dict(completions)
    # lm-eval enumerates the selected documents once each, in dataset order.
    self._selected = {task: sorted(set(ids)) for task, ids in (samples or {}).items()}

  def _doc_id(self, task: str, position: int) -> int:
    selected = self._selected.get(task)
    return position if selected is None else selected[position]

  def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
    out = []
    for request in requests:
      key = (request.task_name, self._doc_id(request.task_name, request.doc_id))
      if key not in self.completions:
        raise KeyError(f"no completion given for task {key[0]!r} doc_id {key[1]}")
      out.append(self.completions[key])
    return out

  def _not_generative(self, requests) -> None:
    tasks = sorted({r.task_name for r in requests})
    raise GenerativeOnlyError(
        f"task(s) {tasks} asked for log-likelihoods: ReplayLM only replays generated "
        "completions (generate_until tasks, e.g. arc_challenge_chat rather than arc_challenge)")

  def loglikelihood(self, requests, disable_tqdm: bool = False):
    self._not_generative(requests)

  def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
    self._not_generative(requests)


def read_completions(path: str) -> list[dict[str, Any]]:
  """The rows of a completions JSONL file (module docstring), validated.

  Each row is returned as given plus `where` ("path:line", for later errors).

  Raises:
    ValueError: naming the line of a malformed row.
  """
  rows = []
  for where, row in fileio.jsonl_rows(path):
    if not isinstance(row, dict):
      raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
    if not isinstance(row.get("completion"), str):
      raise ValueError(f"{where}: expected a string 'completion'")
    if "task_id" not in row and "doc_id" not in row:
      raise ValueError(f"{where}: expected 'task_id' or 'doc_id' naming the document")
    doc_id = row.get("doc_id")
    if "doc_id" in row and (not isinstance(doc_id, int) or isinstance(doc_id, bool) or doc_id < 0):
      raise ValueError(f"{where}: 'doc_id' must be an integer >= 0, got {doc_id!r}")
    if "task_id" in row and not isinstance(row["task_id"], (str, int)):
      raise ValueError(f"{where}: 'task_id' must be a string or an integer, got {row['task_id']!r}")
    if "task" in row and not isinstance(row["task"], str):
      raise ValueError(f"{where}: 'task' must be a string, got {row['task']!r}")
    rows.append({**row, "where": where})
  if not rows:
    raise ValueError(f"{path}: no completions")
  return rows


class _DocIds:
  """Maps a row's `task`/`task_id`/`doc_id` to (leaf task, lm-eval doc id)."""

  def __init__(self, benchmark: benchmarks_lib.Benchmark, tasks: Mapping[str, Any]) -> None:
    self.benchmark = benchmark
    self.tasks = tasks
    self._sizes: dict[str, int] = {}
    self._by_task_id: dict[str, dict[str, int]] = {}

  def size(self, task: str) -> int:
    if task not in self._sizes:
      self._sizes[task] = len(self.tasks[task].eval_docs)
    return self._sizes[task]

  def task_ids(self, task: str) -> dict[str, int]:
    """`{str(doc["task_id"]): doc id}` of a task whose documents carry a task_id."""
    if task not in self._by_task_id:
      ids: dict[str, int] = {}
      for i, doc in enumerate(self.tasks[task].eval_docs):
        if "task_id" not in doc:
          break
        ids[str(doc["task_id"])] = i
      self._by_task_id[task] = ids
    return self._by_task_id[task]

  def resolve(self, row: Mapping[str, Any], index: int) -> tuple[str, int]:
    where = row.get("where", f"completion {index}")
    names = sorted(self.tasks)
    task = row.get("task")
    if task is not None and task not in self.tasks:
      raise ValueError(f"{where}: task {task!r} is not one of {self.benchmark.title}'s "
                       f"tasks {names}")
    if "task_id" in row:
      candidates = [task] if task is not None else names
      found = [(t, self.task_ids(t)[str(row["task_id"])]) for t in candidates
               if str(row["task_id"]) in self.task_ids(t)]
      if not found:
        if not any(self.task_ids(t) for t in candidates):
          raise ValueError(f"{where}: the documents of {candidates} have no task_id field; "
                           "name the document by 'doc_id'")
        raise ValueError(f"{where}: unknown task_id {row['task_id']!r} in {candidates}")
      if len(found) > 1:
        raise ValueError(f"{where}: task_id {row['task_id']!r} occurs in several tasks "
                         f"{[t for t, _ in found]}; name one with 'task'")
      task, doc_id = found[0]
      if "doc_id" in row and row["doc_id"] != doc_id:
        raise ValueError(f"{where}: task_id {row['task_id']!r} is doc_id {doc_id}, "
                         f"not the given doc_id {row['doc_id']}")
      return task, doc_id
    if task is None:
      if len(names) > 1:
        raise ValueError(f"{where}: {self.benchmark.title} has subtasks {names}; name the "
                         "document's subtask with 'task'")
      task = names[0]
    doc_id = row["doc_id"]
    if doc_id >= self.size(task):
      raise ValueError(f"{where}: doc_id {doc_id} is out of range; task {task} has "
                       f"{self.size(task)} documents")
    return task, doc_id


def score_completions(benchmark: benchmarks_lib.Benchmark, completions: Sequence[Mapping[str, Any]],
                      *, data_dir: str | None = None,
                      tm: lm_eval.tasks.TaskManager | None = None,
                      limit: int | None = None) -> dict[str, Any]:
  """Scores completions (rows as `read_completions` returns them) with lm-eval.

  Only the documents that have completions are scored (and of those only doc
  ids below `limit` when given). With several completions per document, the
  j-th completions of all documents are scored in round j. Code tasks run the
  completions as their metrics do for generated programs.

  Returns:
    `{"accuracy": percent, "documents": n, "completions": m, "samples": [...]}`;
    each sample is `{"task", "doc_id", "completion", "answer" (the filtered
    response), "target", "correct"}` in file order of the completions, and
    accuracy is the mean over documents of each document's mean correctness
    under `benchmark.metric`.
  """
  if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit <= 0):
    raise ValueError(f"limit must be a positive int or None, got {limit!r}")
  if not completions:
    raise ValueError(f"{benchmark.title}: no completions to score")
  tm = tm or benchmarks_lib.task_manager(benchmark=benchmark)
  task_dict = benchmarks_lib.load_tasks(benchmark, data_dir=data_dir, tm=tm)
  tasks = task_dict["tasks"]
  doc_ids = _DocIds(benchmark, tasks)

  # Completions of each document in file order; round j takes the j-th.
  per_doc: dict[tuple[str, int], list[int]] = collections.defaultdict(list)
  for i, row in enumerate(completions):
    key = doc_ids.resolve(row, i)
    if limit is None or key[1] < limit:
      per_doc[key].append(i)
  if not per_doc:
    raise ValueError(f"{benchmark.title}: no completion has a doc_id below limit={limit}")

  records: dict[int, dict[str, Any]] = {}
  rounds = max(len(v) for v in per_doc.values())
  for j in range(rounds):
    chosen = {key: rows[j] for key, rows in per_doc.items() if len(rows) > j}
    selection: dict[str, list[int]] = collections.defaultdict(list)
    for task, doc_id in chosen:
      selection[task].append(doc_id)
    selection = {t: sorted(ids) for t, ids in selection.items()}
    replay = ReplayLM({key: completions[i]["completion"] for key, i in chosen.items()},
                      samples=selection)
    results = lm_eval.simple_evaluate(
        model=replay, tasks=[tasks[t] for t in sorted(selection)], task_manager=tm,
        samples=selection, num_fewshot=0, apply_chat_template=False, log_samples=True,
        confirm_run_unsafe_code=True, bootstrap_iters=0)
    for task in selection:
      logged = [s for s in results["samples"].get(task, [])
                if s["filter"] == benchmark.metric_filter]
      if len(logged) != len(selection[task]):
        filters = sorted({s["filter"] for s in results["samples"].get(task, [])})
        raise ValueError(f"{benchmark.title}: lm-eval logged {len(logged)} samples of task "
                         f"{task} under filter {benchmark.metric_filter!r} for "
                         f"{len(selection[task])} documents (filters: {filters}); check "
                         f"Benchmark.metric {benchmark.metric!r}")
      for sample in logged:
        if benchmark.metric_name not in sample:
          raise ValueError(f"{benchmark.title}: task {task}'s samples have no metric "
                           f"{benchmark.metric_name!r} (metrics: {sample.get('metrics')})")
        i = chosen[(task, sample["doc_id"])]
        records[i] = {
            "task": task,
            "doc_id": sample["doc_id"],
            "completion": completions[i]["completion"],
            "answer": sample["filtered_resps"][0],
            "target": sample["target"],
            "correct": float(sample[benchmark.metric_name]),
        }

  per_doc_scores = [sum(records[i]["correct"] for i in rows) / len(rows)
                    for rows in per_doc.values()]
  return {
      "accuracy": 100.0 * sum(per_doc_scores) / len(per_doc_scores),
      "documents": len(per_doc),
      "completions": len(records),
      "samples": [records[i] for i in sorted(records)],
  }
