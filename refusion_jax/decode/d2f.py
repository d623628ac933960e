"""Discrete diffusion forcing decoding (the D2F baseline): pipelined blocks over an exact
KV cache.

ALGORITHM.md "Table 1's baselines", D2F. The model is an MDM whose D2F adapter
(`refusion_jax.lora`) taught it *block-causal* attention: the prompt sees the prompt;
a response token of block j sees the prompt, the blocks before j and all of block j.
Under that mask a finished block's K/V never change, so they enter the row's KV cache
once, exactly, and every pass feeds only the blocks in flight.

Admission prefills the prompt (each prompt token sees the whole prompt) into the
row's cache. Then each step is **one pass** per active row:

1. *Add*: a block of `block_size` masks is appended when the last block's decoded
   fraction is at least tau_add (`d2f_add_threshold`; the prompt counts as decoded,
   so the first block comes at once), no stop token has been committed, blocks remain,
   and fewer than `d2f_window` blocks are in flight (appended, not yet cached).
2. *Activate*: a block becomes fully activated once its predecessor's decoded fraction
   is at least tau_act (`d2f_act_threshold`; the first block is from the start); the
   flag is never reset.
3. *Pass*: the in-flight blocks, in order, each token seeing the row's cache, its own
   block both ways and the earlier in-flight blocks (`passes.run_pass(block_groups=
   True)`, at the narrowest width that holds every row's feed). Blocks finished in an
   earlier step lead the feed: their K/V are written into the cache (the cache's live
   length then takes them in).
4. *Commit*: in every in-flight block, each masked token whose confidence exceeds
   tau_conf (`d2f_conf_threshold`), and in a fully activated block at least its most
   confident masked token. Draft and confidence are the MDM decoder's (argmax, or a
   sample at temperature > 0; its softmax probability; the mask never drafted; ties to
   the lower position).
5. *To the cache*: the run of fully decided blocks that starts at the first uncached
   block is fed (and cached) in the next pass.

A row stops when its first stop token (EOS or a `stop_token_ids`) is final (every
position before it decided), or when its last block is decided; its response is the
MDM decoder's (`mdm.output`): the tokens up to its first stop token. D2F's code goes
on decoding the blocks in flight after a stop token; the tokens up to it are the same.

Counters: `plan_b` counts the passes (`nfe_b == steps_b`), `prefill_b` is 1.

A model whose logits are shifted (Dream) reads position i's draft from position i-1's
output: the first in-flight position's from the last cached token's, kept from the pass
that cached it (the prompt's last token's, from the prefill), as D2F keeps `last_logits`;
at temperature > 0 that draft is the one sampled then.

A row program of `engine`: one compiled program per shape; the three thresholds and
the temperature are traced knobs, `d2f_window` static.
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp

from refusion_jax.decode import common, engine, heads, mdm, passes
from refusion_jax.decode import program as program_lib
from refusion_jax.decode.counters import DecodeCounters, DecodeOutput
from refusion_jax.decode.program import DONE, FIRST_PHASE, FREE
from refusion_jax.decode.settings import DecodeConfig
from refusion_jax.kv_cache import KVCache

DENOISE = FIRST_PHASE


@dataclasses.dataclass(frozen=True, kw_only=True)
class Spec(program_lib.Spec):
  block_size: int  # decode.block_size
  d2f_window: int  # decode.d2f_window, at most the response's blocks


@flax.struct.dataclass(kw_only=True)
class Knobs(program_lib.Knobs):
  d2f_add: jax.Array  # tau_add (decode.d2f_add_threshold)
  d2f_act: jax.Array  # tau_act
  d2f_conf: jax.Array  # tau_conf


@flax.struct.dataclass
class Rows:
  phase_b: jax.Array
  length_b: jax.Array  # live cache entries: the prompt and the cached blocks
  prompt_len_b: jax.Array
  key_b2: jax.Array  # the prompt's PRNG key (raw uint32)
  gen_bg: jax.Array  # response tokens (mask id where undecided)
  decided_bg: jax.Array
  commit_step_bg: jax.Array  # the row's step at which each position was committed, -1 never
  cached_b: jax.Array  # blocks in the cache (the first in flight is block cached_b)
  added_b: jax.Array  # blocks appended
  to_cache_b: jax.Array  # finished blocks after the cached ones, fed (and cached) next
  complete_bk: jax.Array  # fully activated blocks
  stop_seen_b: jax.Array  # a stop token has been committed: no block is appended
  # A shifted model (Dream): the first uncached position's draft and its probability, read
  # from the last cached token's output (the prompt's last at first; D2F's last_logits).
  last_pick_b: jax.Array
  last_p_b: jax.Array
  counters: DecodeCounters


State = program_lib.State


def widths(spec: Spec) -> tuple[int, ...]:
  """Static pass widths: 1, 2, 4, ... blocks, up to the window."""
  out, n = [], 1
  while n < spec.d2f_window:
    out.append(n * spec.block_size)
    n *= 2
  return tuple(out) + (spec.d2f_window * spec.block_size,)


def _empty_rows(spec: Spec, b: int, mask_id) -> Rows:
  g = spec.gen_length
  zi = jnp.zeros((b,), jnp.int32)
  return Rows(phase_b=zi + FREE, length_b=zi, prompt_len_b=zi + 1,
              key_b2=jnp.zeros((b, 2), jnp.uint32),
              gen_bg=jnp.full((b, g), mask_id, jnp.int32), decided_bg=jnp.zeros((b, g), bool),
              commit_step_bg=jnp.full((b, g), -1, jnp.int32), cached_b=zi, added_b=zi,
              to_cache_b=zi, complete_bk=jnp.zeros((b, g // spec.block_size), bool),
              stop_seen_b=jnp.zeros((b,), bool), last_pick_b=zi,
              last_p_b=jnp.zeros((b,), jnp.float32), counters=DecodeCounters.zeros(b))


def init(model, spec: Spec, rows: int, width: int) -> State:
  mask = model.config.mask_token_id
  r = _empty_rows(spec, rows, -1 if mask is None else mask)
  return State(passes=jnp.zeros((), jnp.int32),
               cache=KVCache.init(model.config, rows, width + spec.gen_length,
                                  chunk=spec.kv_chunk), rows=r)


def admit(model, spec: Spec, st: State, ids_ap, lens_a, rows_a, keys_a2, knobs: Knobs) -> State:
  """Prefills each prompt (every token seeing the whole prompt) into its row's cache."""
  cache, last_ad = common.prefill_rows(model, st.cache, ids_ap, lens_a, rows_a,
                                       bidirectional=True)
  a = ids_ap.shape[0]
  fresh = _empty_rows(spec, a, knobs.mask_id).replace(
      phase_b=jnp.full((a,), DENOISE, jnp.int32), length_b=lens_a, prompt_len_b=lens_a,
      key_b2=keys_a2)
  if model.config.shift_logits:
    # The prompt's last output predicts the first response token (a key no pass uses).
    n = spec.d2f_window * spec.block_size
    keys = program_lib.pass_keys(keys_a2, jnp.zeros((a,), jnp.int32), n + 1,
                            knobs.temperature)[:, n:]
    stats = heads.token_stats(last_ad[:, None], model.unembed(), jnp.zeros((a, 1), jnp.int32),
                              sample_bt=jnp.ones((a, 1), bool), temperature=knobs.temperature,
                              keys_bt2=keys, banned_id=knobs.mask_id,
                              vocab_chunk=spec.vocab_chunk)
    fresh = fresh.replace(last_pick_b=stats.pick_bt[:, 0], last_p_b=stats.p_pick_bt[:, 0])
  fresh = fresh.replace(counters=fresh.counters.add(jnp.ones((a,), bool), prefill_b=1))
  return st.replace(cache=cache, rows=program_lib.set_rows(st.rows, fresh, rows_a))


