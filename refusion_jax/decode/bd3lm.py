"""Block diffusion decoding with the KV cache (the BD3-LM baseline).

ALGORITHM.md "Baselines", BD3-LM "Decoding". The model is a causal backbone
trained with BD3-LM's two-half layout (a noised block attends to itself both
ways and to the clean blocks before it). Admission prefills the prompt
causally into the row's KV cache. The response area of `gen_length` tokens is
split into blocks of `block_size`, decoded left to right; a block starts as
all mask tokens at positions `prompt_len + j * block_size + i` and each step
is **one pass** of the block in which every block token sees the row's cache
(the prompt and the committed blocks) and every token of the block (already
committed ones as their tokens, the others as masks). Each step commits
masked tokens of the block:

* `mdm_threshold is None` (LLaDA-style): the `mdm_tokens_per_step` most
  confident ones (fewer when fewer are left);
* otherwise (Fast-dLLM-style): every one whose confidence exceeds
  `mdm_threshold`, and the most confident one when none does.

Draft and confidence are the MDM decoder's: draft = argmax of the logits (a
sample at temperature > 0: argmax with Gumbel noise), confidence = its softmax
probability under the plain logits; the mask token is never drafted; ties in
confidence go to the lower position.

The shared clean pass. A finished block's clean K/V enter the cache in the
same pass as the next block's first step: that pass feeds the finished block's
tokens (group 0: they see the cache and each other, both ways; their K/V are
written after the row's live entries, which then take them in) followed by the
next block's masks (group 1: they see the cache, the clean block and
themselves). It is the attention of a separate clean pass followed by the
block's first step, in one pass (`passes.run_pass(block_groups=True)`); a pass
is `block_size` tokens wide, or twice that when some row feeds a clean block.
The last block, and a block that ends the text, never enter the cache.

EOS rule: a block that commits an EOS is still completed; then the row stops,
and its response is the tokens up to and including its first EOS (later
positions are discarded: pad id, commit step -1, not counted). Without an EOS
a row stops after its last block.

Counters: `plan_b` counts the block passes (one per step while the row is
active, the shared clean pass included: it is the step's own pass, so
`nfe_b == steps_b`); `prefill_b` is 1 (the prompt's pass, reported apart as
for the other cached decoders). Commit steps count the row's steps from 0.

A row program of `engine`: one compiled program per shape, the count, the
threshold and the temperature traced knobs (LLaDA-style and Fast-dLLM-style
settings share it); rows advance independently, so a prompt decodes the same
alone, in a batch, or admitted mid-run.
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp

from refusion_jax.decode import common, compiled, engine, mdm, passes
from refusion_jax.decode import program as program_lib
from refusion_jax.decode.counters import DecodeCounters, DecodeOutput
from refusion_jax.decode.program import DONE, FIRST_PHASE, FREE
from refusion_jax.decode.settings import DecodeConfig
from refusion_jax.kv_cache import KVCache

DENOISE = FIRST_PHASE
CLEAN_GROUP, BLOCK_GROUP = 0, 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class Spec(program_lib.Spec):
  block_size: int  # decode.block_size


@flax.struct.dataclass(kw_only=True)
class Knobs(program_lib.Knobs):
  mdm_threshold: jax.Array  # < 0: off (mdm_tokens_per_step a step)
  mdm_tokens_per_step: jax.Array


@flax.struct.dataclass
class Rows:
  phase_b: jax.Array
  length_b: jax.Array  # live cache entries (the cache's own length is kept equal)
  prompt_len_b: jax.Array
  key_b2: jax.Array  # the prompt's PRNG key (raw uint32)
  gen_bg: jax.Array  # response tokens (mask id where undecided)
  decided_bg: jax.Array
  commit_step_bg: jax.Array  # the row's step at which each position was committed, -1 never
  block_b: jax.Array  # index of each row's current block
  clean_b: jax.Array  # the block before the current one is done; its K/V are not cached yet
  counters: DecodeCounters


State = program_lib.State


def widths(spec: Spec) -> tuple[int, int]:
  """Static pass widths: one block, or a clean block and the next block's masks."""
  return (spec.block_size, 2 * spec.block_size)


