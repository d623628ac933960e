"""The decode check: a decode method's programs for the slice, and one pass per width."""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from refusion_jax import config as config_lib
from refusion_jax import sharding, tpu
from refusion_jax.aot.estimates import (
  GIB,
  Memory,
  cached_pass_flops,
  canvas_pass_flops,
  compile_program,
  hbm_traffic,
  log,
  per_chip_bytes,
  roofline,
  xla_flops,
)
from refusion_jax.aot.report import program_entry
from refusion_jax.config import ModelConfig
from refusion_jax.decode import compiled as compiled_lib
from refusion_jax.decode import engine, passes
from refusion_jax.decode import program as program_lib
from refusion_jax.decode.settings import DecodeConfig
from refusion_jax.kv_cache import KVCache
from refusion_jax.model import Transformer
from refusion_jax.training import settings


def decode_model_config(model: str, method: str) -> tuple[ModelConfig, str]:
  """A preset name or a folder (config.json or model_config.json read, nothing else)."""
  if model in config_lib.PRESETS:
    mc, source = config_lib.get_preset(model), f"preset {model}"
    if mc.mask_token_id is None and mc.vocab_size > config_lib.REFUSION_MASK_ID:
      mc = mc.replace(mask_token_id=config_lib.REFUSION_MASK_ID,
                      bos_token_id=config_lib.REFUSION_BOS_ID)
  elif os.path.isdir(model) and config_lib.is_model_dir(model):
    return config_lib.read_model_config(model), f"{model} (model_config.json)"
  elif os.path.isfile(os.path.join(model, "config.json")):
    mc, source = config_lib.from_hf_config(model), f"{model} (config.json)"
  elif os.path.isdir(model):
    raise ValueError(f"--model={model!r} has neither config.json nor model_config.json")
  else:
    raise ValueError(f"--model={model!r} is neither a preset {sorted(config_lib.PRESETS)} nor "
                     "a folder")
  if method in ("mdm", "d2f"):  # presets and HF config.json do not record it: an MDM
    mc = mc.replace(attention="bidirectional")
  return mc, source


def _abstract_sharded_model(mc: ModelConfig, mesh, rules):
  graphdef, state = nnx.split(nnx.eval_shape(lambda: Transformer(mc, rngs=nnx.Rngs(0))))
  shardings = sharding.state_shardings(state, mesh, rules)
  state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                       state, shardings)
  return nnx.merge(graphdef, state)


def _cache_shapes(mc: ModelConfig, rows: int, max_len: int, mesh, rules,
                  chunk: int = 0) -> KVCache:
  cache = jax.eval_shape(lambda: KVCache.init(mc, rows, max_len, chunk=chunk))
  axes = (("layers",) if cache.stacked else ()) + (None, "kv_heads", "cache_seq", "head_dim")

  def place(x, spec=PartitionSpec()):
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec))

  kv = lambda x: place(x, sharding.logical_to_physical(axes, rules, x.shape, mesh))  # noqa: E731
  return cache.map_kv(kv).replace(positions_bs=place(cache.positions_bs),
                                  length_b=place(cache.length_b))


def _pass_program(graphdef, params, cache, ids_bw, positions_bw, keys_bw2, temperature, *,
                  width: int, vocab_chunk: int):
  """One decode pass: every row feeds `width` tokens (one causal group) written into its
  cache after the prompt, as a ReFusion or AR pass does."""
  model = nnx.merge(graphdef, params)
  b = ids_bw.shape[0]
  zeros = jnp.zeros((b, width), jnp.int32)
  feed = passes.Feed(fed_bn=jnp.ones((b, width), bool), ids_bn=ids_bw, positions_bn=positions_bw,
                     group_bn=zeros, dest_bn=positions_bw, sample_bn=zeros > 0)
  return passes.run_pass(model, cache, feed, (width,), temperature=temperature,
                         keys_bn2=keys_bw2, vocab_chunk=vocab_chunk)


def _step_program(graphdef, params, state, knobs, *, spec):
  with program_lib.precision(spec):
    return program_lib.program_of(spec).step(nnx.merge(graphdef, params), spec, state, knobs)


@functools.cache
def _jitted():
  """(one pass, one mdm step), jitted once JAX is loaded."""
  return (jax.jit(_pass_program, static_argnames=("graphdef", "width", "vocab_chunk"),
                  donate_argnames=("cache",)),
          jax.jit(_step_program, static_argnames=("graphdef", "spec"),
                  donate_argnames=("state",)))


