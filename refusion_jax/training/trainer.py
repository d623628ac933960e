"""The compiled pieces of training: optimizer, step rngs, the sharded train and
eval steps (`Trainer`), and the parameter surgery of a Hugging Face start.
"""

from __future__ import annotations

import functools
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from refusion_jax import hf, loading, objective, runtime, sharding
from refusion_jax.config import ModelConfig
from refusion_jax.model import Transformer
from refusion_jax.tokenizer import Tokenizer
from refusion_jax.training import settings

BATCH_KEYS = objective.PACKED_KEYS  # every field [rows, seq_len]
# Independent rng streams under one seed.
_TRAIN_STREAM, _EVAL_STREAM = 0, 1


def bd3lm_kwargs(config) -> dict:
  """`objective.loss_fn`'s BD3-LM settings from the config."""
  block, eps_min, eps_max = settings.bd3lm_settings(config)
  return {"bd3lm_block_size": int(block), "bd3lm_eps": (float(eps_min), float(eps_max))}


def make_optimizer(opt_config, total_steps: int):
  """AdamW with linear warmup (possibly none) + cosine decay and global-norm clipping.

  Returns `(tx, schedule)`; `schedule(step)` is the rate of update `step` (0-based).
  """
  peak = float(opt_config.learning_rate)
  end = peak * float(opt_config.end_lr_ratio)
  warmup = int(opt_config.warmup_steps)
  if warmup > 0:
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=peak, warmup_steps=warmup,
        decay_steps=max(total_steps, warmup + 1), end_value=end)
  else:
    schedule = optax.cosine_decay_schedule(
        init_value=peak, decay_steps=max(total_steps, 1), alpha=float(opt_config.end_lr_ratio))
  adamw = optax.adamw(schedule, b1=float(opt_config.b1), b2=float(opt_config.b2),
                      eps=float(opt_config.eps), weight_decay=float(opt_config.weight_decay))
  if opt_config.grad_clip_norm > 0:
    return optax.chain(optax.clip_by_global_norm(float(opt_config.grad_clip_norm)), adamw), \
        schedule
  return adamw, schedule


def step_rng(seed: int, step) -> jax.Array:
  """The rng of train step `step`: a function of (seed, step) only."""
  return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), _TRAIN_STREAM), step)


def eval_rng(seed: int, index) -> jax.Array:
  return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), _EVAL_STREAM), index)


def _resize_rows(table_vd, vocab_size: int, reset_ids: tuple[int, ...]):
  """Rows of `table_vd` resized to `vocab_size`; new and reset rows get the mean row.

  The mean is taken over the rows that are kept and not reset, in float32.
  """
  old, _ = table_vd.shape
  keep = min(old, vocab_size)
  kept_vd = table_vd[:keep]
  reused_v = jnp.ones((keep,), bool)
  for token_id in reset_ids:
    if token_id < keep:
      reused_v = reused_v.at[token_id].set(False)
  weights_v = reused_v.astype(jnp.float32)
  mean_d = jnp.einsum("v,vd->d", weights_v, kept_vd.astype(jnp.float32)) / jnp.sum(weights_v)
  fresh_v = jnp.arange(vocab_size) >= keep
  for token_id in reset_ids:
    fresh_v = fresh_v.at[token_id].set(True)
  if vocab_size > keep:
    kept_vd = jnp.concatenate(
        [kept_vd, jnp.zeros((vocab_size - keep, kept_vd.shape[1]), kept_vd.dtype)])
  return jnp.where(fresh_v[:, None], mean_d.astype(table_vd.dtype), kept_vd)


def add_special_token_rows(params: dict, *, vocab_size: int, reset_ids: tuple[int, ...]) -> dict:
  """Resizes the embedding (and an untied lm_head) to `vocab_size` rows/columns.

  The rule (ReFusion's release adds `<|beginoftext|>` and `<|mask|>` this way):
  rows `[0, min(old, vocab_size))` are kept; every appended row and every row
  listed in `reset_ids` (the two special tokens) is set to the mean of the
  kept rows that are not reset. The untied head's columns follow the same
  rule. For Qwen3-8B (151936 rows, tokenizer ids up to 151670) the mean is
  over ids 0..151668, i.e. every token the backbone was trained with.
  """
  params = dict(params)
  reset_ids = tuple(int(i) for i in reset_ids)
  params["embed"] = _resize_rows(params["embed"], vocab_size, reset_ids)
  if "lm_head" in params:
    params["lm_head"] = _resize_rows(params["lm_head"].T, vocab_size, reset_ids).T
  return params



