"""A drafter trained for acceptance: draft adapters taught what the causal head emits.

  python -m refusion_jax.drafter --config=configs/drafter_tiny.py \\
      --config.model_dir=REFUSION_MODEL_DIR --config.output_dir=OUT

Under lossless decoding (`decode.verify='lossless'`) the answer is the model's causal
head's; the drafts decide only how many passes it takes (a draft that equals the causal
pick after it is made final in the pass that checks it). This trains the drafts alone:

1. **The model's own answers**: its greedy AR answers (`decode.method='ar'`, what
   lossless decoding returns) to `num_prompts` prompts of the training file, decoded
   through the engine (`OUT/answers.jsonl`, read again by a resumed run).
2. **The draft adapters** (`ModelConfig.draft_rank`, model.py's `MLP`): a low-rank update
   of every layer's MLP output at the entries whose input is the mask token, zero at the
   start. In a decoding pass a token entry never attends to a mask entry (tokens are fed
   before masks, causally), so the adapters change what the masks draft and never a
   causal pick: **every answer, greedy or sampled, is the model's own, bit for bit**
   (tested).
3. **The loss** (`draft_loss`): each [prompt | the model's answer] row cut after a random
   answer token, the `window - 1` tokens after it masked, the cross-entropy of each mask
   against the token it hides: the layout of lossless decoding's passes in which every
   draft comes from a mask (the first, and the fresh plans after a correction). The
   gradient is taken with respect to the adapters alone (every other weight is a
   constant of the step).

A task of the training loop (`training.loop`): `OUT/checkpoints/<step>/` (the adapters,
their optimizer state, the step; a step's rows are drawn from (seed, step)), a rerun
resumes from the newest, SIGTERM or Ctrl-C saves and stops (exit status 75 or 130).
`OUT/final_model/` is the model with its adapters, a model folder every decoder reads;
`OUT/metrics.jsonl` one line per step.
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

from refusion_jax import checkpoint, distill, entry_flags, fileio, loading, runtime
from refusion_jax.decode import engine
from refusion_jax.decode.settings import DecodeConfig
from refusion_jax.model import Transformer
from refusion_jax.rl import trainer as rl_trainer
from refusion_jax.training import loop
from refusion_jax.training.outputs import FINAL_MODEL_DIR

ANSWERS_FILE = "answers.jsonl"
ADAPTER_PARAMS = ("draft_a", "draft_b")


def check_config(c, need_model: bool = True) -> None:
  """Every bad field of the config is one ValueError line, before any loading
  (`need_model=False`: the folders and files are not read)."""
  if need_model:
    if not c.model_dir:
      raise ValueError("--config.model_dir is required: the ReFusion model whose drafts to "
                       "train (a shipped name, a refusion_jax or a HF folder)")
    loading.model_dir(c.model_dir)
    if not c.output_dir:
      raise ValueError("--config.output_dir is required")
    if not c.train_file or not os.path.isfile(c.train_file):
      raise ValueError(f"--config.train_file={c.train_file!r} is not a file")
  for name in ("draft_rank", "num_prompts", "gen_length", "steps", "batch_size", "save_every",
               "engine_rows"):
    v = c[name]
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
      raise ValueError(f"--config.{name} must be a positive int, got {v!r}")
  if not isinstance(c.window, int) or isinstance(c.window, bool) or c.window < 2:
    raise ValueError(f"--config.window must be an int >= 2 (the head and at least one mask: "
                     f"the lossless window), got {c.window!r}")
  if not c.learning_rate > 0:
    raise ValueError(f"--config.learning_rate must be > 0, got {c.learning_rate!r}")


def self_answers(model, prompts: list[list[int]], gen_length: int, rows: int) -> list[list[int]]:
  """The model's greedy AR answer to each prompt (up to and including its stop token)."""
  dc = DecodeConfig(method="ar", gen_length=gen_length)
  out = engine.Decoder(model, dc).engine(rows).run(prompts)
  return [list(r.tokens) for r in out.results]


def encode_rows(prompts, answers, pad_id: int):
  """One-sample-per-row batch arrays: `tokens [N, L]` (prompt then answer, pad after),
  `prompt_len [N]`, `response_len [N]`; an empty answer is dropped."""
  keep = [(p, a) for p, a in zip(prompts, answers) if a]
  if not keep:
    raise ValueError("the model answered none of the prompts (every answer is empty)")
  width = max(len(p) + len(a) for p, a in keep)
  tokens = np.full((len(keep), width), pad_id, np.int32)
  for i, (p, a) in enumerate(keep):
    tokens[i, :len(p) + len(a)] = p + a
  return (tokens, np.asarray([len(p) for p, _ in keep], np.int32),
          np.asarray([len(a) for _, a in keep], np.int32))


