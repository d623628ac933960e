"""GRPO on verifiable rewards for ReFusion, with exact trajectory log-probabilities.

  python -m refusion_jax.rl --config=configs/rl_tiny.py \\
      --config.model_dir=REFUSION_MODEL_DIR --config.output_dir=OUT

The RL task of the training loop (`training.loop`), wired from three pieces as tunix
splits them: `rollout` (the sampler), `scoring` (log-probabilities under given weights)
and `learner` (the loss and the update). One step:

1. **Rollouts** (`rollout.Rollout`, the engine: continuous batching, the compiled
   ReFusion program): `prompts_per_step` prompts drawn from the training file,
   `group_size` samples each, at `decode.temperature`, recorded (`decode.record`). With
   `decode.verify='lossless'` (configs/rl_lossless.py) they are the model's AR samples,
   decoded in ReFusion's fused passes, each token's probability kept; otherwise the
   release's parallel decode with the infill's drafts sampled too
   (`decode.sample_drafts`) and every committed token's deciding pass recorded. The
   prompts and the rollout key are drawn from (seed, step), so a step redone after a
   restart draws the same samples.
2. **Rewards** (`rl.rewards`): the completion's text (up to its stop token) against its
   row; optional speed term `reward * (1 + speed_weight * tokens / forwards)`. The
   selection policy on lossless rollouts (configs/planner_lossless.py) is trained for
   speed alone: its choices change no answer, so its reward is the rollout's tokens per
   forward (the answers' accuracy is still logged).
3. **Advantages**, group-relative (`rl.grpo.group_advantages`).
4. **Scoring** (`scoring`): each rollout's training layout (lossless: prompt and answer
   in one causal run, the answer's AR likelihood), `micro_batch` rollouts per forward; the reference's log-probabilities (the starting weights) when beta > 0, the
   current ones as GRPO's old log-probabilities when `num_iterations` > 1.
5. **Update** (`learner`): GRPO's clipped ratio and a k3 KL to the reference
   (`rl.grpo.policy_loss`); `num_iterations` optimizer steps on one batch of
   rollouts, gradients accumulated over its micro-batches; optax AdamW with clipping.

What is trained (`train_policy`): "model", every parameter of the model; "selector",
the small slot-selection policy alone (`decode.planner='policy'`, base frozen: the
rollouts draw each plan step's slots from it, `rl.selector` scores the choices);
or "both" (each rollout's tokens and plan choices in one log-likelihood). The loop
writes the checkpoints (`OUT/checkpoints/<step>/`: parameters, optimizer state, the
step, and the seed, policy and model they were made with; a rerun resumes from the
newest) every `save_every` steps. SIGTERM or Ctrl-C before a step's update abandons
that step (its rollouts are drawn again, identically, on resume) and saves the state
before it; during the update the step finishes and is saved; then the run stops (exit
status 75 or 130). `OUT/final_model/` is a model folder; `OUT/metrics.jsonl` holds one
line per step (reward mean / std, accuracy, KL, clip fraction, token entropy, tokens
per forward, timings; the plan's entropy with the selector) and
`OUT/reward_failures.log` each reward that raised or timed out; a trained selector's
weights go to `OUT/plan_weights.json`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import app
from flax import nnx

from refusion_jax import checkpoint, fileio, loading, runtime, sharding
from refusion_jax.decode.methods import PLAN_FEATURES
from refusion_jax.decode.settings import DecodeConfig
from refusion_jax.rl import grpo, learner, scoring
from refusion_jax.rl import rewards as rewards_lib
from refusion_jax.rl import rollout as rollout_lib
from refusion_jax.training import loop
from refusion_jax.training.outputs import FINAL_MODEL_DIR


def check_config(c, need_model: bool = True) -> None:
  """Every bad field of the config is one ValueError line, before any loading
  (`need_model=False`: the folders and files are not read, as aot's)."""
  if need_model:
    if not c.model_dir:
      raise ValueError("--config.model_dir is required: the ReFusion model to train (a shipped "
                       "name, a refusion_jax or a HF folder)")
    loading.model_dir(c.model_dir)  # a shipped name, or a folder
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
  if lossless(c) and c.train_policy == "both":
    raise ValueError("--config.train_policy='both' with decode.verify='lossless': the slot "
                     "choice changes no answer there, only the passes, so the two learn "
                     "different things: 'model' trains the causal head for the reward, "
                     "'selector' the planner for speed (tokens per forward), in two runs")
  try:
    decode_config_of(c)
  except (TypeError, ValueError) as e:
    raise ValueError(f"--config.decode: {e}") from None
  if not c.decode.temperature > 0 and not planner_for_speed(c):
    raise ValueError(f"--config.decode.temperature must be > 0 for RL rollouts (a greedy "
                     f"policy has no probabilities to learn from), got {c.decode.temperature!r}")


TRAIN_POLICIES = ("model", "selector", "both")


def decode_config_of(c):
  """The rollouts' decode, recorded: lossless (`decode.verify='lossless'`: the model's AR
  samples, each token's probability kept), else the parallel decode with its drafts
  sampled; with the selection policy trained, `planner='policy'` with its slots drawn."""
  fields = dict(c.decode.to_dict(), method="refusion", record=True)
  if fields.get("verify") != "lossless":
    fields["sample_drafts"] = True
  if c.train_policy in ("selector", "both"):
    fields.update(planner="policy", plan_sample=True)
  return DecodeConfig(**fields)


def lossless(c) -> bool:
  return c.decode.get("verify", "off") == "lossless"


def planner_for_speed(c) -> bool:
  """The selection policy trained on lossless rollouts: its choices change no answer, so
  its reward is the rollout's tokens per forward (greedy rollouts allowed: the plan's
  draws are the policy's probabilities)."""
  return lossless(c) and c.train_policy == "selector"


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


class _Watch:
  """The engine's progress object: abandons the step's decode once a stop is requested."""

  def __init__(self, stop: loop.StopNotice):
    self.stop = stop

  def update(self, finished: int) -> None:
    del finished
    if self.stop.requested:
      raise loop.StepAbandoned()


def _placement(c) -> loop.Placement:
  """With `mesh.shard`, sharded as training shards: the parameters (and so the optimizer
  state, the rollout engine's rows and KV cache, the policy step) over a (data, fsdp,
  tensor) mesh of every device, by the model's logical axes."""
  if not c.mesh.shard:
    return loop.Placement()
  return loop.Placement(sharding.make_mesh(data=c.mesh.data, fsdp=c.mesh.fsdp,
                                           tensor=c.mesh.tensor))


class RLTask(loop.Task):
  """GRPO on the training loop: rollouts, rewards, scoring and the learner's update per
  step; the state is the trained parts (`params["model"]`, `params["selector"]`) and their
  optimizer state. The reference is the starting weights (never saved: `model_dir`)."""

  label = "rl"

  def __init__(self, c, model_config, model, tokenizer, rows: list[dict],
               prompts: list[list[int]], placement: loop.Placement):
    self.c, self.total_steps, self.model_config = c, int(c.steps), model_config
    self.rows, self.prompts = rows, prompts
    self.decode_config = decode_config_of(c)
    graphdef, model_params, rest = nnx.split(model, nnx.Param, ...)
    params = {}
    if c.train_policy in ("model", "both"):
      params["model"] = model_params
    if c.train_policy in ("selector", "both"):
      params["selector"] = jnp.asarray(self.decode_config.plan_weights_on, jnp.float32)
    self.ref_params = jax.tree.map(jnp.copy, params) if c.beta > 0 else None
    tx = learner.make_optimizer(c)
    self._initial = {"params": params, "opt_state": tx.init(params)}

    def merge(p):
      return nnx.merge(graphdef, p, rest)

    temperature = float(self.decode_config.temperature)
    self.rollout = rollout_lib.Rollout(model, self.decode_config, tokenizer, rows=c.engine_rows,
                                       width=rollout_lib.prompt_width(prompts, c.prompt_bucket))
    self._score = placement.jit(scoring.make_score(merge, temperature))
    self.learner = learner.Learner(merge, tx, placement, num_iterations=c.num_iterations,
                                   temperature=temperature, epsilon=c.epsilon,
                                   epsilon_high=c.epsilon_high, beta=c.beta)
    self._reward_fn = rewards_lib.reward_fn(c.reward)

  def meta(self) -> dict:
    return {"seed": int(self.c.seed), "train_policy": self.c.train_policy,
            "model_config": dataclasses.asdict(self.model_config)}

  def abstract_state(self):
    return loop.abstract_of(self._initial)

  def init_state(self):
    return self._initial

  def _rollouts(self, params, step: int, stop) -> rollout_lib.Rollouts:
    c, group = self.c, self.c.group_size
    pick = rollout_lib.draw_prompts(c.seed, step, len(self.rows), c.prompts_per_step)
    self.rollout.update_params(params)
    return self.rollout.generate([self.rows[i] for i in pick for _ in range(group)],
                                 [self.prompts[i] for i in pick for _ in range(group)],
                                 rng=jax.random.fold_in(jax.random.key(c.seed), step),
                                 progress=_Watch(stop))

  def _rewards(self, rollouts: rollout_lib.Rollouts, step: int, stop):
    """`(correct, reward, tokens per forward, failures)`. A stop that came while they were
    scored abandons the step: a Ctrl-C also reaches the sandbox's subprocesses, whose
    rewards are then not the run's."""
    c, lines = self.c, []
    raw, failed = rewards_lib.score_all(self._reward_fn, rollouts.rows, rollouts.texts,
                                        timeout=c.reward_timeout, workers=c.reward_workers,
                                        log=lambda line: lines.append(f"step {step}: {line}"))
    if stop.requested:
      raise loop.StepAbandoned()
    if lines:
      with open(os.path.join(c.output_dir, "reward_failures.log"), "a", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    tpf = np.asarray([r.counters["tokens_b"] / max(r.counters["nfe_b"], 1.0)
                      for r in rollouts.results], np.float32)
    if planner_for_speed(c):
      return raw, tpf, tpf, failed
    return raw, raw * (1.0 + c.speed_weight * tpf), tpf, failed

  def _update(self, state, rollouts: rollout_lib.Rollouts, reward):
    c, params = self.c, state["params"]
    adv = grpo.group_advantages(reward, c.group_size).astype(np.float32)
    batches = scoring.micro_batches(rollouts, self.decode_config, self.model_config.mask_token_id,
                                    c.micro_batch, with_plan="selector" in params)
    advantages = [jnp.asarray(adv[i:i + c.micro_batch]) for i in range(0, len(adv),
                                                                       c.micro_batch)]
    ref_lps = (None if self.ref_params is None
               else [self._score(self.ref_params, b) for b in batches])
    old_lps = ([self._score(params, b) for b in batches] if c.num_iterations > 1
               else [None] * len(batches))
    params, opt_state, metrics = self.learner.update(params, state["opt_state"], batches,
                                                     advantages, old_lps, ref_lps)
    return {"params": params, "opt_state": opt_state}, metrics

  def step(self, state, step, stop):
    rollouts = self._rollouts(state["params"], step, stop)
    raw, reward, tpf, failed = self._rewards(rollouts, step, stop)
    start = time.perf_counter()
    state, losses = self._update(state, rollouts, reward)
    return state, {
        "reward_mean": float(reward.mean()), "reward_std": float(reward.std()),
        "accuracy": float(raw.mean()), "reward_failures": failed,
        "tokens_per_forward": float(tpf.mean()),
        "response_len": float(np.mean([len(r.tokens) for r in rollouts.results])),
        "grad_norm": losses.pop("grad_norm"), "rollout_s": rollouts.seconds,
        "update_s": time.perf_counter() - start, **losses}

  def postfix(self, metrics):
    return {"reward": f"{metrics['reward_mean']:.3f}",
            "tpf": f"{metrics['tokens_per_forward']:.2f}"}


def _load(c):
  """`(model_config, model, tokenizer, tokenizer folder or "")` of `c.model_dir`."""
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
  return model_config, model, tokenizer, tok_dir


def _write_outputs(c, task: RLTask, params, tok_dir: str) -> dict:
  """What the finished run trained: `OUT/plan_weights.json` (for `decode.planner='policy'`
  with `--config.decode.plan_weights`) and / or `OUT/final_model`."""
  out = {"final_model": None}
  if "selector" in params:
    out["plan_weights"] = [float(x) for x in np.asarray(params["selector"])]
    fileio.write_json_atomic(os.path.join(c.output_dir, "plan_weights.json"),
                             {"features": list(PLAN_FEATURES),
                              "plan_weights": out["plan_weights"]})
  if "model" in params:
    model = task.rollout.model
    nnx.update(model, params["model"])
    final = os.path.join(c.output_dir, FINAL_MODEL_DIR)
    checkpoint.save_model(final, task.model_config, model, overwrite=True)
    if tok_dir:
      shutil.copy(os.path.join(tok_dir, "tokenizer.json"), os.path.join(final, "tokenizer.json"))
    out["final_model"] = final
  return out


def run(c, progress: bool = True) -> dict[str, Any]:
  """Trains; returns `{"steps", "final_model", "seconds", "last": the last step's metrics,
  "devices"}` (and `"plan_weights"` with the selector trained). SIGTERM or Ctrl-C raises
  `loop.Stopped` once its checkpoint is saved."""
  check_config(c)
  dc = decode_config_of(c)
  model_config, model, tokenizer, tok_dir = _load(c)
  rows, prompts = read_rows(c.train_file, c.reward, tokenizer, model_config, dc.gen_length)
  dc.check_fits(model_config, max(len(p) for p in prompts))
  placement = _placement(c)
  placement.shard_model(model)
  task = RLTask(c, model_config, model, tokenizer, rows, prompts, placement)
  os.makedirs(c.output_dir, exist_ok=True)
  start = time.perf_counter()
  result = loop.run_loop(task, loop.LoopOptions(workdir=c.output_dir, save_every=c.save_every,
                                                progress=progress))
  params = result.state["params"]
  last = {"step": result.step, **result.metrics} if result.metrics else {}
  return {"steps": result.step, "seconds": time.perf_counter() - start, "last": last,
          "devices": len(jax.tree.leaves(params)[0].sharding.device_set),
          **_write_outputs(c, task, params, tok_dir)}


def main(argv, config_flag) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  c = config_flag.value
  with loop.stops_reported("refusion_jax.rl"):
    result = run(c)
  if result["final_model"]:
    runtime.note("rl", f"wrote {result['final_model']} (decode it: "
                 f"{runtime.sample_command(result['final_model'])})")
  if "plan_weights" in result:
    weights = ",".join(f"{w:.6g}" for w in result["plan_weights"])
    # The rollouts' decode settings the weights were trained under.
    same = [f"--config.decode.{k}={c.decode[k]}" for k in ("verify", "block_size",
                                                          "slot_size", "slot_threshold")
            if k in c.decode and planner_for_speed(c)]
    runtime.note("rl", f"wrote {os.path.join(c.output_dir, 'plan_weights.json')} (decode "
                 "with it: " + runtime.sample_command(
                     result["final_model"] or c.model_dir, "--config.decode.planner=policy",
                     f"--config.decode.plan_weights='({weights})'", *same) + ")")
  print(json.dumps(result))
