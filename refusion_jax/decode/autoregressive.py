"""Left-to-right decoding with the static KV buffer (the ARM baseline).

A row program of `engine` (one protocol for every decoder): admission
prefills the prompt and picks the first token from the logits at its last
token; then each pass feeds one token per active row (its newest), commits
its K/V and picks the next token. A row that produced an EOS, or reached
`gen_length`, is done; the others go on.

Counters: `ar_b` counts one AR pass per generated token (the first token
comes from the prefill logits and counts one, so `nfe == tokens`; the loop
itself runs `tokens - 1` single-token passes), `prefill_b` is 1. At
temperature > 0 every token is sampled (argmax of logits / temperature plus
Gumbel noise, a categorical draw).
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from refusion_jax.config import ModelConfig
from refusion_jax.decode import common, compiled, engine, heads, passes
from refusion_jax.decode import program as program_lib
from refusion_jax.decode.counters import DecodeCounters, DecodeOutput
from refusion_jax.decode.program import DONE, FIRST_PHASE, FREE
from refusion_jax.decode.settings import DecodeConfig
from refusion_jax.kv_cache import KVCache

DECODE = FIRST_PHASE
# AR has no options of its own: the shared Spec and Knobs.
Spec, Knobs = program_lib.Spec, program_lib.Knobs


def pad_id(config: ModelConfig) -> int:
  """Filler written after the end of each row's response."""
  return config.pad_token_id if config.pad_token_id is not None else 0


@flax.struct.dataclass
class Rows:
  phase_b: jax.Array
  length_b: jax.Array  # live cache entries
  prompt_len_b: jax.Array
  key_b2: jax.Array
  tokens_bg: jax.Array
  commit_step_bg: jax.Array
  n_b: jax.Array  # tokens generated
  counters: DecodeCounters


State = program_lib.State


def _empty_rows(spec: Spec, b: int, pad) -> Rows:
  zi = jnp.zeros((b,), jnp.int32)
  return Rows(phase_b=zi + FREE, length_b=zi, prompt_len_b=zi,
              key_b2=jnp.zeros((b, 2), jnp.uint32),
              tokens_bg=jnp.full((b, spec.gen_length), pad, jnp.int32),
              commit_step_bg=jnp.full((b, spec.gen_length), -1, jnp.int32), n_b=zi,
              counters=DecodeCounters.zeros(b))


def init(model, spec: Spec, rows: int, width: int) -> State:
  r = _empty_rows(spec, rows, pad_id(model.config))
  return State(passes=jnp.zeros((), jnp.int32),
               cache=KVCache.init(model.config, rows, width + spec.gen_length,
                                   chunk=spec.kv_chunk), rows=r)


def _emit(spec: Spec, r: Rows, token_b, active_b, knobs: Knobs) -> Rows:
  """Writes each active row's next token and counts its pass."""
  rows = jnp.arange(token_b.shape[0])
  index = jnp.minimum(r.n_b, spec.gen_length - 1)
  tokens = r.tokens_bg.at[rows, index].set(jnp.where(active_b, token_b, r.tokens_bg[rows, index]))
  steps = r.commit_step_bg.at[rows, index].set(
      jnp.where(active_b, r.n_b, r.commit_step_bg[rows, index]))
  n_b = r.n_b + active_b.astype(jnp.int32)
  done = active_b & (knobs.is_stop(token_b) | (n_b >= spec.gen_length))
  counters = r.counters.add(active_b, ar_b=1, steps_b=1).add_step_tpf(active_b, active_b,
                                                                      active_b)
  return r.replace(tokens_bg=tokens, commit_step_bg=steps, n_b=n_b, counters=counters,
                   phase_b=jnp.where(done, DONE, r.phase_b))


