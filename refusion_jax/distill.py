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
alone: the base weights are constants of the step) and only the adapter is saved:
`OUT/checkpoints/step_N/` holds the adapter as a PEFT folder, the optimizer state and
the step (written to a temporary folder and renamed: never half-written); a rerun
resumes from the newest; SIGTERM saves and exits. `OUT/adapter/` is the final PEFT
folder, which `sample`, `evaluate` and `serve` merge into the base with
`--config.adapter_dir`. Metrics go to `OUT/metrics.jsonl`.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import sys
import time
from typing import Any

import numpy as np

from refusion_jax import fileio

_STEP_DIR = "step_{:08d}"


# --------------------------------------------------------------------------- the objective


def block_ratios(u0, u_bk, p_min: float, p_max: float, blocks_b):
  """Mask ratios `[B, K]` of each sample's response blocks: p_0 = p_min + (p_max - p_min)
  u0, then p_j = p_{j-1} + u_j (p_max - p_0) / (blocks - 1) (only the sample's `blocks_b`
  first blocks are meaningful); clipped to 1."""
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  p0 = p_min + (p_max - p_min) * u0
  step = (p_max - p0) / jnp.maximum(blocks_b - 1, 1).astype(jnp.float32)
  inc = u_bk * step[:, None]
  inc = inc.at[:, 0].set(0.0)
  return jnp.minimum(p0[:, None] + jnp.cumsum(inc, axis=1), 1.0)


def noise(tokens_bt, prompt_len_b, response_len_b, rng, *, mask_id: int, block_size: int,
          p_min: float, p_max: float):
  """D2F's noising of one-sample rows: `(input ids, masked, ratio per token, block of each
  token (-1 outside the response))`."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
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
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  t = jax.nn.softmax(teacher_logits_btv.astype(jnp.float32), axis=-1)
  return -jnp.sum(t * jax.nn.log_softmax(student_logits_btv.astype(jnp.float32), axis=-1), -1)


def loss_from_logits(student_logits_btv, teacher_logits_btv, masked_bt, p_bt):
  """The mean over masked positions of soft cross-entropy / ratio; `(loss, masked count)`."""
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  ce_bt = soft_cross_entropy(student_logits_btv, teacher_logits_btv)
  n = jnp.sum(masked_bt)
  total = jnp.sum(jnp.where(masked_bt, ce_bt / jnp.maximum(p_bt, 1e-6), 0.0))
  return total / jnp.maximum(n, 1).astype(jnp.float32), n


def distill_loss(student, teacher, tokens_bt, prompt_len_b, response_len_b, rng, *,
                 mask_id: int, block_size: int, p_min: float, p_max: float):
  """`(loss, metrics)` of one batch of one-sample rows (jittable). `student` runs
  block-causally, `teacher` (the same weights without the adapter) with full attention
  among each row's real tokens; the teacher is a constant of the gradient."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  from refusion_jax import masks  # pylint: disable=import-outside-toplevel
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


# --------------------------------------------------------------------------- checkpoints


def latest_checkpoint(directory: str) -> str | None:
  ckpt = os.path.join(directory, "checkpoints")
  if not os.path.isdir(ckpt):
    return None
  steps = sorted(d for d in os.listdir(ckpt) if d.startswith("step_") and d[5:].isdigit())
  return os.path.join(ckpt, steps[-1]) if steps else None


