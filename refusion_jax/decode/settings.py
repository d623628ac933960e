"""A decode's settings: the ones every method shares and its method's options (no JAX).

`DecodeConfig` holds the shared settings (`Shared`: gen_length, temperature,
ignore_eos, kv_chunk, matmul_precision) and the options of its `method`
(methods.py). Flat names (`DecodeConfig(method="mdm", mdm_cache="dual")`,
`--config.decode.mdm_cache=dual`, lm-eval's `verify=exact`) route to the method's
fields: a name another method owns is ignored when it is a plain setting and
refused by name when it is a switch that this method lacks (options.py).

The flat surfaces are derived here from the registry: `config_dict` (a config
file's `decode`), `from_args` (lm-eval's model arguments), `flat_fields` and
`defaults` (their names), `DecodeConfig.flat` (what results files and cache keys
hold; `from_flat(..., lenient=True)` reads files written when every method's
fields were kept), `summary` (a results table's line), `switches_on` (a log line).
"""

import dataclasses
from typing import Any, Mapping

import ml_collections

from refusion_jax.decode import methods  # noqa: F401  (registers the methods)
from refusion_jax.decode import options as opts
from refusion_jax.decode.options import (
  BOOL,
  NON_NEGATIVE,
  POSITIVE_INT,
  MethodOptions,
  Rule,
  one_of,
  option,
)

MATMUL_PRECISIONS = ("default", "high", "highest")

# decode.kv_chunk=None by platform. CPU: a pass at 16 rows took 0.54-0.91x the time
# of one over the whole buffer, with prompts of 48 or 256 columns (docs/RESULTS.md).
# TPU: the loop runs on the chip; not timed on one. GPU: each trip's condition is
# read by the host, so the whole buffer stays one product there (0).
KV_CHUNK_AUTO = {"cpu": 64, "tpu": 512}
# ... and, where a program's row count is known (the offline Decoder.generate and
# Engine: DecodeConfig.kv_chunk_on's `rows`), only from this many rows on. CPU, one row
# (tiny Qwen3, ReFusion, benchmarks/decode_commits.py): with prompts of 16-32 tokens in
# a buffer of 32 + 64 entries, chunked 0.93x the tokens/s of whole-buffer passes, in
# 64 + 128 entries 1.01-1.03x; only a buffer padded far past its prompt gains (width
# 256: 1.15-1.2x; set decode.kv_chunk=64 there). 16 rows at width 256: 1.3-1.4x.
KV_CHUNK_AUTO_MIN_ROWS = {"cpu": 2}
# DecodeConfig.matmul_precision when unset, per platform (absent: JAX's default). A GPU
# computes float32 matrix products in TF32 by default, whose rounding depends on the
# kernel a product's shape selects: a prompt's greedy answer could then change with what
# it is batched or prefilled with.
MATMUL_PRECISION_AUTO = {"gpu": "highest"}


_KV_CHUNK = Rule(lambda v: opts.is_int(v) and v >= 0, "be an int >= 0 (0: the whole buffer)")


@dataclasses.dataclass(frozen=True)
class Shared:
  """The settings every method shares (DecodeConfig's own fields, besides `method`)."""

  gen_length: int = option(128, "response tokens to generate at most (EOS stops earlier)",
                           rule=POSITIVE_INT)
  temperature: float = option(0.0, "0 = greedy; > 0 samples (Gumbel noise on the diffusion "
                              "drafts)", rule=NON_NEGATIVE, kind="traced")
  ignore_eos: bool = option(False, "EOS ends nothing: every answer is gen_length tokens (a "
                            "load test with fixed answer lengths)", rule=BOOL, kind="traced")
  kv_chunk: int | None = option(
      None, "KV entries attention reads at a time, up to the longest row's live part (0: "
      "the whole buffer at once; unset: 64 on CPU, 512 on TPU, 0 on GPU)",
      rule=_KV_CHUNK.or_none("per platform"))
  matmul_precision: str | None = option(
      None, "float32 matrix products: 'default', 'high' or 'highest' (unset: 'highest' on "
      "GPUs, whose TF32 could make a greedy answer depend on its batch; JAX's elsewhere)",
      rule=one_of(MATMUL_PRECISIONS).or_none("per platform"))


SHARED_FIELDS = {f.name: f for f in dataclasses.fields(Shared)}
METHOD_DOC = "the decoding method: " + ", ".join(
    f"{name!r} ({cls.title})" for name, cls in opts.registry().items())


def method_names() -> tuple[str, ...]:
  return tuple(opts.registry())


