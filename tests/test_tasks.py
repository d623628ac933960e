"""Tests of the synthetic task suite (refusion_jax.tasks)."""

import json
import os

import pytest

from refusion_jax import tasks
from refusion_jax.tasks import base


# Hand-computed (query, answer) pairs: the oracle for every task's solver.
HAND_CASES = [
    ("copy 52930", "52930"),
    ("copy 7", "7"),
    ("reverse 52930", "03925"),
    ("sort 52930", "02359"),
    ("lookup a=3 b=7 c=1 ? c a", "13"),
    ("lookup q=0 z=9 ? z z q", "990"),
    ("arith 3+4 9-1 8+5", "07 08 13"),
    ("arith 0-0", "00"),
    ("fib 35 plus 0 len 8", "35831459"),
    ("fib 35 plus 1 len 7", "3595517"),
    ("template f=sq v=x op=* n=3: def {f}({v}): return {v} {op} {n}", "def sq(x): return x * 3"),
    ("template f=g v=y op=+ n=12: for {v} in range({n}): print({v} {op} 1)",
     "for y in range(12): print(y + 1)"),
]

WRONG = {
    "copy 52930": "5293",
    "reverse 52930": "52930",
    "sort 52930": "2359",
    "lookup a=3 b=7 c=1 ? c a": "31",
    "arith 3+4 9-1 8+5": "7 8 13",
    "fib 35 plus 0 len 8": "3583145",
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
    if name == "arith":  # single digits, + and - only; two-digit results
      expected = " ".join("%02d" % eval(e) for e in body.split())
    elif name in ("sort", "reverse", "copy"):
      assert len(set(body)) == len(body), ex  # distinct digits
      expected = {"sort": "".join(sorted(body)), "reverse": body[::-1], "copy": body}[name]
    elif name == "lookup":
      table_text, keys = body.split(" ? ")
      table = dict(pair.split("=") for pair in table_text.split())
      expected = "".join(table[k] for k in keys.split())
    elif name == "fib":
      start, _, plus, _, length = body.split()
      digits = [int(start[0]), int(start[1])]
      for _ in range(int(length) - 2):
        digits.append((digits[-1] + digits[-2] + int(plus)) % 10)
      expected = "".join(map(str, digits[:int(length)]))
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
  examples = tasks.generate(None, 140, seed=0)
  names = [ex["query"].split()[0] for ex in examples]
  assert {n: names.count(n) for n in set(names)} == {n: 20 for n in tasks.TASKS}
  assert len({ex["query"] for ex in examples}) == 140


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
  with pytest.raises(ValueError, match="digits"):
    tasks.score("copy 1 2", "12")
  with pytest.raises(ValueError, match="fib"):
    tasks.score("fib 3 plus 1 len 4", "3")


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
  assert len(splits["tiny_train"]) == 20000 and len(splits["tiny_test"]) == 210
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
  valid_file = os.path.join(os.path.dirname(tasks.TINY_TEST_FILE), "tiny_valid.jsonl")
  for path in (tasks.TINY_TRAIN_FILE, tasks.TINY_TEST_FILE, valid_file):
    with open(path, "rb") as f:
      assert (tmp_path / os.path.basename(path)).read_bytes() == f.read()
  queries = {name: {json.loads(line)["query"] for line in open(tmp_path / f"{name}.jsonl")}
             for name in ("tiny_train", "tiny_test", "tiny_valid")}
  assert len(queries["tiny_valid"]) == 210
  assert not queries["tiny_valid"] & (queries["tiny_train"] | queries["tiny_test"])
  # The base corpus shares no query with the held-out splits.
  module.main(["--base_out", str(tmp_path / "base.jsonl"), "--n_base", "700"])
  base = {json.loads(line)["query"] for line in open(tmp_path / "base.jsonl")}
  assert len(base) == 700 and not base & (queries["tiny_valid"] | queries["tiny_test"])


def test_answers_are_short_with_the_tiny_tokenizer():
  from refusion_jax.tokenizer import Tokenizer
  tok = Tokenizer.tiny()
  examples = tasks.generate(None, 600, seed=11)
  longest = max(len(tok.encode(ex["response"])) + 1 for ex in examples)
  assert longest <= 24  # configs/repro_tiny.py: decode.gen_length
  longest_row = max(len(tok.encode_prompt(ex["query"])) + len(tok.encode(ex["response"])) + 1
                    for ex in examples)
  assert longest_row <= 64  # configs/repro_tiny.py: train.data.seq_len