def save_checkpoint(directory: str, step: int, model_config, lora_model, alpha: float,
                    opt_state, keep: int = 2) -> str:
  """The adapter (PEFT folder), the optimizer state and the step, written beside and
  renamed into place; older checkpoints beyond `keep` removed."""
  import jax  # pylint: disable=import-outside-toplevel

  from refusion_jax import lora  # pylint: disable=import-outside-toplevel
  ckpt = os.path.join(directory, "checkpoints")
  final = os.path.join(ckpt, _STEP_DIR.format(step))
  tmp = final + ".tmp"
  shutil.rmtree(tmp, ignore_errors=True)
  lora.save_adapter(tmp, model_config, lora.extract(lora_model, alpha))
  leaves = [np.asarray(x) for x in jax.tree.leaves(jax.device_get(opt_state))]
  np.savez(os.path.join(tmp, "opt_state.npz"), *leaves)
  fileio.write_json_atomic(os.path.join(tmp, "state.json"), {"step": step})
  shutil.rmtree(final, ignore_errors=True)
  os.replace(tmp, final)
  for old in sorted(d for d in os.listdir(ckpt) if d.startswith("step_")
                    and not d.endswith(".tmp"))[:-keep]:
    shutil.rmtree(os.path.join(ckpt, old), ignore_errors=True)
  return final


def restore_opt_state(path: str, like):
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  with np.load(os.path.join(path, "opt_state.npz")) as f:
    leaves = [f[f"arr_{i}"] for i in range(len(f.files))]
  treedef = jax.tree.structure(like)
  if treedef.num_leaves != len(leaves):
    raise ValueError(f"{path}: optimizer state has {len(leaves)} arrays, this config's "
                     f"optimizer {treedef.num_leaves}")
  return jax.tree.unflatten(treedef, [jnp.asarray(x) for x in leaves])


# --------------------------------------------------------------------------- the run


def check_config(c, need_dirs: bool = True) -> None:
  """Every bad field of the config is one ValueError line, before any loading
  (`need_dirs=False`: the folders are filled in later)."""
  if not c.base_dir:
    raise ValueError("--config.base_dir is required: the MDM model folder to adapt")
  if need_dirs and not os.path.isdir(c.base_dir):
    raise ValueError(f"--config.base_dir={c.base_dir!r} is not a folder")
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


