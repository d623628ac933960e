"""Training objectives: ReFusion's hybrid slot loss and the ARM / MDM baselines.

ALGORITHM.md "Training objective". For one example with prompt length P and
response length R (answer + EOS):

* a slot size k is drawn from `slot_sizes`; the response is cut into
  consecutive slots of k tokens (the last may be shorter);
* p = (1 - eps) * t + eps with t ~ U(0, 1); each slot is masked with prob p;
* the input is the prompt, the clean slots in a random order, then the masked
  slots in their original order (all their tokens = mask id), then padding;
  every token keeps its original position id;
* clean-slot tokens learn the next token of their own slot (AR), masked tokens
  learn their own token (MDM).

Everything is vectorised over the batch: the permutation is built with an
argsort over per-slot random keys and cumulative sums of slot lengths, then
applied with one scatter (to get each output slot's source index) and gathers.
No Python loop runs over examples or slots, so the whole thing jits into a
few small ops next to the model.

The random draw is split from the layout (`draw_refusion` then
`refusion_corrupt_from_draws`) so a test can rebuild the expected layout from
the very same draw with a plain-Python oracle.

Each loss is a function of the per-token cross-entropy (`*_loss_from_ce`).
That CE comes either from full `[B, T, V]` logits or, for long rows and large
vocabularies, from the hidden states a chunk of the sequence at a time
(`chunked_token_cross_entropy`, `loss_fn(..., loss_chunk=N)`).

Batch format (from the data pipeline): `tokens` int32 [B, L] = prompt tokens
then response tokens, right-padded; `prompt_len` int32 [B]; `response_len`
int32 [B] (EOS included). `prompt_len + response_len <= L` is required; it is
checked by `check_batch` whenever the values are concrete. Inside a jitted
program (where it cannot be checked) out-of-range lengths are clipped to the
row so the layout stays a permutation.
"""

from __future__ import annotations

import numbers
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from refusion_jax import sharding
from refusion_jax.checks import is_int

KIND_IGNORE = 0
KIND_AR = 1
KIND_MDM = 2

# Each objective and the attention its model trains with (ALGORITHM.md "Baselines"):
# the MDM baseline sees the whole row, ReFusion and the ARM are causal.
OBJECTIVE_ATTENTION = {"refusion": "causal", "arm": "causal", "mdm": "bidirectional"}
OBJECTIVES = tuple(OBJECTIVE_ATTENTION)
DEFAULT_SLOT_SIZES = (4, 8, 16, 32)
DEFAULT_EPS = 1e-3


@struct.dataclass
class Corrupted:
  """A model-ready training input plus what the loss needs.

  Attributes:
    input_ids_bt: int32 [B, L] tokens fed to the model (permuted, masked).
    positions_bt: int32 [B, L] true position of each input token. Padding
      keeps its own index as position (padding never moves, so this is also
      its original position).
    labels_bt: int32 [B, L] target token per input token; `pad_id` where
      `kind_bt` is KIND_IGNORE (a valid id, so the gather in the loss is safe).
    kind_bt: int8 [B, L] KIND_IGNORE (0), KIND_AR (1) or KIND_MDM (2).
    p_b: float32 [B] masking probability of the example (the MDM weight 1/p).
    response_len_b: int32 [B] response length (the MDM normaliser; for the MDM
      baseline the EOS-padded length L - prompt_len, see `mdm_corrupt`).
    slot_size_b: int32 [B] slot size k of the example (1 for the MDM baseline,
      whose token-level masking is masking slots of one token).
  """

  input_ids_bt: jax.Array
  positions_bt: jax.Array
  labels_bt: jax.Array
  kind_bt: jax.Array
  p_b: jax.Array
  response_len_b: jax.Array
  slot_size_b: jax.Array


@struct.dataclass
class RefusionDraws:
  """Every random choice of `refusion_corrupt`, explicit.

  Attributes:
    slot_size_b: int32 [B] slot size k.
    t_b: float32 [B] t ~ U(0, 1).
    p_b: float32 [B] (1 - eps) * t + eps.
    slot_masked_bs: bool [B, S] whether slot s is masked (bits of slots past
      the end of the response are drawn but unused).
    slot_order_key_bs: float32 [B, S] random keys; clean slots are placed in
      increasing key order (ties by slot index).
  """

  slot_size_b: jax.Array
  t_b: jax.Array
  p_b: jax.Array
  slot_masked_bs: jax.Array
  slot_order_key_bs: jax.Array


