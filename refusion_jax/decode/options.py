"""How a decoding method declares its options, once (no JAX import).

A method is a frozen dataclass of its own fields (`MethodOptions`), registered
under its name with `register`. Each field is declared with `option`: its
default, a one-line description, its rule (checked when the options are built),
where it goes in a compiled program (`"static"`: the program's `Spec`, one
program per value; `"traced"`: its `Knobs`, never recompiled; `"host"`: read by
a host-side decoder), and whether it is a *switch* (a setting that turns
something on: given a value other than its default to a method that lacks it,
it is refused by name; a plain setting is ignored by the methods that lack it,
so a benchmark's slot size travels with its config whatever the method).

A field may hold a nested group of options selected by name (ReFusion's
`planner`: the threshold rule, the selection policy, MCTS), registered the same
way under its own group.

Everything else is derived from these declarations: `DecodeConfig`'s flat
names (`decode.mdm_cache`, lm-eval's `verify=correct`), the config files'
`decode` fields, lm-eval's model arguments and their error line, the server's
buckets, the static / traced split of every compiled program, the cache keys
and the results files. A new option is one field of its method's class here,
its use in the decoder, and a test.
"""

import dataclasses
import math
import numbers
import types
import typing
from typing import Any, Callable, ClassVar, Mapping

import numpy as np

# --- rules ---------------------------------------------------------------------------------


def is_int(value) -> bool:
  return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_number(value) -> bool:
  return (isinstance(value, numbers.Real) and not isinstance(value, bool)
          and math.isfinite(value))


@dataclasses.dataclass(frozen=True)
class Rule:
  """What a field's value must satisfy: `test(value)`, said as "must `what`"."""

  test: Callable[[Any], bool]
  what: str

  def or_none(self, meaning: str = "") -> "Rule":
    return Rule(lambda v: v is None or self.test(v),
                f"{self.what} or None{f' ({meaning})' if meaning else ''}")


BOOL = Rule(lambda v: isinstance(v, bool), "be a bool")
POSITIVE_INT = Rule(lambda v: is_int(v) and v > 0, "be a positive int")
UNIT = Rule(lambda v: is_number(v) and 0.0 <= v <= 1.0, "lie in [0, 1]")
OPEN_UNIT = Rule(lambda v: is_number(v) and 0.0 < v <= 1.0, "lie in (0, 1]")
NON_NEGATIVE = Rule(lambda v: is_number(v) and v >= 0, "be >= 0")


def non_negative_int(meaning: str) -> Rule:
  return Rule(lambda v: is_int(v) and v >= 0, f"be an int >= 0 ({meaning})")


def one_of(choices: tuple) -> Rule:
  return Rule(lambda v: v in choices, f"be one of {choices}")


# --- declarations --------------------------------------------------------------------------

KINDS = ("static", "traced", "host")


def option(default, doc: str, *, rule: Rule, kind: str = "static", switch: bool | str = False,
           label: str = "", under: str = "") -> Any:
  """A field of a method's options (module docstring); `label` is said beside its name
  in errors (e.g. "tau_remask"). A switch may say what it does ("samples ReFusion's
  infill drafts"), for the error that refuses it to another method. `under` names the
  switch a setting refines (it matters only while that switch is on)."""
  if kind not in KINDS:
    raise ValueError(f"option kind must be one of {KINDS}, got {kind!r}")
  return dataclasses.field(default=default, metadata=dict(
      doc=doc, rule=rule, kind=kind, switch=switch, label=label, group="", under=under))


def choice(group_name: str, default: str, doc: str) -> Any:
  """A field holding a nested group's chosen member, chosen by name from registry group
  `group_name` (`default`: the member a config without the field chooses). Its flat
  value is the member's name; choosing other than the default is a switch."""
  return dataclasses.field(default=None, metadata=dict(
      doc=doc, rule=None, kind="static", switch=True, label="", group=group_name,
      default_member=default))