def _foreign(name: str, value, method: str) -> None:
  """Refuses flat field `name` (which `method` lacks) where it is a switch that is on."""
  if name in opts.group_fields():
    f = opts.group_fields()[name]
    on = value != f.metadata["default_member"]
  else:
    fields = opts.all_fields()[name]
    f = fields[0]
    on = f.metadata["switch"] and value != f.default
  if not on:
    return  # a setting another method reads: ignored here
  owner = opts.owners(name)[0]
  what = f.metadata["switch"] if isinstance(f.metadata["switch"], str) else (
      f"is one of {owner.title}'s options")
  raise ValueError(f"decode.{name}={value!r} {what}; it needs decode.method={owner.name!r} "
                   f"(decode.method={method!r} has none)")


@dataclasses.dataclass(frozen=True, init=False)
class DecodeConfig:
  """Decoding settings (hashable: one compiled program per static value).

  `DecodeConfig(method, gen_length, ..., options=...)`, or with flat names
  (`DecodeConfig(method="mdm", block_size=8, mdm_cache="dual")`), which route to
  the method's options (module docstring). Reading a flat name (`dc.mdm_cache`)
  reads the method's field; another method's switch reads as off (its default), another
  method's setting is an AttributeError naming its owner.
  """

  method: str
  gen_length: int
  temperature: float
  ignore_eos: bool
  kv_chunk: int | None
  matmul_precision: str | None
  options: MethodOptions

  def __init__(self, method: str = "refusion", gen_length: int = 128, temperature: float = 0.0,
               ignore_eos: bool = False, kv_chunk: int | None = None,
               matmul_precision: str | None = None, options: MethodOptions | None = None,
               **flat):
    if method not in opts.registry():
      raise ValueError(f"decode.method must be one of {method_names()}, got {method!r}")
    shared = dict(gen_length=gen_length, temperature=temperature, ignore_eos=ignore_eos,
                  kv_chunk=kv_chunk, matmul_precision=matmul_precision)
    for name, value in shared.items():
      opts.check_field(SHARED_FIELDS[name], value)
    known = set(opts.all_fields()) | set(opts.group_fields())
    unknown = sorted(set(flat) - known)
    if unknown:
      raise ValueError(f"unknown decode field(s) {unknown}; known: "
                       f"{sorted(known | set(SHARED_FIELDS) | {'method'})}")
    cls = opts.registry()[method]
    carried = {}
    if options is not None:
      if not isinstance(options, MethodOptions) or options.group != "method":
        raise ValueError(f"decode options must be a method's MethodOptions, got {options!r}")
      # Another method's options (a replace of `method`): what the new one shares is kept.
      carried = options.flat()
    chosen = cls.from_flat({**carried, **flat})
    own = set(chosen.flat())
    for name, value in flat.items():
      if name not in own:
        _foreign(name, value, method)
    object.__setattr__(self, "method", method)
    for name, value in shared.items():
      object.__setattr__(self, name, value)
    object.__setattr__(self, "options", chosen)
    for member in chosen.members():
      member.check(self)

  def __getattr__(self, name: str):
    # Only called when normal lookup fails: a flat name or a property of the options.
    options = self.__dict__.get("options")
    if options is None or name.startswith("__"):
      raise AttributeError(name)
    flat = options.flat()  # a nested group by its name (dc.planner == "mcts")
    if name in flat:
      return flat[name]
    for member in options.members():
      if isinstance(getattr(type(member), name, None), property):
        return getattr(member, name)
    if name in opts.group_fields():  # another method's switch reads as off
      return opts.group_fields()[name].metadata["default_member"]
    declared = opts.all_fields().get(name)
    if declared and declared[0].metadata["switch"]:
      return declared[0].default
    if declared:
      raise AttributeError(f"decode.{name} belongs to "
                           f"{', '.join(c.title for c in opts.owners(name))}; this config's "
                           f"decode.method is {self.method!r}")
    raise AttributeError(f"DecodeConfig has no field {name!r}")

  def __reduce__(self):  # pickled by its fields (the server passes configs to its engine)
    return (_from_fields, (self.method, self.shared(), self.options))

  def shared(self) -> dict:
    return {name: getattr(self, name) for name in SHARED_FIELDS}

  def flat(self) -> dict:
    """The settings by flat name: the method, the shared ones, then the method's own
    (what results files and cache keys hold). Read one by one, so that `replace()`
    re-checks an instance whose fields were altered after construction."""
    names = ["method", *SHARED_FIELDS, *self.options.flat()]
    return {name: getattr(self, name) for name in names}

  def summary(self) -> dict:
    """What a results table says of a decode: gen_length, the method's settings that are
    set (not None, and their switch on), then its switches that are on, by flat name."""
    out, on = {"gen_length": self.gen_length}, self.switches_on()
    for member in self.options.members():
      for f in dataclasses.fields(member):
        value = getattr(member, f.name)
        if (f.metadata.get("group") or f.metadata["switch"] or value is None
            or (f.metadata["under"] and f.metadata["under"] not in on)):
          continue
        out[f.name] = value
    return {**out, **on}

  def switches_on(self) -> dict:
    """The method's switches that are on (not at their defaults), by flat name: what a
    log line names beside the method."""
    out = {}
    for member in self.options.members():
      for f in dataclasses.fields(member):
        value = getattr(member, f.name)
        if f.metadata.get("group"):
          if value.name != f.metadata["default_member"]:
            out[f.name] = value.name
        elif f.metadata["switch"] and value != f.default:
          out[f.name] = value
    return out

  def replace(self, **changes) -> "DecodeConfig":
    """A copy with `changes` (flat names), every check run again. A new `method` keeps
    the shared settings and the fields the new method also has (its block size, ...),
    its defaults otherwise."""
    flat = self.flat()
    method = changes.pop("method", flat.pop("method"))
    shared = {k: changes.pop(k, flat.pop(k)) for k in SHARED_FIELDS}
    if method == self.method:
      return DecodeConfig(method, **shared, **{**flat, **changes})
    return DecodeConfig(method, **shared, options=self.options, **changes)

  @property
  def is_host(self) -> bool:
    """Whether a host-side decoder runs it (the MCTS planner), not a compiled program."""
    return self.options.is_host()

  @property
  def host_decoder(self) -> str:
    """"module:Class" of the host-side decoder that runs it ("" for a compiled program)."""
    return next((m.host_decoder for m in self.options.members() if m.host_decoder), "")

  def require_compiled(self, where: str) -> None:
    """Refuses a host-side decoder, naming `where` (an entry point that compiles)."""
    if self.is_host:
      host = next(m for m in self.options.members() if m.host_decoder)
      raise ValueError(f"decode.{host.group}={host.name!r} is a host-driven search; {where} "
                       f"runs compiled decoders only (decode.{host.group} one of "
                       f"{tuple(n for n, c in opts.registry(host.group).items() if not c.host_decoder)})")

  @property
  def num_blocks(self) -> int:
    """Blocks of the response (1 for a method without blocks)."""
    block = self.options.flat().get("block_size")
    return self.gen_length // block if block else 1

  @property
  def slots_per_block(self) -> int:
    return self.options.block_size // self.options.slot_size

  def kv_chunk_on(self, platform: str, rows: int | None = None) -> int:
    """`kv_chunk` as a decode on `platform` ("cpu", "gpu", "tpu") uses it, in a
    program over `rows` rows (None: any number; a set `kv_chunk` holds for every
    row count, the platform's default only from KV_CHUNK_AUTO_MIN_ROWS rows on)."""
    if self.kv_chunk is not None:
      return self.kv_chunk
    if rows is not None and rows < KV_CHUNK_AUTO_MIN_ROWS.get(platform, 1):
      return 0
    return KV_CHUNK_AUTO.get(platform, 0)

  def matmul_precision_on(self, platform: str) -> str | None:
    """`matmul_precision` as a decode on `platform` uses it (None: JAX's default)."""
    if self.matmul_precision is not None:
      return self.matmul_precision
    return MATMUL_PRECISION_AUTO.get(platform)

  def check_fits(self, model_config, prompt_len: int) -> None:
    """Fails (before any compile) when the method cannot decode this model (its
    attention, a mask token) or prompt + generation exceed the model's positions."""
    total = prompt_len + self.gen_length
    if total > model_config.max_position_embeddings:
      raise ValueError(
          f"prompt length {prompt_len} + decode.gen_length {self.gen_length} = {total} exceeds "
          f"the model's max_position_embeddings={model_config.max_position_embeddings}")
    for member in self.options.members():
      member.check_model(self, model_config)

  @classmethod
  def from_flat(cls, flat: Mapping[str, Any], *, lenient: bool = False) -> "DecodeConfig":
    """A config from flat names (a results file's `decode`, a cache key). `lenient`:
    fields the method lacks are dropped whatever their value (files written when every
    method's fields were kept, some of them inert)."""
    flat = dict(flat)
    method = flat.pop("method", "refusion")
    shared = {k: flat.pop(k) for k in list(flat) if k in SHARED_FIELDS}
    if lenient and method in opts.registry():
      own = set(opts.registry()[method].from_flat(
          {k: v for k, v in flat.items() if k in opts.group_fields()}).flat())
      flat = {k: v for k, v in flat.items() if k in own}
    return cls(method, **shared, **flat)


