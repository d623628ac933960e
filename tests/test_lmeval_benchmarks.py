"""The paper's benchmarks scored through lm-eval's own filters and metrics.

Hand-made documents in each hub repo's format (README.md with a `configs:`
header, data files with the real column names and splits) are read from a
local data folder; hand-written completions (right, wrong, and in the forms
the tasks' extraction must handle) are replayed through `score_completions`
and the accuracies compared with hand-computed ones. Nothing is downloaded:
the hub is switched off and the datasets cache points into a temporary folder.
"""

import dataclasses
import json
import os
import random
import time

import datasets
import huggingface_hub
import lm_eval
import pyarrow as pa
import pyarrow.csv
import pyarrow.parquet
import pytest
import yaml
from lm_eval.api.instance import Instance
from lm_eval.tasks import TaskManager

from refusion_jax.lmeval import benchmarks, replay

MMLU_PRO_SUBJECTS = ("biology", "business", "chemistry", "computer science", "economics",
                     "engineering", "health", "history", "law", "math", "other", "philosophy",
                     "physics", "psychology")
MATH_CONFIGS = {  # hub config -> minerva_math subtask
    "algebra": "minerva_math_algebra",
    "counting_and_probability": "minerva_math_counting_and_prob",
    "geometry": "minerva_math_geometry",
    "intermediate_algebra": "minerva_math_intermediate_algebra",
    "number_theory": "minerva_math_num_theory",
    "prealgebra": "minerva_math_prealgebra",
    "precalculus": "minerva_math_precalc",
}


@pytest.fixture(scope="module", autouse=True)
def _offline(tmp_path_factory):
  """No hub, and a private datasets cache (`datasets` reads both at import time)."""
  with pytest.MonkeyPatch.context() as mp:
    mp.setenv("HF_HUB_OFFLINE", "1")
    mp.setenv("HF_DATASETS_OFFLINE", "1")
    mp.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    mp.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    mp.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path_factory.mktemp("hf_datasets_cache"))
    yield


@pytest.fixture(scope="module")
def tm():
  return benchmarks.task_manager()


@pytest.mark.parametrize("name", list(benchmarks.BENCHMARKS))
def test_a_benchmarks_own_index_gives_what_the_full_index_gives(tm, name):
  # A run indexes only the benchmark's task folders (and ours); the full index is the
  # oracle: the same task or group, the same subtasks, each from the same YAML file with
  # the same config.
  bench = benchmarks.BENCHMARKS[name]
  own = benchmarks.task_manager(benchmark=bench)
  assert len(own.task_index) < len(tm.task_index) / 20
  paths = benchmarks.leaf_dataset_paths(own, bench.task)
  assert paths and paths == benchmarks.leaf_dataset_paths(tm, bench.task)
  for task in [bench.task, *paths]:
    assert own.task_index[task].kind == tm.task_index[task].kind
    assert own.task_index[task].yaml_path == tm.task_index[task].yaml_path
    assert own.task_index[task].cfg == tm.task_index[task].cfg


# ---------------------------------------------------------------------------
# Hub-format data folders.


def _readme(path, configs):
  header = yaml.safe_dump({"configs": configs}, sort_keys=False)
  with open(os.path.join(path, "README.md"), "w") as f:
    f.write(f"---\n{header}---\n\n# Hand-made test copy\n")


def _parquet(path, rows):
  os.makedirs(os.path.dirname(path), exist_ok=True)
  pyarrow.parquet.write_table(pa.Table.from_pylist(rows), path)


def _split_configs(name, splits, prefix):
  return {"config_name": name, "data_files": [
      {"split": s, "path": f"{prefix}{s}-*"} for s in splits]}