def label_of(f: dataclasses.Field) -> str:
  label = f.metadata.get("label")
  return f"decode.{f.name}" + (f" ({label})" if label else "")


def check_field(f: dataclasses.Field, value) -> None:
  rule = f.metadata["rule"]
  if not rule.test(value):
    raise ValueError(f"{label_of(f)} must {rule.what}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class MethodOptions:
  """A decoding method's (or a planner's) own options (module docstring).

  Subclasses set `name` and `title`, declare fields with `option`, and override
  `check` (rules between fields and the shared settings), `check_model` (what the
  method needs of a model), `static` and `traced` where a value reaches its
  program other than as itself.
  """

  name: ClassVar[str] = ""
  title: ClassVar[str] = ""  # how messages name it ("ReFusion", "MDM", ...)
  group: ClassVar[str] = "method"  # the registry group it is chosen from
  # Where its compiled program lives (a module that registers it when imported); "" for
  # a host-side decoder, which `host_decoder` names instead.
  module: ClassVar[str] = ""
  host_decoder: ClassVar[str] = ""  # "module:Class" of a host-side decoder ("": compiled)

  def program_module(self, dc) -> str:
    """The module of the program that runs these options (`module`, or a variant's that
    registers a program of its own: `decode.program.program_of`)."""
    return self.module

  def __post_init__(self):
    for f in dataclasses.fields(self):
      value = getattr(self, f.name)
      if f.metadata.get("group"):
        if value is None:  # the group's default member
          value = lookup(f.metadata["group"], f.metadata["default_member"])()
          object.__setattr__(self, f.name, value)
        elif not (isinstance(value, MethodOptions) and value.group == f.metadata["group"]):
          raise ValueError(f"{label_of(f)} must be one of {tuple(registry(f.metadata['group']))}, "
                           f"got {value!r}")
        continue
      if isinstance(value, list):  # a tuple field read back from JSON
        value = tuple(value)
        object.__setattr__(self, f.name, value)
      check_field(f, value)

  # -- what a subclass overrides ----------------------------------------------------------

  def check(self, dc) -> None:
    """Rules between this method's fields and the shared ones of `dc` (a DecodeConfig)."""
    del dc

  def check_model(self, dc, model_config) -> None:
    """What this method needs of a model (its attention, a mask token, ...)."""
    del dc, model_config

  def static(self, dc) -> dict:
    """This method's part of its program's `Spec`: the static fields as they are. An
    entry may also override a shared one (`kv_chunk`, for a method without a cache)."""
    del dc
    return self._by_kind("static")

  def traced(self, dc) -> dict:
    """This method's part of its program's `Knobs`: the traced fields as they are."""
    del dc
    return self._by_kind("traced")

  # -- derived ----------------------------------------------------------------------------

  def _by_kind(self, kind: str) -> dict:
    """The fields of this kind by name (traced ones as numpy scalars of their type)."""
    out = {}
    for f in dataclasses.fields(self):
      value = getattr(self, f.name)
      if isinstance(value, MethodOptions):
        out.update(value._by_kind(kind))  # pylint: disable=protected-access
      elif f.metadata["kind"] == kind:
        out[f.name] = as_knob(f, value) if kind == "traced" else value
    return out

  def members(self) -> list["MethodOptions"]:
    """These options and the nested groups chosen in them."""
    out = [self]
    for f in dataclasses.fields(self):
      value = getattr(self, f.name)
      if isinstance(value, MethodOptions):
        out += value.members()
    return out

  def is_host(self) -> bool:
    """Whether a host-side decoder runs these options (a nested group may choose one)."""
    return any(m.host_decoder for m in self.members())

  def flat(self) -> dict:
    """Every field by its flat name; a nested group as its name, then its own fields."""
    out = {}
    for f in dataclasses.fields(self):
      value = getattr(self, f.name)
      if isinstance(value, MethodOptions):
        out[f.name] = value.name
        out.update(value.flat())
      else:
        out[f.name] = value
    return out

  def get(self, name: str):
    """The value of flat field `name` (KeyError if these options have none)."""
    return self.flat()[name]

  @classmethod
  def from_flat(cls, flat: Mapping[str, Any]) -> "MethodOptions":
    """These options from flat names (those it lacks are left out; see DecodeConfig)."""
    kwargs = {}
    for f in dataclasses.fields(cls):
      group = f.metadata.get("group")
      if group:
        member = lookup(group, flat.get(f.name, f.metadata["default_member"]), label_of(f))
        kwargs[f.name] = member.from_flat(flat)
      elif f.name in flat:
        kwargs[f.name] = flat[f.name]
    return cls(**kwargs)


def own_names(options: MethodOptions) -> set[str]:
  """The flat names `options` holds (its nested groups' as chosen)."""
  return set(options.flat())


# --- the registry --------------------------------------------------------------------------

_REGISTRY: dict[str, dict[str, type[MethodOptions]]] = {}


def register(cls: type[MethodOptions]) -> type[MethodOptions]:
  """Registers `cls` under `cls.group` / `cls.name`; its fields' flat names must not
  clash with another class's unless declared alike (one default, one rule)."""
  if not cls.name or not cls.title:
    raise ValueError(f"{cls.__name__} needs a name and a title")
  for f in dataclasses.fields(cls):
    if f.metadata.get("group"):
      continue
    for other in all_fields().get(f.name, ()):
      if (other.default, other.metadata["rule"].what, other.metadata["kind"]) != (
          f.default, f.metadata["rule"].what, f.metadata["kind"]):
        raise ValueError(f"{cls.__name__}.{f.name} is declared unlike another method's "
                         f"{f.name} (one flat name, one meaning)")
  _REGISTRY.setdefault(cls.group, {})[cls.name] = cls
  return cls


def registry(group: str = "method") -> dict[str, type[MethodOptions]]:
  return _REGISTRY.get(group, {})


def lookup(group: str, name: str, where: str = "") -> type[MethodOptions]:
  members = registry(group)
  if name not in members:
    raise ValueError(f"{where or 'decode.' + group} must be one of {tuple(members)}, got "
                     f"{name!r}")
  return members[name]


def all_fields() -> dict[str, list[dataclasses.Field]]:
  """Every registered field by flat name (a name may be declared by several methods;
  group fields are left out: `group_fields` has them)."""
  out: dict[str, list[dataclasses.Field]] = {}
  for members in _REGISTRY.values():
    for cls in members.values():
      for f in dataclasses.fields(cls):
        if not f.metadata.get("group"):
          out.setdefault(f.name, []).append(f)
  return out


def group_fields() -> dict[str, dataclasses.Field]:
  """The fields that choose a nested group (`planner`), by flat name."""
  out = {}
  for members in _REGISTRY.values():
    for cls in members.values():
      for f in dataclasses.fields(cls):
        if f.metadata.get("group"):
          out[f.name] = f
  return out


def owners(name: str) -> list[type[MethodOptions]]:
  """The registered classes that declare flat field `name`."""
  return [cls for members in _REGISTRY.values() for cls in members.values()
          if any(f.name == name for f in dataclasses.fields(cls))]




def as_knob(f: dataclasses.Field, value):
  """A traced field's value as its program takes it: a numpy scalar of the declared type
  (an int given for a float field stays a float: one program for both)."""
  typ, _ = value_type(f)
  dtype = {bool: np.bool_, int: np.int32, float: np.float32}.get(typ)
  if dtype is None:
    raise ValueError(f"decode.{f.name}: a traced field must be a bool, an int or a float "
                     f"(or give its own traced())")
  return dtype(value)


def value_type(f: dataclasses.Field) -> tuple[type, bool]:
  """(the scalar type, whether None is allowed) of a declared field."""
  t = f.type
  args = typing.get_args(t) if isinstance(t, types.UnionType) else ()
  if args:
    inner = [a for a in args if a is not type(None)]
    return inner[0], type(None) in args
  return t, False
