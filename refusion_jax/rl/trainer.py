"""GRPO on verifiable rewards for ReFusion, with exact trajectory log-probabilities.

  python -m refusion_jax.rl --config=configs/rl_tiny.py \\
      --config.model_dir=REFUSION_MODEL_DIR --config.output_dir=OUT

One step:

1. **Rollouts** by the engine (continuous batching, the compiled ReFusion program):
   `prompts_per_step` prompts drawn from the training file, `group_size` samples each,
   at `decode.temperature` with the infill's drafts sampled too (`decode.sample_drafts`)
   and every committed token's deciding pass recorded (`decode.record`). The rollout
   key is `fold_in(key(seed), step)`, so a step redone after a restart draws the same
   samples.
2. **Rewards** (`rl.rewards`): the completion's text (up to its stop token) against its
   row; optional speed term `reward * (1 + speed_weight * tokens / forwards)`.
3. **Advantages**, group-relative (`rl.grpo.group_advantages`).
4. **Policy step**: each rollout's exact log-probability under the current weights,
   one forward of its training layout (`rl.replay`); GRPO's clipped ratio and a
   k3 KL to the frozen reference (the starting weights; its log-probabilities from the
   same function) (`rl.grpo.policy_loss`); `num_iterations` optimizer steps on
   one batch of rollouts (the first one's old log-probabilities are the current ones),
   gradients accumulated over `micro_batch` rollouts; optax AdamW with clipping.

What is trained (`train_policy`): "model", every parameter of the model; "selector",
the small slot-selection policy alone (`decode.planner='policy'`, base frozen: the
rollouts draw each plan step's slots from it, `rl.selector` scores the choices);
or "both" (each rollout's tokens and plan choices in one log-likelihood). Checkpoints
(`OUT/checkpoints/<step>/`, orbax: parameters, optimizer state, step and seed; a
rerun resumes from the newest) are written every `save_every` steps; SIGTERM during a
rollout abandons that step's rollouts and saves the state before it (the step is
redone identically on resume), during an update it saves after it; either way the run
exits cleanly. `OUT/final_model/` is a model folder; `OUT/metrics.jsonl` holds one line
per step (reward mean / std, accuracy, KL, clip fraction, token entropy, tokens per
forward, timings; the plan's entropy with the selector) and `OUT/reward_failures.log` each
reward that raised or timed out; a trained selector's weights go to
`OUT/plan_weights.json`.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import sys
import time
from typing import Any, Callable

import numpy as np

from refusion_jax import fileio
from refusion_jax.config import PLAN_FEATURES
from refusion_jax.rl import rewards as rewards_lib


class _Stop(Exception):
  """SIGTERM arrived during a rollout."""


def check_config(c, need_model: bool = True) -> None:
  """Every bad field of the config is one ValueError line, before any loading
  (`need_model=False`: the folders and files are not read, as aot's)."""
  if need_model:
    if not c.model_dir:
      raise ValueError("--config.model_dir is required: the ReFusion model folder to train")
    if not os.path.isdir(c.model_dir):
      raise ValueError(f"--config.model_dir={c.model_dir!r} is not a folder")
    if not c.output_dir:
      raise ValueError("--config.output_dir is required")
    if not c.train_file or not os.path.isfile(c.train_file):
      raise ValueError(f"--config.train_file={c.train_file!r} is not a file")
  if c.reward not in rewards_lib.KINDS:
    raise ValueError(f"--config.reward must be one of {rewards_lib.KINDS}, got {c.reward!r}")
  for name in ("steps", "prompts_per_step", "micro_batch", "engine_rows", "save_every",
               "num_iterations"):
    v = c[name]
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
      raise ValueError(f"--config.{name} must be a positive int, got {v!r}")
  g = c.group_size
  if not isinstance(g, int) or isinstance(g, bool) or g < 2:
    raise ValueError(f"--config.group_size must be an int >= 2 (a group-relative advantage "
                     f"compares samples of one prompt), got {g!r}")
  if (c.prompts_per_step * g) % c.micro_batch:
    raise ValueError(f"--config.micro_batch={c.micro_batch} must divide the step's "
                     f"{c.prompts_per_step * g} rollouts (prompts_per_step x group_size)")
  if not c.beta >= 0:
    raise ValueError(f"--config.beta (the KL weight) must be >= 0, got {c.beta!r}")
  if not c.epsilon > 0 or not c.epsilon_high > 0:
    raise ValueError(f"--config.epsilon and epsilon_high must be > 0, got {c.epsilon!r}, "
                     f"{c.epsilon_high!r}")
  if not c.learning_rate > 0:
    raise ValueError(f"--config.learning_rate must be > 0, got {c.learning_rate!r}")
  if not c.speed_weight >= 0:
    raise ValueError(f"--config.speed_weight must be >= 0, got {c.speed_weight!r}")
  if not c.reward_timeout > 0:
    raise ValueError(f"--config.reward_timeout must be > 0 seconds, got {c.reward_timeout!r}")
  if c.train_policy not in TRAIN_POLICIES:
    raise ValueError(f"--config.train_policy must be one of {TRAIN_POLICIES}, got "
                     f"{c.train_policy!r}")
  try:
    decode_config_of(c)
  except (TypeError, ValueError) as e:
    raise ValueError(f"--config.decode: {e}") from None
  if not c.decode.temperature > 0:
    raise ValueError(f"--config.decode.temperature must be > 0 for RL rollouts (a greedy "
                     f"policy has no probabilities to learn from), got {c.decode.temperature!r}")


TRAIN_POLICIES = ("model", "selector", "both")


def decode_config_of(c):
  """The rollouts' decode: sampled drafts, recorded; with the selection policy trained,
  `planner='policy'` with its slots drawn."""
  from refusion_jax.config import DecodeConfig  # pylint: disable=import-outside-toplevel
  fields = dict(c.decode.to_dict(), method="refusion", sample_drafts=True, record=True)
  if c.train_policy in ("selector", "both"):
    fields.update(planner="policy", plan_sample=True)
  return DecodeConfig(**fields)


def read_rows(path: str, kind: str, tokenizer, model_config, gen_length: int):
  """The training file's rows and their prompts (token ids)."""
  rows, prompts = [], []
  for where, row in fileio.jsonl_rows(path):
    if not isinstance(row, dict):
      raise ValueError(f"{where}: expected a JSON object")
    row = rewards_lib.with_query(kind, row)
    if "prompt_ids" in row:
      ids = [int(x) for x in row["prompt_ids"]]
      if kind != "tasks" or "query" in row:
        rewards_lib.check_row(kind, row, where)
    else:
      rewards_lib.check_row(kind, row, where)
      ids = tokenizer.encode_prompt(str(row["query"]))
    if not ids:
      raise ValueError(f"{where}: the prompt is empty")
    rows.append(row)
    prompts.append(ids)
  if not rows:
    raise ValueError(f"{path}: no rows")
  longest = max(len(p) for p in prompts)
  if longest + gen_length > model_config.max_position_embeddings:
    raise ValueError(f"{path}: a prompt of {longest} tokens and decode.gen_length={gen_length} "
                     f"exceed the model's {model_config.max_position_embeddings} positions")
  return rows, prompts


def make_optimizer(c):
  """AdamW after global-norm clipping, at a constant rate."""
  import optax  # pylint: disable=import-outside-toplevel
  return optax.chain(optax.clip_by_global_norm(c.grad_clip),
                     optax.adamw(c.learning_rate, b1=c.b1, b2=c.b2, weight_decay=c.weight_decay))


def trajectory_logprobs(merge, p, batch, temperature: float, entropy: bool = False):
  """Each rollout's log-probabilities under the trained parts of `p`, concatenated along
  the last axis: `p["model"]` scores every committed token (`rl.replay`),
  `p["selector"]` every plan step's choice (`rl.selector`). Returns `(lp [B, T],
  valid [B, T], metrics)`."""
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  from refusion_jax.rl import replay, selector  # pylint: disable=import-outside-toplevel
  parts, valids, metrics = [], [], {}
  if "model" in p:
    lp, ent = replay.logprobs(merge(p["model"]), batch, temperature, entropy=True)
    valid = jnp.asarray(batch["valid"])
    parts.append(lp)
    valids.append(valid)
    if entropy:
      v = valid.astype(jnp.float32)
      metrics["token_entropy"] = (ent * v).sum() / jnp.maximum(v.sum(), 1.0)
  if "selector" in p:
    lp, valid = selector.choice_logprobs(p["selector"], batch["plan_feats"], batch["plan_fed"],
                                         batch["plan_chosen"])
    parts.append(lp)
    valids.append(valid)
    if entropy:
      metrics["plan_entropy"] = selector.plan_entropy(p["selector"], batch["plan_feats"],
                                                      batch["plan_fed"])
  return jnp.concatenate(parts, -1), jnp.concatenate(valids, -1), metrics


def make_loss(merge, *, temperature: float, epsilon: float, epsilon_high: float, beta: float):
  """GRPO's loss of a packed batch of rollouts under parameters `p` (a dict of the
  trained parts, `trajectory_logprobs`; `merge(p["model"])`: the model):
  `loss_of(p, batch, old_lp, ref_lp, adv) -> (loss, metrics)`; an `old_lp` or `ref_lp` of
  None is the current log-probabilities, constant (one update per batch of rollouts; no
  reference)."""
  import jax  # pylint: disable=import-outside-toplevel

  from refusion_jax.rl import grpo  # pylint: disable=import-outside-toplevel

  def loss_of(p, batch, old_lp, ref_lp, adv):
    lp, valid, extra = trajectory_logprobs(merge, p, batch, temperature, entropy=True)
    old = jax.lax.stop_gradient(lp) if old_lp is None else old_lp
    ref = jax.lax.stop_gradient(lp) if ref_lp is None else ref_lp
    loss, metrics = grpo.policy_loss(lp, old, ref, valid, adv, epsilon=epsilon,
                                     epsilon_high=epsilon_high, beta=beta)
    return loss, dict(metrics, **extra)

  return loss_of


def make_policy_grads(merge, **loss_kwargs):
  """`grads(p, batch, old_lp, ref_lp, adv) -> ((loss, metrics), gradients)` of
  `make_loss`'s loss (the trainer accumulates them over micro-batches)."""
  import jax  # pylint: disable=import-outside-toplevel
  return jax.value_and_grad(make_loss(merge, **loss_kwargs), has_aux=True)


def make_apply(tx):
  """`apply(params, opt_state, grads) -> (params, opt_state, gradient norm)`."""
  import optax  # pylint: disable=import-outside-toplevel

  def apply(params, opt_state, grads):
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, optax.tree.norm(grads)

  return apply


def make_policy_step(merge, tx, **loss_kwargs):
  """One policy update on one batch of rollouts, the reference's log-probabilities
  computed in it: `step(params, opt_state, ref_params, batch, adv) -> (params,
  opt_state, metrics)` over parameter dicts (`trajectory_logprobs`; `ref_params` None: no
  KL). What `aot --program=rl` compiles: the trainer's gradient and update
  (`make_policy_grads`, `make_apply`) in one program, for one micro-batch."""
  import jax  # pylint: disable=import-outside-toplevel
  grads_of, apply = make_policy_grads(merge, **loss_kwargs), make_apply(tx)

  def step(params, opt_state, ref_params, batch, adv):
    ref_lp = None
    if ref_params is not None:
      ref_lp = jax.lax.stop_gradient(trajectory_logprobs(
          merge, ref_params, batch, loss_kwargs["temperature"])[0])
    (_, metrics), grads = grads_of(params, batch, None, ref_lp, adv)
    params, opt_state, norm = apply(params, opt_state, grads)
    return params, opt_state, dict(metrics, grad_norm=norm)

  return step


def _checkpointer(directory: str):
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  return ocp.CheckpointManager(
      os.path.join(os.path.abspath(directory), "checkpoints"),
      options=ocp.CheckpointManagerOptions(max_to_keep=2, create=True,
                                           enable_async_checkpointing=False,
                                           cleanup_tmp_directories=True),
      item_handlers={"state": ocp.StandardCheckpointHandler(),
                     "meta": ocp.JsonCheckpointHandler()})


def _save(manager, step: int, params, opt_state, meta: dict) -> None:
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  manager.save(step, args=ocp.args.Composite(
      state=ocp.args.StandardSave({"params": params, "opt_state": opt_state}),
      meta=ocp.args.JsonSave(dict(meta, step=step))), force=True)
  manager.wait_until_finished()


def run(c, progress: bool = True, hook: Callable[[str, int, int], None] | None = None
        ) -> dict[str, Any]:
  """Trains; returns `{"steps", "final_model", "seconds", "last": last metrics}`.

  `hook(event, step, n)` (tests): called with ("rollout", step, rollouts finished) as
  rollouts finish and ("update", step, 0) before each update."""
  check_config(c)
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from flax import nnx  # pylint: disable=import-outside-toplevel

  from refusion_jax import checkpoint, loading  # pylint: disable=import-outside-toplevel
  from refusion_jax.decode import engine  # pylint: disable=import-outside-toplevel
  from refusion_jax.rl import grpo, replay  # pylint: disable=import-outside-toplevel

  dc = decode_config_of(c)
  model_config, model = loading.load_model(c.model_dir, scan_layers=False)
  if model_config.mask_token_id is None:
    raise ValueError(f"{c.model_dir}: ReFusion RL needs the model's mask_token_id")
  tokenizer = loading.load_tokenizer(c.model_dir, model_config, c.tokenizer_dir,  # loading's rule
                                     required=False)
  if tokenizer is None:
    raise ValueError(f"{c.model_dir}: no tokenizer.json there and --config.tokenizer_dir is "
                     "empty (the rewards read the answers' text)")
  tok_dir = c.tokenizer_dir or (c.model_dir if os.path.isfile(
      os.path.join(c.model_dir, "tokenizer.json")) else "")
  rows, prompts = read_rows(c.train_file, c.reward, tokenizer, model_config, dc.gen_length)
  dc.check_fits(model_config, max(len(p) for p in prompts))
  score_one = rewards_lib.reward_fn(c.reward)

  mesh, rules = None, None
  if c.mesh.shard:
    # Sharded as training shards: the parameters (and so the optimizer state, the
    # rollout engine's rows and KV cache, the policy step) over a (data, fsdp, tensor)
    # mesh of every device, by the model's logical axes.
    from refusion_jax import sharding  # pylint: disable=import-outside-toplevel
    rules = sharding.ShardingRules()
    mesh = sharding.make_mesh(data=c.mesh.data, fsdp=c.mesh.fsdp, tensor=c.mesh.tensor)
    state = nnx.state(model)
    nnx.update(model, jax.device_put(state, sharding.state_shardings(state, mesh, rules)))
  graphdef, model_params, rest = nnx.split(model, nnx.Param, ...)
  # The trained parts: the model's parameters and / or the selection policy's weights.
  params = {}
  if c.train_policy in ("model", "both"):
    params["model"] = model_params
  if c.train_policy in ("selector", "both"):
    params["selector"] = jnp.asarray(dc.plan_weights_on, jnp.float32)
  ref_params = jax.tree.map(jnp.copy, params) if c.beta > 0 else None
  tx = make_optimizer(c)
  opt_state = tx.init(params)
  os.makedirs(c.output_dir, exist_ok=True)
  manager = _checkpointer(c.output_dir)
  start = 0
  if manager.latest_step() is not None:
    import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
    step0 = manager.latest_step()
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct,
                            {"params": params, "opt_state": opt_state})
    restored = manager.restore(step0, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
    meta = dict(restored["meta"])
    if int(meta.get("seed", c.seed)) != c.seed:
      raise ValueError(f"{c.output_dir}: its checkpoints were written with seed "
                       f"{meta['seed']}, this config has seed {c.seed}")
    params, opt_state = restored["state"]["params"], restored["state"]["opt_state"]
    start = int(meta["step"])

  temperature = float(dc.temperature)
  mb = c.micro_batch

  def merge(p):
    return nnx.merge(graphdef, p, rest)

  def score(p, batch):
    return trajectory_logprobs(merge, p, batch, temperature)[0]


  def on_mesh(fn):
    """`fn` jitted, traced and run with the mesh's activation constraints."""
    jitted = jax.jit(fn)

    def call(*args):
      if mesh is None:
        return jitted(*args)
      from refusion_jax import sharding  # pylint: disable=import-outside-toplevel
      with sharding.use_mesh(mesh, rules):
        return jitted(*args)
    return call

  score_jit = on_mesh(score)

  grad_step = on_mesh(make_policy_grads(merge, temperature=temperature, epsilon=c.epsilon,
                                        epsilon_high=c.epsilon_high, beta=c.beta))
  apply = on_mesh(make_apply(tx))

  stop = {"flag": False}
  previous = signal.signal(signal.SIGTERM, lambda *_: stop.update(flag=True))
  metrics_path = os.path.join(c.output_dir, "metrics.jsonl")
  failures_path = os.path.join(c.output_dir, "reward_failures.log")
  bar = None
  if progress:
    from tqdm import tqdm  # pylint: disable=import-outside-toplevel
    bar = tqdm(total=c.steps, initial=start, desc="rl", file=sys.stderr)
  t0 = time.perf_counter()
  step, last = start, {}
  n_rows = len(rows)
  width = int(c.prompt_bucket) * max(1, -(-max(len(p) for p in prompts) // int(c.prompt_bucket)))
  saved_at = start

  class _Watch:
    """The engine's progress object: reports rollouts and stops on SIGTERM."""

    def __init__(self, step):
      self.step, self.n = step, 0

    def update(self, k):
      self.n += k
      if hook is not None:
        hook("rollout", self.step, self.n)
      if stop["flag"]:
        raise _Stop()

  try:
    while step < c.steps:
      # --- rollouts
      t_roll = time.perf_counter()
      pick = np.random.default_rng([c.seed, step]).choice(
          n_rows, size=c.prompts_per_step, replace=n_rows < c.prompts_per_step)
      batch_rows = [rows[i] for i in pick for _ in range(c.group_size)]
      batch_prompts = [prompts[i] for i in pick for _ in range(c.group_size)]
      if "model" in params:
        nnx.update(model, params["model"])
      if "selector" in params:  # the policy's current weights (traced: no recompile)
        dc = dc.replace(plan_weights=tuple(float(x) for x in np.asarray(params["selector"])))
      decoder = engine.Decoder(model, dc, method="refusion")
      eng = decoder.engine(c.engine_rows, width=width)
      try:
        out = eng.run(batch_prompts, rng=jax.random.fold_in(jax.random.key(c.seed), step),
                      progress=_Watch(step))
      except _Stop:
        break
      t_roll = time.perf_counter() - t_roll
      # --- rewards
      texts = [tokenizer.decode(r.tokens, skip_special_tokens=True) for r in out.results]
      lines = []
      raw, failed = rewards_lib.score_all(score_one, batch_rows, texts,
                                          timeout=c.reward_timeout, workers=c.reward_workers,
                                          log=lambda line: lines.append(f"step {step}: {line}"))
      if lines:
        with open(failures_path, "a", encoding="utf-8") as f:
          f.write("\n".join(lines) + "\n")
      tpf = np.asarray([r.counters["tokens_b"] / max(r.counters["nfe_b"], 1.0)
                        for r in out.results], np.float32)
      reward = raw * (1.0 + c.speed_weight * tpf)
      adv = grpo.group_advantages(reward, c.group_size).astype(np.float32)
      # --- the policy step
      t_upd = time.perf_counter()
      if hook is not None:
        hook("update", step, 0)
      layouts = [replay.layout(p, r.trace, dc.slot_size, dc.block_size,
                               model_config.mask_token_id)
                 for p, r in zip(batch_prompts, out.results)]
      need_w = max(len(x.ids) for x in layouts)
      need_t = max(len(x.targets) for x in layouts)
      w, t = replay.bucket(need_w, 32), replay.bucket(need_t, 16)
      chunks = [replay.pack(layouts[i:i + mb], width=w, tokens=t)
                for i in range(0, len(layouts), mb)]
      if "selector" in params:
        for i, ch in enumerate(chunks):
          part = out.results[i * mb:(i + 1) * mb]
          for key in ("plan_feats", "plan_fed", "plan_chosen"):
            ch[key] = np.stack([r.trace[key] for r in part])
      adv_chunks = [jnp.asarray(adv[i:i + mb]) for i in range(0, len(layouts), mb)]
      ref_lps = [score_jit(ref_params, ch) for ch in chunks] if ref_params is not None else None
      old_lps = ([score_jit(params, ch) for ch in chunks] if c.num_iterations > 1
                 else [None] * len(chunks))
      agg = {}
      for _ in range(c.num_iterations):
        grads_sum = None
        for j, ch in enumerate(chunks):
          (_, m), g = grad_step(params, ch, old_lps[j],
                                None if ref_lps is None else ref_lps[j], adv_chunks[j])
          grads_sum = g if grads_sum is None else jax.tree.map(jnp.add, grads_sum, g)
          for k, v in m.items():
            agg[k] = agg.get(k, 0.0) + float(v) / (len(chunks) * c.num_iterations)
        grads = jax.tree.map(lambda x: x / len(chunks), grads_sum)
        params, opt_state, gnorm = apply(params, opt_state, grads)
      t_upd = time.perf_counter() - t_upd
      step += 1
      lens = [len(r.tokens) for r in out.results]
      last = {"step": step, "reward_mean": float(reward.mean()),
              "reward_std": float(reward.std()), "accuracy": float(raw.mean()),
              "reward_failures": failed, "tokens_per_forward": float(tpf.mean()),
              "response_len": float(np.mean(lens)), "grad_norm": float(gnorm),
              "rollout_s": t_roll, "update_s": t_upd, **agg}
      with open(metrics_path, "a", encoding="utf-8") as f:
        f.write(json.dumps(last) + "\n")
      if bar is not None:
        bar.update(1)
        bar.set_postfix(reward=f"{last['reward_mean']:.3f}", tpf=f"{last['tokens_per_forward']:.2f}")
      if step % c.save_every == 0 or step == c.steps or stop["flag"]:
        _save(manager, step, params, opt_state, {"seed": c.seed})
        saved_at = step
      if stop["flag"]:
        break
    if stop["flag"] and saved_at != step:
      _save(manager, step, params, opt_state, {"seed": c.seed})
  finally:
    signal.signal(signal.SIGTERM, previous)
    manager.close()
    if bar is not None:
      bar.close()
  result = {"steps": step, "final_model": None, "seconds": time.perf_counter() - t0,
            "stopped": stop["flag"], "last": last,
            "devices": len(jax.tree.leaves(params)[0].sharding.device_set)}
  if "selector" in params:
    result["plan_weights"] = [float(x) for x in np.asarray(params["selector"])]
  if step >= c.steps and "selector" in params:
    # decode.planner='policy' with --config.decode.plan_weights from this file.
    fileio.write_json_atomic(os.path.join(c.output_dir, "plan_weights.json"),
                             {"features": list(PLAN_FEATURES),
                              "plan_weights": result["plan_weights"]})
  if step >= c.steps and "model" in params:
    nnx.update(model, params["model"])
    final = os.path.join(c.output_dir, "final_model")
    checkpoint.save_model(final, model_config, model, overwrite=True)
    if tok_dir:
      shutil.copy(os.path.join(tok_dir, "tokenizer.json"), os.path.join(final, "tokenizer.json"))
    result["final_model"] = final
  if math.isnan(last.get("loss", 0.0)):
    raise FloatingPointError(f"the RL loss became NaN at step {step}")
  return result


def main(argv, config_flag) -> None:
  if len(argv) > 1:
    from absl import app  # pylint: disable=import-outside-toplevel
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  print(json.dumps(run(config_flag.value)))
