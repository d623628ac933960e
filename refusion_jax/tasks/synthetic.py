"""Seven miniature tasks a 4-layer, d=128 model can learn on a CPU in minutes.

Every answer is a pure function of its query, recomputed by each task's
`solve` from the query text for scoring. Qwen's pre-tokenizer splits numbers
into single digits, so every digit is one token of the tiny tokenizer, the
same token in the query and in the answer, and numbers in answers have a
fixed width: an answer's token positions follow from the query. That is what
lets parallel slot decoding pay off on the first five tasks, whose answer
parts are mutually independent given the query; `fib` is the strongly
sequential control, where each answer digit is a function of the two before
it; `template` fills a small code template (answer parts of varying length).

  copy     "copy 5293"  (distinct digits)   -> "5293"
  reverse  "reverse 5293"                   -> "3925"
  sort     "sort 5293"                      -> "2359"
  lookup   "lookup a=3 b=7 c=1 ? c a"       -> "13"
  arith    "arith 3+4 9-1 8+5"              -> "07 08 13"     (two digits each)
  fib      "fib 35 plus 1 len 7"            -> "3595517"      (x[i] = x[i-1] + x[i-2] + 1 mod 10)
  template "template f=sq v=x op=* n=3: def {f}({v}): return {v} {op} {n}"
                                            -> "def sq(x): return x * 3"
"""

from __future__ import annotations

import random
import re
import string

from refusion_jax.tasks.base import Task

_LETTERS = string.ascii_lowercase
_LIST_LEN = (4, 10)  # copy / reverse / sort: distinct digits
_LOOKUP_KEYS = (4, 8)
_LOOKUP_ASK = (2, 6)
_ARITH_TERMS = (2, 5)  # single-digit + and - (never negative): results 00..18
_FIB_LEN = (5, 16)
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

_EXPR = re.compile(r"^(\d)([+\-])(\d)$")
_FIB = re.compile(r"^(\d)(\d) plus (\d) len (\d+)$")


def _body(query: str, name: str) -> str:
  prefix = name + " "
  if not query.startswith(prefix):
    raise ValueError(f"{name}: query must start with {prefix!r}, got {query!r}")
  return query[len(prefix):]


def _assignments(text: str, name: str, query: str) -> dict[str, str]:
  """"k=v k=v ..." -> {k: v}; a word without "=" or with an empty key is an error."""
  table = {}
  for pair in text.split():
    key, sep, value = pair.partition("=")
    if not sep or not key:
      raise ValueError(f"{name}: bad assignment {pair!r} in {query!r}")
    table[key] = value
  return table


def _digits(text: str, name: str) -> str:
  if not text.isdigit() or not text.isascii():
    raise ValueError(f"{name}: expected a string of digits, got {text!r}")
  return text


def _rand_digits(rng: random.Random, length: tuple[int, int]) -> str:
  """Distinct digits: each occurs once, so a digit names its place in the string."""
  return "".join(rng.sample(string.digits, rng.randint(*length)))


# digit strings -----------------------------------------------------------------

def _make_copy(rng):
  digits = _rand_digits(rng, _LIST_LEN)
  return "copy " + digits, digits


def _solve_copy(query):
  return _digits(_body(query, "copy"), "copy")


def _make_reverse(rng):
  digits = _rand_digits(rng, _LIST_LEN)
  return "reverse " + digits, digits[::-1]


def _solve_reverse(query):
  return _digits(_body(query, "reverse"), "reverse")[::-1]


def _make_sort(rng):
  digits = _rand_digits(rng, _LIST_LEN)
  return "sort " + digits, "".join(sorted(digits))


def _solve_sort(query):
  return "".join(sorted(_digits(_body(query, "sort"), "sort")))


# lookup -----------------------------------------------------------------------

def _make_lookup(rng):
  keys = rng.sample(_LETTERS, rng.randint(*_LOOKUP_KEYS))
  table = {k: str(rng.randint(0, 9)) for k in keys}
  asked = [rng.choice(keys) for _ in range(rng.randint(*_LOOKUP_ASK))]
  pairs = " ".join(f"{k}={table[k]}" for k in keys)
  return f"lookup {pairs} ? {' '.join(asked)}", "".join(table[k] for k in asked)


def _solve_lookup(query):
  body = _body(query, "lookup")
  if " ? " not in body:
    raise ValueError(f"lookup: query needs ' ? ' between table and keys, got {query!r}")
  pairs, asked = body.split(" ? ", 1)
  table = _assignments(pairs, "lookup", query)
  missing = [k for k in asked.split() if k not in table]
  if missing:
    raise ValueError(f"lookup: keys {missing} not in the table of {query!r}")
  return "".join(table[k] for k in asked.split())


# arith ------------------------------------------------------------------------

def _make_arith(rng: random.Random) -> tuple[str, str]:
  exprs, results = [], []
  for _ in range(rng.randint(*_ARITH_TERMS)):
    a = rng.randint(0, 9)
    if rng.random() < 0.5:
      b = rng.randint(0, 9)
      exprs.append(f"{a}+{b}")
      results.append(a + b)
    else:  # Subtraction never goes negative: no minus sign to learn.
      b = rng.randint(0, a)
      exprs.append(f"{a}-{b}")
      results.append(a - b)
  return "arith " + " ".join(exprs), " ".join(f"{r:02d}" for r in results)


def _solve_arith(query: str) -> str:
  results = []
  for expr in _body(query, "arith").split():
    match = _EXPR.match(expr)
    if match is None:
      raise ValueError(f"arith: cannot parse expression {expr!r} in {query!r}")
    a, op, b = int(match.group(1)), match.group(2), int(match.group(3))
    results.append(a + b if op == "+" else a - b)
  return " ".join(f"{r:02d}" for r in results)


# fib --------------------------------------------------------------------------

def _fib_digits(a: int, b: int, plus: int, length: int) -> str:
  digits = [a, b]
  while len(digits) < length:
    digits.append((digits[-1] + digits[-2] + plus) % 10)
  return "".join(str(d) for d in digits[:length])


def _make_fib(rng):
  a, b, plus = rng.randint(0, 9), rng.randint(0, 9), rng.randint(0, 9)
  length = rng.randint(*_FIB_LEN)
  return f"fib {a}{b} plus {plus} len {length}", _fib_digits(a, b, plus, length)


def _solve_fib(query):
  match = _FIB.match(_body(query, "fib"))
  if match is None:
    raise ValueError(f"fib: expected 'fib <digit><digit> plus <digit> len <n>', got {query!r}")
  length = int(match.group(4))
  if length < 2:
    raise ValueError(f"fib: len must be at least 2, got {query!r}")
  return _fib_digits(int(match.group(1)), int(match.group(2)), int(match.group(3)), length)


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
  values = _assignments(assignments, "template", query)
  try:
    return template.format(**values)
  except (KeyError, IndexError, ValueError) as e:
    raise ValueError(f"template: cannot fill {template!r} with {values}: {e}") from e


TASKS: dict[str, Task] = {
    task.name: task for task in (
        Task("copy", _make_copy, _solve_copy),
        Task("reverse", _make_reverse, _solve_reverse),
        Task("sort", _make_sort, _solve_sort),
        Task("lookup", _make_lookup, _solve_lookup),
        Task("arith", _make_arith, _solve_arith),
        Task("fib", _make_fib, _solve_fib),
        Task("template", _make_template, _solve_template),
    )
}
