"""Training objectives: ReFusion's hybrid slot loss and the ARM / MDM baselines, on packed rows.

ALGORITHM.md "Training objective" and "Packed rows". A row of `seq_len`
tokens holds one or more samples one after another, then padding. For each
sample (prompt length P, response length R: answer + EOS) of ReFusion:

* a slot size k is drawn from `slot_sizes`; the response is cut into
  consecutive slots of k tokens (the last may be shorter);
* p = (1 - eps) * t + eps with t ~ U(0, 1); each slot is masked with prob p;
* the sample's tokens become its prompt, its clean slots in a random order,
  then its masked slots in their original order (all their tokens = mask id),
  in the row range the sample occupies; every token keeps its position within
  its sample (0 at the sample's first token);
* clean-slot tokens learn the next token of their own slot (AR), masked tokens
  learn their own token (MDM); with `boundary_label` (ALGORITHM.md "Past the
  paper") the last token of a clean slot also learns the token after it, its
  positional successor in the next slot (an AR term like the others; off: the
  release's objective, that token carries no label).

The ARM learns each response token from the token before it; the MDM baseline
masks each response token (its EOS padding included, which the data pipeline
adds) with its sample's p. BD3-LM (block diffusion) doubles the row: the
noised response (each block of `bd3lm_block_size` masked with its own t), then
the clean sample, tied by `masks.block_diffusion_btt` (`bd3lm_corrupt`).
Attention never crosses samples (`segment_ids`).

Everything is vectorised over the whole batch, with no loop over rows, samples
or slots: every random choice is a uniform laid out like the tokens
(`Draws`), read at the sample's first token (slot size, t) or at the slot's
first token (mask bit, order key), so each sample draws for itself wherever it
sits; the permutation is one sort of each row on (sample, region, order key,
slot, offset). The draw is split from the layout so a test can rebuild the
expected layout from the very same draw with a plain-Python oracle.

The loss is defined over samples, not rows, so packing does not change it:
AR = mean cross-entropy over every AR-labelled token of the batch; MDM = sum
over samples of (sum of CE / p over the sample's masked tokens) / R, divided
by the number of samples in the batch (`loss_from_ce`).

Batch formats (from the data pipeline; `packed_rows` reads both):

* packed: int32 `[B, L]` arrays `tokens`, `segment_ids` (each row's samples
  numbered from 1, 0 = padding), `positions` (within the sample),
  `segment_prompt_len` and `segment_response_len` (the token's sample's P and
  R, EOS and any EOS padding included);
* one sample per row: `tokens` int32 `[B, L]` = prompt then response,
  right-padded, with `prompt_len` and `response_len` int32 `[B]`.

Concrete batches are checked by `check_batch`; inside a jitted program (where
they cannot be) inconsistent lengths still give a permutation of each sample's
range, never one that crosses samples.
"""

from __future__ import annotations

import numbers
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from refusion_jax import masks, sharding
from refusion_jax.checks import is_int

KIND_IGNORE = 0
KIND_AR = 1
KIND_MDM = 2

# Each objective and the attention its model trains with (ALGORITHM.md "Baselines"):
# the MDM baseline sees its whole sample, ReFusion and the ARM are causal.
# BD3-LM's backbone is causal too (its prompt prefills the decoder's KV cache causally);
# its two-half training mask is explicit (`masks.block_diffusion_btt`).
OBJECTIVE_ATTENTION = {"refusion": "causal", "arm": "causal", "mdm": "bidirectional",
                       "bd3lm": "causal"}
OBJECTIVES = tuple(OBJECTIVE_ATTENTION)
DEFAULT_SLOT_SIZES = (4, 8, 16, 32)
DEFAULT_EPS = 1e-3
# BD3-LM (ALGORITHM.md "Baselines"): block size and the clip of each block's noise level.
DEFAULT_BD3LM_BLOCK_SIZE = 8
DEFAULT_BD3LM_EPS = (1e-3, 1.0)

# How the data pipeline lays samples into rows (data.make_loader): one per row, or
# packed by grain's first-fit / best-fit packers.
PACKINGS = ("none", "first_fit", "best_fit")
# The packed batch format: every field int32 [B, L].
PACKED_KEYS = ("tokens", "segment_ids", "positions", "segment_prompt_len",
               "segment_response_len")
# One sample per row: tokens [B, L], lengths [B].
ROW_KEYS = ("tokens", "prompt_len", "response_len")