def _gsm8k(root):
  repo = os.path.join(root, "openai", "gsm8k")
  test = [
      {"question": "Ann has 40 apples and buys 2. How many?", "answer": "40 + 2 = 42\n#### 42"},
      {"question": "A car costs $250 a week. Four weeks?", "answer": "4 * 250 = 1000\n#### 1,000"},
      {"question": "Half of 36?", "answer": "36 / 2 = 18\n#### 18"},
      {"question": "Two plus three?", "answer": "2 + 3 = 5\n#### 5"},
  ]
  train = [{"question": "One plus one?", "answer": "1 + 1 = 2\n#### 2"}]
  for config in ("main", "socratic"):
    _parquet(os.path.join(repo, config, "test-00000-of-00001.parquet"), test)
    _parquet(os.path.join(repo, config, "train-00000-of-00001.parquet"), train)
  _readme(repo, [_split_configs(c, ("train", "test"), f"{c}/") for c in ("main", "socratic")])


def _arc(root):
  repo = os.path.join(root, "allenai", "ai2_arc")

  def q(i, question, texts, labels, key):
    return {"id": f"Mercury_{i}", "question": question,
            "choices": {"text": texts, "label": labels}, "answerKey": key}
  test = [
      q(0, "Which is a mammal?", ["trout", "whale", "shark", "squid"], list("ABCD"), "B"),
      # Some ARC questions label their choices 1-4; the task maps "3" to "C".
      q(1, "Which is a gas at room temperature?", ["iron", "salt", "oxygen", "wax"],
        list("1234"), "3"),
      q(2, "What does a plant need for photosynthesis?", ["light", "sand", "plastic", "oil"],
        list("ABCD"), "A"),
      # Three choices only.
      q(3, "Which planet is closest to the Sun?", ["Venus", "Mercury", "Mars"], list("ABC"), "B"),
  ]
  other = [q(9, "What melts ice?", ["heat", "cold", "dark", "wind"], list("ABCD"), "A")]
  for config in ("ARC-Challenge", "ARC-Easy"):
    for split, rows in (("train", other), ("validation", other), ("test", test)):
      _parquet(os.path.join(repo, config, f"{split}-00000-of-00001.parquet"), rows)
  _readme(repo, [_split_configs(c, ("train", "test", "validation"), f"{c}/")
                 for c in ("ARC-Challenge", "ARC-Easy")])


MATH_DOCS = {  # config -> [(boxed answer in the reference solution, completion)]
    "algebra": [(r"\frac{1}{2}", r"So $x = \boxed{\frac{1}{2}}$."),
                ("5", "Final Answer: The final answer is $5$. I hope it is correct.")],
    "counting_and_probability": [("10", r"There are $\boxed{12}$ ways.")],
    "geometry": [(r"\frac{1}{2}", "The area is 0.5.")],
    "intermediate_algebra": [("3", "Final Answer: The final answer is $4$. I hope it is correct.")],
    "number_theory": [("7", r"The remainder is $\boxed{7}$.")],
    "prealgebra": [("20", "Final Answer: The final answer is 20. I hope it is correct.")],
    "precalculus": [(r"\pi", r"The period is $\boxed{2\pi}$.")],
}


def _math(root):
  repo = os.path.join(root, "EleutherAI", "hendrycks_math")
  for config, docs in MATH_DOCS.items():
    kind = config.replace("_", " ").title()
    test = [{"problem": f"Problem {i} of {config}.", "level": "Level 2", "type": kind,
             "solution": f"Working. The answer is $\\boxed{{{answer}}}$."}
            for i, (answer, _) in enumerate(docs)]
    train = [{"problem": "What is $1+1$?", "level": "Level 1", "type": kind,
              "solution": r"$1+1=\boxed{2}$."}]
    _parquet(os.path.join(repo, config, "test-00000-of-00001.parquet"), test)
    _parquet(os.path.join(repo, config, "train-00000-of-00001.parquet"), train)
  _readme(repo, [_split_configs(c, ("train", "test"), f"{c}/") for c in MATH_DOCS])


GPQA_DOCS = [  # (question, correct answer, three incorrect answers)
    ("What is the spin of a photon?", "1", ("1/2", "0", "3/2")),
    ("Which gas is a noble gas?", "Argon", ("Nitrogen", "Oxygen", "Chlorine")),
    ("What is the charge of a neutron?", "zero", ("plus one", "minus one", "plus two")),
]


