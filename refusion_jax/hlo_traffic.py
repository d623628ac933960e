"""HBM traffic of a compiled TPU program, counted from its optimized HLO.

XLA's `cost_analysis()["bytes accessed"]` adds up every operand and output of
every instruction, wherever it lives and however much of it is touched. For a
decoding pass that is far from what moves through HBM: weights prefetched into
on-chip memory are counted again when a fusion reads them there, a gather from
a vocabulary-sized embedding counts the whole table for a few rows, an
in-place cache update fused with other work can count the whole cache twice
for a few entries, and a `while` body (a scan over layers) counts once
whatever its trip count. This
module counts instead, per instruction outside fusions:

* a fusion or plain op: the bytes of its operands and results that live in
  HBM (memory space 0; `S(1)` and above are on-chip and cost no HBM traffic);
  except that an operand a fusion only slices or gathers counts at the size of
  the slice read from it, and an operand a fusion updates in place (scatter,
  dynamic-update-slice into its own buffer) counts at the size of the update,
  read and written;
* `slice-start` / `copy-start` (asynchronous copies between memory spaces):
  the HBM side of the copy;
* a `while`: its body and condition times the trip count read from the
  condition (`compare(counter, constant N)`); when it cannot be read (a traced
  bound), the caller's `unknown_trips` (1 by default);
* a `conditional`: its most expensive branch (the program takes one);
* bookkeeping (tuples, bitcasts, parameters, constants, `*-done`): nothing.

It is an estimate of what a program moves, labelled as such by its users; the
tests check it against hand counts on programs whose traffic is known.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re

_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
          "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "f8e4m3fn": 1, "f8e5m2": 1,
          "s4": 1, "u4": 1}
_ARRAY = re.compile(r"\b(" + "|".join(sorted(_BYTES, key=len, reverse=True))
                    + r")\[([0-9,]*)\](\{[^}]*\})?")
_INSTR = re.compile(r"\s*(?:ROOT\s+)?(%[\w.\-]+)\s*=\s*(.+?)\s+([a-z][\w\-]*)\((.*)$")
_HEADER = re.compile(r"^(?:ENTRY\s+)?(%[\w.\-]+)\s*\(")
_FREE = {"parameter", "tuple", "get-tuple-element", "constant", "bitcast", "after-all",
         "partition-id", "replica-id", "opt-barrier", "slice-done", "copy-done",
         "all-gather-done", "all-reduce-done", "collective-permute-done", "iota"}
_SLICING = {"dynamic-slice", "slice", "gather"}
_IN_PLACE = {"dynamic-update-slice", "scatter"}


def _arrays(shape: str, hbm_only: bool = True) -> int:
  """Bytes of the arrays in a shape string (a tuple counts each element)."""
  total = 0
  for m in _ARRAY.finditer(shape):
    if hbm_only and re.search(r"S\([1-9]\d*\)", m.group(3) or ""):
      continue
    total += math.prod(int(d) for d in m.group(2).split(",") if d) * _BYTES[m.group(1)]
  return total


@dataclasses.dataclass
class _Instr:
  name: str
  shape: str
  op: str
  args: str  # the text between the op's parentheses
  operands: list[str]
  attrs: str
  label: str


@dataclasses.dataclass
class Traffic:
  """HBM bytes of one execution of the entry computation (an estimate)."""

  total: int
  by_label: dict[str, int]  # bytes per source op (jax's op_name metadata)


def _parse(hlo: str) -> tuple[dict[str, list[_Instr]], str]:
  computations: dict[str, list[_Instr]] = {}
  entry, current = "", None
  for line in hlo.splitlines():
    if not line.strip() or line.startswith("HloModule"):
      continue
    if not line.startswith(" ") and line.rstrip().endswith("{"):
      m = _HEADER.match(line)
      current = m.group(1) if m else None
      if current is not None:
        computations[current] = []
        if line.startswith("ENTRY"):
          entry = current
      continue
    if current is None:
      continue
    m = _INSTR.match(line)
    if not m:
      continue
    name, shape, op, rest = m.groups()
    depth, args, attrs = 0, rest, ""
    for i, ch in enumerate(rest):  # the operand list ends at the matching parenthesis
      if ch == "(":
        depth += 1
      elif ch == ")":
        if depth == 0:
          args, attrs = rest[:i], rest[i + 1:]
          break
        depth -= 1
    meta = re.search(r'op_name="([^"]*)"', attrs)
    computations[current].append(_Instr(name, shape, op, args, re.findall(r"%[\w.\-]+", args),
                                        attrs, meta.group(1) if meta else op))
  return computations, entry


def _called(attrs: str, key: str) -> list[str]:
  m = re.search(key + r"=(\{[^}]*\}|%[\w.\-]+)", attrs)
  return re.findall(r"%[\w.\-]+", m.group(1)) if m else []


class _Counter:

  def __init__(self, hlo: str, unknown_trips: int = 1):
    self.comps, self.entry = _parse(hlo)
    self.unknown_trips = unknown_trips
    self.by_label: collections.Counter = collections.Counter()
    self._rules: dict[str, tuple[dict[int, int], dict[int, int]]] = {}

  def _fusion_rules(self, fused: str) -> tuple[dict[int, int], dict[int, int]]:
    """`(read_as, update_of)` of a fused computation: parameter number -> bytes read
    from a parameter it only slices or gathers; parameter number -> bytes of the
    update written into a parameter it updates in place. A parameter passed on to a
    nested fusion takes that fusion's rule for it."""
    if fused not in self._rules:
      self._rules[fused] = ({}, {})  # a cycle (none expected) counts in full
      instrs = self.comps.get(fused, [])
      shapes = {ins.name: ins.shape for ins in instrs}
      uses: dict[str, list[_Instr]] = collections.defaultdict(list)
      for ins in instrs:
        for o in ins.operands:
          uses[o].append(ins)
      read_as, update_of = {}, {}
      for ins in instrs:
        if ins.op != "parameter":
          continue
        number = int(ins.args.strip())
        reads, updates, whole = 0, 0, not uses.get(ins.name)
        for u in uses.get(ins.name, []):
          first = bool(u.operands) and u.operands[0] == ins.name
          if u.op in _SLICING and first:
            reads += _arrays(u.shape, hbm_only=False)
          elif u.op in _IN_PLACE and first:
            # dynamic-update-slice(buffer, update, ...); scatter(buffer, indices, updates)
            update = u.operands[1] if u.op == "dynamic-update-slice" else u.operands[-1]
            updates += _arrays(shapes.get(update, ""), hbm_only=False)
          elif u.op == "fusion" and _called(u.attrs, "calls"):
            inner_read, inner_update = self._fusion_rules(_called(u.attrs, "calls")[0])
            for j, o in enumerate(u.operands):
              if o != ins.name:
                continue
              if j in inner_read:
                reads += inner_read[j]
              elif j in inner_update:
                updates += inner_update[j]
              else:
                whole = True
          else:
            whole = True
        if not whole and not updates:
          read_as[number] = reads
        elif not whole and not reads:
          update_of[number] = updates
      self._rules[fused] = (read_as, update_of)
    return self._rules[fused]

  def cost(self, comp: str, weight: int = 1, seen: tuple = ()) -> int:
    if comp in seen:
      return 0
    shapes = {ins.name: ins.shape for ins in self.comps.get(comp, [])}
    return sum(self._instr_cost(ins, shapes, weight, seen + (comp,))
               for ins in self.comps.get(comp, []))

  def _instr_cost(self, ins: _Instr, shapes: dict[str, str], weight: int, seen: tuple) -> int:
    op = ins.op
    if op in _FREE or op.endswith("-done"):
      return 0
    if op == "while":
      cond = _called(ins.attrs, "condition")
      trips = self._trip_count(cond[0]) if cond else 1
      return trips * sum(self.cost(c, weight * trips, seen)
                         for c in _called(ins.attrs, "body") + cond)
    if op == "conditional":
      branches = _called(ins.attrs, "branch_computations") or (
          _called(ins.attrs, "true_computation") + _called(ins.attrs, "false_computation"))
      return max((self.cost(c, weight, seen) for c in branches), default=0)
    if op == "call":
      return sum(self.cost(c, weight, seen) for c in _called(ins.attrs, "to_apply"))
    source = shapes.get(ins.operands[0], "") if ins.operands else ""
    if op == "slice-start":
      # (source, on-chip slice, ...): the slice is what leaves HBM.
      b = max(_arrays(ins.shape, hbm_only=False) - _arrays(source, hbm_only=False), 0)
    elif op == "copy-start":
      # (destination, source, ...): read where the source is in HBM, write where the
      # destination is.
      b = _arrays(source) + max(_arrays(ins.shape) - _arrays(source), 0)
    elif op == "custom-call" and "ConcatBitcast" in ins.attrs:
      b = 0  # joins pieces already copied on chip
    elif op == "fusion":
      fused = _called(ins.attrs, "calls")
      read_as, update_of = self._fusion_rules(fused[0]) if fused else ({}, {})
      out, b = _arrays(ins.shape), 0
      for i, o in enumerate(ins.operands):
        full = _arrays(shapes.get(o, ""))
        if i in update_of:
          out -= full  # the result is this buffer, updated in place
          b += 2 * min(full, update_of[i])
        elif i in read_as:
          b += min(full, read_as[i])
        else:
          b += full
      b += max(out, 0)
    elif op in _SLICING:
      b = 2 * _arrays(ins.shape)
    elif op in _IN_PLACE and len(ins.operands) > 1:
      update = ins.operands[1] if op == "dynamic-update-slice" else ins.operands[-1]
      b = 2 * _arrays(shapes.get(update, ""))
    else:
      b = _arrays(ins.shape) + sum(_arrays(shapes.get(o, "")) for o in ins.operands)
    self.by_label[ins.label] += b * weight
    return b

  def _trip_count(self, cond: str) -> int:
    """N of the condition's `counter < N` (scans count up from 0); `unknown_trips`
    when unreadable."""
    comps = [cond] + [c for ins in self.comps.get(cond, []) if ins.op == "fusion"
                      for c in _called(ins.attrs, "calls")]
    for comp in comps:
      for ins in self.comps.get(comp, []):
        if ins.op == "constant" and re.fullmatch(r"s32\[\]\S*", ins.shape):
          value = int(ins.args.strip())
          if value > 0:
            return value
    return self.unknown_trips


def hbm_bytes(hlo_text: str, unknown_trips: int = 1) -> Traffic:
  """HBM traffic of one run of the program's entry computation (see the module doc);
  a `while` whose trip count the program computes counts `unknown_trips` trips."""
  counter = _Counter(hlo_text, unknown_trips)
  total = counter.cost(counter.entry)
  return Traffic(total=total, by_label=dict(counter.by_label))