def with_adapters(model, rank: int, seed: int):
  """A copy of `model` with draft adapters of `rank` (B = 0: they change nothing yet); a
  model that has them already keeps them (their rank must match)."""
  config = model.config
  if config.draft_rank:
    if config.draft_rank != rank:
      raise ValueError(f"the model has draft adapters of rank {config.draft_rank}; "
                       f"--config.draft_rank={rank} asks for another")
    return model
  out = Transformer(dataclasses.replace(config, draft_rank=rank), rngs=nnx.Rngs(seed))
  nnx.update(out, nnx.state(model, nnx.Param))
  return out


def _is_adapter(path, _) -> bool:
  return bool(path) and path[-1] in ADAPTER_PARAMS


def draft_loss(model, batch, rng, *, mask_id: int, window: int):
  """The drafts' loss on the model's own answers, in the layout a decoding pass feeds.

  Each row `[prompt | answer]` is cut after a random answer token h (the newest final
  token of a pass, its *head*); the `window - 1` tokens after it are replaced by masks
  and everything after them is never read (causal attention). A mask then sees the
  prompt, the answer up to h and the masks before it: lossless decoding's first pass
  and its fresh plans, where every draft comes from a mask. The loss is the mean
  cross-entropy of each mask's prediction of the token it hides (the model's greedy
  token: what its draft must equal to pass)."""
  tokens, plen, rlen = batch["tokens"], batch["prompt_len"], batch["response_len"]
  b, n = tokens.shape
  h = jax.random.randint(rng, (b,), 0, jnp.maximum(rlen, 1))  # the head, in the answer
  pos = jnp.arange(n)[None]
  first = (plen + h + 1)[:, None]
  masked = (pos >= first) & (pos < first + window - 1) & (pos < (plen + rlen)[:, None])
  ids = jnp.where(masked, mask_id, tokens)
  h_btd = model.hidden(ids, jnp.broadcast_to(pos, (b, n)))
  logits = model.unembed().logits(h_btd)
  ce = -jnp.take_along_axis(jax.nn.log_softmax(logits, -1), tokens[..., None], -1)[..., 0]
  count = jnp.maximum(masked.sum(), 1)
  loss = jnp.where(masked, ce, 0.0).sum() / count
  hit = (jnp.argmax(logits, -1) == tokens) & masked
  return loss, {"loss": loss, "draft_accuracy": hit.sum() / count,
                "masked": masked.sum().astype(jnp.float32)}


def make_train_step(graphdef, tx, *, seed: int, **loss_kwargs):
  """`step(adapters, rest, opt_state, batch, step) -> (adapters, opt_state, metrics)`: one
  update of the draft adapters; the rest of the weights are constants."""

  def loss_of(adapters, rest, batch, rng):
    return draft_loss(nnx.merge(graphdef, adapters, rest), batch, rng, **loss_kwargs)

  def step(adapters, rest, opt_state, batch, step):
    rng = jax.random.fold_in(jax.random.key(seed), step)
    (_, metrics), grads = jax.value_and_grad(loss_of, has_aux=True)(adapters, rest, batch, rng)
    updates, opt_state = tx.update(grads, opt_state, adapters)
    return optax.apply_updates(adapters, updates), opt_state, dict(
        metrics, grad_norm=optax.tree.norm(grads))

  return step


