"""`Transformer`: the decoder of every family (Qwen3, Qwen2 / Qwen2.5, Dream, Llama, LLaDA)
in Flax NNX.

`ModelConfig.model_type` picks the family (`config.FAMILIES`, data, not code):
Qwen3 normalises q and k per head, Qwen2 adds biases to the q, k and v
projections (Dream is Qwen2's layers, bidirectional, its logits read shifted by
one), Llama has neither (3.1: the "llama3" RoPE scaling); all else is shared. ReFusion changes no layer of either; what matters here is that

* RoPE is applied from explicit **position ids** (training inputs are
  permuted and the KV cache is kept in commit order, so the array index is not
  the position);
* attention has one entry point, `forward_chunk`, where a chunk of new tokens
  attends to a static KV buffer (per-row valid length) and to itself under a
  given chunk mask, and the chunk's own K/V are *returned, not written*: the
  decoder decides what to commit;
* the full-sequence training call (`__call__` / `hidden` without a mask,
  optionally over packed rows: `segment_ids_bt`) may run a memory-efficient
  kernel instead of the einsum reference `attend` (`ModelConfig.attention_impl`,
  attention_kernels.py); decoding passes always use `attend`.

Einsum letters: B batch, T chunk length, S cache length, N query heads,
K kv heads, G query heads per kv head, H head dim, D model, F mlp, V vocab.
"""

from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from refusion_jax import attention_kernels, masks, sharding
from refusion_jax.config import ModelConfig
from refusion_jax.kv_cache import KVCache

_NEG_INF = -1e30  # finite, so rows with nothing to attend to stay NaN-free