def _from_fields(method: str, shared: dict, options: MethodOptions) -> DecodeConfig:
  return DecodeConfig(method, **shared, options=options)


# --- the flat surfaces ---------------------------------------------------------------------


def flat_fields() -> dict[str, dataclasses.Field | None]:
  """Every flat name a decode config takes, in order: `method` (None), the shared fields,
  then each method's own (a name several methods share, once; a group field, then the
  fields of each of its members)."""
  out: dict[str, dataclasses.Field | None] = {"method": None, **SHARED_FIELDS}

  def add(cls):
    for f in dataclasses.fields(cls):
      if f.name not in out:
        out[f.name] = f
      if f.metadata.get("group"):
        for member in opts.registry(f.metadata["group"]).values():
          add(member)
  for cls in opts.registry().values():
    add(cls)
  return out


def defaults() -> dict[str, Any]:
  """Every flat name's default (a group field: its default member's name)."""
  out = {}
  for name, f in flat_fields().items():
    if f is None:
      out[name] = "refusion"
    elif f.metadata.get("group"):
      out[name] = f.metadata["default_member"]
    else:
      out[name] = f.default
  return out


def config_dict(**overrides) -> ml_collections.ConfigDict:
  """A config file's `decode`: every flat field at its default (`overrides` on top), so
  that `--config.decode.<name>=value` reaches any method's option. `describe(name)` says
  what a field does; a field the chosen method lacks is ignored, or refused when it is
  a switch that would turn something on (DecodeConfig)."""
  fields = flat_fields()
  unknown = sorted(set(overrides) - set(fields))
  if unknown:
    raise ValueError(f"unknown decode field(s) {unknown}")
  d = ml_collections.ConfigDict()
  for name, value in {**defaults(), **overrides}.items():
    f = fields[name]
    if value is None:  # typed, so that --config.decode.<name>=0.9 parses as its type
      d[name] = ml_collections.config_dict.placeholder(opts.value_type(f)[0])
    else:
      d[name] = value
  return d