@struct.dataclass
class PackedRows:
  """A batch of rows, each holding samples one after another (int32 `[B, L]` fields).

  Attributes:
    tokens_bt: prompt then response of each sample; padding holds any id.
    segment_ids_bt: the sample a token belongs to (distinct positive ids within a
      row, in row order), 0 for padding.
    positions_bt: the token's position within its sample (0 at its first token).
    prompt_len_bt: its sample's prompt length P.
    response_len_bt: its sample's response length R (answer + EOS, and for the MDM
      baseline the EOS padding after it).
  """

  tokens_bt: jax.Array
  segment_ids_bt: jax.Array
  positions_bt: jax.Array
  prompt_len_bt: jax.Array
  response_len_bt: jax.Array


@struct.dataclass
class Corrupted:
  """A model-ready training input plus what the loss needs (every field `[B, L]`).

  Attributes:
    input_ids_bt: int32 tokens fed to the model (permuted, masked).
    positions_bt: int32 position of each input token within its sample.
    segment_ids_bt: int32 sample of each input token (0 = padding): attention
      stays within a sample.
    labels_bt: int32 target token per input token; `pad_id` where `kind_bt` is
      KIND_IGNORE (a valid id, so the gather in the loss is safe).
    kind_bt: int8 KIND_IGNORE (0), KIND_AR (1) or KIND_MDM (2).
    mdm_weight_bt: float32 1 / (p * R) of the token's sample on KIND_MDM tokens,
      0 elsewhere (the MDM term's weight).
    block_bt, noised_bt: BD3-LM's two-half rows only (`[B, 2L]`, None otherwise):
      the token's response block (-1 in the prompt) and whether it is in the noised
      half; with the segments and positions they give `masks.block_diffusion_btt`.
      Only the noised half (the first L tokens) carries loss.
  """

  input_ids_bt: jax.Array
  positions_bt: jax.Array
  segment_ids_bt: jax.Array
  labels_bt: jax.Array
  kind_bt: jax.Array
  mdm_weight_bt: jax.Array
  block_bt: jax.Array | None = None
  noised_bt: jax.Array | None = None

  @property
  def two_halves(self) -> bool:
    return self.noised_bt is not None

  def loss_half(self) -> "Corrupted":
    """The tokens that can carry loss: BD3-LM's noised half (the first L), else all."""
    if not self.two_halves:
      return self
    half = self.input_ids_bt.shape[1] // 2
    return jax.tree.map(lambda v: v[:, :half], self)


@struct.dataclass
class Draws:
  """Every random choice of the corruptions: float32 uniforms in [0, 1) laid out like
  the tokens (`[B, L]`), so that each sample draws for itself wherever it is packed.

  Attributes:
    size_bt: at a sample's first token, its slot size: `slot_sizes[floor(u * n)]`.
    t_bt: at a sample's first token, its t; p = (1 - eps) * t + eps. BD3-LM: at a
      block's first token, the block's noise level, eps_min + (eps_max - eps_min) u.
    mask_bt: ReFusion: at a slot's first token, the slot is masked when u < p;
      MDM: each response token is masked when u < p; BD3-LM: when u < its block's t.
    order_bt: ReFusion: at a slot's first token, its key; clean slots are placed in
      increasing key order (ties by slot index).
  """

  size_bt: jax.Array
  t_bt: jax.Array
  mask_bt: jax.Array
  order_bt: jax.Array


def draw(rng, shape: tuple[int, int]) -> Draws:
  """Independent uniforms for every token of a `[B, L]` batch."""
  keys = jax.random.split(rng, 4)
  return Draws(*(jax.random.uniform(k, shape, jnp.float32) for k in keys))


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


def _check_bool(name: str, value) -> bool:
  if not isinstance(value, (bool, np.bool_)):
    raise ValueError(f"{name} must be a bool, got {value!r}")
  return bool(value)


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


def is_packed(batch: Mapping[str, Any]) -> bool:
  """Whether `batch` is in the packed format (else one sample per row)."""
  return "segment_ids" in batch


def _check_fields(batch: Mapping[str, Any], keys: Sequence[str]) -> tuple[int, int]:
  missing = [k for k in keys if k not in batch]
  if missing:
    raise ValueError(f"batch is missing field(s) {missing}; it has {sorted(batch)}")
  tokens = batch["tokens"]
  if getattr(tokens, "ndim", None) != 2:
    raise ValueError(f"batch['tokens'] must be [batch, length], got shape "
                     f"{getattr(tokens, 'shape', None)}")
  b, l = tokens.shape
  packed = keys is PACKED_KEYS
  for name in keys:
    value = batch[name]
    want = (b, l) if packed or name == "tokens" else (b,)
    if getattr(value, "shape", None) != want:
      raise ValueError(f"batch['{name}'] must have shape {want} to match tokens {tokens.shape}, "
                       f"got {getattr(value, 'shape', None)}")
    if not jnp.issubdtype(value.dtype, jnp.integer):
      raise ValueError(f"batch['{name}'] must be an integer array, got dtype {value.dtype}")
  return b, l


