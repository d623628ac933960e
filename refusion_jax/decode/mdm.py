"""Block-wise masked-diffusion decoding (the MDM baseline: LLaDA / Fast-dLLM).

The canvas of row b is its prompt followed by `gen_length` mask tokens at
positions `prompt_len_b[b] + i`; columns past that are padding, hidden from
every query by the attention mask. The response area is split into blocks of
`block_size` decoded left to right. Every step re-runs the whole canvas with
bidirectional attention (no KV cache) and unmasks masked tokens of the row's
current block:

* `mdm_threshold is None` (LLaDA, low-confidence remasking): the
  `mdm_tokens_per_step` most confident ones (fewer when fewer are left);
* otherwise (Fast-dLLM parallel decoding): every one whose confidence exceeds
  `mdm_threshold`, and the most confident one when none does.

Draft = argmax of the logits (a sample at temperature > 0, i.e. argmax with
Gumbel noise); confidence = its softmax probability under the plain logits.
The mask token is never drafted. Ties in confidence go to the lower position.

EOS rule: a row stops as soon as it has a decided EOS and every position
before its first decided EOS is decided too (that EOS is then final: nothing
before it can still change). Its response is the tokens up to and including
that EOS; later positions are discarded (pad id, commit step -1) and not
counted. Without an EOS a row stops after its last block.

Counters: `plan_b` counts denoising passes (one per step while the row is
active), `prefill_b` is 0 (there is no separate prompt pass).
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from refusion_jax.config import DecodeConfig, ModelConfig
from refusion_jax.decode import common
from refusion_jax.decode.autoregressive import pad_id
from refusion_jax.decode.counters import DecodeCounters, DecodeOutput


@flax.struct.dataclass
class _Carry:
  step: jax.Array
  gen_bg: jax.Array  # response tokens (mask id where undecided)
  decided_bg: jax.Array
  commit_step_bg: jax.Array
  block_b: jax.Array  # index of each row's current block
  done_b: jax.Array
  counters: DecodeCounters
  rng: jax.Array


def confidence_rank_bg(conf_bg, candidate_bg):
  """Rank of each candidate by confidence (0 = most confident; ties: lower index first)."""
  g = conf_bg.shape[1]
  idx = jnp.arange(g)
  conf_i = conf_bg[:, :, None]
  conf_j = conf_bg[:, None, :]
  beats_bgg = candidate_bg[:, None, :] & (
      (conf_j > conf_i) | ((conf_j == conf_i) & (idx[None, None, :] < idx[None, :, None])))
  return beats_bgg.sum(axis=-1)


def first_eos_b(tokens_bg, decided_bg, eos: int):
  """(index of the first decided EOS, or G; whether it is final)."""
  g = tokens_bg.shape[1]
  is_eos_bg = decided_bg & (tokens_bg == eos)
  first_b = jnp.where(is_eos_bg.any(axis=1), jnp.argmax(is_eos_bg, axis=1), g)
  before_bg = jnp.arange(g)[None, :] < first_b[:, None]
  final_b = (first_b < g) & jnp.all(decided_bg | ~before_bg, axis=1)
  return first_b, final_b


def _decode(graphdef, state, prompt_ids_bp, prompt_len_b, rng, decode_config: DecodeConfig):
  model = common.merge_model(graphdef, state)
  config: ModelConfig = model.config
  b, p = prompt_ids_bp.shape
  g = decode_config.gen_length
  total = p + g
  mask_id = config.mask_token_id
  eos = -1 if config.eos_token_id is None else config.eos_token_id
  fill = pad_id(config)

  cols_l = jnp.arange(total)
  gen_col_bg = prompt_len_b[:, None] + jnp.arange(g)[None, :]
  base_bl = jnp.concatenate([prompt_ids_bp, jnp.full((b, g), fill, jnp.int32)], axis=1)
  base_bl = jnp.where(cols_l[None] < prompt_len_b[:, None], base_bl, fill)
  key_live_bl = cols_l[None] < (prompt_len_b + g)[:, None]
  # Padding queries keep their own key so that no softmax row is empty.
  attn_bll = key_live_bl[:, None, :] | jnp.eye(total, dtype=bool)[None]
  positions_bl = jnp.broadcast_to(cols_l[None].astype(jnp.int32), (b, total))
  rows_bg = jnp.broadcast_to(jnp.arange(b)[:, None], (b, g))
  block_of_g = jnp.arange(g) // decode_config.block_size

  def cond(c: _Carry):
    return (c.step < g) & ~jnp.all(c.done_b)

  def body(c: _Carry):
    active_b = ~c.done_b
    seq_bl = base_bl.at[rows_bg, gen_col_bg].set(c.gen_bg)
    logits_blv = model(seq_bl, positions_bl, attn_bll)
    logits_bgv = jnp.take_along_axis(logits_blv, gen_col_bg[:, :, None], axis=1)
    logits_bgv = logits_bgv.astype(jnp.float32).at[:, :, mask_id].set(-jnp.inf)
    rng, key = jax.random.split(c.rng)
    if decode_config.temperature == 0.0:
      draft_bg = jnp.argmax(logits_bgv, axis=-1).astype(jnp.int32)
    else:
      draft_bg = jax.random.categorical(key, logits_bgv / decode_config.temperature,
                                        axis=-1).astype(jnp.int32)
    probs_bgv = jax.nn.softmax(logits_bgv, axis=-1)
    conf_bg = jnp.take_along_axis(probs_bgv, draft_bg[:, :, None], axis=-1)[:, :, 0]

    in_block_bg = block_of_g[None, :] == c.block_b[:, None]
    candidate_bg = in_block_bg & ~c.decided_bg & active_b[:, None]
    rank_bg = confidence_rank_bg(conf_bg, candidate_bg)
    if decode_config.mdm_threshold is None:
      chosen_bg = candidate_bg & (rank_bg < decode_config.mdm_tokens_per_step)
    else:
      chosen_bg = candidate_bg & ((conf_bg > decode_config.mdm_threshold) | (rank_bg == 0))

    gen_bg = jnp.where(chosen_bg, draft_bg, c.gen_bg)
    decided_bg = c.decided_bg | chosen_bg
    commit_step_bg = jnp.where(chosen_bg, c.step, c.commit_step_bg)
    block_left_b = jnp.any(in_block_bg & ~decided_bg, axis=1)
    block_b = c.block_b + (active_b & ~block_left_b).astype(jnp.int32)
    _, eos_final_b = first_eos_b(gen_bg, decided_bg, eos)
    done_b = c.done_b | eos_final_b | (block_b >= decode_config.num_blocks)
    return _Carry(step=c.step + 1, gen_bg=gen_bg, decided_bg=decided_bg,
                  commit_step_bg=commit_step_bg, block_b=block_b, done_b=done_b,
                  counters=c.counters.add(active_b, plan_b=1, steps_b=1).add_step_tpf(
                      active_b, chosen_bg.sum(-1), active_b), rng=rng)

  carry = _Carry(step=jnp.int32(0), gen_bg=jnp.full((b, g), mask_id, jnp.int32),
                 decided_bg=jnp.zeros((b, g), bool),
                 commit_step_bg=jnp.full((b, g), -1, jnp.int32),
                 block_b=jnp.zeros((b,), jnp.int32), done_b=jnp.zeros((b,), bool),
                 counters=DecodeCounters.zeros(b), rng=rng)
  c = jax.lax.while_loop(cond, body, carry)

  first_b, _ = first_eos_b(c.gen_bg, c.decided_bg, eos)
  length_b = jnp.minimum(first_b + 1, g).astype(jnp.int32)
  kept_bg = jnp.arange(g)[None, :] < length_b[:, None]
  tokens_bg = jnp.where(kept_bg & c.decided_bg, c.gen_bg, fill)
  commit_step_bg = jnp.where(kept_bg, c.commit_step_bg, -1)
  counters = c.counters.replace(tokens_b=length_b)
  return DecodeOutput(tokens_bg=tokens_bg, length_b=length_b, counters=counters,
                      commit_step_bg=commit_step_bg)


_decode_jit = jax.jit(_decode, static_argnames=("graphdef", "decode_config"))


def check_config(config: ModelConfig, decode_config: DecodeConfig, prompt_len: int) -> None:
  if not isinstance(decode_config, DecodeConfig):
    raise TypeError(f"decode_config must be a DecodeConfig, got {type(decode_config).__name__}")
  if decode_config.method != "mdm":
    raise ValueError(f"mdm.generate needs decode.method='mdm', got {decode_config.method!r}")
  if config.attention != "bidirectional":
    # A causal model never saw masked tokens after its context: MDM decoding would be noise.
    raise ValueError(f"MDM decoding needs a bidirectional model (ModelConfig.attention="
                     f"'bidirectional'), got {config.attention!r}")
  if config.mask_token_id is None:
    raise ValueError("MDM decoding needs ModelConfig.mask_token_id, got None")
  decode_config.check_fits(config, prompt_len)


def generate(model, prompt_ids_bp, prompt_len_b, decode_config: DecodeConfig,
             rng=None) -> DecodeOutput:
  """Decodes up to `decode_config.gen_length` tokens after each prompt by unmasking.

  Args:
    model: a bidirectional `Qwen3` (ModelConfig.attention == 'bidirectional').
    prompt_ids_bp: `[B, P]` right-padded prompt ids.
    prompt_len_b: `[B]` real prompt lengths (1..P).
    decode_config: `DecodeConfig` with `method='mdm'`.
    rng: PRNG key (used only when temperature > 0).
  """
  # Positions run up to prompt_len + gen_length - 1; right padding needs none.
  ids, lens = common.checked_prompts(model, prompt_ids_bp, prompt_len_b, decode_config,
                                     check_config)
  rng = jax.random.key(0) if rng is None else rng
  graphdef, state = common.split_model(model)
  # ReFusion's slot size and thresholds do not matter here: reset them so they share a program.
  program_config = DecodeConfig(
      method="mdm", gen_length=decode_config.gen_length, slot_size=decode_config.block_size,
      block_size=decode_config.block_size, temperature=decode_config.temperature,
      mdm_tokens_per_step=decode_config.mdm_tokens_per_step,
      mdm_threshold=decode_config.mdm_threshold)
  return _decode_jit(graphdef, state, jnp.asarray(ids), jnp.asarray(lens), rng,
                     decode_config=program_config)


def compiled_programs() -> int:
  """Programs compiled so far (tests use it to prove a shape bucket is reused)."""
  return _decode_jit._cache_size()
