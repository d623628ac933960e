"""Six miniature tasks a 4-layer, d=128 model can learn on a CPU in minutes.

Texts are short (answers of at most ~25 tokens with a digit-splitting BPE) and
every answer is a pure function of its query, recomputed by each task's
`solve` from the query text for scoring.

  arith    "arith 3+4; 12+5; 7*2"            -> "7; 17; 14"
  sort     "sort 5 3 9 1"                    -> "1 3 5 9"
  reverse  "reverse 5 3 9 1"                 -> "1 9 3 5"
  copy     "copy 5 3 9 1"                    -> "5 3 9 1"
  lookup   "lookup a=3 b=7 c=1 ? b c"        -> "7 1"
  template "template f=sq v=x op=* n=3: def {f}({v}): return {v} {op} {n}"
                                             -> "def sq(x): return x * 3"
"""

from __future__ import annotations

import random
import re
import string

from refusion_jax.tasks.base import Task

# Operand ranges keep every result at most three digits.
_ADD_MAX = 20
_MUL_MAX = 9
_ARITH_TERMS = (2, 4)
_LIST_LEN = (3, 6)
_SORT_MAX = 49
_LIST_MAX = 99
_LOOKUP_KEYS = (3, 5)
_LOOKUP_ASK = (1, 2)
_LOOKUP_MAX = 9
_FUNC_NAMES = ("f", "g", "h", "sq", "inc", "add", "mul", "step")
_VAR_NAMES = ("x", "y", "n", "a", "b", "v")
_OPS = ("+", "-", "*")
_TEMPLATE_MAX = 20
_TEMPLATES = (
    "def {f}({v}): return {v} {op} {n}",
    "def {f}({v}): return [{v}] * {n}",
    "for {v} in range({n}): print({v} {op} 1)",
    "{f} = lambda {v}: {n} {op} {v}",
)

_EXPR = re.compile(r"^(\d+)([+\-*])(\d+)$")


def _body(query: str, name: str) -> str:
  prefix = name + " "
  if not query.startswith(prefix):
    raise ValueError(f"{name}: query must start with {prefix!r}, got {query!r}")
  return query[len(prefix):]


def _ints(text: str, name: str) -> list[int]:
  words = text.split()
  if not words or not all(w.isdigit() for w in words):
    raise ValueError(f"{name}: expected space-separated non-negative integers, got {text!r}")
  return [int(w) for w in words]


def _join(values) -> str:
  return " ".join(str(v) for v in values)


def _rand_list(rng: random.Random, max_value: int) -> list[int]:
  return [rng.randint(0, max_value) for _ in range(rng.randint(*_LIST_LEN))]


# arith ------------------------------------------------------------------------

def _make_arith(rng: random.Random) -> tuple[str, str]:
  exprs, results = [], []
  for _ in range(rng.randint(*_ARITH_TERMS)):
    op = rng.choice(_OPS)
    if op == "*":
      a, b = rng.randint(0, _MUL_MAX), rng.randint(0, _MUL_MAX)
      result = a * b
    elif op == "+":
      a, b = rng.randint(0, _ADD_MAX), rng.randint(0, _ADD_MAX)
      result = a + b
    else:  # Subtraction never goes negative: no minus sign to learn.
      a = rng.randint(0, _ADD_MAX)
      b = rng.randint(0, a)
      result = a - b
    exprs.append(f"{a}{op}{b}")
    results.append(str(result))
  return "arith " + "; ".join(exprs), "; ".join(results)


def _solve_arith(query: str) -> str:
  results = []
  for expr in _body(query, "arith").split(";"):
    match = _EXPR.match(expr.strip())
    if match is None:
      raise ValueError(f"arith: cannot parse expression {expr!r} in {query!r}")
    a, op, b = int(match.group(1)), match.group(2), int(match.group(3))
    results.append(a + b if op == "+" else a - b if op == "-" else a * b)
  return "; ".join(str(r) for r in results)


# lists ------------------------------------------------------------------------

def _make_sort(rng):
  values = _rand_list(rng, _SORT_MAX)
  return "sort " + _join(values), _join(sorted(values))


def _solve_sort(query):
  return _join(sorted(_ints(_body(query, "sort"), "sort")))


def _make_reverse(rng):
  values = _rand_list(rng, _LIST_MAX)
  return "reverse " + _join(values), _join(values[::-1])


def _solve_reverse(query):
  return _join(_ints(_body(query, "reverse"), "reverse")[::-1])


def _make_copy(rng):
  values = _rand_list(rng, _LIST_MAX)
  return "copy " + _join(values), _join(values)


def _solve_copy(query):
  return _join(_ints(_body(query, "copy"), "copy"))


# lookup -----------------------------------------------------------------------

def _make_lookup(rng):
  keys = rng.sample(string.ascii_lowercase, rng.randint(*_LOOKUP_KEYS))
  table = {k: rng.randint(0, _LOOKUP_MAX) for k in keys}
  asked = rng.sample(keys, rng.randint(*_LOOKUP_ASK))
  pairs = " ".join(f"{k}={table[k]}" for k in keys)
  return f"lookup {pairs} ? {' '.join(asked)}", _join(table[k] for k in asked)


def _solve_lookup(query):
  body = _body(query, "lookup")
  if " ? " not in body:
    raise ValueError(f"lookup: query needs ' ? ' between table and keys, got {query!r}")
  pairs, asked = body.split(" ? ", 1)
  table = {}
  for pair in pairs.split():
    key, sep, value = pair.partition("=")
    if not sep or not key:
      raise ValueError(f"lookup: bad pair {pair!r} in {query!r}")
    table[key] = value
  missing = [k for k in asked.split() if k not in table]
  if missing:
    raise ValueError(f"lookup: keys {missing} not in the table of {query!r}")
  return " ".join(table[k] for k in asked.split())


# template ---------------------------------------------------------------------

def _make_template(rng):
  template = rng.choice(_TEMPLATES)
  values = {
      "f": rng.choice(_FUNC_NAMES),
      "v": rng.choice(_VAR_NAMES),
      "op": rng.choice(_OPS),
      "n": str(rng.randint(0, _TEMPLATE_MAX)),
  }
  assignments = " ".join(f"{k}={v}" for k, v in values.items())
  return f"template {assignments}: {template}", template.format(**values)


def _solve_template(query):
  body = _body(query, "template")
  if ": " not in body:
    raise ValueError(f"template: query needs ': ' before the template, got {query!r}")
  assignments, template = body.split(": ", 1)
  values = {}
  for pair in assignments.split():
    key, sep, value = pair.partition("=")
    if not sep or not key:
      raise ValueError(f"template: bad assignment {pair!r} in {query!r}")
    values[key] = value
  try:
    return template.format(**values)
  except (KeyError, IndexError, ValueError) as e:
    raise ValueError(f"template: cannot fill {template!r} with {values}: {e}") from e


TASKS: dict[str, Task] = {
    task.name: task for task in (
        Task("arith", _make_arith, _solve_arith),
        Task("sort", _make_sort, _solve_sort),
        Task("reverse", _make_reverse, _solve_reverse),
        Task("copy", _make_copy, _solve_copy),
        Task("lookup", _make_lookup, _solve_lookup),
        Task("template", _make_template, _solve_template),
    )
}