# --------------------------------------------------------------------------
# Python-level validation (runs before anything is traced or compiled).


def check_slot_sizes(slot_sizes: Sequence[int]) -> tuple[int, ...]:
  """Returns `slot_sizes` as a tuple of positive ints, or raises ValueError."""
  if isinstance(slot_sizes, (str, bytes)) or not isinstance(slot_sizes, Sequence):
    raise ValueError(f"slot_sizes must be a non-empty sequence of positive ints, "
                     f"got {slot_sizes!r}")
  if len(slot_sizes) == 0:
    raise ValueError("slot_sizes must be non-empty, got ()")
  for k in slot_sizes:
    if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k <= 0:
      raise ValueError(f"slot_sizes must contain positive ints only, got {k!r} in "
                       f"{tuple(slot_sizes)!r}")
  return tuple(int(k) for k in slot_sizes)


def _check_eps(eps: float) -> float:
  if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not 0.0 < eps < 1.0:
    raise ValueError(f"eps must be a float in (0, 1), got {eps!r}")
  return float(eps)


def _check_token_id(name: str, value: int, vocab_size: int | None = None) -> int:
  if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
    raise ValueError(f"{name} must be a non-negative int, got {value!r}")
  if vocab_size is not None and value >= vocab_size:
    raise ValueError(f"{name}={value} is outside the model vocabulary [0, {vocab_size})")
  return int(value)


def _check_objective(objective: str) -> str:
  if objective not in OBJECTIVES:
    raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
  return objective


def attention_for(objective: str) -> str:
  """The ModelConfig.attention that `objective` trains with."""
  return OBJECTIVE_ATTENTION[_check_objective(objective)]


def _is_concrete(x) -> bool:
  return not isinstance(x, jax.core.Tracer)


def check_batch(batch: Mapping[str, Any]) -> None:
  """Validates a batch's fields and shapes; also its lengths when they are concrete.

  Raises ValueError naming the field. Lengths held by tracers (inside jit)
  cannot be inspected and are only shape-checked.
  """
  if not isinstance(batch, Mapping):
    raise ValueError(f"batch must be a mapping with tokens/prompt_len/response_len, got "
                     f"{type(batch).__name__}")
  missing = [k for k in ("tokens", "prompt_len", "response_len") if k not in batch]
  if missing:
    raise ValueError(f"batch is missing field(s) {missing}; it has {sorted(batch)}")
  tokens, prompt_len, response_len = batch["tokens"], batch["prompt_len"], batch["response_len"]
  if getattr(tokens, "ndim", None) != 2:
    raise ValueError(f"batch['tokens'] must be [batch, length], got shape "
                     f"{getattr(tokens, 'shape', None)}")
  b, l = tokens.shape
  for name, value in (("prompt_len", prompt_len), ("response_len", response_len)):
    if getattr(value, "shape", None) != (b,):
      raise ValueError(f"batch['{name}'] must have shape ({b},) to match tokens {tokens.shape}, "
                       f"got {getattr(value, 'shape', None)}")
  for name, value in (("tokens", tokens), ("prompt_len", prompt_len),
                      ("response_len", response_len)):
    if not jnp.issubdtype(value.dtype, jnp.integer):
      raise ValueError(f"batch['{name}'] must be an integer array, got dtype {value.dtype}")
  if _is_concrete(prompt_len) and _is_concrete(response_len):
    p = np.asarray(prompt_len)
    r = np.asarray(response_len)
    if (p < 0).any():
      raise ValueError(f"batch['prompt_len'] must be >= 0, got {p[p < 0][:4].tolist()}")
    if (r < 1).any():
      raise ValueError(f"batch['response_len'] must be >= 1 (EOS included), got "
                       f"{r[r < 1][:4].tolist()}")
    too_long = np.nonzero(p + r > l)[0]
    if too_long.size:
      i = int(too_long[0])
      raise ValueError(f"batch row {i}: prompt_len {int(p[i])} + response_len {int(r[i])} "
                       f"exceeds the token length {l}")


def _clip_lengths(prompt_len_b, response_len_b, seq_len: int):
  # Keeps the layout a permutation even for bad lengths that slipped into jit.
  prompt_len_b = jnp.clip(jnp.asarray(prompt_len_b, jnp.int32), 0, seq_len)
  response_len_b = jnp.clip(jnp.asarray(response_len_b, jnp.int32), 0, seq_len - prompt_len_b)
  return prompt_len_b, response_len_b