class DrafterTask(loop.Task):
  """The draft adapters' training on the loop: the state is the adapters and their
  optimizer state; the model's weights are constants of the step, saved only in the
  final model."""

  label = "drafter"

  def __init__(self, c, model, rows):
    self.c, self.total_steps, self.rows = c, int(c.steps), rows
    self._model_config = model.config
    graphdef, adapters, self._rest = nnx.split(model, _is_adapter, ...)
    tx = optax.chain(optax.clip_by_global_norm(c.grad_clip),
                     optax.adamw(c.learning_rate, b1=c.b1, b2=c.b2, weight_decay=0.0))
    self._initial = {"params": adapters, "opt_state": tx.init(adapters)}
    self._train_step = jax.jit(make_train_step(
        graphdef, tx, seed=int(c.seed), mask_id=model.config.mask_token_id,
        window=int(c.window)))

  def meta(self) -> dict:
    return {"seed": int(self.c.seed), "num_prompts": int(self.c.num_prompts),
            "model_config": dataclasses.asdict(self._model_config)}

  def abstract_state(self):
    return loop.abstract_of(self._initial)

  def init_state(self):
    return self._initial

  def step(self, state, step, stop):
    # Step `step`'s rows, drawn from (seed, step) as the distillation draws its own.
    tokens, plens, rlens = self.rows.batch(int(self.c.seed), step, int(self.c.batch_size))
    batch = {"tokens": tokens, "prompt_len": plens, "response_len": rlens}
    params, opt_state, metrics = self._train_step(state["params"], self._rest,
                                                  state["opt_state"], batch, jnp.int32(step))
    return ({"params": params, "opt_state": opt_state},
            {k: float(v) for k, v in jax.device_get(metrics).items()})

  def postfix(self, metrics):
    return {"loss": f"{metrics['loss']:.3f}", "right": f"{metrics['draft_accuracy']:.1%}"}


def _answers(c, model, prompts) -> list[list[int]]:
  """OUT/answers.jsonl when it holds these prompts' answers (a resumed run), else decoded
  now and written."""
  path = os.path.join(c.output_dir, ANSWERS_FILE)
  if os.path.isfile(path):
    rows = [json.loads(line) for line in open(path, encoding="utf-8")]
    if [r["prompt"] for r in rows] == prompts:
      return [r["answer"] for r in rows]
  answers = self_answers(model, prompts, int(c.gen_length), int(c.engine_rows))
  fileio.write_text_atomic(path, "".join(json.dumps({"prompt": p, "answer": a}) + "\n"
                                         for p, a in zip(prompts, answers)))
  return answers


def run(c, progress: bool = True) -> dict[str, Any]:
  """Trains the draft adapters; returns `{"final_model", "steps", "final_loss", "seconds",
  "samples"}`. SIGTERM or Ctrl-C raises `loop.Stopped` once its checkpoint is saved."""
  check_config(c)
  model_config, model = loading.load_model(c.model_dir, scan_layers=False)
  if model_config.mask_token_id is None or model_config.attention != "causal":
    raise ValueError(f"{c.model_dir}: draft adapters need a causal ReFusion model with a "
                     "mask_token_id")
  tokenizer = loading.load_tokenizer(c.model_dir, model_config, c.tokenizer_dir)
  _, prompts = rl_trainer.read_rows(c.train_file, "tasks", tokenizer, model_config,
                                    int(c.gen_length))
  prompts = prompts[:int(c.num_prompts)]
  os.makedirs(c.output_dir, exist_ok=True)
  t0 = time.perf_counter()
  answers = _answers(c, model, prompts)
  pad = 0 if model_config.pad_token_id is None else model_config.pad_token_id
  rows = distill.Rows(*encode_rows(prompts, answers, pad))
  student = with_adapters(model, int(c.draft_rank), int(c.seed))
  task = DrafterTask(c, student, rows)
  result = loop.run_loop(task, loop.LoopOptions(workdir=c.output_dir, save_every=c.save_every,
                                                progress=progress))
  nnx.update(student, result.state["params"])
  final = os.path.join(c.output_dir, FINAL_MODEL_DIR)
  checkpoint.save_model(final, student.config, student, overwrite=True)
  tok_src = os.path.join(loading.resolve(c.model_dir), "tokenizer.json")
  if os.path.isfile(tok_src):
    shutil.copy(tok_src, os.path.join(final, "tokenizer.json"))
  return {"final_model": final, "steps": result.step, "samples": len(rows.tokens),
          "final_loss": result.metrics.get("loss", math.nan),
          "seconds": time.perf_counter() - t0}


def main(argv, config_flag) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  c = config_flag.value
  with loop.stops_reported("refusion_jax.drafter"):
    result = run(c)
  runtime.note("drafter", f"wrote {result['final_model']} (decode it: " + runtime.sample_command(
      result["final_model"], "--config.decode.verify=lossless") + ")")
  print(json.dumps(result))


if __name__ == "__main__":

  _CONFIG = config_flags.DEFINE_config_file(
      "config", None, "Drafter config file (configs/drafter_tiny.py).", lock_config=True)
  entry_flags.run_program(lambda argv: main(argv, _CONFIG), "refusion_jax.drafter",
                          user_errors=(ValueError, FileNotFoundError))