def _gpqa(root):
  repo = os.path.join(root, "Idavidrein", "gpqa")
  os.makedirs(repo)
  rows = [{"Pre-Revision Question": q, "Pre-Revision Correct Answer": right,
           "Question": q, "Correct Answer": right, "Incorrect Answer 1": wrong[0],
           "Incorrect Answer 2": wrong[1], "Incorrect Answer 3": wrong[2],
           "Record ID": f"rec{i}", "High-level domain": "Physics", "Subdomain": "Basics"}
          for i, (q, right, wrong) in enumerate(GPQA_DOCS)]
  # The hub repo keeps one CSV per config (each loads as a single "train" split).
  for config in ("gpqa_main", "gpqa_diamond", "gpqa_extended"):
    pyarrow.csv.write_csv(pa.Table.from_pylist(rows), os.path.join(repo, f"{config}.csv"))
  _readme(repo, [{"config_name": c, "data_files": f"{c}.csv"}
                 for c in ("gpqa_main", "gpqa_diamond", "gpqa_extended")])


def _mmlu_pro(root):
  repo = os.path.join(root, "TIGER-Lab", "MMLU-Pro")
  test = []
  for i, subject in enumerate(MMLU_PRO_SUBJECTS):
    options = [f"{subject} option {j}" for j in range(10)]
    answer_index = (3 * i) % 10
    test.append({"question_id": 70 + i, "question": f"A question about {subject}?",
                 "options": options, "answer": "ABCDEFGHIJ"[answer_index],
                 "answer_index": answer_index, "cot_content": "", "category": subject,
                 "src": f"ori_mmlu-{subject}"})
  validation = [{"question_id": 0, "question": "Which is largest?",
                 "options": ["1", "2", "3", "4"], "answer": "D", "answer_index": 3,
                 "cot_content": "A: Let's think step by step. 4 is largest. The answer is (D).",
                 "category": "math", "src": "cot_lib-math"}]
  _parquet(os.path.join(repo, "data", "test-00000-of-00001.parquet"), test)
  _parquet(os.path.join(repo, "data", "validation-00000-of-00001.parquet"), validation)
  _readme(repo, [{"config_name": "default", "data_files": [
      {"split": "test", "path": "data/test-*"},
      {"split": "validation", "path": "data/validation-*"}]}])


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
  root = str(tmp_path_factory.mktemp("hub_data"))
  for make in (_gsm8k, _arc, _math, _gpqa, _mmlu_pro):
    make(root)
  return root


def _score(name, rows, data_dir, tm, **kwargs):
  return replay.score_completions(benchmarks.get(name), rows, data_dir=data_dir, tm=tm, **kwargs)


def _replayed_results(benchmark, rows, data_dir, tm):
  """simple_evaluate over the whole benchmark (every document answered), as a model run."""
  task_dict = benchmarks.load_tasks(benchmark, data_dir=data_dir, tm=tm)
  lm = replay.ReplayLM({(r["task"], r["doc_id"]): r["completion"] for r in rows})
  return lm_eval.simple_evaluate(model=lm, tasks=benchmarks.top_level(task_dict), task_manager=tm,
                                 num_fewshot=0, bootstrap_iters=0)


# ---------------------------------------------------------------------------
# The table.


def test_benchmarks_follow_the_paper(tm):
  assert [b.title for b in benchmarks.BENCHMARKS.values()] == [
      "MMLU-Pro", "ARC-C", "GSM8K", "MATH", "GPQA", "HumanEval", "MBPP"]
  b = benchmarks.get("math")
  assert (b.task, b.slot_size, b.block_size, b.slot_threshold, b.token_threshold,
          b.gen_length) == ("minerva_math", 32, 64, 0.8, 0.6, 512)
  assert (b.metric_name, b.metric_filter) == ("math_verify", "none")
  # The repos listed are the ones the lm-eval tasks read (HumanEval's problems
  # come from a package: no dataset_path).
  for b in benchmarks.BENCHMARKS.values():
    paths = benchmarks.leaf_dataset_paths(tm, b.task)
    assert set(paths.values()) - {None} == set(b.datasets), b.name
  assert benchmarks.leaf_dataset_paths(tm, "humaneval_instruct_noprefix") == {
      "humaneval_instruct_noprefix": None}
  assert len(benchmarks.leaf_dataset_paths(tm, "mmlu_pro")) == 14
  assert len(benchmarks.leaf_dataset_paths(tm, "minerva_math")) == 7