# --------------------------------------------------------------------------
# ReFusion corruption.


def max_slots(seq_len: int, slot_sizes: Sequence[int]) -> int:
  """Slots the draw must cover: a response of at most `seq_len` tokens at the smallest k."""
  return -(-seq_len // min(slot_sizes))


def draw_refusion(rng, batch_size: int, seq_len: int, *, slot_sizes=DEFAULT_SLOT_SIZES,
                  eps: float = DEFAULT_EPS) -> RefusionDraws:
  """Draws slot sizes, t, per-slot mask bits and per-slot order keys."""
  slot_sizes = check_slot_sizes(slot_sizes)
  eps = _check_eps(eps)
  s = max_slots(seq_len, slot_sizes)
  k_rng, t_rng, m_rng, o_rng = jax.random.split(rng, 4)
  choice_b = jax.random.randint(k_rng, (batch_size,), 0, len(slot_sizes))
  slot_size_b = jnp.asarray(slot_sizes, jnp.int32)[choice_b]
  t_b = jax.random.uniform(t_rng, (batch_size,), jnp.float32)
  p_b = (1.0 - eps) * t_b + eps
  # uniform in [0, 1) < p: p = 1 masks every slot, p = eps almost none.
  slot_masked_bs = jax.random.uniform(m_rng, (batch_size, s), jnp.float32) < p_b[:, None]
  slot_order_key_bs = jax.random.uniform(o_rng, (batch_size, s), jnp.float32)
  return RefusionDraws(slot_size_b=slot_size_b, t_b=t_b, p_b=p_b,
                       slot_masked_bs=slot_masked_bs, slot_order_key_bs=slot_order_key_bs)


def refusion_corrupt_from_draws(tokens_bt, prompt_len_b, response_len_b, draws: RefusionDraws,
                                *, mask_id: int, pad_id: int) -> Corrupted:
  """The ReFusion input layout for explicit draws (see the module docstring)."""
  tokens_bt = jnp.asarray(tokens_bt, jnp.int32)
  b, l = tokens_bt.shape
  s = draws.slot_masked_bs.shape[1]
  prompt_len_b, response_len_b = _clip_lengths(prompt_len_b, response_len_b, l)
  p_1 = prompt_len_b[:, None]
  r_1 = response_len_b[:, None]
  k_1 = draws.slot_size_b.astype(jnp.int32)[:, None]

  # Per original token: region, slot index and offset inside the slot.
  index_1t = jnp.arange(l, dtype=jnp.int32)[None]
  in_prompt_bt = index_1t < p_1
  offset_bt = index_1t - p_1  # offset in the response (negative in the prompt)
  in_resp_bt = (offset_bt >= 0) & (offset_bt < r_1)
  slot_bt = jnp.clip(offset_bt // k_1, 0, s - 1)
  in_slot_bt = offset_bt - slot_bt * k_1

  # Per slot: length, masked / clean, and start offset in the permuted response.
  slot_1s = jnp.arange(s, dtype=jnp.int32)[None]
  slot_len_bs = jnp.clip(r_1 - slot_1s * k_1, 0, k_1)
  exists_bs = slot_len_bs > 0
  masked_bs = draws.slot_masked_bs & exists_bs
  clean_bs = exists_bs & ~masked_bs
  # Clean slots sorted by their random key come first; the rest sort after them.
  clean_order_bs = jnp.argsort(jnp.where(clean_bs, draws.slot_order_key_bs, jnp.inf), axis=1,
                               stable=True)
  clean_len_bs = jnp.where(clean_bs, slot_len_bs, 0)
  len_by_rank_bs = jnp.take_along_axis(clean_len_bs, clean_order_bs, axis=1)
  start_by_rank_bs = jnp.cumsum(len_by_rank_bs, axis=1) - len_by_rank_bs
  rank_bs = jnp.argsort(clean_order_bs, axis=1)  # inverse permutation
  clean_start_bs = jnp.take_along_axis(start_by_rank_bs, rank_bs, axis=1)
  num_clean_b1 = jnp.sum(clean_len_bs, axis=1, keepdims=True)
  masked_len_bs = jnp.where(masked_bs, slot_len_bs, 0)
  masked_start_bs = num_clean_b1 + jnp.cumsum(masked_len_bs, axis=1) - masked_len_bs
  slot_start_bs = jnp.where(masked_bs, masked_start_bs, clean_start_bs)

  # Destination of every original token: prompt and padding stay where they are.
  token_start_bt = jnp.take_along_axis(slot_start_bs, slot_bt, axis=1)
  dest_bt = jnp.where(in_resp_bt, p_1 + token_start_bt + in_slot_bt, index_1t)

  # Inputs, labels and kinds in the original order.
  masked_tok_bt = in_resp_bt & jnp.take_along_axis(masked_bs, slot_bt, axis=1)
  token_slot_len_bt = jnp.take_along_axis(slot_len_bs, slot_bt, axis=1)
  has_next_bt = in_resp_bt & ~masked_tok_bt & (in_slot_bt < token_slot_len_bt - 1)
  next_bt = jnp.concatenate([tokens_bt[:, 1:], jnp.full((b, 1), pad_id, jnp.int32)], axis=1)
  ids_bt = jnp.where(in_prompt_bt | in_resp_bt, tokens_bt, pad_id)
  ids_bt = jnp.where(masked_tok_bt, mask_id, ids_bt)
  labels_bt = jnp.where(masked_tok_bt, tokens_bt, jnp.where(has_next_bt, next_bt, pad_id))
  kind_bt = jnp.where(masked_tok_bt, KIND_MDM, jnp.where(has_next_bt, KIND_AR, KIND_IGNORE))

  # One scatter gives, for each output slot, the original index it comes from.
  rows_b1 = jnp.arange(b, dtype=jnp.int32)[:, None]
  src_bt = jnp.zeros((b, l), jnp.int32).at[rows_b1, dest_bt].set(
      jnp.broadcast_to(index_1t, (b, l)), unique_indices=True)

  def take(x_bt):
    return jnp.take_along_axis(x_bt, src_bt, axis=1)

  return Corrupted(
      input_ids_bt=take(ids_bt),
      positions_bt=src_bt,  # the source index is the original position
      labels_bt=take(labels_bt),
      kind_bt=take(kind_bt).astype(jnp.int8),
      p_b=draws.p_b.astype(jnp.float32),
      response_len_b=response_len_b,
      slot_size_b=draws.slot_size_b.astype(jnp.int32))


def refusion_corrupt(tokens_bt, prompt_len_b, response_len_b, rng, *, mask_id: int, pad_id: int,
                     slot_sizes=DEFAULT_SLOT_SIZES, eps: float = DEFAULT_EPS) -> Corrupted:
  """Draws and applies ReFusion's slot corruption (jittable; ids/sizes static)."""
  slot_sizes = check_slot_sizes(slot_sizes)
  b, l = jnp.shape(tokens_bt)
  draws = draw_refusion(rng, b, l, slot_sizes=slot_sizes, eps=eps)
  return refusion_corrupt_from_draws(tokens_bt, prompt_len_b, response_len_b, draws,
                                     mask_id=mask_id, pad_id=pad_id)


# --------------------------------------------------------------------------
# Losses.


def token_cross_entropy(logits_btv, labels_bt):
  """-log_softmax(logits)[label] per token, in float32."""
  logits_btv = logits_btv.astype(jnp.float32)
  # logsumexp - picked logit is -log_softmax at the label, without keeping [B, T, V] log-probs.
  picked_bt = jnp.take_along_axis(logits_btv, labels_bt[..., None].astype(jnp.int32),
                                  axis=-1)[..., 0]
  return jax.nn.logsumexp(logits_btv, axis=-1) - picked_bt


def check_loss_chunk(loss_chunk: int) -> int:
  """`loss_chunk` as an int >= 0 (0 = full logits), or ValueError."""
  if not is_int(loss_chunk) or loss_chunk < 0:
    raise ValueError(f"loss_chunk must be a non-negative int (0 = full logits), got "
                     f"{loss_chunk!r}")
  return int(loss_chunk)


def chunked_token_cross_entropy(h_btd, unembed, labels_bt, chunk_len: int):
  """`token_cross_entropy(unembed.project(h_btd), labels_bt)` without `[B, T, V]` logits.

  `unembed` is a `model.Unembed` (the output projection in the compute dtype).
  The sequence is cut into chunks of `chunk_len` tokens (a shorter last one when
  `chunk_len` does not divide T); each chunk's logits are projected, reduced to
  its per-token CE and dropped. The chunk body is rematerialised, so the
  backward pass recomputes one chunk's logits at a time too: at most
  `[B, chunk_len, V]` logits (and their gradient) exist at any moment.
  Returns float32 `[B, T]`.
  """
  chunk_len = check_loss_chunk(chunk_len)
  if chunk_len == 0:
    raise ValueError("chunked_token_cross_entropy needs chunk_len > 0, got 0")
  b, t, d = h_btd.shape
  labels_bt = jnp.asarray(labels_bt, jnp.int32)
  compute_dtype = unembed.w.dtype
  # The weight enters the chunks in float32 so that the per-chunk weight gradients
  # are summed in float32: a bfloat16 running sum, rounded after every chunk, drifts
  # measurably further from the full-sequence matmul's gradient.
  w32 = unembed.w.astype(jnp.float32)

  def chunk_ce(w, h_bcd, labels_bc):
    h_bcd = sharding.constrain(h_bcd, ("batch", "seq", "act_embed"))
    logits_bcv = unembed.replace(w=w.astype(compute_dtype)).project(h_bcd)
    # The model's own logits constraint: the vocabulary stays split over the tensor axis.
    logits_bcv = sharding.constrain(logits_bcv, ("batch", "seq", "vocab"))
    return token_cross_entropy(logits_bcv, labels_bc)

  n = t // chunk_len
  full = n * chunk_len
  pieces = []
  if n:
    # Inside scan the loop already keeps XLA from merging recomputation with the forward.
    scan_ce = jax.checkpoint(chunk_ce, prevent_cse=False)
    h_nbcd = h_btd[:, :full].reshape(b, n, chunk_len, d).swapaxes(0, 1)
    labels_nbc = labels_bt[:, :full].reshape(b, n, chunk_len).swapaxes(0, 1)
    _, ce_nbc = jax.lax.scan(lambda carry, xs: (carry, scan_ce(w32, *xs)), None,
                             (h_nbcd, labels_nbc))
    pieces.append(ce_nbc.swapaxes(0, 1).reshape(b, full))
  if full < t:
    pieces.append(jax.checkpoint(chunk_ce)(w32, h_btd[:, full:], labels_bt[:, full:]))
  return pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces, axis=1)


def _mdm_term(ce_bt, mdm_bt, p_b, response_len_b):
  # Sum over masked tokens of CE / p / len(response), averaged over the batch.
  weight_b = 1.0 / (p_b.astype(jnp.float32) * jnp.maximum(response_len_b, 1).astype(jnp.float32))
  per_example_b = jnp.sum(jnp.where(mdm_bt, ce_bt, 0.0), axis=1) * weight_b
  return jnp.sum(per_example_b) / ce_bt.shape[0]


def _metrics(loss, ar_loss, mdm_loss, ar_tokens, mdm_tokens):
  return {"loss": loss, "ar_loss": ar_loss, "mdm_loss": mdm_loss,
          "ar_tokens": ar_tokens.astype(jnp.float32),
          "mdm_tokens": mdm_tokens.astype(jnp.float32)}


def refusion_loss_from_ce(ce_bt, corrupted: Corrupted):
  """`refusion_loss` from the per-token CE of `corrupted.labels_bt`."""
  ar_bt = corrupted.kind_bt == KIND_AR
  mdm_bt = corrupted.kind_bt == KIND_MDM
  ar_tokens = jnp.sum(ar_bt)
  ar_loss = jnp.sum(jnp.where(ar_bt, ce_bt, 0.0)) / jnp.maximum(ar_tokens, 1).astype(jnp.float32)
  mdm_loss = _mdm_term(ce_bt, mdm_bt, corrupted.p_b, corrupted.response_len_b)
  loss = ar_loss + mdm_loss
  return loss, _metrics(loss, ar_loss, mdm_loss, ar_tokens, jnp.sum(mdm_bt))


def refusion_loss(logits_btv, corrupted: Corrupted):
  """AR (token mean, 0 when there is none) + MDM (CE / p / len summed, batch mean)."""
  return refusion_loss_from_ce(token_cross_entropy(logits_btv, corrupted.labels_bt), corrupted)


def arm_targets(tokens_bt, prompt_len_b, response_len_b):
  """`(labels_bt, valid_bt)` of the next-token loss: label i is token i+1, valid on the response."""
  tokens_bt = jnp.asarray(tokens_bt, jnp.int32)
  b, l = tokens_bt.shape
  prompt_len_b, response_len_b = _clip_lengths(prompt_len_b, response_len_b, l)
  labels_bt = jnp.concatenate([tokens_bt[:, 1:], jnp.zeros((b, 1), jnp.int32)], axis=1)
  target_1t = jnp.arange(l, dtype=jnp.int32)[None] + 1  # index of the predicted token
  valid_bt = (target_1t >= prompt_len_b[:, None]) & (
      target_1t < (prompt_len_b + response_len_b)[:, None]) & (target_1t < l)
  return labels_bt, valid_bt


def arm_loss_from_ce(ce_bt, valid_bt):
  """`arm_loss` from the per-token CE of `arm_targets`' labels."""
  count = jnp.sum(valid_bt)
  loss = jnp.sum(jnp.where(valid_bt, ce_bt, 0.0)) / jnp.maximum(count, 1).astype(jnp.float32)
  return loss, _metrics(loss, loss, jnp.zeros((), jnp.float32), count, jnp.zeros((), jnp.int32))


def arm_loss(logits_btv, tokens_bt, prompt_len_b, response_len_b):
  """Next-token loss on the response tokens (token mean over the batch).

  `logits_btv` come from the unchanged causal input with positions 0..L-1.
  Logit i predicts token i+1; the targets are the response tokens, so the
  first is predicted from the last prompt token (a response at position 0,
  with no prompt, has no predictor and is skipped).
  """
  labels_bt, valid_bt = arm_targets(tokens_bt, prompt_len_b, response_len_b)
  return arm_loss_from_ce(token_cross_entropy(logits_btv, labels_bt), valid_bt)


def mdm_corrupt(tokens_bt, prompt_len_b, response_len_b, rng, *, mask_id: int, eos_id: int,
                pad_id: int, eps: float = DEFAULT_EPS) -> Corrupted:
  """LLaDA corruption: the response, EOS-padded to the row's end, masked token by token.

  As in LLaDA's SFT, every position after the response's EOS is filled with
  further EOS tokens and belongs to the response: it is masked, labelled and
  counted in the normaliser like any answer token. The model thus learns to
  fill the positions after the answer with EOS. The decoder's canvas is the
  prompt followed by `gen_length` masks, longer than most answers; a model
  that only ever saw exactly `response_len` masks (the padding hidden) has no
  way to tell where its answer should end and fills the whole canvas with
  text, which breaks every exact answer.

  Each response position (EOS padding included) is masked with probability
  p = (1 - eps) t + eps. Nothing moves; positions are 0..L-1. Masked tokens
  are labelled with their own token (KIND_MDM); everything else is ignored.
  `response_len_b` of the result is the padded length L - prompt_len, the
  loss's normaliser. `pad_id` labels the ignored positions.
  """
  eps = _check_eps(eps)
  tokens_bt = jnp.asarray(tokens_bt, jnp.int32)
  b, l = tokens_bt.shape
  prompt_len_b, response_len_b = _clip_lengths(prompt_len_b, response_len_b, l)
  t_rng, m_rng = jax.random.split(rng)
  t_b = jax.random.uniform(t_rng, (b,), jnp.float32)
  p_b = (1.0 - eps) * t_b + eps
  index_1t = jnp.arange(l, dtype=jnp.int32)[None]
  in_resp_bt = index_1t >= prompt_len_b[:, None]  # the answer and its EOS padding
  tail_bt = index_1t >= (prompt_len_b + response_len_b)[:, None]
  clean_bt = jnp.where(tail_bt, eos_id, tokens_bt)
  masked_bt = in_resp_bt & (jax.random.uniform(m_rng, (b, l), jnp.float32) < p_b[:, None])
  return Corrupted(
      input_ids_bt=jnp.where(masked_bt, mask_id, clean_bt),
      positions_bt=jnp.broadcast_to(index_1t, (b, l)),
      labels_bt=jnp.where(masked_bt, clean_bt, pad_id),
      kind_bt=jnp.where(masked_bt, KIND_MDM, KIND_IGNORE).astype(jnp.int8),
      p_b=p_b,
      response_len_b=l - prompt_len_b,
      slot_size_b=jnp.ones((b,), jnp.int32))


def mdm_loss_from_ce(ce_bt, corrupted: Corrupted):
  """`mdm_loss` from the per-token CE of `corrupted.labels_bt`."""
  mdm_bt = corrupted.kind_bt == KIND_MDM
  loss = _mdm_term(ce_bt, mdm_bt, corrupted.p_b, corrupted.response_len_b)
  return loss, _metrics(loss, jnp.zeros((), jnp.float32), loss, jnp.zeros((), jnp.int32),
                        jnp.sum(mdm_bt))


def mdm_loss(logits_btv, corrupted: Corrupted):
  """LLaDA loss: sum over masked tokens of CE / p / len(padded response), batch mean."""
  return mdm_loss_from_ce(token_cross_entropy(logits_btv, corrupted.labels_bt), corrupted)


# --------------------------------------------------------------------------
# The trainer's entry point.


def loss_fn(model, batch: Mapping[str, Any], rng, *, objective: str, mask_id: int, pad_id: int,
            slot_sizes=DEFAULT_SLOT_SIZES, eps: float = DEFAULT_EPS, eos_id: int | None = None,
            loss_chunk: int = 0):
  """Loss and metrics of `objective` ("refusion", "arm" or "mdm") on one batch.

  `eos_id` (MDM only: the token that pads the response to the row's end)
  defaults to the model config's `eos_token_id`. `loss_chunk` > 0 computes the
  cross-entropy from the model's hidden states `loss_chunk` tokens of the
  sequence at a time (`chunked_token_cross_entropy`: the same loss and
  gradients without `[B, T, V]` logits); 0 projects the whole sequence at once.

  Meant to run inside `nnx.value_and_grad` / `jax.jit`; all checks of
  arguments, shapes and the model's attention kind happen at trace time, in
  Python, before anything compiles.
  """
  _check_objective(objective)
  slot_sizes = check_slot_sizes(slot_sizes)
  eps = _check_eps(eps)
  loss_chunk = check_loss_chunk(loss_chunk)
  config = getattr(model, "config", None)
  vocab = getattr(config, "vocab_size", None)
  mask_id = _check_token_id("mask_id", mask_id, vocab)
  pad_id = _check_token_id("pad_id", pad_id, vocab)
  if objective == "mdm":
    if eos_id is None:
      eos_id = getattr(config, "eos_token_id", None)
    if eos_id is None:
      raise ValueError("objective='mdm' pads responses with EOS: pass eos_id or use a model "
                       "whose ModelConfig.eos_token_id is set")
    eos_id = _check_token_id("eos_id", eos_id, vocab)
  want = attention_for(objective)
  attention = getattr(config, "attention", want)
  if attention != want:
    raise ValueError(f"objective={objective!r} needs a model with attention={want!r}, "
                     f"got ModelConfig.attention={attention!r}")
  check_batch(batch)
  tokens_bt = jnp.asarray(batch["tokens"], jnp.int32)
  prompt_len_b = jnp.asarray(batch["prompt_len"], jnp.int32)
  response_len_b = jnp.asarray(batch["response_len"], jnp.int32)
  b, l = tokens_bt.shape

  def model_ce(input_ids_bt, positions_bt, labels_bt):
    if loss_chunk:
      return chunked_token_cross_entropy(model.hidden(input_ids_bt, positions_bt),
                                         model.unembed(), labels_bt, loss_chunk)
    return token_cross_entropy(model(input_ids_bt, positions_bt), labels_bt)

  if objective == "refusion":
    corrupted = refusion_corrupt(tokens_bt, prompt_len_b, response_len_b, rng, mask_id=mask_id,
                                 pad_id=pad_id, slot_sizes=slot_sizes, eps=eps)
    ce_bt = model_ce(corrupted.input_ids_bt, corrupted.positions_bt, corrupted.labels_bt)
    return refusion_loss_from_ce(ce_bt, corrupted)
  if objective == "arm":
    positions_bt = jnp.broadcast_to(jnp.arange(l, dtype=jnp.int32)[None], (b, l))
    labels_bt, valid_bt = arm_targets(tokens_bt, prompt_len_b, response_len_b)
    return arm_loss_from_ce(model_ce(tokens_bt, positions_bt, labels_bt), valid_bt)
  corrupted = mdm_corrupt(tokens_bt, prompt_len_b, response_len_b, rng, mask_id=mask_id,
                          eos_id=eos_id, pad_id=pad_id, eps=eps)
  # Every position is live (the response runs to the row's end): full bidirectional attention.
  ce_bt = model_ce(corrupted.input_ids_bt, corrupted.positions_bt, corrupted.labels_bt)
  return mdm_loss_from_ce(ce_bt, corrupted)