def step(model, spec: Spec, st: State, knobs: Knobs) -> State:
  """One pass: every active row appends, activates, feeds its blocks in flight, commits."""
  r = st.rows
  b, g = r.gen_bg.shape
  bs, w = spec.block_size, spec.d2f_window
  k_blocks = g // bs
  n = w * bs
  active_b = r.phase_b == DENOISE
  ks = jnp.arange(k_blocks)
  frac_bk = r.decided_bg.reshape(b, k_blocks, bs).sum(-1).astype(jnp.float32) / bs

  # 1. Append a block: the last one decoded enough (the prompt counts as decoded).
  last_frac_b = jnp.where(r.added_b > 0, jnp.take_along_axis(
      frac_bk, jnp.maximum(r.added_b - 1, 0)[:, None], axis=1)[:, 0], 1.0)
  add_b = (active_b & (r.added_b < k_blocks) & ~r.stop_seen_b & (last_frac_b >= knobs.d2f_add)
           & (r.added_b - r.cached_b < w))
  added_b = r.added_b + add_b.astype(jnp.int32)
  # 2. Activate: a block whose predecessor decoded enough (the first: the prompt).
  prev_frac_bk = jnp.concatenate([jnp.ones((b, 1), jnp.float32), frac_bk[:, :-1]], axis=1)
  complete_bk = r.complete_bk | ((ks[None] < added_b[:, None]) & (prev_frac_bk >= knobs.d2f_act))

  # 3. The pass: blocks cached_b .. added_b - 1, block j's tokens in group j.
  block_bw = r.cached_b[:, None] + jnp.arange(w)[None]
  in_flight_bw = active_b[:, None] & (block_bw < added_b[:, None])
  caching_bw = in_flight_bw & (jnp.arange(w)[None] < r.to_cache_b[:, None])
  t = jnp.arange(bs)
  gen_pos_bn = (block_bw[:, :, None] * bs + t[None, None]).reshape(b, n)
  pos_bn = jnp.minimum(gen_pos_bn, g - 1)
  fed_bn = jnp.repeat(in_flight_bw, bs, axis=1)
  decided_bn = jnp.take_along_axis(r.decided_bg, pos_bn, axis=1)
  positions_bn = (r.prompt_len_b[:, None] + pos_bn).astype(jnp.int32)
  feed = passes.Feed(
      fed_bn=fed_bn, ids_bn=jnp.take_along_axis(r.gen_bg, pos_bn, axis=1),
      positions_bn=positions_bn,
      group_bn=jnp.repeat(block_bw, bs, axis=1).astype(jnp.int32),
      dest_bn=jnp.where(jnp.repeat(caching_bw, bs, axis=1), positions_bn, -1).astype(jnp.int32),
      sample_bn=fed_bn & ~decided_bn)
  keys = program_lib.pass_keys(r.key_b2, r.counters.nfe_b(), n, knobs.temperature)
  cache, out = passes.run_pass(model, st.cache, feed, widths(spec),
                               temperature=knobs.temperature, keys_bn2=keys,
                               banned_id=knobs.mask_id, vocab_chunk=spec.vocab_chunk,
                               block_groups=True)
  cached_b = r.cached_b + jnp.where(active_b, r.to_cache_b, 0)
  length_b = r.length_b + jnp.where(active_b, r.to_cache_b * bs, 0).astype(jnp.int32)
  pick_bn, p_bn = out.pick_bn, out.p_pick_bn
  last_pick_b, last_p_b = r.last_pick_b, r.last_p_b
  if model.config.shift_logits:
    # Entry i's token is read from entry i - 1's output; the first entry's from the last
    # cached token's, kept. Blocks cached by this pass hand their last output on.
    pick_bn = jnp.concatenate([r.last_pick_b[:, None], out.pick_bn[:, :-1]], axis=1)
    p_bn = jnp.concatenate([r.last_p_b[:, None], out.p_pick_bn[:, :-1]], axis=1)
    last_at = jnp.clip(r.to_cache_b * bs - 1, 0, n - 1)[:, None]
    handed_b = active_b & (r.to_cache_b > 0)
    last_pick_b = jnp.where(handed_b, jnp.take_along_axis(out.pick_bn, last_at, 1)[:, 0],
                            r.last_pick_b)
    last_p_b = jnp.where(handed_b, jnp.take_along_axis(out.p_pick_bn, last_at, 1)[:, 0],
                         r.last_p_b)

  # 4. Commit, block by block.
  cand_bwt = (fed_bn & ~decided_bn).reshape(b, w, bs)
  conf_bwt = p_bn.reshape(b, w, bs)
  rank_bwt = mdm.confidence_rank_bg(conf_bwt.reshape(b * w, bs),
                                    cand_bwt.reshape(b * w, bs)).reshape(b, w, bs)
  complete_bw = jnp.take_along_axis(complete_bk, jnp.minimum(block_bw, k_blocks - 1), axis=1)
  chosen_bn = (cand_bwt & ((conf_bwt > knobs.d2f_conf)
                           | (complete_bw[:, :, None] & (rank_bwt == 0)))).reshape(b, n)
  rows_bn = jnp.broadcast_to(jnp.arange(b)[:, None], (b, n))
  put_bn = jnp.where(chosen_bn, gen_pos_bn, g)  # dropped where nothing is committed
  gen_bg = r.gen_bg.at[rows_bn, put_bn].set(pick_bn, mode="drop")
  decided_bg = r.decided_bg.at[rows_bn, put_bn].set(True, mode="drop")
  commit_step_bg = r.commit_step_bg.at[rows_bn, put_bn].set(
      jnp.broadcast_to(r.counters.steps_b[:, None], (b, n)), mode="drop")
  stop_seen_b = r.stop_seen_b | jnp.any(chosen_bn & knobs.is_stop(pick_bn), axis=1)

  # 5. The finished blocks that follow the cached ones go to the cache next.
  done_bk = jnp.all(decided_bg.reshape(b, k_blocks, bs), axis=-1) & (ks[None] < added_b[:, None])
  open_bk = (ks[None] >= cached_b[:, None]) & ~done_bk
  first_open_b = jnp.where(open_bk.any(axis=1), jnp.argmax(open_bk, axis=1), k_blocks)
  to_cache_b = jnp.maximum(jnp.minimum(first_open_b, added_b) - cached_b, 0).astype(jnp.int32)

  _, stop_final_b = mdm.first_eos_b(gen_bg, decided_bg, knobs)
  finish_b = active_b & (stop_final_b | jnp.all(decided_bg, axis=1))
  counters = r.counters.add(active_b, plan_b=1, steps_b=1).add_step_tpf(
      active_b, chosen_bn.sum(-1), active_b)
  keep = lambda new, old: jnp.where(active_b.reshape((b,) + (1,) * (new.ndim - 1)), new, old)
  r = r.replace(phase_b=jnp.where(finish_b, DONE, r.phase_b), length_b=length_b,
                gen_bg=gen_bg, decided_bg=decided_bg, commit_step_bg=commit_step_bg,
                cached_b=cached_b, added_b=keep(added_b, r.added_b),
                to_cache_b=keep(to_cache_b, r.to_cache_b),
                complete_bk=keep(complete_bk, r.complete_bk), stop_seen_b=stop_seen_b,
                last_pick_b=last_pick_b, last_p_b=last_p_b, counters=counters)
  return State(passes=st.passes + 1, cache=cache.replace(length_b=length_b), rows=r)


PROGRAM = program_lib.register(program_lib.Program(
    # The response, its stop rule and counters are the MDM decoder's (same Rows fields).
    name="d2f", init=init, admit=admit, step=step, output=mdm.output, spec_type=Spec,
    knobs_type=Knobs, pass_widths=widths, needs_rng_to_sample=False), __name__)


def generate(model, prompt_ids_bp, prompt_len_b, decode_config: DecodeConfig,
             rng=None) -> DecodeOutput:
  """Decodes up to `decode_config.gen_length` tokens after each prompt, D2F's way.

  Args:
    model: a bidirectional `Transformer` with a D2F adapter (merged: `lora.merge`).
    prompt_ids_bp: `[B, P]` right-padded prompt ids.
    prompt_len_b: `[B]` real prompt lengths (1..P).
    decode_config: `DecodeConfig` with `method='d2f'`.
    rng: PRNG key (used only when temperature > 0; default key 0).
  """
  return engine.Decoder(model, decode_config, method="d2f").generate(
      prompt_ids_bp, prompt_len_b, rng)