def _empty_rows(spec: Spec, b: int, mask_id) -> Rows:
  g = spec.gen_length
  zi = jnp.zeros((b,), jnp.int32)
  return Rows(phase_b=zi + FREE, length_b=zi, prompt_len_b=zi + 1,
              key_b2=jnp.zeros((b, 2), jnp.uint32),
              gen_bg=jnp.full((b, g), mask_id, jnp.int32), decided_bg=jnp.zeros((b, g), bool),
              commit_step_bg=jnp.full((b, g), -1, jnp.int32), block_b=zi,
              clean_b=jnp.zeros((b,), bool), counters=DecodeCounters.zeros(b))


def init(model, spec: Spec, rows: int, width: int) -> State:
  mask = model.config.mask_token_id
  r = _empty_rows(spec, rows, -1 if mask is None else mask)
  return State(passes=jnp.zeros((), jnp.int32),
               cache=KVCache.init(model.config, rows, width + spec.gen_length,
                                  chunk=spec.kv_chunk), rows=r)


def admit(model, spec: Spec, st: State, ids_ap, lens_a, rows_a, keys_a2, knobs: Knobs) -> State:
  """Prefills each prompt causally into its row's cache; its first block is all masks."""
  cache, _ = common.prefill_rows(model, st.cache, ids_ap, lens_a, rows_a)
  a = ids_ap.shape[0]
  fresh = _empty_rows(spec, a, knobs.mask_id).replace(
      phase_b=jnp.full((a,), DENOISE, jnp.int32), length_b=lens_a, prompt_len_b=lens_a,
      key_b2=keys_a2)
  fresh = fresh.replace(counters=fresh.counters.add(jnp.ones((a,), bool), prefill_b=1))
  return st.replace(cache=cache, rows=program_lib.set_rows(st.rows, fresh, rows_a))