def run(c, progress: bool = True) -> dict[str, Any]:
  """Trains the adapter; returns `{"adapter_dir", "steps", "final_loss", "seconds"}`."""
  check_config(c)
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import optax  # pylint: disable=import-outside-toplevel
  from flax import nnx  # pylint: disable=import-outside-toplevel

  from refusion_jax import data, loading, lora  # pylint: disable=import-outside-toplevel
  model_config, base = loading.load_model(c.base_dir, scan_layers=False, flag="--config.base_dir")
  if model_config.attention != "bidirectional":
    raise ValueError(f"{c.base_dir}: D2F adapts an MDM (attention='bidirectional'), got "
                     f"{model_config.attention!r}")
  if model_config.mask_token_id is None or model_config.eos_token_id is None:
    raise ValueError(f"{c.base_dir}: the model config needs mask_token_id and eos_token_id")
  tokenizer = loading.load_tokenizer(c.base_dir, model_config, c.tokenizer_dir,
                                     flag="--config.base_dir")
  tokens, plens, rlens, dropped = encode_rows(
      list(data.iter_examples(list(c.train_files))), tokenizer, c.seq_len,
      model_config.eos_token_id)

  student = lora.apply(base, c.lora_rank, c.lora_alpha, dropout=c.lora_dropout, seed=c.seed)
  graphdef, lora_params, rest = nnx.split(student, nnx.LoRAParam, ...)
  tx = optax.chain(optax.clip_by_global_norm(c.grad_clip),
                   optax.adamw(c.learning_rate, b1=c.b1, b2=c.b2, eps=1e-8,
                               weight_decay=c.weight_decay))
  opt_state = tx.init(lora_params)
  start = 0
  resume = latest_checkpoint(c.output_dir)
  if resume:
    lora.load_into(student, lora.read_adapter(resume, model_config))
    graphdef, lora_params, rest = nnx.split(student, nnx.LoRAParam, ...)
    opt_state = restore_opt_state(resume, opt_state)
    start = int(fileio.read_json(os.path.join(resume, "state.json"))["step"])
  kwargs = dict(mask_id=model_config.mask_token_id, block_size=c.block_size, p_min=c.p_min,
                p_max=c.p_max)

  def loss_of(lp, rest, batch, rng):
    s_model = nnx.merge(graphdef, lp, rest)
    # The teacher: the same weights, the adapter's contribution zero (B = 0).
    zero = jax.tree.map(lambda x: jnp.zeros_like(x), lp)
    t_model = nnx.merge(graphdef, zero, rest)
    return distill_loss(s_model, t_model, *batch, rng, **kwargs)

  @jax.jit
  def train_step(lp, rest, opt_state, batch, step):
    rng = jax.random.fold_in(jax.random.key(c.seed), step)
    (loss, metrics), grads = jax.value_and_grad(loss_of, has_aux=True)(lp, rest, batch, rng)
    updates, opt_state = tx.update(grads, opt_state, lp)
    return optax.apply_updates(lp, updates), opt_state, dict(
        metrics, grad_norm=optax.tree.norm(grads))

  stop = {"flag": False}
  previous = signal.signal(signal.SIGTERM, lambda *_: stop.update(flag=True))
  os.makedirs(c.output_dir, exist_ok=True)
  metrics_path = os.path.join(c.output_dir, "metrics.jsonl")
  n = tokens.shape[0]
  bar = None
  if progress:
    from tqdm import tqdm  # pylint: disable=import-outside-toplevel
    bar = tqdm(total=c.steps, initial=start, desc="distill", file=sys.stderr)
  t0, loss = time.perf_counter(), math.nan
  step = start
  try:
    while step < c.steps:
      order = np.random.default_rng([c.seed, step]).choice(n, size=c.batch_size,
                                                              replace=n < c.batch_size)
      batch = (jnp.asarray(tokens[order]), jnp.asarray(plens[order]), jnp.asarray(rlens[order]))
      lora_params, opt_state, metrics = train_step(lora_params, rest, opt_state, batch,
                                                   jnp.int32(step))
      step += 1
      loss = float(metrics["loss"])
      with open(metrics_path, "a", encoding="utf-8") as f:
        f.write(json.dumps({"step": step, **{k: float(v) for k, v in metrics.items()}}) + "\n")
      if bar is not None:
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.4f}")
      if step % c.save_every == 0 or step == c.steps or stop["flag"]:
        nnx.update(student, lora_params)
        save_checkpoint(c.output_dir, step, model_config, student, c.lora_alpha, opt_state)
      if stop["flag"]:
        break
  finally:
    signal.signal(signal.SIGTERM, previous)
    if bar is not None:
      bar.close()
  nnx.update(student, lora_params)
  out = {"steps": step, "final_loss": loss, "seconds": time.perf_counter() - t0,
         "dropped": dropped, "adapter_dir": None}
  if step >= c.steps:
    final = os.path.join(c.output_dir, "adapter")
    tmp = final + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    lora.save_adapter(tmp, model_config, lora.extract(student, c.lora_alpha),
                      base_model=c.base_dir, dropout=c.lora_dropout)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    out["adapter_dir"] = final
  return out


def main(argv, config_flag) -> None:
  if len(argv) > 1:
    from absl import app  # pylint: disable=import-outside-toplevel
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  result = run(config_flag.value)
  print(json.dumps(result))


if __name__ == "__main__":
  from ml_collections import config_flags  # pylint: disable=import-outside-toplevel

  from refusion_jax import entry_flags  # pylint: disable=import-outside-toplevel
  _CONFIG = config_flags.DEFINE_config_file(
      "config", None, "Distillation config file (configs/d2f_tiny.py).", lock_config=True)
  # Bad settings and inputs (config fields, folders, adapters) are ValueErrors: one line.
  entry_flags.run_program(lambda argv: main(argv, _CONFIG), "refusion_jax.distill",
                          user_errors=(ValueError, FileNotFoundError))