def describe(name: str) -> str:
  """A flat name's one-line description (who owns it, what it does)."""
  f = flat_fields()[name]
  if f is None:
    return METHOD_DOC
  owned = opts.owners(name)
  who = "every method" if name in SHARED_FIELDS else ", ".join(c.title for c in owned)
  return f"{who}: {f.metadata['doc']}"


def parse_value(name: str, value: Any, where: str, typ: type | None = None) -> Any:
  """A value from text (an lm-eval model argument, ...): by `typ`, else by the flat field
  `name`'s declared type; a value already of its type is kept. None, "", "none" mean None
  where the field allows it."""
  optional = False
  if typ is None:
    f = flat_fields().get(name)
    if f is None or f.metadata.get("group"):
      return str(value)
    typ, optional = opts.value_type(f)
  if optional and value in (None, "", "none", "None"):
    return None
  if typ is bool:
    if isinstance(value, bool):
      return value
    if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
      return value.lower() in ("true", "1")
    if isinstance(value, int) and value in (0, 1):
      return bool(value)
    raise ValueError(f"{where} {name} must be true or false, got {value!r}")
  if typ is int:
    try:
      out = int(value)
    except (TypeError, ValueError):
      raise ValueError(f"{where} {name} must be an int, got {value!r}") from None
    if isinstance(value, float) and value != out:
      raise ValueError(f"{where} {name} must be an int, got {value!r}")
    return out
  if typ is float:
    try:
      return float(value)
    except (TypeError, ValueError):
      raise ValueError(f"{where} {name} must be a number, got {value!r}") from None
  if typ is tuple:  # numbers, as lm-eval's model_args give them ("1.0 2.0", [..], "(..)")
    if isinstance(value, str):
      value = value.strip("()[] ").replace(",", " ").split()
    try:
      return tuple(float(x) for x in value)
    except (TypeError, ValueError):
      raise ValueError(f"{where} {name} must be numbers, got {value!r}") from None
  return str(value)


def from_args(args: Mapping[str, Any], where: str) -> DecodeConfig:
  """A config from flat names given as text (lm-eval's model arguments)."""
  return DecodeConfig(**{k: parse_value(k, v, where) for k, v in args.items()})


