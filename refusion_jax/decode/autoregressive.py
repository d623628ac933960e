"""Left-to-right decoding with the static KV buffer (the ARM baseline).

One compiled program per (model graph, DecodeConfig, batch and prompt shape):
a prefill pass over the right-padded prompts, then a `lax.while_loop` that
feeds one token per row per iteration, commits its K/V and picks the next
token. Rows that produced EOS are frozen (their tokens, cache and counters no
longer change) while the others go on.

The KV buffer (`max_len = P + gen_length`) is allocated inside the program
rather than donated: no output could alias a donated buffer (XLA warns and
ignores it), and inside the program XLA already updates it in place.

Counters: `verify_b` counts one AR pass per generated token (the first token
comes from the prefill logits, so `nfe == tokens`; the loop itself runs
`tokens - 1` single-token passes), `prefill_b` is 1.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from refusion_jax.config import DecodeConfig, ModelConfig
from refusion_jax.decode import common
from refusion_jax.decode.counters import DecodeCounters, DecodeOutput
from refusion_jax.kv_cache import KVCache


def pad_id(config: ModelConfig) -> int:
  """Filler written after the end of each row's response."""
  return config.pad_token_id if config.pad_token_id is not None else 0


def pick_tokens(logits_bv, rng, temperature: float):
  """Greedy argmax, or a sample from softmax(logits / temperature)."""
  logits_bv = logits_bv.astype(jnp.float32)
  if temperature == 0.0:
    return jnp.argmax(logits_bv, axis=-1).astype(jnp.int32)
  return jax.random.categorical(rng, logits_bv / temperature, axis=-1).astype(jnp.int32)


@flax.struct.dataclass
class _Carry:
  step: jax.Array  # tokens generated so far by the longest-running row
  last_b: jax.Array  # the newest token of each row (fed next)
  tokens_bg: jax.Array
  commit_step_bg: jax.Array
  cache: KVCache
  done_b: jax.Array
  length_b: jax.Array
  counters: DecodeCounters
  rng: jax.Array


def _decode(graphdef, state, prompt_ids_bp, prompt_len_b, rng, decode_config: DecodeConfig):
  model = common.merge_model(graphdef, state)
  config: ModelConfig = model.config
  b, p = prompt_ids_bp.shape
  g = decode_config.gen_length
  cache = common.init_cache(config, b, p + g)
  eos = -1 if config.eos_token_id is None else config.eos_token_id

  cache, last_logits_bv = common.prefill(model, cache, prompt_ids_bp, prompt_len_b)
  rng, key = jax.random.split(rng)
  first_b = pick_tokens(last_logits_bv, key, decode_config.temperature)
  tokens_bg = jnp.full((b, g), pad_id(config), jnp.int32).at[:, 0].set(first_b)
  commit_step_bg = jnp.full((b, g), -1, jnp.int32).at[:, 0].set(0)
  ones_b = jnp.ones((b,), bool)
  counters = DecodeCounters.zeros(b).add(ones_b, prefill_b=1, verify_b=1, steps_b=1)
  counters = counters.add_step_tpf(ones_b, ones_b, ones_b)  # one token per pass
  carry = _Carry(step=jnp.int32(1), last_b=first_b, tokens_bg=tokens_bg,
                 commit_step_bg=commit_step_bg, cache=cache,
                 done_b=(first_b == eos) | (g == 1), length_b=jnp.ones((b,), jnp.int32),
                 counters=counters, rng=rng)

  def cond(c: _Carry):
    return (c.step < g) & ~jnp.all(c.done_b)

  def body(c: _Carry):
    active_b = ~c.done_b
    # The newest token sits at position prompt_len + (step - 1).
    pos_b1 = (prompt_len_b + c.step - 1)[:, None]
    logits_b1v, k, v = model.forward_chunk(c.last_b[:, None], pos_b1, c.cache,
                                           jnp.ones((b, 1, 1), bool))
    cache = c.cache.commit(k, v, pos_b1, active_b[:, None])
    rng, key = jax.random.split(c.rng)
    new_b = pick_tokens(logits_b1v[:, 0], key, decode_config.temperature)
    new_b = jnp.where(active_b, new_b, c.last_b)
    tokens_bg = c.tokens_bg.at[:, c.step].set(jnp.where(active_b, new_b, c.tokens_bg[:, c.step]))
    commit_step_bg = c.commit_step_bg.at[:, c.step].set(
        jnp.where(active_b, c.step, c.commit_step_bg[:, c.step]))
    done_b = c.done_b | (active_b & ((new_b == eos) | (c.step + 1 >= g)))
    return _Carry(step=c.step + 1, last_b=new_b, tokens_bg=tokens_bg,
                  commit_step_bg=commit_step_bg, cache=cache, done_b=done_b,
                  length_b=c.length_b + active_b.astype(jnp.int32),
                  counters=c.counters.add(active_b, verify_b=1, steps_b=1).add_step_tpf(
                      active_b, active_b, active_b), rng=rng)

  c = jax.lax.while_loop(cond, body, carry)
  counters = c.counters.replace(tokens_b=c.length_b)
  return DecodeOutput(tokens_bg=c.tokens_bg, length_b=c.length_b, counters=counters,
                      commit_step_bg=c.commit_step_bg)


# The graph definition and the DecodeConfig are hashable: one compile per value and shape.
_decode_jit = jax.jit(_decode, static_argnames=("graphdef", "decode_config"))


def check_config(config: ModelConfig, decode_config: DecodeConfig, prompt_len: int) -> None:
  if not isinstance(decode_config, DecodeConfig):
    raise TypeError(f"decode_config must be a DecodeConfig, got {type(decode_config).__name__}")
  if decode_config.method != "ar":
    raise ValueError(f"autoregressive.generate needs decode.method='ar', got "
                     f"{decode_config.method!r}")
  if config.attention != "causal":
    raise ValueError(f"AR decoding needs a causal model, but ModelConfig.attention="
                     f"{config.attention!r}")
  decode_config.check_fits(config, prompt_len)


def generate(model, prompt_ids_bp, prompt_len_b, decode_config: DecodeConfig,
             rng=None) -> DecodeOutput:
  """Decodes `decode_config.gen_length` tokens (or up to EOS) after each prompt.

  Args:
    model: a causal `Qwen3`.
    prompt_ids_bp: `[B, P]` right-padded prompt ids.
    prompt_len_b: `[B]` real prompt lengths (1..P); row b's response starts at
      position `prompt_len_b[b]`.
    decode_config: `DecodeConfig` with `method='ar'`.
    rng: PRNG key (used only when temperature > 0).
  """
  # Positions run up to prompt_len + gen_length - 1; right padding needs none.
  ids, lens = common.checked_prompts(model, prompt_ids_bp, prompt_len_b, decode_config,
                                     check_config)
  rng = jax.random.key(0) if rng is None else rng
  graphdef, state = common.split_model(model)
  # Fields AR ignores are reset so that, e.g., a threshold sweep reuses one program.
  g = decode_config.gen_length
  program_config = DecodeConfig(method="ar", gen_length=g, slot_size=g, block_size=g,
                                temperature=decode_config.temperature)
  return _decode_jit(graphdef, state, jnp.asarray(ids), jnp.asarray(lens), rng,
                     decode_config=program_config)


def compiled_programs() -> int:
  """Programs compiled so far (tests use it to prove a shape bucket is reused)."""
  return _decode_jit._cache_size()
