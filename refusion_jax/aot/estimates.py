"""Compiling for the slice and estimating: memory, HBM traffic, hand flop counts, roofline."""

from __future__ import annotations

import dataclasses
import math
import re
import sys
import time

import jax
import jax.numpy as jnp

from refusion_jax import hlo_traffic, tpu
from refusion_jax.config import ModelConfig

GIB = 2**30
# The paper's run (ALGORITHM.md "Training in the paper"): 4 epochs over 3.7M samples of
# ~1.22B tokens, ~330 tokens each.
PAPER_SAMPLES, PAPER_EPOCHS, PAPER_SAMPLE_TOKENS = 3_700_000, 4, 330


def log(message: str) -> None:
  print(f"[aot] {message}", file=sys.stderr, flush=True)


@dataclasses.dataclass
class Memory:
  """Per-chip bytes of one compiled program (XLA's buffer assignment)."""

  argument: int
  output: int
  alias: int  # outputs that reuse a (donated) argument's buffer
  temp: int
  code: int

  @property
  def total(self) -> int:
    return self.argument + self.output - self.alias + self.temp + self.code

  @classmethod
  def of(cls, compiled) -> "Memory":
    m = compiled.memory_analysis()
    return cls(argument=m.argument_size_in_bytes, output=m.output_size_in_bytes,
               alias=m.alias_size_in_bytes, temp=m.temp_size_in_bytes,
               code=m.generated_code_size_in_bytes)


class DoesNotFit(Exception):
  """The compiler refused the program for lack of HBM; `used` / `limit` are bytes (or None)."""

  def __init__(self, message: str, used: float | None, limit: float | None):
    super().__init__(message)
    self.used, self.limit = used, limit


_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def _bytes(number: str, unit: str) -> float:
  return float(number) * _UNITS[unit]


def compile_program(lowered, what: str):
  """`(compiled, seconds)`; raises DoesNotFit when XLA runs out of HBM while compiling."""
  log(f"compiling {what} ...")
  t = time.perf_counter()
  try:
    compiled = lowered.compile()
  except Exception as e:  # XLA's RESOURCE_EXHAUSTED arrives as a runtime error
    text = str(e)
    if "RESOURCE_EXHAUSTED" not in text and "out of memory" not in text.lower():
      raise
    first = next((line for line in text.splitlines() if "memory" in line.lower()),
                 text.splitlines()[0]).strip()
    # "... temporaries (35.35G) exceeds available HBM (15.75G)" or "Used 20G of 15.75G hbm".
    sizes = [_bytes(n, u) for n, u in re.findall(r"([0-9]+(?:\.[0-9]+)?)([KMGT])i?B?\b", first)]
    used, limit = (sizes[0], sizes[1]) if len(sizes) >= 2 else (None, None)
    raise DoesNotFit(f"{what}: {first}", used, limit) from None
  seconds = time.perf_counter() - t
  log(f"compiled {what} in {seconds:.1f}s")
  return compiled, seconds


def hbm_traffic(compiled, unknown_trips: int = 1) -> int:
  """`hlo_traffic`'s count; a loop whose trip count is traced runs `unknown_trips` times."""
  return hlo_traffic.hbm_bytes(compiled.as_text(), unknown_trips=unknown_trips).total


def xla_flops(compiled) -> float | None:
  """XLA's own flop count (a loop body counted once: too low for scanned layers)."""
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  return float(cost["flops"]) if cost and "flops" in cost else None


def roofline(flops: float, nbytes: float, chip: tpu.Chip) -> float:
  """Estimated seconds: the slower of the chip's bf16 peak and its HBM bandwidth."""
  return max(flops / (chip.bf16_tflops * 1e12), nbytes / (chip.hbm_gbps * 1e9))


def per_chip_bytes(tree) -> int:
  """Bytes each chip holds of a tree of sharded `ShapeDtypeStruct`s (the largest shard)."""
  total = 0
  for x in jax.tree.leaves(tree):
    shape = x.sharding.shard_shape(x.shape) if getattr(x, "sharding", None) else x.shape
    total += math.prod(shape) * jnp.dtype(x.dtype).itemsize
  return total