def _block_of(x_bg, block_b, blk: int):
  """`[B, blk]`: each row's block `block_b` of a `[B, G]` array (index clipped)."""
  b, g = x_bg.shape
  index = jnp.clip(block_b, 0, g // blk - 1)
  return jnp.take_along_axis(x_bg.reshape(b, g // blk, blk), index[:, None, None], axis=1)[:, 0]


def step(model, spec: Spec, st: State, knobs: Knobs) -> State:
  """One pass: every active row denoises its current block (after caching the clean
  block before it, in the same pass, when that block has just been finished)."""
  r = st.rows
  b, g = r.gen_bg.shape
  blk = spec.block_size
  n_blocks = g // blk
  t = jnp.arange(blk)
  active_b = r.phase_b == DENOISE
  clean_b = active_b & r.clean_b

  # Layout: [the finished block's clean tokens | the current block].
  ones_bt = jnp.ones((b, blk), bool)
  block_pos_bt = r.prompt_len_b[:, None] + r.block_b[:, None] * blk + t[None]
  feed = passes.Feed(
      fed_bn=jnp.concatenate([clean_b[:, None] & ones_bt, active_b[:, None] & ones_bt], 1),
      ids_bn=jnp.concatenate([_block_of(r.gen_bg, r.block_b - 1, blk),
                              _block_of(r.gen_bg, r.block_b, blk)], 1),
      positions_bn=jnp.concatenate([block_pos_bt - blk, block_pos_bt], 1).astype(jnp.int32),
      group_bn=jnp.concatenate([jnp.full((b, blk), CLEAN_GROUP, jnp.int32),
                                jnp.full((b, blk), BLOCK_GROUP, jnp.int32)], 1),
      dest_bn=jnp.concatenate([jnp.where(clean_b[:, None], r.length_b[:, None] + t[None], -1),
                               jnp.full((b, blk), -1, jnp.int32)], 1).astype(jnp.int32),
      sample_bn=jnp.concatenate([~ones_bt, ones_bt], 1))
  keys = program_lib.pass_keys(r.key_b2, r.counters.nfe_b(), 2 * blk, knobs.temperature)
  cache, out = passes.run_pass(model, st.cache, feed, widths(spec),
                               temperature=knobs.temperature, keys_bn2=keys,
                               banned_id=knobs.mask_id, vocab_chunk=spec.vocab_chunk,
                               block_groups=True)
  length_b = r.length_b + jnp.where(clean_b, blk, 0).astype(jnp.int32)
  draft_bt, conf_bt = out.pick_bn[:, blk:], out.p_pick_bn[:, blk:]

  decided_bt = _block_of(r.decided_bg, r.block_b, blk)
  candidate_bt = active_b[:, None] & ~decided_bt
  rank_bt = mdm.confidence_rank_bg(conf_bt, candidate_bt)
  chosen_bt = candidate_bt & jnp.where(knobs.mdm_threshold >= 0,
                                       (conf_bt > knobs.mdm_threshold) | (rank_bt == 0),
                                       rank_bt < knobs.mdm_tokens_per_step)
  # The current block is one row of the [B, blocks, block] view: an elementwise select.
  put_bkt = ((jnp.arange(n_blocks)[None] == r.block_b[:, None])[:, :, None]
             & chosen_bt[:, None, :])

  def write(x_bg, value):
    return jnp.where(put_bkt, value, x_bg.reshape(b, n_blocks, blk)).reshape(b, g)

  gen_bg = write(r.gen_bg, draft_bt[:, None, :])
  decided_bg = r.decided_bg | put_bkt.reshape(b, g)
  commit_step_bg = write(r.commit_step_bg, r.counters.steps_b[:, None, None])

  block_tokens_bt = _block_of(gen_bg, r.block_b, blk)
  block_done_b = active_b & jnp.all(decided_bt | chosen_bt, axis=1)
  eos_b = jnp.any(knobs.is_stop(block_tokens_bt), axis=1)  # every token decided when done
  finish_b = block_done_b & (eos_b | (r.block_b == n_blocks - 1))
  advance_b = block_done_b & ~finish_b
  counters = r.counters.add(active_b, plan_b=1, steps_b=1).add_step_tpf(
      active_b, chosen_bt.sum(-1), active_b)
  r = r.replace(phase_b=jnp.where(finish_b, DONE, r.phase_b), length_b=length_b,
                gen_bg=gen_bg, decided_bg=decided_bg, commit_step_bg=commit_step_bg,
                block_b=r.block_b + advance_b.astype(jnp.int32),
                clean_b=jnp.where(active_b, advance_b, r.clean_b), counters=counters)
  return State(passes=st.passes + 1, cache=cache.replace(length_b=length_b), rows=r)


PROGRAM = program_lib.register(program_lib.Program(
    # The response, its EOS rule and counters are the MDM decoder's (same Rows fields).
    name="bd3lm", init=init, admit=admit, step=step, output=mdm.output, spec_type=Spec,
    knobs_type=Knobs, pass_widths=widths, needs_rng_to_sample=False), __name__)


def generate(model, prompt_ids_bp, prompt_len_b, decode_config: DecodeConfig,
             rng=None) -> DecodeOutput:
  """Decodes up to `decode_config.gen_length` tokens after each prompt, block by block.

  Args:
    model: a causal `Transformer` trained with the BD3-LM objective.
    prompt_ids_bp: `[B, P]` right-padded prompt ids.
    prompt_len_b: `[B]` real prompt lengths (1..P).
    decode_config: `DecodeConfig` with `method='bd3lm'`.
    rng: PRNG key (used only when temperature > 0; default key 0).
  """
  return engine.Decoder(model, decode_config, method="bd3lm").generate(
      prompt_ids_bp, prompt_len_b, rng)


def compiled_programs() -> int:
  """Programs compiled so far by `generate` (tests use it to prove a bucket is reused)."""
  return compiled.compiled_programs()["generate"]
