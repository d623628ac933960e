"""D2F's asymmetric distillation: a LoRA adapter that teaches an MDM block-causal attention.

  python -m refusion_jax.distill --config=configs/d2f_tiny.py \\
      --config.base_dir=MDM_MODEL_DIR --config.output_dir=OUT

ALGORITHM.md "Table 1's baselines", D2F. The student is the base MDM with a LoRA
adapter on its attention projections (`refusion_jax.lora`, qwix) under *block-causal*
attention (`masks.block_causal_btt`); the teacher is the same weights with the adapter
off under full attention, on the same noised sequence. Each sample's response (EOS
padded to the row's end, as D2F's data is) is cut into blocks of `block_size` from its
first token; block 0's mask ratio is p_0 ~ U(p_min, p_max), each later block adds
U(0, (p_max - p_0) / (blocks - 1)), so the ratios never decrease and stay in
[p_min, p_max]; tokens are masked independently at their block's ratio, the prompt
never. The loss at each masked position is the cross-entropy of the student's softmax
against the teacher's, divided by that position's ratio, averaged over the batch's
masked positions (`distill_loss`); a model with shifted logits (Dream) is read one
position left, as it decodes.

Only the adapter trains (the gradient is taken with respect to the LoRA parameters
alone: the base weights are constants of the step) and only the adapter is saved. The
run is a task of the training loop (`training.loop`): `OUT/checkpoints/<step>/` are its
checkpoints (the adapter's factors and their optimizer state, the step and what a
resume must match; a step's rows are drawn from (seed, step), so there is no data
position to keep); a rerun resumes from the newest; SIGTERM or Ctrl-C saves the step in
progress and stops (exit status 75 or 130). `OUT/adapter/` is the final PEFT folder,
which `sample`, `evaluate` and `serve` merge into the base with `--config.adapter_dir`.
Metrics go to `OUT/metrics.jsonl`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app
from flax import nnx
from ml_collections import config_flags

from refusion_jax import data, entry_flags, loading, lora, masks, runtime
from refusion_jax.training import loop
from refusion_jax.training.outputs import CHECKPOINT_DIR

# --------------------------------------------------------------------------- the objective


def block_ratios(u0, u_bk, p_min: float, p_max: float, blocks_b):
  """Mask ratios `[B, K]` of each sample's response blocks: p_0 = p_min + (p_max - p_min)
  u0, then p_j = p_{j-1} + u_j (p_max - p_0) / (blocks - 1) (only the sample's `blocks_b`
  first blocks are meaningful); clipped to 1."""
  p0 = p_min + (p_max - p_min) * u0
  step = (p_max - p0) / jnp.maximum(blocks_b - 1, 1).astype(jnp.float32)
  inc = u_bk * step[:, None]
  inc = inc.at[:, 0].set(0.0)
  return jnp.minimum(p0[:, None] + jnp.cumsum(inc, axis=1), 1.0)


def noise(tokens_bt, prompt_len_b, response_len_b, rng, *, mask_id: int, block_size: int,
          p_min: float, p_max: float):
  """D2F's noising of one-sample rows: `(input ids, masked, ratio per token, block of each
  token (-1 outside the response))`."""
  b, l = tokens_bt.shape
  k = -(-l // block_size)
  offset_bt = jnp.arange(l)[None] - prompt_len_b[:, None]
  in_resp_bt = (offset_bt >= 0) & (offset_bt < response_len_b[:, None])
  block_bt = jnp.where(in_resp_bt, offset_bt // block_size, -1)
  k0, k1, k2 = jax.random.split(rng, 3)
  blocks_b = -(-response_len_b // block_size)
  ratios_bk = block_ratios(jax.random.uniform(k0, (b,)), jax.random.uniform(k1, (b, k)),
                           p_min, p_max, blocks_b)
  p_bt = jnp.where(in_resp_bt, jnp.take_along_axis(ratios_bk, jnp.maximum(block_bt, 0), axis=1),
                   0.0)
  masked_bt = in_resp_bt & (jax.random.uniform(k2, (b, l)) < p_bt)
  return jnp.where(masked_bt, mask_id, tokens_bt), masked_bt, p_bt, block_bt


def soft_cross_entropy(student_logits_btv, teacher_logits_btv):
  """`-sum_v softmax(teacher)_v log softmax(student)_v` per token, float32."""
  t = jax.nn.softmax(teacher_logits_btv.astype(jnp.float32), axis=-1)
  return -jnp.sum(t * jax.nn.log_softmax(student_logits_btv.astype(jnp.float32), axis=-1), -1)


def loss_from_logits(student_logits_btv, teacher_logits_btv, masked_bt, p_bt):
  """The mean over masked positions of soft cross-entropy / ratio; `(loss, masked count)`."""
  ce_bt = soft_cross_entropy(student_logits_btv, teacher_logits_btv)
  n = jnp.sum(masked_bt)
  total = jnp.sum(jnp.where(masked_bt, ce_bt / jnp.maximum(p_bt, 1e-6), 0.0))
  return total / jnp.maximum(n, 1).astype(jnp.float32), n


def distill_loss(student, teacher, tokens_bt, prompt_len_b, response_len_b, rng, *,
                 mask_id: int, block_size: int, p_min: float, p_max: float):
  """`(loss, metrics)` of one batch of one-sample rows (jittable). `student` runs
  block-causally, `teacher` (the same weights without the adapter) with full attention
  among each row's real tokens; the teacher is a constant of the gradient."""
  b, l = tokens_bt.shape
  ids_bt, masked_bt, p_bt, _ = noise(tokens_bt, prompt_len_b, response_len_b, rng,
                                     mask_id=mask_id, block_size=block_size, p_min=p_min,
                                     p_max=p_max)
  real_bt = jnp.arange(l)[None] < (prompt_len_b + response_len_b)[:, None]
  both_btt = real_bt[:, None, :] & real_bt[:, :, None]
  eye = jnp.eye(l, dtype=bool)[None]
  student_mask = (masks.block_causal_btt(prompt_len_b, block_size, l) & both_btt) | eye
  teacher_mask = both_btt | eye
  positions = jnp.broadcast_to(jnp.arange(l, dtype=jnp.int32)[None], (b, l))
  s = student(ids_bt, positions, attention_mask_btt=student_mask)
  t = jax.lax.stop_gradient(teacher(ids_bt, positions, attention_mask_btt=teacher_mask))
  if getattr(student.config, "shift_logits", False):
    # Dream: token i is read from position i - 1's output (the prompt is never masked, so
    # position 0's own output is never used).
    s = jnp.concatenate([s[:, :1], s[:, :-1]], axis=1)
    t = jnp.concatenate([t[:, :1], t[:, :-1]], axis=1)
  loss, n = loss_from_logits(s, t, masked_bt, p_bt)
  return loss, {"loss": loss, "masked_tokens": n.astype(jnp.float32)}


# --------------------------------------------------------------------------- data


def encode_rows(examples, tokenizer, seq_len: int, eos_id: int):
  """`(tokens [N, L], prompt_len [N], response_len [N])`: chat-template prompt, answer +
  EOS, the rest of the row EOS (D2F's padding, part of the response); samples longer
  than the row are dropped (counted)."""
  rows, plens, rlens, dropped = [], [], [], 0
  for ex in examples:
    prompt = tokenizer.encode_prompt(ex["query"], enable_thinking=False)
    answer = tokenizer.encode(ex["response"]) + [eos_id]
    if len(prompt) + len(answer) > seq_len or not prompt:
      dropped += 1
      continue
    row = prompt + answer + [eos_id] * (seq_len - len(prompt) - len(answer))
    rows.append(row)
    plens.append(len(prompt))
    rlens.append(seq_len - len(prompt))
  if not rows:
    raise ValueError(f"no training sample fits config.seq_len={seq_len} ({dropped} dropped)")
  return (np.asarray(rows, np.int32), np.asarray(plens, np.int32), np.asarray(rlens, np.int32),
          dropped)


# --------------------------------------------------------------------------- the run


def check_config(c, need_dirs: bool = True) -> None:
  """Every bad field of the config is one ValueError line, before any loading
  (`need_dirs=False`: the folders are filled in later)."""
  if not c.base_dir:
    raise ValueError("--config.base_dir is required: the MDM model folder to adapt")
  if need_dirs:
    loading.model_dir(c.base_dir, "--config.base_dir")  # a shipped name, or a folder
  if not c.output_dir:
    raise ValueError("--config.output_dir is required")
  for path in c.train_files:
    if not os.path.isfile(path):
      raise ValueError(f"--config.train_files: {path!r} is not a file")
  for name in ("steps", "batch_size", "seq_len", "block_size", "lora_rank", "save_every"):
    v = c[name]
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
      raise ValueError(f"--config.{name} must be a positive int, got {v!r}")
  if not 0.0 < c.p_min <= c.p_max <= 1.0:
    raise ValueError(f"--config.p_min={c.p_min} and p_max={c.p_max} must satisfy "
                     "0 < p_min <= p_max <= 1")
  if not c.lora_alpha > 0:
    raise ValueError(f"--config.lora_alpha must be > 0, got {c.lora_alpha!r}")
  if not 0.0 <= c.lora_dropout < 1.0:
    raise ValueError(f"--config.lora_dropout must lie in [0, 1), got {c.lora_dropout!r}")
  if not c.learning_rate > 0:
    raise ValueError(f"--config.learning_rate must be > 0, got {c.learning_rate!r}")


def make_optimizer(c):
  """AdamW (D2F's betas and weight decay) after global-norm clipping, at a constant rate."""
  return optax.chain(optax.clip_by_global_norm(c.grad_clip),
                     optax.adamw(c.learning_rate, b1=c.b1, b2=c.b2, eps=1e-8,
                                 weight_decay=c.weight_decay))


def make_train_step(graphdef, tx, *, seed: int, **loss_kwargs):
  """`step(lora_params, rest, opt_state, batch, step) -> (lora_params, opt_state, metrics)`:
  one update of the LoRA factors. The teacher is the same graph with the factors zeroed
  (B = 0: the adapter's contribution is zero; no second copy of the base weights)."""

  def loss_of(lora_params, rest, batch, rng):
    student = nnx.merge(graphdef, lora_params, rest)
    teacher = nnx.merge(graphdef, jax.tree.map(jnp.zeros_like, lora_params), rest)
    return distill_loss(student, teacher, *batch, rng, **loss_kwargs)

  def step(lora_params, rest, opt_state, batch, step):
    rng = jax.random.fold_in(jax.random.key(seed), step)
    (_, metrics), grads = jax.value_and_grad(loss_of, has_aux=True)(lora_params, rest, batch,
                                                                    rng)
    updates, opt_state = tx.update(grads, opt_state, lora_params)
    return optax.apply_updates(lora_params, updates), opt_state, dict(
        metrics, grad_norm=optax.tree.norm(grads))

  return step


@dataclasses.dataclass(frozen=True)
class Rows:
  """The training rows of `encode_rows`: tokens [N, L], prompt and response lengths [N]."""
  tokens: np.ndarray
  prompt_len: np.ndarray
  response_len: np.ndarray

  def batch(self, seed: int, step: int, size: int):
    """Step `step`'s rows, drawn from (seed, step): a step done again draws the same."""
    n = len(self.tokens)
    pick = np.random.default_rng([seed, step]).choice(n, size=size, replace=n < size)
    return (jnp.asarray(self.tokens[pick]), jnp.asarray(self.prompt_len[pick]),
            jnp.asarray(self.response_len[pick]))


class DistillTask(loop.Task):
  """The distillation on the training loop: the state is the adapter's factors and their
  optimizer state; the base weights are constants of the step, never saved."""

  label = "distill"

  def __init__(self, c, model_config, student, rows: Rows):
    self.c, self.total_steps, self.rows = c, int(c.steps), rows
    self._model_config = model_config
    graphdef, lora_params, self._rest = nnx.split(student, nnx.LoRAParam, ...)
    tx = make_optimizer(c)
    self._initial = {"params": lora_params, "opt_state": tx.init(lora_params)}
    self._train_step = jax.jit(make_train_step(
        graphdef, tx, seed=int(c.seed), mask_id=model_config.mask_token_id,
        block_size=c.block_size, p_min=c.p_min, p_max=c.p_max))

  def meta(self) -> dict:
    # What the saved factors mean: the base they adapt, their rank and scale, the draws.
    return {"seed": int(self.c.seed), "lora_rank": int(self.c.lora_rank),
            "lora_alpha": float(self.c.lora_alpha),
            "model_config": dataclasses.asdict(self._model_config)}

  def abstract_state(self):
    return loop.abstract_of(self._initial)

  def init_state(self):
    return self._initial

  def step(self, state, step, stop):
    batch = self.rows.batch(int(self.c.seed), step, int(self.c.batch_size))
    params, opt_state, metrics = self._train_step(state["params"], self._rest,
                                                  state["opt_state"], batch, jnp.int32(step))
    return ({"params": params, "opt_state": opt_state},
            {k: float(v) for k, v in jax.device_get(metrics).items()})


def _refuse_old_checkpoints(output_dir: str) -> None:
  """Checkpoints of the earlier format (`step_N` PEFT folders) cannot be resumed from."""
  folder = os.path.join(output_dir, CHECKPOINT_DIR)
  old = sorted(n for n in os.listdir(folder) if n.startswith("step_")) if os.path.isdir(
      folder) else []
  if old:
    raise ValueError(f"--config.output_dir={output_dir!r} holds checkpoints of an earlier "
                     f"format ({old[-1]} in {folder}), which this version does not resume; "
                     "use a new output_dir, or remove them to start over")


def _load(c):
  """`(model_config, base model, tokenizer)` of `c.base_dir`, checked for D2F."""
  model_config, base = loading.load_model(c.base_dir, scan_layers=False, flag="--config.base_dir")
  if model_config.attention != "bidirectional":
    raise ValueError(f"{c.base_dir}: D2F adapts an MDM (attention='bidirectional'), got "
                     f"{model_config.attention!r}")
  if model_config.mask_token_id is None or model_config.eos_token_id is None:
    raise ValueError(f"{c.base_dir}: the model config needs mask_token_id and eos_token_id")
  tokenizer = loading.load_tokenizer(c.base_dir, model_config, c.tokenizer_dir,
                                     flag="--config.base_dir")
  return model_config, base, tokenizer


def _save_final_adapter(c, model_config, student) -> str:
  """`OUT/adapter`, the PEFT folder, written beside and renamed into place."""
  final = os.path.join(c.output_dir, "adapter")
  tmp = final + ".tmp"
  shutil.rmtree(tmp, ignore_errors=True)
  lora.save_adapter(tmp, model_config, lora.extract(student, c.lora_alpha),
                    base_model=c.base_dir, dropout=c.lora_dropout)
  shutil.rmtree(final, ignore_errors=True)
  os.replace(tmp, final)
  return final


def run(c, progress: bool = True) -> dict[str, Any]:
  """Trains the adapter; returns `{"adapter_dir", "steps", "final_loss", "seconds",
  "dropped"}`. SIGTERM or Ctrl-C raises `loop.Stopped` once its checkpoint is saved."""
  check_config(c)
  _refuse_old_checkpoints(c.output_dir)
  model_config, base, tokenizer = _load(c)
  tokens, plens, rlens, dropped = encode_rows(
      list(data.iter_examples(list(c.train_files))), tokenizer, c.seq_len,
      model_config.eos_token_id)
  student = lora.apply(base, c.lora_rank, c.lora_alpha, dropout=c.lora_dropout, seed=c.seed)
  task = DistillTask(c, model_config, student, Rows(tokens, plens, rlens))
  os.makedirs(c.output_dir, exist_ok=True)
  t0 = time.perf_counter()
  result = loop.run_loop(task, loop.LoopOptions(workdir=c.output_dir, save_every=c.save_every,
                                                progress=progress))
  nnx.update(student, result.state["params"])
  return {"steps": result.step, "final_loss": result.metrics.get("loss", math.nan),
          "seconds": time.perf_counter() - t0, "dropped": dropped,
          "adapter_dir": _save_final_adapter(c, model_config, student)}


def main(argv, config_flag) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  c = config_flag.value
  with loop.stops_reported("refusion_jax.distill"):
    result = run(c)
  adapter = result["adapter_dir"]
  runtime.note("distill", f"wrote {adapter} (decode with it: " + runtime.sample_command(
      c.base_dir, f"--config.adapter_dir={adapter}", "--config.decode.method=d2f") + ")")
  print(json.dumps(result))


if __name__ == "__main__":

  _CONFIG = config_flags.DEFINE_config_file(
      "config", None, "Distillation config file (configs/d2f_tiny.py).", lock_config=True)
  # Bad settings and inputs (config fields, folders, adapters) are ValueErrors: one line.
  entry_flags.run_program(lambda argv: main(argv, _CONFIG), "refusion_jax.distill",
                          user_errors=(ValueError, FileNotFoundError))