def _check_packed_values(batch: Mapping[str, Any]) -> None:
  """A packed batch's samples are whole: positions 0, 1, ... within a segment, one
  (P, R) per segment with R >= 1, and P + R tokens in it."""
  seg = np.asarray(batch["segment_ids"])
  pos = np.asarray(batch["positions"])
  p = np.asarray(batch["segment_prompt_len"])
  r = np.asarray(batch["segment_response_len"])
  if (seg < 0).any():
    raise ValueError("batch['segment_ids'] must be >= 0 (0 = padding)")
  real = seg > 0
  b = seg.shape[0]
  pad = np.zeros((b, 1), seg.dtype)
  prev_seg = np.concatenate([pad, seg[:, :-1]], axis=1)
  next_seg = np.concatenate([seg[:, 1:], pad], axis=1)
  starts = real & (seg != prev_seg)
  ends = real & (seg != next_seg)
  problems = []
  if (pos[starts] != 0).any():
    problems.append("a sample's first token must have position 0")
  cont = real & ~starts
  prev = lambda x: np.concatenate([np.zeros((b, 1), x.dtype), x[:, :-1]], axis=1)  # noqa: E731
  if (pos[cont] != prev(pos)[cont] + 1).any():
    problems.append("positions must count up by 1 within a sample")
  if (p[cont] != prev(p)[cont]).any() or (r[cont] != prev(r)[cont]).any():
    problems.append("segment_prompt_len / segment_response_len must be constant within a sample")
  if (p[real] < 0).any() or (r[real] < 1).any():
    problems.append("each sample needs segment_prompt_len >= 0 and segment_response_len >= 1 "
                    "(EOS included)")
  if (pos[ends] != (p + r - 1)[ends]).any():
    problems.append("each sample must hold exactly segment_prompt_len + segment_response_len "
                    "tokens")
  first_ids = np.sort(np.where(starts, seg, 0), axis=1)  # each sample's id once, per row
  reused = (first_ids[:, 1:] == first_ids[:, :-1]) & (first_ids[:, 1:] > 0)
  if reused.any():
    row = int(np.nonzero(reused.any(axis=1))[0][0])
    problems.append(f"row {row}: a segment id is used by two samples")
  if problems:
    raise ValueError("packed batch: " + "; ".join(problems))


def check_batch(batch: Mapping[str, Any]) -> None:
  """Validates a batch's fields and shapes; also its lengths when they are concrete.

  Either format (module doc). Raises ValueError naming the field. Values held by
  tracers (inside jit) cannot be inspected and are only shape-checked.
  """
  if not isinstance(batch, Mapping):
    raise ValueError(f"batch must be a mapping with {ROW_KEYS} or {PACKED_KEYS}, got "
                     f"{type(batch).__name__}")
  if is_packed(batch):
    _check_fields(batch, PACKED_KEYS)
    if all(_is_concrete(batch[k]) for k in PACKED_KEYS):
      _check_packed_values(batch)
    return
  _, l = _check_fields(batch, ROW_KEYS)
  prompt_len, response_len = batch["prompt_len"], batch["response_len"]
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