@flax.struct.dataclass
class Unembed:
  """The output projection in the layout it is stored in: the tied embedding
  `[V, D]` (`vocab_axis=0`) or the LM head `[D, V]` (`vocab_axis=1`).

  Decoders reduce over the vocabulary a chunk at a time; reading the weight
  in its own layout keeps a transposed copy of it out of every decoding pass.
  """

  w: jax.Array
  vocab_axis: int = flax.struct.field(pytree_node=False, default=0)

  @property
  def vocab_size(self) -> int:
    return self.w.shape[self.vocab_axis]

  def project(self, h_btd) -> jax.Array:
    """`[B, T, V]` logits in the weight's (compute) dtype."""
    spec = "btd,vd->btv" if self.vocab_axis == 0 else "btd,dv->btv"
    return jnp.einsum(spec, h_btd, self.w)

  def logits(self, h_btd) -> jax.Array:
    """`[B, T, V]` float32 logits, rounded to the compute dtype first like the model's."""
    return self.project(h_btd).astype(jnp.float32)

  def columns(self, start, size: int) -> "Unembed":
    """Vocabulary entries `[start, start + size)` (`start` may be traced)."""
    return Unembed(jax.lax.dynamic_slice_in_dim(self.w, start, size, axis=self.vocab_axis),
                   self.vocab_axis)

  def group_logits(self, h_btd, groups: int, start, size: int) -> jax.Array:
    """`[B, T, groups, size]` float32 logits of columns `g * V/groups + [start, start + size)`
    of every group g (`start` may be traced).

    With the vocabulary split over `groups` devices, each group is one device's
    own part: a slice taken inside every part reads only local columns, where a
    slice of the whole vocabulary would first gather the entire projection onto
    every device.
    """
    v = self.vocab_size
    if v % groups:
      raise ValueError(f"vocabulary {v} does not split into {groups} groups")
    if self.vocab_axis == 0:  # [V, D] -> [G, V/G, D]
      w = sharding.constrain(self.w.reshape(groups, v // groups, -1), ("vocab", None, None))
      part = jax.lax.dynamic_slice_in_dim(w, start, size, axis=1)
      logits = jnp.einsum("btd,gcd->btgc", h_btd, part)
    else:  # [D, V] -> [D, G, V/G]
      w = sharding.constrain(self.w.reshape(-1, groups, v // groups), (None, "vocab", None))
      part = jax.lax.dynamic_slice_in_dim(w, start, size, axis=2)
      logits = jnp.einsum("btd,dgc->btgc", h_btd, part)
    return logits.astype(jnp.float32)


def _param(rngs: nnx.Rngs, shape, axes, config: ModelConfig, std: float | None = 0.02,
           fill: float = 1.0):
  if std is None:  # a constant: norm scales (1), biases (0)
    value = jnp.full(shape, fill, config.weight_dtype)
  else:
    value = (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(
        config.weight_dtype)
  return nnx.Param(value, logical_axes=axes)


class RMSNorm(nnx.Module):
  """Root-mean-square norm, computed in float32 as Qwen3 does."""

  def __init__(self, dim: int, config: ModelConfig, *, rngs: nnx.Rngs):
    self.scale = _param(rngs, (dim,), ("norm",), config, std=None)
    self.eps = config.rms_eps

  def __call__(self, x):
    dtype = x.dtype
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return self.scale[...].astype(dtype) * x32.astype(dtype)


def rope_frequencies(config: ModelConfig) -> jax.Array:
  """RoPE's `[head_dim / 2]` inverse frequencies, float32: theta^(-2i / head_dim), with
  Llama 3.1's "llama3" scaling where the config has it (`rope_scaling_factor` > 0):
  wavelengths longer than original_max / low_freq_factor divided by the factor,
  shorter than original_max / high_freq_factor kept, the ones between interpolated
  linearly in original_max / wavelength."""
  h = config.head_dim
  inv = 1.0 / (config.rope_theta ** (jnp.arange(0, h, 2, dtype=jnp.float32) / h))
  factor = config.rope_scaling_factor
  if not factor:
    return inv
  low, high = config.rope_low_freq_factor, config.rope_high_freq_factor
  old = float(config.rope_original_max_positions)
  wavelength = 2.0 * jnp.pi / inv
  smooth = (old / wavelength - low) / (high - low)
  between = (wavelength >= old / high) & (wavelength <= old / low)
  scaled = jnp.where(wavelength > old / low, inv / factor, inv)
  return jnp.where(between, (1.0 - smooth) * inv / factor + smooth * inv, scaled)


def rope(x_btnh, positions_bt, config: ModelConfig):
  """Rotary embedding (the half-split layout of Qwen3 and Llama) at the given true
  positions, at the config's frequencies (`rope_frequencies`)."""
  inv_freq = rope_frequencies(config)
  angles_bth = positions_bt.astype(jnp.float32)[..., None] * inv_freq
  angles_bth = jnp.concatenate([angles_bth, angles_bth], axis=-1)
  cos = jnp.cos(angles_bth)[:, :, None, :]
  sin = jnp.sin(angles_bth)[:, :, None, :]
  x1, x2 = jnp.split(x_btnh, 2, axis=-1)
  rotated = jnp.concatenate([-x2, x1], axis=-1)
  out = x_btnh.astype(jnp.float32) * cos + rotated.astype(jnp.float32) * sin
  return out.astype(x_btnh.dtype)


def attend(q_btnh, k_btkh, v_btkh, chunk_mask_btt, cache_k_bksh=None, cache_v_bksh=None,
           cache_len_b=None, kv_chunk: int = 0):
  """Grouped-query attention of a chunk over [cache entries, chunk entries].

  `chunk_mask_btt[b, i, j]` says whether chunk query i sees chunk key j; every
  chunk query sees cache entries `[0, cache_len_b[b])` (the live prefix of a
  `KVCache` row). Softmax runs in float32 over the union of both key sets.
  With a cache the two score blocks are never joined: each is exponentiated
  against the joint maximum, multiplied with its own values, and the sum is
  normalised once at the end, so no `[.., t, s + t]` array (or a slice copy of
  one) exists.

  `kv_chunk` > 0 and shorter than the buffer: the cache is read `kv_chunk`
  entries at a time (`attend_live`), only as far as the longest row's live
  prefix, instead of the whole buffer in one product.
  """
  if cache_k_bksh is not None and 0 < kv_chunk < cache_k_bksh.shape[2]:
    return attend_live(q_btnh, k_btkh, v_btkh, chunk_mask_btt, cache_k_bksh, cache_v_bksh,
                       cache_len_b, kv_chunk)
  b, t, n, h = q_btnh.shape
  kv = k_btkh.shape[2]
  q = q_btnh.reshape(b, t, kv, n // kv, h) * (h ** -0.5)
  scores = jnp.einsum("btkgh,bukh->bkgtu", q, k_btkh, preferred_element_type=jnp.float32)
  scores = jnp.where(chunk_mask_btt[:, None, None, :, :], scores, _NEG_INF)
  if cache_k_bksh is None:
    probs = jax.nn.softmax(scores, axis=-1).astype(v_btkh.dtype)
    return jnp.einsum("bkgtu,bukh->btkgh", probs, v_btkh).reshape(b, t, n, h)
  cache_valid_bs = masks.cache_valid_bs(cache_len_b, cache_k_bksh.shape[2])
  cache_scores = jnp.einsum("btkgh,bksh->bkgts", q, cache_k_bksh,
                            preferred_element_type=jnp.float32)
  cache_scores = jnp.where(cache_valid_bs[:, None, None, None, :], cache_scores, _NEG_INF)
  top = jax.lax.stop_gradient(jnp.maximum(cache_scores.max(-1), scores.max(-1)))[..., None]
  e_cache = jnp.exp(cache_scores - top)
  e_chunk = jnp.exp(scores - top)
  total = e_cache.sum(-1) + e_chunk.sum(-1)  # [b, k, g, t]
  out = (jnp.einsum("bkgts,bksh->btkgh", e_cache.astype(v_btkh.dtype), cache_v_bksh,
                    preferred_element_type=jnp.float32)
         + jnp.einsum("bkgtu,bukh->btkgh", e_chunk.astype(v_btkh.dtype), v_btkh,
                      preferred_element_type=jnp.float32))
  out = out / jnp.moveaxis(total, 3, 1)[..., None]
  return out.astype(v_btkh.dtype).reshape(b, t, n, h)


def attend_live(q_btnh, k_btkh, v_btkh, chunk_mask_btt, cache_k_bksh, cache_v_bksh,
                cache_len_b, kv_chunk: int):
  """`attend` reading the cache `kv_chunk` entries at a time, up to the longest
  row's live prefix only: a pass over a buffer sized for the longest prompt
  costs what its rows hold, not what they could hold.

  Online softmax: the chunk's own keys start a running maximum, sum and
  weighted value sum in float32, and each cache chunk, in buffer order, rescales
  them to its new maximum and adds its own terms. A loop whose trip count is
  traced (the longest live prefix) runs the chunks; the last one starts at
  `S - kv_chunk` and skips the entries an earlier chunk took.

  A row's result does not depend on how many chunks the loop runs: a chunk
  past the row's live prefix is wholly masked, so its maximum leaves the
  running one as it is (every query sees at least one of its chunk's own
  keys, so that maximum is a real score), the rescaling factor is exp(0) = 1
  and every added term exp(-1e30 - max) = 0, all exactly. So a row decodes to
  the same bits beside a longer row as beside a shorter one. (A query that sees
  no key at all, which decoders never ask for, gets a finite average.)
  """
  b, t, n, h = q_btnh.shape
  kv = k_btkh.shape[2]
  s, c = cache_k_bksh.shape[2], kv_chunk
  q = q_btnh.reshape(b, t, kv, n // kv, h) * (h ** -0.5)
  scores = jnp.einsum("btkgh,bukh->bkgtu", q, k_btkh, preferred_element_type=jnp.float32)
  scores = jnp.where(chunk_mask_btt[:, None, None, :, :], scores, _NEG_INF)
  top = jax.lax.stop_gradient(scores.max(-1))  # [b, k, g, t]
  e = jnp.exp(scores - top[..., None])
  total = e.sum(-1)
  acc = jnp.einsum("bkgtu,bukh->bkgth", e.astype(v_btkh.dtype), v_btkh,
                   preferred_element_type=jnp.float32)
  cache_len_b = jnp.asarray(cache_len_b, jnp.int32)
  chunks = (jnp.max(cache_len_b) + c - 1) // c
  offsets = jnp.arange(c, dtype=jnp.int32)

  def chunk(i, carry):
    top, total, acc = carry
    first = i * c
    start = jnp.minimum(first, s - c)  # the last chunk may overlap the one before it
    index = start + offsets
    valid_bc = (index >= first)[None, :] & (index[None, :] < cache_len_b[:, None])
    k_c = jax.lax.dynamic_slice_in_dim(cache_k_bksh, start, c, axis=2)
    v_c = jax.lax.dynamic_slice_in_dim(cache_v_bksh, start, c, axis=2)
    sc = jnp.einsum("btkgh,bksh->bkgts", q, k_c, preferred_element_type=jnp.float32)
    sc = jnp.where(valid_bc[:, None, None, None, :], sc, _NEG_INF)
    new_top = jax.lax.stop_gradient(jnp.maximum(top, sc.max(-1)))
    scale = jnp.exp(top - new_top)
    p = jnp.exp(sc - new_top[..., None])
    total = total * scale + p.sum(-1)
    acc = acc * scale[..., None] + jnp.einsum("bkgts,bksh->bkgth", p.astype(v_c.dtype), v_c,
                                              preferred_element_type=jnp.float32)
    return new_top, total, acc

  _, total, acc = jax.lax.fori_loop(0, chunks, chunk, (top, total, acc))
  out = jnp.moveaxis(acc / total[..., None], 3, 1)  # [b, t, k, g, h]
  return out.astype(v_btkh.dtype).reshape(b, t, n, h)


def _attend_kernel(q_btnh, k_btkh, v_btkh, segment_ids_bt, config: ModelConfig):
  causal = config.attention == "causal"
  if config.attention_impl == "cudnn":
    # cuDNN here takes no segment ids: a row is one sample then padding (the trainer
    # refuses packed rows with it), so its length is its count of real tokens.
    length_b = jnp.sum(segment_ids_bt > 0, axis=1, dtype=jnp.int32)
    return attention_kernels.attend_full(q_btnh, k_btkh, v_btkh, impl="cudnn", causal=causal,
                                         length_b=length_b)
  return attention_kernels.attend_full(q_btnh, k_btkh, v_btkh, impl=config.attention_impl,
                                       causal=causal, segment_ids_bt=segment_ids_bt)


class Attention(nnx.Module):

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    d, n, k, h = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
    self.config = config
    self.q_proj = _param(rngs, (d, n, h), ("embed", "q_heads", "head_dim"), config)
    self.k_proj = _param(rngs, (d, k, h), ("embed", "kv_heads", "head_dim"), config)
    self.v_proj = _param(rngs, (d, k, h), ("embed", "kv_heads", "head_dim"), config)
    self.o_proj = _param(rngs, (n, h, d), ("q_heads", "head_dim", "embed"), config)
    if config.qk_norm:  # Qwen3
      self.q_norm = RMSNorm(h, config, rngs=rngs)
      self.k_norm = RMSNorm(h, config, rngs=rngs)
    if config.qkv_bias:  # Qwen2
      self.q_bias = _param(rngs, (n, h), ("q_heads", "head_dim"), config, std=None, fill=0.0)
      self.k_bias = _param(rngs, (k, h), ("kv_heads", "head_dim"), config, std=None, fill=0.0)
      self.v_bias = _param(rngs, (k, h), ("kv_heads", "head_dim"), config, std=None, fill=0.0)

  def __call__(self, x_btd, positions_bt, chunk_mask_btt, cache_k_bksh=None, cache_v_bksh=None,
               cache_len_b=None, kv_chunk: int = 0):
    dtype = self.config.compute_dtype
    q = jnp.einsum("btd,dnh->btnh", x_btd, self.q_proj[...].astype(dtype))
    k = jnp.einsum("btd,dkh->btkh", x_btd, self.k_proj[...].astype(dtype))
    v = jnp.einsum("btd,dkh->btkh", x_btd, self.v_proj[...].astype(dtype))
    if self.config.qkv_bias:
      q = q + self.q_bias[...].astype(dtype)
      k = k + self.k_bias[...].astype(dtype)
      v = v + self.v_bias[...].astype(dtype)
    if self.config.qk_norm:
      q, k = self.q_norm(q), self.k_norm(k)
    q = rope(q, positions_bt, self.config)
    k = rope(k, positions_bt, self.config)
    q = sharding.constrain(q, ("batch", "seq", "q_heads", "head_dim"))
    k = sharding.constrain(k, ("batch", "seq", "kv_heads", "head_dim"))
    v = sharding.constrain(v, ("batch", "seq", "kv_heads", "head_dim"))
    if isinstance(chunk_mask_btt, attention_kernels.RowSegments):
      # The whole row (each of its segments) under the config's own mask: a kernel.
      if cache_k_bksh is not None:
        raise ValueError("a kernel attention call (RowSegments) takes no KV cache")
      out = _attend_kernel(q, k, v, chunk_mask_btt.segment_ids_bt, self.config)
    else:
      out = attend(q, k, v, chunk_mask_btt, cache_k_bksh, cache_v_bksh, cache_len_b, kv_chunk)
    y = jnp.einsum("btnh,nhd->btd", out, self.o_proj[...].astype(dtype))
    return y, k, v


class MLP(nnx.Module):
  """SwiGLU: down(silu(gate(x)) * up(x))."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    d, f = config.hidden_size, config.mlp_dim
    self.config = config
    self.gate_proj = _param(rngs, (d, f), ("embed", "mlp"), config)
    self.up_proj = _param(rngs, (d, f), ("embed", "mlp"), config)
    self.down_proj = _param(rngs, (f, d), ("mlp", "embed"), config)
    if config.draft_rank:  # ModelConfig.draft_rank; B = 0 at the start (no change)
      self.draft_a = _param(rngs, (d, config.draft_rank), ("embed", None), config)
      self.draft_b = _param(rngs, (config.draft_rank, d), (None, "embed"), config, std=None,
                            fill=0.0)

  def __call__(self, x_btd, draft_bt=None):
    dtype = self.config.compute_dtype
    gate = jnp.einsum("btd,df->btf", x_btd, self.gate_proj[...].astype(dtype))
    up = jnp.einsum("btd,df->btf", x_btd, self.up_proj[...].astype(dtype))
    hidden = sharding.constrain(jax.nn.silu(gate) * up, ("batch", "seq", "mlp"))
    out = jnp.einsum("btf,fd->btd", hidden, self.down_proj[...].astype(dtype))
    if draft_bt is None:
      return out
    # The draft adapter, at the mask token's entries only (every other entry: exactly `out`).
    low = jnp.einsum("btd,dr->btr", x_btd, self.draft_a[...].astype(dtype))
    delta = jnp.einsum("btr,rd->btd", low, self.draft_b[...].astype(dtype))
    return jnp.where(draft_bt[..., None], out + delta, out)


class DecoderLayer(nnx.Module):

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    self.input_norm = RMSNorm(config.hidden_size, config, rngs=rngs)
    self.attn = Attention(config, rngs=rngs)
    self.post_attn_norm = RMSNorm(config.hidden_size, config, rngs=rngs)
    self.mlp = MLP(config, rngs=rngs)

  def __call__(self, x_btd, positions_bt, chunk_mask_btt, cache_k_bksh=None, cache_v_bksh=None,
               cache_len_b=None, kv_chunk: int = 0, draft_bt=None):
    y, k, v = self.attn(self.input_norm(x_btd), positions_bt, chunk_mask_btt, cache_k_bksh,
                        cache_v_bksh, cache_len_b, kv_chunk)
    x_btd = x_btd + y
    x_btd = x_btd + self.mlp(self.post_attn_norm(x_btd), draft_bt)
    return sharding.constrain(x_btd, ("batch", "seq", "act_embed")), k, v


def remat_policy(name: str):
  """The jax.checkpoint policy of ModelConfig.remat ("none": no rematerialisation)."""
  if name == "full":
    return None  # save nothing but the function's inputs
  if name == "save_dots":
    # Keeps the weight matmuls' outputs (no batch dimension); attention's batched
    # products and every elementwise op are recomputed.
    return jax.checkpoint_policies.dots_with_no_batch_dims_saveable
  raise ValueError(f"no rematerialisation policy for ModelConfig.remat={name!r}")


def remat_layer(fn, name: str):
  """`fn` under ModelConfig.remat's policy (unchanged for "none")."""
  if name == "none":
    return fn
  return nnx.remat(fn, policy=remat_policy(name))


def _call_layer(layer, x_btd, positions_bt, chunk_mask_btt, cache_k_bksh, cache_v_bksh,
                cache_len_b, draft_bt=None, kv_chunk: int = 0):
  return layer(x_btd, positions_bt, chunk_mask_btt, cache_k_bksh, cache_v_bksh, cache_len_b,
               kv_chunk, draft_bt)


def stack_layers(layers: list[DecoderLayer]) -> DecoderLayer:
  """One DecoderLayer whose every parameter is the stack of `layers`' (a leading
  `[num_layers]` axis with the logical name "layers"): what `lax.scan` runs.

  Built from the per-layer modules, so a scanned model draws the very same
  initial values as an unrolled one from the same seed.
  """
  stacked = layers[0]
  flat = [dict(nnx.to_flat_state(nnx.state(layer, nnx.Param))) for layer in layers]
  for path, var in flat[0].items():
    value = jnp.stack([f[path].get_value() for f in flat])
    parent = stacked
    for name in path[:-1]:
      parent = getattr(parent, name)
    axes = ("layers",) + tuple(var.logical_axes)
    setattr(parent, path[-1], nnx.Param(value, logical_axes=axes))
  return stacked


class Transformer(nnx.Module):
  """The LM of every family: Qwen3, Qwen2.5, Dream, Llama-3 or LLaDA
  (`ModelConfig.model_type`). `model(ids, positions)` is the public full-sequence call
  (position i's output, as HF computes it; `token_logits` re-indexes a Dream model's by
  the token each predicts)."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    self.config = config
    self.embed = _param(rngs, (config.vocab_size, config.hidden_size), ("vocab", "embed"),
                        config)
    layers = [DecoderLayer(config, rngs=rngs) for _ in range(config.num_layers)]
    self.layers = stack_layers(layers) if config.scan_layers else nnx.List(layers)
    self.final_norm = RMSNorm(config.hidden_size, config, rngs=rngs)
    if not config.tie_embeddings:
      self.lm_head = _param(rngs, (config.hidden_size, config.vocab_size), ("embed", "vocab"),
                            config)

  def _check_inputs(self, input_ids_bt, positions_bt):
    if input_ids_bt.ndim != 2 or positions_bt.shape != input_ids_bt.shape:
      raise ValueError(
          f"input_ids {input_ids_bt.shape} and positions {positions_bt.shape} must both be "
          "[batch, length]")

  def _logits(self, x_btd):
    logits = self.unembed().project(self.final_norm(x_btd))
    return sharding.constrain(logits, ("batch", "seq", "vocab"))

  def _draft_gate(self, input_ids_bt):
    """Where the draft adapters act (ModelConfig.draft_rank): the mask token's entries;
    None without adapters."""
    if not self.config.draft_rank:
      return None
    return input_ids_bt == self.config.mask_token_id

  def unembed(self) -> Unembed:
    """The output projection in the compute dtype and its stored layout (no transpose).

    With `forward_hidden`, `unembed().logits(h)` equals the logits of
    `forward_chunk` in float32; decoders use it to reduce over the vocabulary
    chunk by chunk instead of materialising `[B, T, V]`.
    """
    dtype = self.config.compute_dtype
    if self.config.tie_embeddings:
      return Unembed(self.embed[...].astype(dtype), vocab_axis=0)
    return Unembed(self.lm_head[...].astype(dtype), vocab_axis=1)

  def forward_hidden(self, input_ids_bt, positions_bt, cache: KVCache | None, chunk_mask_btt,
                     write_bt=None):
    """`forward_chunk` without the output projection.

    Returns `(hidden_btd, k_lbtkh, v_lbtkh)`, the hidden states after the final
    norm (`cache=None`: no cache, the chunk attends to itself only). With
    `write_bt = (rows_bt, dest_bt)` the chunk's K/V are written into the cache
    instead (`KVCache.write`; lengths and positions untouched) and the result is
    `(hidden_btd, cache)`: a scanned model writes each layer's entries inside its
    scan, into the buffer the scan already holds, so no pass copies the cache.
    """
    if write_bt is not None and cache is not None and self.config.scan_layers:
      x, cache = self._scan_layers(self._embed(input_ids_bt, positions_bt), positions_bt,
                                   chunk_mask_btt, cache, True, write_bt,
                                   draft_bt=self._draft_gate(input_ids_bt))
      return self.final_norm(x), cache
    x, k, v = self._run_layers(input_ids_bt, positions_bt, chunk_mask_btt, cache)
    if write_bt is not None:
      return self.final_norm(x), cache.write(write_bt[0], write_bt[1], k, v)
    return self.final_norm(x), k, v

  def _run(self, input_ids_bt, positions_bt, chunk_mask_btt, cache: KVCache | None):
    x, k, v = self._run_layers(input_ids_bt, positions_bt, chunk_mask_btt, cache)
    return self._logits(x), k, v

  def _run_layers(self, input_ids_bt, positions_bt, chunk_mask_btt, cache: KVCache | None,
                  return_kv: bool = True):
    x = self._embed(input_ids_bt, positions_bt)
    draft_bt = self._draft_gate(input_ids_bt)
    if self.config.scan_layers:
      return self._scan_layers(x, positions_bt, chunk_mask_btt, cache, return_kv,
                               draft_bt=draft_bt)
    ks, vs = [], []
    length_b = None if cache is None else cache.length_b
    call = _call_layer if cache is None else functools.partial(_call_layer, kv_chunk=cache.chunk)
    run_layer = remat_layer(call, self.config.remat)
    for i, layer in enumerate(self.layers):
      layer_k, layer_v = (None, None) if cache is None else cache.layer(i)
      x, k, v = run_layer(layer, x, positions_bt, chunk_mask_btt, layer_k, layer_v, length_b,
                          draft_bt)
      ks.append(k)
      vs.append(v)
    if not return_kv:
      return x, None, None
    return x, jnp.stack(ks), jnp.stack(vs)

  def _embed(self, input_ids_bt, positions_bt):
    self._check_inputs(input_ids_bt, positions_bt)
    x = jnp.take(self.embed[...], input_ids_bt, axis=0).astype(self.config.compute_dtype)
    return sharding.constrain(x, ("batch", "seq", "act_embed"))

  def _scan_layers(self, x_btd, positions_bt, chunk_mask_btt, cache, return_kv, write_bt=None,
                   draft_bt=None):
    # One layer body in a lax.scan over the stacked parameters (and the stacked cache):
    # the program holds one layer however deep the model is.
    graphdef, layer_state = nnx.split(self.layers)
    length_b, kv_chunk = (None, 0) if cache is None else (cache.length_b, cache.chunk)
    if write_bt is not None:
      # The cache rides in the carry and each layer writes its own entries into it:
      # the loop updates one buffer in place.
      rows_bt, dest_bt = write_bt

      def write_body(carry, xs):
        x, k_buf, v_buf = carry
        state, i = xs
        layer = nnx.merge(graphdef, state)
        x, k, v = layer(x, positions_bt, chunk_mask_btt, k_buf[i], v_buf[i], length_b, kv_chunk,
                        draft_bt)
        # The chunk's K/V pass through a barrier (an identity) before the write: without
        # it libtpu 0.0.42 aborts compiling AR decode's loop around this scan (grouped-
        # query heads on a tensor-parallel mesh) in a loop analysis that finds a cycle
        # (algebraic_simplifier.cc "A cycle is detected"): the K/V projection gets the
        # control edge ordering the in-place write after the attention that reads the
        # buffer, and that attention depends on the projection. The barrier keeps only
        # the small [B, T, K, H] chunk apart; the buffers are still written in place.
        k, v = jax.lax.optimization_barrier((k, v))
        k_buf = k_buf.at[i, rows_bt, :, dest_bt].set(k.astype(k_buf.dtype), mode="drop")
        v_buf = v_buf.at[i, rows_bt, :, dest_bt].set(v.astype(v_buf.dtype), mode="drop")
        return (x, k_buf, v_buf), None

      (x, k_buf, v_buf), _ = jax.lax.scan(
          write_body, (x_btd, cache.k, cache.v),
          (layer_state, jnp.arange(self.config.num_layers)))
      return x, cache.replace(k=k_buf, v=v_buf)

    def body(x, xs):
      state, layer_k, layer_v = xs
      layer = nnx.merge(graphdef, state)
      x, k, v = layer(x, positions_bt, chunk_mask_btt, layer_k, layer_v, length_b, kv_chunk,
                      draft_bt)
      return x, ((k, v) if return_kv else None)

    if self.config.remat != "none":
      body = jax.checkpoint(body, policy=remat_policy(self.config.remat), prevent_cse=False)
    kv = (None, None) if cache is None else (cache.k, cache.v)
    x, ys = jax.lax.scan(body, x_btd, (layer_state,) + kv)
    if not return_kv:
      return x, None, None
    return x, ys[0], ys[1]

  def hidden(self, input_ids_bt, positions_bt, attention_mask_btt=None, segment_ids_bt=None):
    """Hidden states `[B, T, D]` after the final norm: `__call__` without the projection.

    With `unembed()`, a loss can project them a chunk of the sequence at a time
    instead of materialising `[B, T, V]` logits.
    """
    input_ids_bt = jnp.asarray(input_ids_bt)
    positions_bt = jnp.asarray(positions_bt)
    self._check_inputs(input_ids_bt, positions_bt)
    b, t = input_ids_bt.shape
    if attention_mask_btt is not None:
      if segment_ids_bt is not None:
        raise ValueError("give attention_mask_btt or segment_ids_bt, not both")
      mask = attention_mask_btt
    else:
      if segment_ids_bt is None:  # the whole row is one sample
        segment_ids_bt = jnp.ones((b, t), jnp.int32)
      segment_ids_bt = jnp.asarray(segment_ids_bt, jnp.int32)
      if segment_ids_bt.shape != (b, t):
        raise ValueError(f"segment_ids {segment_ids_bt.shape} must match input_ids {(b, t)}")
      if self.config.attention_impl != "xla":
        attention_kernels.check_supported(
            self.config.attention_impl, seq_len=t, dtype=self.config.dtype,
            platform=attention_kernels.current_platform())
        # Every layer runs ModelConfig.attention_impl's kernel over each segment.
        mask = attention_kernels.RowSegments(segment_ids_bt)
      else:
        mask = masks.segment_btt(segment_ids_bt, causal=self.config.attention == "causal")
    x, _, _ = self._run_layers(input_ids_bt, positions_bt, mask, None, return_kv=False)
    return self.final_norm(x)

  def __call__(self, input_ids_bt, positions_bt, attention_mask_btt=None, segment_ids_bt=None):
    """Logits `[B, T, V]`.

    Attention is causal in *input order* (bidirectional for an MDM config)
    unless `attention_mask_btt` (True = may attend) is given; with
    `segment_ids_bt` (int `[B, T]`, packed rows: each sample's tokens share an
    id, 0 = padding) a token attends only within its own segment. Without an
    explicit mask, `ModelConfig.attention_impl` picks how it is computed
    ("splash" / "cudnn": attention_kernels.py; an explicit mask always takes the
    einsum path).
    """
    h = self.hidden(input_ids_bt, positions_bt, attention_mask_btt, segment_ids_bt)
    return sharding.constrain(self.unembed().project(h), ("batch", "seq", "vocab"))

  def token_logits(self, input_ids_bt, positions_bt, attention_mask_btt=None,
                   segment_ids_bt=None):
    """Logits `[B, T, V]` indexed by the token they predict: `__call__`'s, except for a
    model with `ModelConfig.shift_logits` (Dream), whose prediction for token i is the
    output at position i-1 (position 0 keeps its own), as Dream's sampler reads them."""
    logits_btv = self(input_ids_bt, positions_bt, attention_mask_btt, segment_ids_bt)
    return shift_to_tokens(logits_btv) if self.config.shift_logits else logits_btv

  def forward_chunk(self, input_ids_bt, positions_bt, cache: KVCache, chunk_mask_btt):
    """A chunk of new tokens against the KV buffer; nothing is written.

    Every chunk query sees the cache's live entries and the chunk keys that
    `chunk_mask_btt` allows. Returns `(logits_btv, k_lbtkh, v_lbtkh)`: the
    chunk's keys (RoPE already applied at `positions_bt`) and values, ready
    for `cache.commit`.
    """
    return self._run(input_ids_bt, positions_bt, chunk_mask_btt, cache)


def shift_to_tokens(x_bt_):
  """`x_bt_` (`[B, T, ...]`) moved one position to the right along T, its first entry
  kept: entry i becomes position i-1's (Dream's logits shift)."""
  return jnp.concatenate([x_bt_[:, :1], x_bt_[:, :-1]], axis=1)


def convert_layer_layout(params: dict, num_layers: int, scanned: bool) -> dict:
  """A pure parameter dict (`nnx.to_pure_dict`) in the other layer layout.

  `scanned=True` stacks the per-layer entries `params["layers"][i]` into one
  `params["layers"]` of `[num_layers, ...]` leaves; `scanned=False` slices them
  back. Values are unchanged, so a model keeps its outputs in either layout.
  """
  params = dict(params)
  layers = params["layers"]
  per_layer = sorted(layers) == list(range(num_layers))
  if scanned:
    if not per_layer:
      raise ValueError(f"params['layers'] has keys {sorted(layers)[:4]}..., not the per-layer "
                       f"0..{num_layers - 1} of an unrolled model")
    params["layers"] = jax.tree.map(lambda *xs: jnp.stack(xs), *[layers[i] for i in
                                                                  range(num_layers)])
  else:
    if per_layer:
      raise ValueError("params['layers'] is already per layer (an unrolled model)")
    params["layers"] = {i: jax.tree.map(lambda x, i=i: x[i], layers) for i in range(num_layers)}
  return params


def param_count(model: nnx.Module) -> int:
  return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