def test_get_names_the_known_benchmarks():
  assert benchmarks.get("gsm8k").task == "gsm8k_cot"
  with pytest.raises(KeyError, match="unknown benchmark 'gsm8'; known: mmlu_pro, arc_c, gsm8k"):
    benchmarks.get("gsm8")


# ---------------------------------------------------------------------------
# Scoring through each task's filters and metrics.


def test_gsm8k_flexible_and_strict_extraction(data_dir, tm):
  rows = [
      {"doc_id": 0, "completion": "She has 40 + 2 = 42 apples. The answer is 42."},
      {"doc_id": 1, "completion": "Four weeks cost $1,000."},  # $ and , ignored; flexible only
      {"doc_id": 2, "completion": "The answer is 17."},  # wrong
      {"doc_id": 3, "completion": "5"},  # a bare number: flexible only
  ]
  out = _score("gsm8k", rows, data_dir, tm)
  assert out["accuracy"] == pytest.approx(75.0)
  assert (out["documents"], out["completions"]) == (4, 4)
  assert [s["correct"] for s in out["samples"]] == [1.0, 1.0, 0.0, 1.0]
  assert [s["answer"] for s in out["samples"]] == ["42.", "$1,000.", "17.", "5"]
  assert [s["target"] for s in out["samples"]] == ["42", "1,000", "18", "5"]
  strict = dataclasses.replace(benchmarks.get("gsm8k"), metric="exact_match,strict-match")
  out = replay.score_completions(strict, rows, data_dir=data_dir, tm=tm)
  assert out["accuracy"] == pytest.approx(25.0)
  assert [s["answer"] for s in out["samples"]] == ["42", "[invalid]", "17", "[invalid]"]


def test_several_completions_per_document_average_per_document(data_dir, tm):
  rows = [
      {"doc_id": 2, "completion": "The answer is 18."},
      {"doc_id": 0, "completion": "The answer is 42."},
      {"doc_id": 0, "completion": "The answer is 41."},
      {"doc_id": 0, "completion": "It is 42"},
      {"doc_id": 3, "completion": "The answer is 6."},  # beyond limit=3 below
  ]
  out = _score("gsm8k", rows, data_dir, tm)
  # doc 0: 2 of 3 right; doc 2: right; doc 3: wrong -> (2/3 + 1 + 0) / 3.
  assert out["accuracy"] == pytest.approx(100 * (2 / 3 + 1 + 0) / 3)
  assert (out["documents"], out["completions"]) == (3, 5)
  assert [(s["doc_id"], s["correct"]) for s in out["samples"]] == [
      (2, 1.0), (0, 1.0), (0, 0.0), (0, 1.0), (3, 0.0)]
  limited = _score("gsm8k", rows, data_dir, tm, limit=3)
  assert limited["accuracy"] == pytest.approx(100 * (2 / 3 + 1) / 2)
  assert limited["documents"] == 2


def test_math_verify_and_minerva_exact_match(data_dir, tm):
  rows = [{"task": MATH_CONFIGS[config], "doc_id": i, "completion": completion}
          for config, docs in MATH_DOCS.items() for i, (_, completion) in enumerate(docs)]
  out = _score("math", rows, data_dir, tm)
  # math_verify: boxed 1/2, "Final Answer ... 5", 0.5 for 1/2, boxed 7 and
  # "Final Answer ... 20" right; 12 for 10, 4 for 3, 2pi for pi wrong.
  assert [s["correct"] for s in out["samples"]] == [1, 1, 0, 1, 0, 1, 1, 0]
  assert out["accuracy"] == pytest.approx(100 * 5 / 8)
  # Minerva's exact_match only reads the "Final Answer: The final answer is X." form.
  exact = dataclasses.replace(benchmarks.get("math"), metric="exact_match,none")
  out_exact = replay.score_completions(exact, rows, data_dir=data_dir, tm=tm)
  assert [s["correct"] for s in out_exact["samples"]] == [0, 1, 0, 0, 0, 0, 1, 0]
  # The group's own aggregate (what `accuracy` reports for a model run) agrees.
  results = _replayed_results(benchmarks.get("math"), rows, data_dir, tm)
  assert benchmarks.accuracy(results, benchmarks.get("math")) == pytest.approx(100 * 5 / 8)
  assert benchmarks.accuracy(results, exact) == pytest.approx(100 * 2 / 8)