def admit(model, spec: Spec, st: State, ids_ap, lens_a, rows_a, keys_a2, knobs: Knobs) -> State:
  cache, last_ad = common.prefill_rows(model, st.cache, ids_ap, lens_a, rows_a)
  a = ids_ap.shape[0]
  ones = jnp.ones((a,), bool)
  fresh = _empty_rows(spec, a, knobs.pad_id).replace(
      phase_b=jnp.full((a,), DECODE, jnp.int32), length_b=lens_a, prompt_len_b=lens_a,
      key_b2=keys_a2)
  fresh = fresh.replace(counters=fresh.counters.add(ones, prefill_b=1))
  # The first token, from the logits at the prompt's last token (pass 0 of the prompt).
  keys = program_lib.pass_keys(keys_a2, jnp.zeros((a,), jnp.int32), 1, knobs.temperature)
  stats = heads.token_stats(last_ad[:, None], model.unembed(), jnp.zeros((a, 1), jnp.int32),
                            sample_bt=jnp.ones((a, 1), bool), temperature=knobs.temperature,
                            keys_bt2=keys, vocab_chunk=spec.vocab_chunk)
  fresh = _emit(spec, fresh, stats.pick_bt[:, 0], ones, knobs)
  rows = program_lib.set_rows(st.rows, fresh, rows_a)
  return st.replace(cache=cache, rows=rows)


def step(model, spec: Spec, st: State, knobs: Knobs) -> State:
  """One pass: every active row feeds its newest token and picks the next."""
  r = st.rows
  b = r.phase_b.shape[0]
  active = r.phase_b == DECODE
  rows = jnp.arange(b)
  newest = r.tokens_bg[rows, jnp.maximum(r.n_b - 1, 0)]
  feed = passes.Feed(fed_bn=active[:, None], ids_bn=newest[:, None],
                     positions_bn=(r.prompt_len_b + r.n_b - 1)[:, None],
                     group_bn=jnp.zeros((b, 1), jnp.int32), dest_bn=r.length_b[:, None],
                     sample_bn=jnp.ones((b, 1), bool))
  keys = program_lib.pass_keys(r.key_b2, r.counters.nfe_b(), 1, knobs.temperature)
  cache, out = passes.run_pass(model, st.cache, feed, (1,), temperature=knobs.temperature,
                               keys_bn2=keys, vocab_chunk=spec.vocab_chunk)
  r = _emit(spec, r.replace(length_b=r.length_b + active.astype(jnp.int32)), out.pick_bn[:, 0],
            active, knobs)
  return State(passes=st.passes + 1, cache=cache.replace(length_b=r.length_b),
               rows=r)


def output(spec: Spec, st: State, knobs: Knobs) -> DecodeOutput:
  del spec, knobs
  r = st.rows
  return DecodeOutput(tokens_bg=r.tokens_bg, length_b=r.n_b,
                      counters=r.counters.replace(tokens_b=r.n_b),
                      commit_step_bg=r.commit_step_bg)


PROGRAM = program_lib.register(program_lib.Program(
    name="ar", init=init, admit=admit, step=step, output=output, pass_widths=lambda spec: (1,),
    needs_rng_to_sample=False), __name__)


def generate(model, prompt_ids_bp, prompt_len_b, decode_config: DecodeConfig,
             rng=None) -> DecodeOutput:
  """Decodes `decode_config.gen_length` tokens (or up to EOS) after each prompt.

  Args:
    model: a causal `Transformer`.
    prompt_ids_bp: `[B, P]` right-padded prompt ids.
    prompt_len_b: `[B]` real prompt lengths (1..P); row b's response starts at
      position `prompt_len_b[b]`.
    decode_config: `DecodeConfig` with `method='ar'`.
    rng: PRNG key (used only when temperature > 0; default key 0).
  """
  return engine.Decoder(model, decode_config, method="ar").generate(
      prompt_ids_bp, prompt_len_b, rng)


def compiled_programs() -> int:
  """Programs compiled so far by `generate` (tests use it to prove a bucket is reused)."""
  return compiled.compiled_programs()["generate"]