class Trainer:
  """Shardings, optimizer and the jitted train / eval steps for one model on one mesh."""

  def __init__(self, config, model_config: ModelConfig, *, mesh, pad_id: int, total_steps: int,
               rules: sharding.ShardingRules | None = None):
    self.config = config
    self.model_config = model_config
    self.mesh = mesh
    self.rules = rules or sharding.ShardingRules()
    self.seed = int(config.seed)
    self.total_steps = int(total_steps)
    self.loss_kwargs = dict(
        objective=config.objective,
        mask_id=model_config.mask_token_id if model_config.mask_token_id is not None else 0,
        pad_id=int(pad_id), slot_sizes=tuple(config.slot_sizes), eps=float(config.eps),
        eos_id=model_config.eos_token_id if config.objective in ("mdm", "bd3lm") else None,
        loss_chunk=objective.check_loss_chunk(config.loss_chunk),
        boundary_label=bool(config.get("boundary_label", False)), **bd3lm_kwargs(config))

    abstract_model = nnx.eval_shape(lambda: Transformer(model_config, rngs=nnx.Rngs(0)))
    self.graphdef, abstract_state = nnx.split(abstract_model)
    self.param_shardings = nnx.to_pure_dict(
        sharding.state_shardings(abstract_state, mesh, self.rules))
    self.abstract_params = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
        nnx.to_pure_dict(abstract_state), self.param_shardings)
    self.replicated = NamedSharding(mesh, PartitionSpec())

    self.tx, self.schedule = make_optimizer(config.optimizer, self.total_steps)
    abstract_opt = jax.eval_shape(self.tx.init, self.abstract_params)
    self.opt_shardings = optax.tree_map_params(
        self.tx, lambda _, s: s, abstract_opt, self.param_shardings,
        transform_non_params=lambda _: self.replicated)
    self.abstract_opt_state = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract_opt,
        self.opt_shardings)
    self.batch_shardings = {k: sharding.data_sharding(mesh, self.rules, 2) for k in BATCH_KEYS}
    self._train_step = jax.jit(
        self._step,
        in_shardings=(self.param_shardings, self.opt_shardings, self.batch_shardings,
                      self.replicated),
        out_shardings=(self.param_shardings, self.opt_shardings, self.replicated),
        donate_argnums=(0, 1))
    self._eval_step = jax.jit(
        self._eval, in_shardings=(self.param_shardings, self.batch_shardings, self.replicated),
        out_shardings=self.replicated)

  # -- pure functions that get compiled

  def _loss(self, params, batch, rng):
    model = nnx.merge(self.graphdef, params)
    return objective.loss_fn(model, batch, rng, **self.loss_kwargs)

  def _step(self, params, opt_state, batch, step):
    rng = step_rng(self.seed, step)
    (loss, metrics), grads = jax.value_and_grad(self._loss, has_aux=True)(params, batch, rng)
    grad_norm = optax.tree.norm(grads)
    updates, opt_state = self.tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    metrics = dict(metrics, loss=loss, grad_norm=grad_norm, lr=self.schedule(step))
    return params, opt_state, metrics

  def _eval(self, params, batch, index):
    loss, metrics = self._loss(params, batch, eval_rng(self.seed, index))
    return dict(metrics, loss=loss)

  # -- host-side entry points

  def abstract_train_state(self) -> dict:
    return {"params": self.abstract_params, "opt_state": self.abstract_opt_state}

  def init_params(self) -> dict:
    """Random initialisation, computed directly in the target shardings."""

    def init():
      model = Transformer(self.model_config, rngs=nnx.Rngs(self.seed))
      return nnx.to_pure_dict(nnx.split(model)[1])

    return jax.jit(init, out_shardings=self.param_shardings)()

  def place_params(self, params) -> dict:
    """Copies a parameter dict (host or device arrays) into the target shardings."""
    # may_alias=False: the train step donates these buffers, which must never be
    # the caller's own (host) memory.
    dtype = self.model_config.weight_dtype
    return jax.tree.map(
        lambda x, s: jax.device_put(np.asarray(jax.device_get(x)).astype(dtype), s,
                                    may_alias=False),
        params, self.param_shardings)

  def init_opt_state(self, params) -> Any:
    return jax.jit(self.tx.init, in_shardings=(self.param_shardings,),
                   out_shardings=self.opt_shardings)(params)

  def shard_batch(self, batch: Mapping[str, np.ndarray]) -> dict:
    """This process's rows -> global arrays sharded over the batch mesh axes.

    `batch` is in the packed format (what the loader yields), or one sample per
    row (`objective.ROW_KEYS`), converted first (the MDM baseline's responses
    then run to the row's end in EOS, as `objective.loss_fn` does).
    """
    if not objective.is_packed(batch):
      missing = [k for k in objective.ROW_KEYS if k not in batch]
      if missing:
        raise ValueError(f"batch is missing {missing}")
      eos = self.loss_kwargs["eos_id"]
      multiple = self.loss_kwargs["bd3lm_block_size"] if self.config.objective == "bd3lm" else 0
      batch = objective.packed_batch({k: np.asarray(batch[k]) for k in objective.ROW_KEYS},
                                     eos_fill_id=eos, eos_fill_multiple=multiple)
    missing = [k for k in BATCH_KEYS if k not in batch]
    if missing:
      raise ValueError(f"batch is missing {missing}")
    return {k: jax.make_array_from_process_local_data(
        self.batch_shardings[k], np.asarray(batch[k], np.int32)) for k in BATCH_KEYS}

  def abstract_batch(self, rows: int, seq_len: int) -> dict:
    """Shapes of a global batch of `rows` x `seq_len`, sharded as `shard_batch` places it."""
    return {k: jax.ShapeDtypeStruct((rows, seq_len), jnp.int32, sharding=self.batch_shardings[k])
            for k in BATCH_KEYS}

  def lower_train_step(self, rows: int, seq_len: int) -> jax.stages.Lowered:
    """The train step lowered from shapes alone (no parameters or data exist): compile
    it for the mesh's devices, which may be a TPU slice described without a TPU."""
    step = jax.ShapeDtypeStruct((), jnp.int32, sharding=self.replicated)
    with sharding.use_mesh(self.mesh, self.rules):
      return self._train_step.lower(self.abstract_params, self.abstract_opt_state,
                                    self.abstract_batch(rows, seq_len), step)

  def train_step(self, params, opt_state, batch, step: int):
    """One update; `params` and `opt_state` are donated (do not reuse them)."""
    with sharding.use_mesh(self.mesh, self.rules):
      return self._train_step(params, opt_state, batch, jnp.asarray(step, jnp.int32))

  def eval_step(self, params, batch, index: int):
    with sharding.use_mesh(self.mesh, self.rules):
      return self._eval_step(params, batch, jnp.asarray(index, jnp.int32))

  def model(self, params) -> nnx.Module:
    return nnx.merge(self.graphdef, params)