def check_decode(decode_config: DecodeConfig, tpu_slice: tpu.Slice, *, model: str, batch: int,
                 prompt_len: int, mesh_sizes: dict, widths, programs,
                 scan_layers: bool | None) -> dict:
  pass_jit, step_jit = _jitted()
  mc, source = decode_model_config(model, decode_config.method)
  if scan_layers is not None:
    mc = mc.replace(scan_layers=scan_layers)
  decode_config.check_fits(mc, prompt_len)
  devices = tpu.slice_devices(tpu_slice)
  try:
    sizes = settings.mesh_shape(ml_collections.ConfigDict(mesh_sizes), len(devices))
  except ValueError as e:
    raise ValueError(f"--mesh (data,fsdp,tensor) over {len(devices)} chips: {e}") from None
  mesh = sharding.make_mesh(devices=devices, **sizes)
  rules = sharding.ShardingRules()
  decoder = engine.Decoder(_abstract_sharded_model(mc, mesh, rules), decode_config)
  chip, chips = tpu_slice.chip, len(devices)
  options = ", ".join(f"{k}={v}" for k, v in decode_config.switches_on().items())
  log(f"{decode_config.method} decode of {source}: {mc.num_params() / 1e9:.3g}B parameters "
      f"({mc.param_dtype}, {'scanned' if mc.scan_layers else 'unrolled'} layers), mesh {sizes}, "
      f"{batch} rows, prompts of {prompt_len}, {decode_config.gen_length} generated"
      + (f" ({options})" if options else ""))
  entries = []
  for name in programs:
    with sharding.use_mesh(mesh, rules):
      lowered = compiled_lib.lower_program(decoder, name, batch, prompt_len)
    compiled, seconds = compile_program(lowered, f"{decode_config.method} {name} program")
    entries.append(program_entry(name, Memory.of(compiled), seconds))
    del compiled
  result = {"model": source, "params": mc.num_params(), "mesh": sizes,
            "method": decode_config.method, "batch": batch, "prompt_len": prompt_len,
            "gen_length": decode_config.gen_length, "decode": decode_config.flat(),
            "scan_layers": mc.scan_layers,
            "kv_chunk": decoder.spec.kv_chunk, "programs": entries,
            "flops_source": "hand count per chip: 2 x matmul params per token + attention",
            "pass_width": None, "flops": None, "bytes": None, "estimated_s": None,
            "per_pass": []}
  if max(e["total"] for e in entries) > chip.hbm_gib * GIB:
    log("does not fit: no per-pass table")
    return result

  weights = decoder.params
  if not mc.tie_embeddings:  # a pass gathers a few rows of the input embedding, not all
    weights = {k: v for k, v in nnx.to_pure_dict(weights).items() if k != "embed"}
  weight_bytes = per_chip_bytes(weights)
  knobs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(
      jnp.shape(x), jnp.result_type(x), sharding=NamedSharding(mesh, PartitionSpec())),
      decoder.knobs)
  per_pass = []
  replicated = NamedSharding(mesh, PartitionSpec())
  kv_chunk = decoder.spec.kv_chunk

  def cached_pass(width: int, max_len: int, what: str) -> dict:
    """One pass of `width` tokens a row over a `max_len`-entry KV cache, compiled."""
    cache = _cache_shapes(mc, batch, max_len, mesh, rules, kv_chunk)
    kv_bytes = per_chip_bytes((cache.k, cache.v))
    # Attention reads the cache in kv_chunk pieces up to the longest row
    # (model.attend_live), a loop of traced length: counted here at a full buffer.
    kv_trips = -(-max_len // kv_chunk) if 0 < kv_chunk < max_len else 1
    shape = lambda s, dt: jax.ShapeDtypeStruct(s, dt, sharding=replicated)  # noqa: E731
    with sharding.use_mesh(mesh, rules):
      lowered = pass_jit.lower(
          decoder.graphdef, decoder.params, cache, shape((batch, width), jnp.int32),
          shape((batch, width), jnp.int32), shape((batch, width, 2), jnp.uint32),
          shape((), jnp.float32), width=width, vocab_chunk=decoder.spec.vocab_chunk)
    compiled, seconds = compile_program(lowered, what)
    nbytes = hbm_traffic(compiled, kv_trips)
    flops = cached_pass_flops(mc, batch, width, max_len) / chips
    return {"width": width, "bytes": nbytes, "bytes_floor": weight_bytes + kv_bytes,
            "flops": flops, "estimated_s": roofline(flops, nbytes, chip),
            "xla_flops": xla_flops(compiled), "compile_s": seconds}

  prog, max_len = program_lib.program_of(decoder.spec), prompt_len + decode_config.gen_length
  cached_widths = prog.pass_widths(decoder.spec)
  if prog.canvas_spec is not None:
    # Its steps feed prompt and canvas whole (with a cache, a block's first step): that
    # pass is one step of the program without its cache; its cached passes follow.
    plain = prog.canvas_spec(decoder.spec)
    state = compiled_lib.abstract_state(decoder, batch, prompt_len, spec=plain)
    with sharding.use_mesh(mesh, rules):
      lowered = step_jit.lower(decoder.graphdef, decoder.params, state, knobs, spec=plain)
    compiled, seconds = compile_program(
        lowered, f"one {decode_config.method} pass ({max_len} tokens per row)")
    nbytes = hbm_traffic(compiled)
    flops = canvas_pass_flops(mc, batch, max_len, decoder.spec.block_size) / chips
    per_pass.append({"width": max_len, "bytes": nbytes, "bytes_floor": weight_bytes,
                     "flops": flops, "estimated_s": roofline(flops, nbytes, chip),
                     "xla_flops": xla_flops(compiled), "compile_s": seconds})
    for width in cached_widths:
      per_pass.append(cached_pass(width, max_len, f"one cached {decode_config.method} pass "
                                                  f"({width} tokens per row)"))
    top = per_pass[-1]
  else:
    widest = max(cached_widths)
    for width in sorted(set(widths) | {widest}):
      if prompt_len + width > max_len:
        log(f"skipping pass width {width}: more than the {decode_config.gen_length} "
            "generated entries of the cache")
        continue
      per_pass.append(cached_pass(width, max_len, f"one pass of width {width}"))
    top = next(p for p in per_pass if p["width"] == widest)
  return dict(result, pass_width=top["width"], flops=top["flops"], bytes=top["bytes"],
              estimated_s=top["estimated_s"],
              per_pass=[{k: v for k, v in p.items() if k != "compile_s"} for p in per_pass],
              pass_compile_s=sum(p["compile_s"] for p in per_pass))