def test_arc_challenge_letter_after_the_gen_prefix(data_dir, tm):
  rows = [
      {"doc_id": 0, "completion": " B"},
      {"doc_id": 1, "completion": " c."},  # label "3" is C; case and punctuation ignored
      {"doc_id": 2, "completion": " D"},  # wrong
      {"doc_id": 3, "completion": " B because Mercury is closest"},  # more than the letter
  ]
  out = _score("arc_c", rows, data_dir, tm)
  assert [s["target"] for s in out["samples"]] == ["B", "C", "A", "B"]
  assert [s["correct"] for s in out["samples"]] == [1.0, 1.0, 0.0, 0.0]
  assert out["accuracy"] == pytest.approx(50.0)


def test_gpqa_shuffled_choices_are_stable(data_dir, tm):
  b = benchmarks.get("gpqa")
  random.seed(5)
  task = benchmarks.load_tasks(b, data_dir=data_dir, tm=tm)["tasks"][b.task]
  assert random.random() == random.Random(5).random()  # the caller's random state is kept
  docs = task.eval_docs
  letters = [doc["answer"] for doc in docs]  # "(A)".."(D)", after process_docs' shuffle
  assert [doc["choices"][ord(letter[1]) - 65] for doc, letter in zip(docs, letters)] == [
      right for _, right, _ in GPQA_DOCS]
  # The shuffle is the one lm-eval's default seed gives, as when simple_evaluate
  # loads the task by name (with two shuffles of these 3 questions among 24**3
  # outcomes, a match by chance is unlikely).
  raw = datasets.Dataset.from_list(
      [{"Question": q, "Correct Answer": right, "Incorrect Answer 1": wrong[0],
        "Incorrect Answer 2": wrong[1], "Incorrect Answer 3": wrong[2]}
       for q, right, wrong in GPQA_DOCS])
  random.seed(0)
  assert [doc["answer"] for doc in task.config.process_docs(raw)] == letters
  wrong = "(A)" if letters[2] != "(A)" else "(B)"
  rows = [
      {"doc_id": 0, "completion": f"Spin one. The answer is {letters[0]}."},
      {"doc_id": 1, "completion": "The noble gas here is argon"},  # the choice's text
      {"doc_id": 2, "completion": f"The answer is {wrong}."},
  ]
  out = _score("gpqa", rows, data_dir, tm)
  assert [s["target"] for s in out["samples"]] == letters
  assert [s["answer"] for s in out["samples"]] == [letters[0], letters[1], wrong]
  assert out["accuracy"] == pytest.approx(100 * 2 / 3)


def test_mmlu_pro_answer_extraction_and_group_aggregate(data_dir, tm):
  rows = []
  for i, subject in enumerate(MMLU_PRO_SUBJECTS):
    right = "ABCDEFGHIJ"[(3 * i) % 10]
    other = "ABCDEFGHIJ"[(3 * i + 1) % 10]
    completion = {0: f"Let's think step by step. The answer is ({right}).",
                  1: f"so the answer is {right}",
                  2: f"The answer is ({other})."}[i % 3]
    if i == 13:
      completion = f"I pick ({right})"  # no "answer is": nothing extracted
    rows.append({"task": "mmlu_pro_" + subject.replace(" ", "_"), "doc_id": 0,
                 "completion": completion})
  out = _score("mmlu_pro", rows, data_dir, tm)
  wrong = {2, 5, 8, 11, 13}
  assert [s["correct"] for s in out["samples"]] == [
      0.0 if i in wrong else 1.0 for i in range(14)]
  assert out["samples"][13]["answer"] == "[invalid]"
  assert out["accuracy"] == pytest.approx(100 * 9 / 14)
  results = _replayed_results(benchmarks.get("mmlu_pro"), rows, data_dir, tm)
  assert benchmarks.accuracy(results, benchmarks.get("mmlu_pro")) == pytest.approx(100 * 9 / 14)