def init_params_from_hf(trainer: Trainer, directory: str, tokenizer: Tokenizer) -> dict:
  """Loads a HF Qwen3 folder (or a shipped model's, by name: `loading.resolve`) and adds
  the special tokens' rows (`add_special_token_rows`).

  A folder that is already a ReFusion checkpoint (its config.json names the
  tokenizer's mask id) keeps its trained special rows; only a vocabulary
  resize, if any, applies.
  """
  model_config = trainer.model_config
  hf_config, hf_model = hf.load(loading.resolve(directory), mesh=trainer.mesh,
                                rules=trainer.rules, dtype=model_config.param_dtype,
                                scan_layers=model_config.scan_layers)
  if hf_config.tie_embeddings != model_config.tie_embeddings:
    raise ValueError(f"init_from_hf {directory!r}: tie_embeddings={hf_config.tie_embeddings} "
                     f"but the model config says {model_config.tie_embeddings}")
  params = nnx.to_pure_dict(nnx.split(hf_model)[1])
  already = hf_config.mask_token_id == tokenizer.mask_id
  reset = () if already else tuple(i for i in (tokenizer.bos_id, tokenizer.mask_id)
                                     if i is not None)
  runtime.note("train", "init_from_hf: %s, vocab %d -> %d, special rows reset to the mean: %s",
               directory, hf_config.vocab_size, model_config.vocab_size, reset)
  resize = functools.partial(add_special_token_rows, vocab_size=model_config.vocab_size,
                             reset_ids=reset)
  return jax.jit(resize, out_shardings=trainer.param_shardings)(params)
