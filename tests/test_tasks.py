"""Tests of the synthetic task suite (refusion_jax.tasks)."""

import json
import os

import pytest

from refusion_jax import tasks
from refusion_jax.tasks import base


# Hand-computed (query, answer) pairs: the oracle for every task's solver.
HAND_CASES = [
    ("arith 3+4; 12+5; 7*2", "7; 17; 14"),
    ("arith 20-7; 0*9", "13; 0"),
    ("sort 5 3 9 1", "1 3 5 9"),
    ("sort 10 2 2 7", "2 2 7 10"),
    ("reverse 5 3 9 1", "1 9 3 5"),
    ("copy 42 0 7", "42 0 7"),
    ("lookup a=3 b=7 c=1 ? b c", "7 1"),
    ("lookup q=0 z=9 k=4 ? k", "4"),
    ("template f=sq v=x op=* n=3: def {f}({v}): return {v} {op} {n}", "def sq(x): return x * 3"),
    ("template f=g v=y op=+ n=12: for {v} in range({n}): print({v} {op} 1)",
     "for y in range(12): print(y + 1)"),
]

WRONG = {
    "arith 3+4; 12+5; 7*2": "7; 17; 15",
    "sort 5 3 9 1": "1 3 9 5",
    "reverse 5 3 9 1": "5 3 9 1",
    "copy 42 0 7": "42 0",
    "lookup a=3 b=7 c=1 ? b c": "1 7",
    "template f=sq v=x op=* n=3: def {f}({v}): return {v} {op} {n}": "def sq(x): return x + 3",
}


@pytest.mark.parametrize("query,answer", HAND_CASES)
def test_score_accepts_hand_computed_answer(query, answer):
  assert tasks.score(query, answer)
  # Whitespace is normalised: extra spaces and newlines do not matter.
  assert tasks.score(query, "  " + answer.replace(" ", "  \n") + "\n")


@pytest.mark.parametrize("query,wrong", sorted(WRONG.items()))
def test_score_rejects_wrong_answer(query, wrong):
  assert not tasks.score(query, wrong)
  assert not tasks.score(query, "")


def test_every_task_has_a_hand_case():
  assert {q.split()[0] for q, _ in HAND_CASES} == set(tasks.TASKS)


def test_generated_examples_match_independent_recomputation():
  """Each generated answer equals a plain-Python recomputation from the query."""
  examples = tasks.generate(None, 300, seed=3)
  for ex in examples:
    name, body = ex["query"].split(" ", 1)
    if name == "arith":
      expected = "; ".join(str(eval(e)) for e in body.split("; "))  # digits and +-* only
    elif name in ("sort", "reverse", "copy"):
      nums = [int(w) for w in body.split()]
      nums = sorted(nums) if name == "sort" else nums[::-1] if name == "reverse" else nums
      expected = " ".join(map(str, nums))
    elif name == "lookup":
      table_text, keys = body.split(" ? ")
      table = dict(pair.split("=") for pair in table_text.split())
      expected = " ".join(table[k] for k in keys.split())
    else:
      assignments, template = body.split(": ", 1)
      expected = template
      for pair in assignments.split():
        key, value = pair.split("=")
        expected = expected.replace("{" + key + "}", value)
    assert ex["response"] == expected, ex
    assert tasks.score(ex["query"], ex["response"])


def test_generate_is_deterministic_per_seed():
  a = tasks.generate(["sort", "lookup"], 50, seed=7)
  b = tasks.generate(["sort", "lookup"], 50, seed=7)
  c = tasks.generate(["sort", "lookup"], 50, seed=8)
  assert a == b
  assert a != c


def test_generate_balances_tasks_and_dedups():
  examples = tasks.generate(None, 120, seed=0)
  names = [ex["query"].split()[0] for ex in examples]
  assert {n: names.count(n) for n in set(names)} == {n: 20 for n in tasks.TASKS}
  assert len({ex["query"] for ex in examples}) == 120


def test_train_test_disjoint_with_exclude():
  train = tasks.generate(None, 600, seed=0)
  test = tasks.generate(None, 60, seed=1, exclude=[ex["query"] for ex in train])
  assert not {ex["query"] for ex in train} & {ex["query"] for ex in test}
  assert len(test) == 60


def test_generate_rejects_bad_arguments():
  with pytest.raises(ValueError, match="unknown task names"):
    tasks.generate(["nope"], 3, seed=0)
  with pytest.raises(ValueError, match="n must be"):
    tasks.generate(None, -1, seed=0)
  # A tiny task space runs out of distinct queries instead of looping forever.
  tiny = {"t": base.Task("t", lambda rng: (f"t {rng.randint(0, 2)}", "x"), lambda q: "x")}
  with pytest.raises(ValueError, match="distinct examples"):
    base.generate(None, 5, 0, tiny)


def test_score_rejects_unknown_task_and_unparsable_query():
  with pytest.raises(ValueError, match="not a task name"):
    tasks.score("divide 4 2", "2")
  with pytest.raises(ValueError, match="cannot parse"):
    tasks.score("arith 3/4", "0")


def test_write_jsonl_round_trip(tmp_path):
  examples = [{"query": "copy 1 2", "response": "1 2"}, {"query": "é ∑", "response": "ü"}]
  path = tmp_path / "sub" / "x.jsonl"
  tasks.write_jsonl(str(path), examples)
  lines = path.read_text(encoding="utf-8").splitlines()
  assert [json.loads(line) for line in lines] == examples
  with pytest.raises(ValueError, match="response"):
    tasks.write_jsonl(str(path), [{"query": "q", "response": 3}])
  # The failed write left the earlier file intact and no temp file behind.
  assert [json.loads(line) for line in path.read_text().splitlines()] == examples
  assert os.listdir(path.parent) == ["x.jsonl"]


def test_bundled_tiny_data_is_valid_and_disjoint():
  splits = {}
  for name, path in (("tiny_train", tasks.TINY_TRAIN_FILE), ("tiny_test", tasks.TINY_TEST_FILE)):
    with open(path, encoding="utf-8") as f:
      splits[name] = [json.loads(line) for line in f]
  assert len(splits["tiny_train"]) == 4000 and len(splits["tiny_test"]) == 200
  for ex in splits["tiny_train"][:500] + splits["tiny_test"]:
    assert tasks.score(ex["query"], ex["response"])
  train_q = {ex["query"] for ex in splits["tiny_train"]}
  assert not train_q & {ex["query"] for ex in splits["tiny_test"]}


def test_bundled_files_are_what_the_script_writes(tmp_path):
  import importlib.util
  script = os.path.join(os.path.dirname(__file__), "..", "scripts", "make_tiny_data.py")
  spec = importlib.util.spec_from_file_location("make_tiny_data", script)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  module.main(["--out_dir", str(tmp_path)])
  for path in (tasks.TINY_TRAIN_FILE, tasks.TINY_TEST_FILE):
    with open(path, "rb") as f:
      assert (tmp_path / os.path.basename(path)).read_bytes() == f.read()


def test_answers_are_short_with_the_tiny_tokenizer():
  from refusion_jax.tokenizer import Tokenizer
  tok = Tokenizer.tiny()
  examples = tasks.generate(None, 600, seed=11)
  longest = max(len(tok.encode(ex["response"])) + 1 for ex in examples)
  assert longest <= 48