def packed_rows(batch: Mapping[str, Any], *, eos_fill_id: int | None = None,
                eos_fill_multiple: int = 0) -> PackedRows:
  """`batch` (either format) as `PackedRows` (jittable).

  A one-sample-per-row batch becomes rows of one segment each. With
  `eos_fill_id` its responses run to the row's end, the padding replaced by that
  token (the MDM baseline's layout when rows are not packed: LLaDA's SFT pads
  every answer with EOS, and the model learns to fill a canvas after its answer),
  or with `eos_fill_multiple` > 0 to the next multiple of it (BD3-LM's whole
  blocks; never past the row). Packed batches carry any EOS padding in their
  samples already.
  """
  tokens_bt = jnp.asarray(batch["tokens"], jnp.int32)
  if is_packed(batch):
    return PackedRows(*(jnp.asarray(batch[k], jnp.int32) for k in PACKED_KEYS))
  b, l = tokens_bt.shape
  index_1t = jnp.arange(l, dtype=jnp.int32)[None]
  # Lengths out of range (only possible inside jit, where check_batch cannot look) are
  # clipped to the row.
  prompt_b = jnp.clip(jnp.asarray(batch["prompt_len"], jnp.int32), 0, l)
  response_b = jnp.clip(jnp.asarray(batch["response_len"], jnp.int32), 0, l - prompt_b)
  if eos_fill_id is not None:
    filled_b = l - prompt_b
    if eos_fill_multiple:
      m = int(eos_fill_multiple)
      filled_b = jnp.minimum(-(-response_b // m) * m, filled_b)
    fill_bt = (index_1t >= (prompt_b + response_b)[:, None]) & (
        index_1t < (prompt_b + filled_b)[:, None])
    tokens_bt = jnp.where(fill_bt, eos_fill_id, tokens_bt)
    response_b = filled_b
  real_bt = index_1t < (prompt_b + response_b)[:, None]
  zero_bt = jnp.zeros((b, l), jnp.int32)
  return PackedRows(
      tokens_bt=tokens_bt, segment_ids_bt=real_bt.astype(jnp.int32),
      positions_bt=jnp.where(real_bt, index_1t, 0),
      prompt_len_bt=jnp.where(real_bt, prompt_b[:, None], zero_bt),
      response_len_bt=jnp.where(real_bt, response_b[:, None], zero_bt))


def packed_batch(batch: Mapping[str, Any], *, eos_fill_id: int | None = None,
                 eos_fill_multiple: int = 0) -> dict:
  """`batch` (either format) as a packed-format dict of numpy arrays (`PACKED_KEYS`)."""
  rows = jax.device_get(packed_rows(batch, eos_fill_id=eos_fill_id,
                                    eos_fill_multiple=eos_fill_multiple))
  return {k: np.asarray(getattr(rows, f), np.int32)
          for k, f in zip(PACKED_KEYS, ("tokens_bt", "segment_ids_bt", "positions_bt",
                                        "prompt_len_bt", "response_len_bt"))}


def num_samples(rows: PackedRows) -> jax.Array:
  """Samples in the batch (each has one token at position 0)."""
  return jnp.sum((rows.segment_ids_bt > 0) & (rows.positions_bt == 0))


def real_tokens(rows: PackedRows) -> jax.Array:
  """Tokens of the batch that belong to a sample (not padding)."""
  return jnp.sum(rows.segment_ids_bt > 0)


# --------------------------------------------------------------------------
# Layouts.


class _Tokens:
  """Per-token facts of packed rows that every layout reads (original order)."""

  def __init__(self, rows: PackedRows, pad_id: int):
    b, l = rows.tokens_bt.shape
    self.shape = (b, l)
    self.index_1t = jnp.arange(l, dtype=jnp.int32)[None]
    self.real_bt = rows.segment_ids_bt > 0
    self.pos_bt = jnp.where(self.real_bt, rows.positions_bt, 0)
    # Row index of the sample's first token (a padding token: its own index), clipped so
    # that positions inconsistent with the row (only possible inside jit) stay in range.
    self.start_bt = jnp.clip(self.index_1t - self.pos_bt, 0, l - 1)
    self.prompt_bt = rows.prompt_len_bt
    self.response_bt = rows.response_len_bt
    self.offset_bt = self.pos_bt - self.prompt_bt  # offset in the response (< 0: prompt)
    self.in_prompt_bt = self.real_bt & (self.offset_bt < 0)
    self.in_resp_bt = self.real_bt & (self.offset_bt >= 0) & (self.offset_bt < self.response_bt)
    self.ids_bt = jnp.where(self.real_bt, rows.tokens_bt, pad_id)
    self.segment_ids_bt = jnp.where(self.real_bt, rows.segment_ids_bt, 0)

  def of_sample(self, x_bt):
    """`x_bt` read at each token's sample's first token."""
    return jnp.take_along_axis(x_bt, self.start_bt, axis=1)

  def shifted(self, x_bt, fill):
    """`x_bt[:, i + 1]` at i (`fill` at the last index)."""
    b = self.shape[0]
    return jnp.concatenate([x_bt[:, 1:], jnp.full((b, 1), fill, x_bt.dtype)], axis=1)

  def p_bt(self, draws: Draws, eps: float):
    return (1.0 - eps) * self.of_sample(draws.t_bt) + eps

  def mdm_weight(self, masked_bt, p_bt):
    return jnp.where(masked_bt, 1.0 / (p_bt * jnp.maximum(self.response_bt, 1)), 0.0)


def refusion_corrupt(rows: PackedRows, draws: Draws, *, mask_id: int, pad_id: int,
                     slot_sizes=DEFAULT_SLOT_SIZES, eps: float = DEFAULT_EPS,
                     boundary_label: bool = False) -> Corrupted:
  """ReFusion's layout of every sample of `rows` for explicit draws (module doc).

  `boundary_label`: the last token of each clean slot is labelled (KIND_AR) with
  the response token at its position + 1, whichever slot holds it (none after the
  response's last token); off, it is ignored, as in the release.
  """
  slot_sizes = check_slot_sizes(slot_sizes)
  boundary_label = _check_bool("boundary_label", boundary_label)
  eps = _check_eps(eps)
  x = _Tokens(rows, pad_id)
  n = len(slot_sizes)
  choice_bt = jnp.clip(jnp.floor(x.of_sample(draws.size_bt) * n).astype(jnp.int32), 0, n - 1)
  k_bt = jnp.asarray(slot_sizes, jnp.int32)[choice_bt]
  p_bt = x.p_bt(draws, eps)

  # Slot index, offset inside the slot and the slot's first token, for response tokens.
  slot_bt = jnp.where(x.in_resp_bt, x.offset_bt // k_bt, 0)
  in_slot_bt = jnp.where(x.in_resp_bt, x.offset_bt - slot_bt * k_bt, 0)
  first_bt = x.index_1t - in_slot_bt
  slot_len_bt = jnp.minimum(k_bt, x.response_bt - slot_bt * k_bt)
  masked_bt = x.in_resp_bt & (jnp.take_along_axis(draws.mask_bt, first_bt, axis=1) < p_bt)
  clean_bt = x.in_resp_bt & ~masked_bt
  has_next_bt = clean_bt & (in_slot_bt < slot_len_bt - 1)
  if boundary_label:
    # The slot's last token learns its positional successor: the next response token
    # of the same sample (rows keep a sample's tokens in position order here).
    has_next_bt = has_next_bt | (clean_bt & (x.offset_bt < x.response_bt - 1))

  ids_bt = jnp.where(masked_bt, mask_id, x.ids_bt)
  labels_bt = jnp.where(masked_bt, x.ids_bt,
                        jnp.where(has_next_bt, x.shifted(x.ids_bt, pad_id), pad_id))
  kind_bt = jnp.where(masked_bt, KIND_MDM, jnp.where(has_next_bt, KIND_AR, KIND_IGNORE))

  # One sort of each row gives, for every output place, the original index it takes:
  # samples stay in their ranges; inside one, the prompt, the clean slots by key (ties
  # by slot index), the masked slots in order, then any token past the response (none
  # in a well-formed batch); a slot's tokens keep their order. Padding is its own group.
  region_bt = jnp.where(x.in_prompt_bt | ~x.real_bt, 0,
                        jnp.where(clean_bt, 1, jnp.where(masked_bt, 2, 3)))
  order_bt = jnp.where(clean_bt, jnp.take_along_axis(draws.order_bt, first_bt, axis=1), 0.0)
  last_bt = jnp.where(x.in_resp_bt, in_slot_bt, x.pos_bt)
  index_bt = jnp.broadcast_to(x.index_1t, x.shape)
  src_bt = jax.lax.sort((x.start_bt, region_bt, order_bt, slot_bt, last_bt, index_bt),
                        dimension=1, num_keys=5)[-1]

  def take(v_bt):
    return jnp.take_along_axis(v_bt, src_bt, axis=1)

  return Corrupted(
      input_ids_bt=take(ids_bt), positions_bt=take(x.pos_bt),
      segment_ids_bt=x.segment_ids_bt,  # samples keep their ranges
      labels_bt=take(labels_bt), kind_bt=take(kind_bt).astype(jnp.int8),
      mdm_weight_bt=take(x.mdm_weight(masked_bt, p_bt)))


def arm_corrupt(rows: PackedRows, *, pad_id: int) -> Corrupted:
  """The ARM's unchanged input: token i learns token i + 1 where that is a response
  token of the same sample (the first response token from the last prompt token; a
  sample without a prompt has no predictor for its first token)."""
  x = _Tokens(rows, pad_id)
  next_same_bt = x.real_bt & (x.shifted(x.segment_ids_bt, 0) == x.segment_ids_bt)
  valid_bt = next_same_bt & x.shifted(x.in_resp_bt, False)
  return Corrupted(
      input_ids_bt=x.ids_bt, positions_bt=x.pos_bt, segment_ids_bt=x.segment_ids_bt,
      labels_bt=jnp.where(valid_bt, x.shifted(x.ids_bt, pad_id), pad_id),
      kind_bt=jnp.where(valid_bt, KIND_AR, KIND_IGNORE).astype(jnp.int8),
      mdm_weight_bt=jnp.zeros(x.shape, jnp.float32))


def mdm_corrupt(rows: PackedRows, draws: Draws, *, mask_id: int, pad_id: int,
                eps: float = DEFAULT_EPS) -> Corrupted:
  """LLaDA corruption: each response token (EOS padding included) masked with its
  sample's p = (1 - eps) t + eps, learning its own token; nothing moves.

  As in LLaDA's SFT the response carries EOS padding after the answer (the data
  pipeline adds it, or `packed_rows(..., eos_fill_id=...)` to the row's end), masked,
  labelled and counted in the normaliser R like any answer token: a model that only
  ever saw exactly its answer's masks could not tell where its answer ends on a
  longer canvas.
  """
  eps = _check_eps(eps)
  x = _Tokens(rows, pad_id)
  p_bt = x.p_bt(draws, eps)
  masked_bt = x.in_resp_bt & (draws.mask_bt < p_bt)
  return Corrupted(
      input_ids_bt=jnp.where(masked_bt, mask_id, x.ids_bt), positions_bt=x.pos_bt,
      segment_ids_bt=x.segment_ids_bt,
      labels_bt=jnp.where(masked_bt, x.ids_bt, pad_id),
      kind_bt=jnp.where(masked_bt, KIND_MDM, KIND_IGNORE).astype(jnp.int8),
      mdm_weight_bt=x.mdm_weight(masked_bt, p_bt))


def check_bd3lm(block_size: int, eps_min: float, eps_max: float) -> tuple[int, float, float]:
  """BD3-LM's settings as (int, float, float), or ValueError naming the bad one."""
  if not is_int(block_size) or block_size < 1:
    raise ValueError(f"bd3lm_block_size must be a positive int, got {block_size!r}")
  for name, v in (("bd3lm_eps_min", eps_min), ("bd3lm_eps_max", eps_max)):
    if isinstance(v, bool) or not isinstance(v, numbers.Real) or not 0.0 < v <= 1.0:
      raise ValueError(f"{name} must be a float in (0, 1], got {v!r}")
  if eps_min > eps_max:
    raise ValueError(f"bd3lm_eps_min={eps_min} exceeds bd3lm_eps_max={eps_max}")
  return int(block_size), float(eps_min), float(eps_max)


def bd3lm_corrupt(rows: PackedRows, draws: Draws, *, mask_id: int, pad_id: int,
                  block_size: int = DEFAULT_BD3LM_BLOCK_SIZE,
                  eps_min: float = DEFAULT_BD3LM_EPS[0],
                  eps_max: float = DEFAULT_BD3LM_EPS[1]) -> Corrupted:
  """BD3-LM's two-half rows (ALGORITHM.md "Baselines"): `[B, 2L]`, the noised half then
  the clean one, each at the row's own indices.

  Each sample's response (its EOS padding to whole blocks included: the data
  pipeline adds it) is cut into blocks of `block_size` from its first token; each
  block draws t = eps_min + (eps_max - eps_min) u and masks each of its tokens with
  probability t. Noised half, token i: its response token, masked or not, in its
  sample's segment (its prompt tokens and padding are segment 0: read by no one);
  masked ones learn their token with weight 1 / (t R) (R: the padded response's
  length). Clean half: the row unchanged, no loss. The attention that ties the
  halves together is `masks.block_diffusion_btt` of the returned fields.
  """
  block_size, eps_min, eps_max = check_bd3lm(block_size, eps_min, eps_max)
  x = _Tokens(rows, pad_id)
  in_block_bt = jnp.where(x.in_resp_bt, x.offset_bt % block_size, 0)
  block_bt = jnp.where(x.in_resp_bt, x.offset_bt // block_size, -1)
  first_bt = x.index_1t - in_block_bt
  t_bt = eps_min + (eps_max - eps_min) * jnp.take_along_axis(draws.t_bt, first_bt, axis=1)
  masked_bt = x.in_resp_bt & (draws.mask_bt < t_bt)
  weight_bt = jnp.where(masked_bt, 1.0 / (t_bt * jnp.maximum(x.response_bt, 1)), 0.0)
  noised = Corrupted(
      input_ids_bt=jnp.where(masked_bt, mask_id, x.ids_bt),
      positions_bt=jnp.where(x.in_resp_bt, x.pos_bt, 0),
      segment_ids_bt=jnp.where(x.in_resp_bt, x.segment_ids_bt, 0),
      labels_bt=jnp.where(masked_bt, x.ids_bt, pad_id),
      kind_bt=jnp.where(masked_bt, KIND_MDM, KIND_IGNORE).astype(jnp.int8),
      mdm_weight_bt=weight_bt.astype(jnp.float32),
      block_bt=block_bt, noised_bt=jnp.ones(x.shape, bool))
  clean = Corrupted(
      input_ids_bt=x.ids_bt, positions_bt=x.pos_bt, segment_ids_bt=x.segment_ids_bt,
      labels_bt=jnp.full(x.shape, pad_id, jnp.int32),
      kind_bt=jnp.full(x.shape, KIND_IGNORE, jnp.int8),
      mdm_weight_bt=jnp.zeros(x.shape, jnp.float32),
      block_bt=block_bt, noised_bt=jnp.zeros(x.shape, bool))
  return jax.tree.map(lambda a, b: jnp.concatenate([a, b], axis=1), noised, clean)


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


def loss_from_ce(ce_bt, corrupted: Corrupted, samples):
  """The batch's loss from the per-token CE of `corrupted.labels_bt`, and its metrics.

  AR = CE averaged over every KIND_AR token of the batch (0 when there is none);
  MDM = sum over KIND_MDM tokens of CE / (p R), divided by `samples`, the number of
  samples in the batch; loss = AR + MDM (the ARM has no MDM tokens, the MDM baseline
  no AR tokens). Defined per sample, so packing does not change it.
  """
  ce_bt = ce_bt.astype(jnp.float32)
  ar_bt = corrupted.kind_bt == KIND_AR
  mdm_bt = corrupted.kind_bt == KIND_MDM
  ar_tokens = jnp.sum(ar_bt)
  ar_loss = jnp.sum(jnp.where(ar_bt, ce_bt, 0.0)) / jnp.maximum(ar_tokens, 1).astype(jnp.float32)
  mdm_sum = jnp.sum(jnp.where(mdm_bt, ce_bt * corrupted.mdm_weight_bt, 0.0))
  mdm_loss = mdm_sum / jnp.maximum(samples, 1).astype(jnp.float32)
  loss = ar_loss + mdm_loss
  return loss, {"loss": loss, "ar_loss": ar_loss, "mdm_loss": mdm_loss,
                "ar_tokens": ar_tokens.astype(jnp.float32),
                "mdm_tokens": jnp.sum(mdm_bt).astype(jnp.float32)}


def corrupt(objective: str, rows: PackedRows, rng, *, mask_id: int, pad_id: int,
            slot_sizes=DEFAULT_SLOT_SIZES, eps: float = DEFAULT_EPS,
            bd3lm_block_size: int = DEFAULT_BD3LM_BLOCK_SIZE,
            bd3lm_eps: tuple[float, float] = DEFAULT_BD3LM_EPS,
            boundary_label: bool = False) -> Corrupted:
  """`objective`'s training input for `rows`, its draws taken from `rng` (jittable).
  `boundary_label` is ReFusion's (`refusion_corrupt`); other objectives ignore it."""
  _check_objective(objective)
  if objective == "arm":
    return arm_corrupt(rows, pad_id=pad_id)
  draws = draw(rng, rows.tokens_bt.shape)
  if objective == "bd3lm":
    return bd3lm_corrupt(rows, draws, mask_id=mask_id, pad_id=pad_id,
                         block_size=bd3lm_block_size, eps_min=bd3lm_eps[0],
                         eps_max=bd3lm_eps[1])
  if objective == "refusion":
    return refusion_corrupt(rows, draws, mask_id=mask_id, pad_id=pad_id, slot_sizes=slot_sizes,
                            eps=eps, boundary_label=boundary_label)
  return mdm_corrupt(rows, draws, mask_id=mask_id, pad_id=pad_id, eps=eps)


def loss_fn(model, batch: Mapping[str, Any], rng, *, objective: str, mask_id: int, pad_id: int,
            slot_sizes=DEFAULT_SLOT_SIZES, eps: float = DEFAULT_EPS, eos_id: int | None = None,
            loss_chunk: int = 0, bd3lm_block_size: int = DEFAULT_BD3LM_BLOCK_SIZE,
            bd3lm_eps: tuple[float, float] = DEFAULT_BD3LM_EPS, boundary_label: bool = False):
  """Loss and metrics of `objective` ("refusion", "arm", "mdm" or "bd3lm") on one batch.

  `batch` is packed or one sample per row (module doc). `eos_id` (MDM and BD3-LM
  on a one-sample-per-row batch only: the token that pads each response to the
  row's end, or to whole blocks of `bd3lm_block_size`) defaults to the model
  config's `eos_token_id`; packed batches carry their padding already. `loss_chunk` > 0 computes
  the cross-entropy from the model's hidden states `loss_chunk` tokens of the
  sequence at a time (`chunked_token_cross_entropy`: the same loss and gradients
  without `[B, T, V]` logits); 0 projects the whole sequence at once.
  `boundary_label` (ReFusion only, `refusion_corrupt`) labels the last token of
  each clean slot with its positional successor.

  Metrics: the loss and its AR / MDM terms, the AR and MDM token counts, and the
  batch's `samples` and `real_tokens` (tokens that are not padding).

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
  check_batch(batch)
  bd3lm_block_size, *bd3lm_eps = check_bd3lm(bd3lm_block_size, *bd3lm_eps)
  boundary_label = _check_bool("boundary_label", boundary_label)
  if boundary_label and objective != "refusion":
    raise ValueError(f"boundary_label=True labels ReFusion's clean slots; objective="
                     f"{objective!r} has none")
  eos_fill_id = None
  if objective in ("mdm", "bd3lm") and not is_packed(batch):
    if eos_id is None:
      eos_id = getattr(config, "eos_token_id", None)
    if eos_id is None:
      raise ValueError(f"objective={objective!r} pads responses with EOS: pass eos_id or use a "
                       "model whose ModelConfig.eos_token_id is set")
    eos_fill_id = _check_token_id("eos_id", eos_id, vocab)
  if getattr(config, "shift_logits", False):
    raise ValueError(f"objective={objective!r}: the model reads token i's logits from position "
                     "i - 1 (a Dream model); training one is not supported here")
  want = attention_for(objective)
  attention = getattr(config, "attention", want)
  if attention != want:
    raise ValueError(f"objective={objective!r} needs a model with attention={want!r}, "
                     f"got ModelConfig.attention={attention!r}")
  rows = packed_rows(batch, eos_fill_id=eos_fill_id,
                     eos_fill_multiple=bd3lm_block_size if objective == "bd3lm" else 0)
  corrupted = corrupt(objective, rows, rng, mask_id=mask_id, pad_id=pad_id,
                      slot_sizes=slot_sizes, eps=eps, bd3lm_block_size=bd3lm_block_size,
                      bd3lm_eps=tuple(bd3lm_eps), boundary_label=boundary_label)
  samples = num_samples(rows)
  loss, metrics = model_loss(model, corrupted, samples, loss_chunk=loss_chunk)
  metrics.update(samples=samples.astype(jnp.float32),
                 real_tokens=real_tokens(rows).astype(jnp.float32))
  return loss, metrics


def model_loss(model, corrupted: Corrupted, samples, *, loss_chunk: int = 0):
  """`loss_from_ce` of the model's cross-entropy on `corrupted` (its attention kept
  within each segment; BD3-LM's two-half mask), from full logits or `loss_chunk`
  tokens at a time. Only tokens that can carry loss are projected (BD3-LM: the
  noised half)."""
  args = (corrupted.input_ids_bt, corrupted.positions_bt)
  if corrupted.two_halves:
    mask = masks.block_diffusion_btt(corrupted.segment_ids_bt, corrupted.block_bt,
                                     corrupted.noised_bt, corrupted.positions_bt)
    h_btd = model.hidden(*args, attention_mask_btt=mask)
  else:
    h_btd = model.hidden(*args, segment_ids_bt=corrupted.segment_ids_bt)
  scored = corrupted.loss_half()
  h_btd = h_btd[:, :scored.labels_bt.shape[1]]
  if check_loss_chunk(loss_chunk):
    ce_bt = chunked_token_cross_entropy(h_btd, model.unembed(), scored.labels_bt, loss_chunk)
  else:
    logits_btv = sharding.constrain(model.unembed().project(h_btd), ("batch", "seq", "vocab"))
    ce_bt = token_cross_entropy(logits_btv, scored.labels_bt)
  return loss_from_ce(ce_bt, scored, samples)