# ---------------------------------------------------------------------------
# Completions by task_id, on a small task of our own.

PROBE_TASK = """\
task: replay_probe
dataset_path: {path}
output_type: generate_until
test_split: test
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
  """A benchmark whose documents carry their own task_id, as HumanEval's and MBPP's do."""
  root = tmp_path_factory.mktemp("probe")
  repo = root / "data" / "me" / "probe"
  _parquet(str(repo / "data" / "test-00000-of-00001.parquet"),
           [{"task_id": f"Probe/{i}", "question": f"{i}+{i}", "answer": str(2 * i)}
            for i in range(4)])
  (root / "tasks").mkdir()
  (root / "tasks" / "probe.yaml").write_text(PROBE_TASK.format(path="me/probe"))
  bench = benchmarks.Benchmark("probe", "Probe", "replay_probe", ("me/probe",),
                               "exact_match,none", 8, 8, 0.9, 0.4)
  tm = TaskManager(include_defaults=False, include_path=str(root / "tasks"))
  return bench, str(root / "data"), tm


def test_completions_by_task_id(probe, tmp_path):
  bench, data_dir, tm = probe
  path = tmp_path / "c.jsonl"
  path.write_text("\n".join(json.dumps(r) for r in [
      {"task_id": "Probe/3", "completion": "6"},
      {"task_id": "Probe/1", "completion": "2"},
      {"task_id": "Probe/1", "completion": "3"},
      {"task_id": "Probe/0", "doc_id": 0, "completion": "1"},
  ]) + "\n")
  rows = replay.read_completions(str(path))
  assert rows[0]["where"] == f"{path}:1"
  out = replay.score_completions(bench, rows, data_dir=data_dir, tm=tm)
  assert [(s["doc_id"], s["correct"]) for s in out["samples"]] == [
      (3, 1.0), (1, 1.0), (1, 0.0), (0, 0.0)]
  assert out["accuracy"] == pytest.approx(100 * (1 + 0.5 + 0) / 3)


@pytest.mark.parametrize("row, needle", [
    ({"task_id": "Probe/9", "completion": "1"}, r"c.jsonl:1: unknown task_id 'Probe/9'"),
    ({"task_id": "Probe/1", "doc_id": 2, "completion": "1"},
     "c.jsonl:1: task_id 'Probe/1' is doc_id 1, not the given doc_id 2"),
    ({"doc_id": 4, "completion": "1"}, "c.jsonl:1: doc_id 4 is out of range; task replay_probe "
                                       "has 4 documents"),
    ({"doc_id": 0, "task": "gsm8k_cot", "completion": "1"},
     r"c.jsonl:1: task 'gsm8k_cot' is not one of Probe's tasks \['replay_probe'\]"),
])
def test_completions_naming_no_document_are_rejected(probe, tmp_path, row, needle):
  bench, data_dir, tm = probe
  path = tmp_path / "c.jsonl"
  path.write_text(json.dumps(row) + "\n")
  with pytest.raises(ValueError, match=needle):
    replay.score_completions(bench, replay.read_completions(str(path)), data_dir=data_dir, tm=tm)


def test_task_id_needs_documents_with_task_ids(data_dir, tm):
  with pytest.raises(ValueError, match=r"completion 0: the documents of \['gsm8k_cot'\] have no task_id"):
    _score("gsm8k", [{"task_id": "x", "completion": "1"}], data_dir, tm)
  with pytest.raises(ValueError, match="MMLU-Pro has subtasks .*name the document's subtask"):
    _score("mmlu_pro", [{"doc_id": 0, "completion": "1"}], data_dir, tm)


@pytest.mark.parametrize("line, needle", [
    ("{not json", "c.jsonl:2: not valid JSON"),
    ('{"doc_id": 1}', "c.jsonl:2: expected a string 'completion'"),
    ('{"completion": "x"}', "c.jsonl:2: expected 'task_id' or 'doc_id'"),
    ('{"doc_id": -1, "completion": "x"}', "c.jsonl:2: 'doc_id' must be an integer >= 0"),
    ('{"doc_id": true, "completion": "x"}', "c.jsonl:2: 'doc_id' must be an integer >= 0"),
    ('["doc_id", 1]', "c.jsonl:2: expected a JSON object, got list"),
    ('{"doc_id": 1, "task": 3, "completion": "x"}', "c.jsonl:2: 'task' must be a string"),
])
def test_read_completions_names_the_bad_line(tmp_path, line, needle):
  path = tmp_path / "c.jsonl"
  path.write_text('{"doc_id": 0, "completion": "ok"}\n' + line + "\n")
  with pytest.raises(ValueError, match=needle):
    replay.read_completions(str(path))


# ---------------------------------------------------------------------------
# Errors.


def test_offline_without_data_names_the_dataset_and_the_remedy(tm):
  start = time.monotonic()
  with pytest.raises(benchmarks.DatasetUnavailableError) as e:
    benchmarks.load_tasks(benchmarks.get("mmlu_pro"), tm=tm)
  assert time.monotonic() - start < 10
  message = str(e.value)
  assert "MMLU-Pro" in message and "HF_HUB_OFFLINE" in message
  assert ("hf download --repo-type dataset TIGER-Lab/MMLU-Pro "
          "--local-dir DATA_DIR/TIGER-Lab/MMLU-Pro") in message
  assert "--config.data_dir=DATA_DIR" in message
  assert isinstance(e.value, FileNotFoundError)


def test_missing_local_copy_names_the_folder(tmp_path, tm):
  with pytest.raises(benchmarks.DatasetUnavailableError,
                     match=f"GPQA: no local copy of the dataset Idavidrein/gpqa at "
                           f"{tmp_path}/Idavidrein/gpqa; .*--local-dir DATA_DIR/Idavidrein/gpqa` "
                           r"\(Idavidrein/gpqa is gated: .*`hf auth login`"):
    benchmarks.load_tasks(benchmarks.get("gpqa"), data_dir=str(tmp_path), tm=tm)
  # A copy without the config the task reads.
  repo = tmp_path / "allenai" / "ai2_arc"
  _parquet(str(repo / "ARC-Easy" / "test-00000-of-00001.parquet"), [{"question": "?"}])
  _readme(str(repo), [_split_configs("ARC-Easy", ("test",), "ARC-Easy/")])
  with pytest.raises(benchmarks.DatasetUnavailableError,
                     match=f"ARC-C: cannot read the dataset allenai/ai2_arc from {repo} .*"
                           "ARC-Challenge"):
    benchmarks.load_tasks(benchmarks.get("arc_c"), data_dir=str(tmp_path), tm=tm)


def test_replay_lm_only_generates():
  lm = replay.ReplayLM({("gsm8k_cot", 0): "42"})
  request = Instance("loglikelihood", {}, ("ctx", " cont"), 0,
                     metadata=("arc_challenge", 0, 1))
  with pytest.raises(replay.GenerativeOnlyError, match=r"\['arc_challenge'\] asked for log-lik"):
    lm.loglikelihood([request])
  generate = Instance("generate_until", {}, ("ctx", {}), 0, metadata=("gsm8k_cot", 1, 1))
  with pytest.raises(KeyError, match="no completion given for task 'gsm8k_cot' doc_id 1"):
    lm.generate_until([generate])
  # Under `samples`, requests number the selected documents 0, 1, ...
  lm = replay.ReplayLM({("gsm8k_cot", 7): "42"}, samples={"gsm8k_cot": [7, 3]})
  assert lm.generate_until([generate]) == ["42"]