def layer_matmul_params(mc: ModelConfig) -> int:
  """Weights of the matrix products of all layers (projections and MLP)."""
  d, h = mc.hidden_size, mc.head_dim
  return mc.num_layers * (d * h * (2 * mc.num_heads + 2 * mc.num_kv_heads) + 3 * d * mc.mlp_dim)


def head_params(mc: ModelConfig) -> int:
  return mc.vocab_size * mc.hidden_size


def attention_flops(mc: ModelConfig, queries: int, keys: int) -> int:
  """Forward flops of scores and weighted values for `queries` x `keys` (all heads, layers)."""
  return 4 * mc.num_layers * mc.num_heads * mc.head_dim * queries * keys


def train_flops(mc: ModelConfig, rows: int, seq_len: int, loss_chunk: int,
                two_halves: bool = False) -> tuple[int, int]:
  """`(model flops, executed flops)` of one train step over `rows` x `seq_len` tokens.

  Model flops: 6 x matmul parameters (layers + LM head; the embedding lookup is
  not a product) x tokens, plus 3 x the attention forward. The einsum attention
  ("xla") computes every score of the square; the kernels ("splash", "cudnn")
  skip the masked half. Executed flops add what the backward pass recomputes:
  the layers' forward (remat "full") or attention (remat "save_dots"), and the
  logits of each chunk of a chunked loss. `two_halves` (BD3-LM): the layers run
  2 x seq_len tokens per row (its einsum mask over the square of them), the LM
  head only the noised half.
  """
  tokens = rows * seq_len
  layer_tokens = tokens * (2 if two_halves else 1)
  attn = rows * attention_flops(mc, layer_tokens // rows, layer_tokens // rows)
  if mc.attention_impl != "xla":
    attn //= 2
  model = 6 * (layer_matmul_params(mc) * layer_tokens + head_params(mc) * tokens) + 3 * attn
  recompute = 0
  if mc.remat == "full":
    recompute += 2 * layer_matmul_params(mc) * layer_tokens + attn
  elif mc.remat == "save_dots":
    recompute += attn
  if loss_chunk:
    recompute += 2 * head_params(mc) * tokens
  return model, model + recompute


def cached_pass_flops(mc: ModelConfig, rows: int, width: int, cache_len: int) -> int:
  """One decode pass of `width` tokens per row over a `cache_len`-entry KV buffer (the
  einsum attention reads every entry) plus the chunk itself, logits for every token."""
  return (2 * (layer_matmul_params(mc) + head_params(mc)) * rows * width
          + rows * attention_flops(mc, width, cache_len + width))


def canvas_pass_flops(mc: ModelConfig, rows: int, canvas: int, scored: int) -> int:
  """One MDM pass: the whole canvas through the layers, logits for the `scored` positions
  only (the current block's)."""
  return (2 * layer_matmul_params(mc) * rows * canvas + 2 * head_params(mc) * rows * scored
          + rows * attention_flops(mc, canvas, canvas))


def rl_flops(mc: ModelConfig, rows: int, width: int, tokens: int, reference: bool
             ) -> tuple[int, int]:
  """`(model flops, executed flops)` of one RL policy step: the replay of `rows` training
  layouts of `width` entries through the layers with the LM head on the `tokens` scored
  ones (forward and backward: 6 x parameters x tokens, + 3 x the einsum attention's
  square, every layout carrying its own mask), the reference's forward (2 x, + 1 x), and
  the backward pass's recomputation (remat)."""
  layer, head = layer_matmul_params(mc) * rows * width, head_params(mc) * rows * tokens
  attn = rows * attention_flops(mc, width, width)
  model = 6 * (layer + head) + 3 * attn
  executed = model + (2 * (layer + head) + attn if reference else 0)
  if mc.remat == "full":
    executed += 2 * layer + attn
  elif mc.remat == "save_dots":
    executed += attn
  return model, executed
