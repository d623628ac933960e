"""The reproduction's training stages, and where their models live.

Stage 1 (`config.base.num_train_steps` > 0) trains one causal ARM "base" in
`W/models/base` and exports it in HF layout (`W/models/base/hf`); a shipped
base (`config.base.pretrained`) takes its place. Stage 2 trains each of
`config.models` in `W/models/<name>` on the same data for the same number of
tokens (`config.train`; only the objective and the attention it needs
differ), fine-tuned from the base when there is one. Stage 3 makes models from
trained ones: D2F's adapter distilled from the MDM; from a ReFusion model, RL (the
causal head), draft adapters (the drafts) and a slot planner trained for speed
(`settings.DISTILLED`, `settings.REINFORCED`, `settings.DRAFTED`, `settings.PLANNED`).

Each stage writes a marker (`reproduce_train.json`: its budget, steps and
seconds) beside the trainer's checkpoints: a finished stage of the same budget
is skipped, an interrupted one resumes, one of another budget (or any model
after a new base) starts again from nothing.
"""

from __future__ import annotations

import copy
import datetime
import json
import math
import os
import shutil
import time
from typing import Callable

import ml_collections

from refusion_jax import checkpoint, distill, drafter, fileio, lora, objective
from refusion_jax import tokenizer as tokenizer_lib
from refusion_jax.repro import settings
from refusion_jax.rl import trainer as rl_trainer
from refusion_jax.training import outputs, supervised

MODELS_DIR = "models"
TRAIN_MARKER = "reproduce_train.json"
BASE_MODEL = "base"  # W/models/base: the stage-1 causal ARM every model starts from
BASE_HF_DIR = "hf"  # its HF export, inside W/models/base
PLAN_WEIGHTS_FILE = "plan_weights.json"  # a planner's product (refusion_jax.rl's name)


def model_dir(workdir: str, name: str) -> str:
  """W/models/<name>: the trainer's workdir of one model (the base included)."""
  return os.path.join(workdir, MODELS_DIR, name)


def final_model_dir(workdir: str, name: str) -> str:
  """The trained model folder of `name` (what the evaluation loads)."""
  return os.path.join(model_dir(workdir, name), outputs.FINAL_MODEL_DIR)


def base_hf_dir(workdir: str) -> str:
  return os.path.join(model_dir(workdir, BASE_MODEL), BASE_HF_DIR)


def base_init_dir(config, workdir: str) -> str:
  """The HF folder every model starts from: the shipped base, or stage 1's export."""
  return config.base.get("pretrained", "") or base_hf_dir(workdir)


# ---------------------------------------------------------------------------
# Each stage's training config and budget.


def _common_train_config(config, workdir: str) -> ml_collections.ConfigDict:
  c = copy.deepcopy(config.train)
  c.progress_bar = bool(config.progress_bar)
  if not c.data.tfds_dir:
    c.data.tfds_dir = os.path.join(workdir, "tfds")  # one TFDS build for every model
  return c


def base_train_config(config, workdir: str) -> ml_collections.ConfigDict:
  """Stage 1: config.train as a causal ARM with the base's steps and rate, exported to HF."""
  c = _common_train_config(config, workdir)
  c.objective = "arm"
  c.model.attention = objective.attention_for("arm")
  c.num_train_steps = int(config.base.num_train_steps)
  c.optimizer.learning_rate = float(config.base.learning_rate)
  c.export_hf_dir = base_hf_dir(workdir)
  return c


def train_config(config, model_name: str, workdir: str) -> ml_collections.ConfigDict:
  """config.train with the model's objective, attention and own fields set
  (`settings.MODELS`; with a base, its init)."""
  c = _common_train_config(config, workdir)
  objective_name, changes = settings.MODELS[model_name]
  c.objective = objective_name
  c.model.attention = objective.attention_for(objective_name)
  for field, value in changes.items():
    c[field] = value
  if settings.has_base(config):
    c.init_from_hf = base_init_dir(config, workdir)
    # The HF export holds weights and config.json only; the vocabulary is the bundled one.
    # Its config.json names the tokenizer's mask id, so init_from_hf keeps the base's
    # trained special-token rows instead of resetting them.
    c.tokenizer_dir = c.tokenizer_dir or tokenizer_lib.TINY_TOKENIZER_DIR
  return c


def _budget(t, steps: int, learning_rate: float) -> dict:
  return {"steps": steps, "num_epochs": 0 if steps > 0 else int(t.num_epochs),
          "global_batch_size": int(t.global_batch_size),
          "seq_len": int(t.data.seq_len), "tokens": steps * int(t.global_batch_size)
          * int(t.data.seq_len), "packing": t.data.get("packing", "none"),
          "mdm_response_len": int(t.get("mdm_response_len", 0)), "seed": int(t.seed),
          "learning_rate": float(learning_rate),
          "model": {k: v for k, v in t.model.to_dict().items() if v is not None}}


def base_budget(config) -> dict | None:
  """The stage-1 budget (for a shipped base: its folder and checksum), or None."""
  if not settings.has_base(config):
    return None
  if config.base.get("pretrained", ""):
    folder = config.base.pretrained
    return {"pretrained": folder, "sha256": settings.check_pretrained_base(folder)}
  return _budget(config.train, int(config.base.num_train_steps), config.base.learning_rate)


def train_budget(config) -> dict:
  """Each model's budget; it names the base it starts from, so a new base retrains them."""
  t = config.train
  budget = _budget(t, int(t.num_train_steps), t.optimizer.learning_rate)
  budget["base"] = base_budget(config)
  return budget


# ---------------------------------------------------------------------------
# Training, resuming or skipping.


def train_stage(name: str, train_cfg, budget: dict, workdir: str, log,
                ready: Callable[[], bool] = lambda: True, restart: bool = False
                ) -> tuple[dict, bool]:
  """Trains (or resumes, or skips) one model in `workdir`; (its marker, trained).

  The marker is {budget, step, seconds, ...}. `restart` (or a finished run of
  another budget) discards `workdir` first: its checkpoints belong to other
  settings or to an older base, never to resume from.
  """
  marker_path = os.path.join(workdir, TRAIN_MARKER)
  marker = fileio.read_json_or_none(marker_path)
  final = os.path.join(workdir, outputs.FINAL_MODEL_DIR)
  if (not restart and marker and marker.get("budget") == budget
      and checkpoint.is_model_dir(final) and ready()):
    log(f"[reproduce] {name}: already trained ({marker['step']} steps), skipped")
    return marker, False
  if os.path.isdir(workdir) and (restart or (marker and marker.get("budget") != budget)):
    log(f"[reproduce] {name}: discarding {workdir} (another budget or an older base)")
    shutil.rmtree(workdir)
  start = "fine-tuning from the base" if train_cfg.init_from_hf else "training"
  packed = "" if budget.get("packing", "none") == "none" else f" ({budget['packing']} packed)"
  size = (f"{budget['steps']} steps" if budget["steps"] > 0 else
          f"{budget['num_epochs']} epoch(s) of samples")
  log(f"[reproduce] {start} {name}: {size} x {budget['global_batch_size']} rows x "
      f"{budget['seq_len']} tokens{packed}")
  t0 = time.perf_counter()
  result = supervised.train_and_evaluate(train_cfg, workdir)
  seconds = time.perf_counter() - t0
  marker = {"budget": budget, "step": int(result.step), "seconds": seconds,
            "final_loss": result.last_metrics.get("loss"),
            "samples_per_step": (None if math.isnan(result.samples_per_step)
                                 else result.samples_per_step),
            "num_params": result.model_config.num_params(),
            "finished": datetime.datetime.now().isoformat(timespec="seconds")}
  fileio.write_json_atomic(marker_path, marker)
  return marker, True


def train_base(config, workdir: str, log=print) -> tuple[dict | None, bool]:
  """Stage 1: trains (or resumes, or skips) the causal ARM base; (marker or None, trained)."""
  budget = base_budget(config)
  if budget is None:
    return None, False
  if "pretrained" in budget:
    log(f"[reproduce] base: the shipped pretrained base {budget['pretrained']} "
        f"(sha256 {budget['sha256'][:12]}...)")
    return {"budget": budget}, False
  hf_config = os.path.join(base_hf_dir(workdir), "config.json")
  return train_stage(BASE_MODEL, base_train_config(config, workdir), budget,
                     model_dir(workdir, BASE_MODEL), log,
                     ready=lambda: os.path.isfile(hf_config))


def train_models(config, workdir: str, log=print, restart: bool = False) -> dict[str, dict]:
  """Stage 2 (or the only stage): each of config.models; {name: marker}.

  `restart`: the base was (re)trained in this run, so any earlier model state
  started from another base and is discarded.
  """
  budget = train_budget(config)

  def own(name):  # a model's own train.* fields are part of its budget
    changes = settings.MODELS[name][1]
    return {**budget, "changes": dict(changes)} if changes else budget

  return {name: train_stage(name, train_config(config, name, workdir), own(name),
                            model_dir(workdir, name), log, restart=restart)[0]
          for name in config.models if name in settings.MODELS}


DISTILL_DIR = "distill"  # W/models/<name>/distill: refusion_jax.distill's output folder


def _made_model_state(workdir: str, name: str, source: str, trained: dict[str, dict],
                      stage: str, fields: dict, done: str, log,
                      product: str = outputs.FINAL_MODEL_DIR) -> tuple[dict, dict | None]:
  """`(budget, marker)` of model `name`, made from the trained `source` by `stage` with
  its settings `fields`: the marker when it holds this budget and its `product` (the
  model folder, or a file) is there (the stage is skipped, `done` logged), else None, the
  model's folder cleared to start over."""
  here = model_dir(workdir, name)
  budget = {stage: fields, "from": {"model": source, "budget": trained[source]["budget"],
                                    "step": trained[source]["step"]}}
  budget = json.loads(json.dumps(budget))  # tuples as lists, as the marker reads back
  marker = fileio.read_json_or_none(os.path.join(here, TRAIN_MARKER))
  made = os.path.join(here, product)
  if (marker and marker.get("budget") == budget
      and (checkpoint.is_model_dir(made) if product == outputs.FINAL_MODEL_DIR
           else os.path.isfile(made))):
    log(f"[reproduce] {name}: already {done} ({marker['step']} steps), skipped")
    return budget, marker
  if os.path.isdir(here):
    shutil.rmtree(here)
  return budget, None


def distill_models(config, workdir: str, trained: dict[str, dict], log=print
                   ) -> dict[str, dict]:
  """Stage 3: each DISTILLED model of config.models, made from its trained model (a D2F
  adapter distilled from the MDM and merged into its weights, saved as a model folder);
  skipped when its marker's budget (the distill settings and the source's marker) holds.
  {name: marker}."""
  out = {}
  for name in config.models:
    if name not in settings.DISTILLED:
      continue
    source = settings.DISTILLED[name]
    here = model_dir(workdir, name)
    dc = settings.distill_config(config, final_model_dir(workdir, source),
                                 os.path.join(here, DISTILL_DIR))
    budget, marker = _made_model_state(
        workdir, name, source, trained, "distill",
        {k: v for k, v in dc.to_dict().items() if k not in ("base_dir", "output_dir")},
        "distilled", log)
    if marker is not None:
      out[name] = marker
      continue
    log(f"[reproduce] distilling {name} from {source}: {dc.steps} steps x {dc.batch_size} "
        f"rows x {dc.seq_len} tokens, LoRA rank {dc.lora_rank}")
    t0 = time.perf_counter()
    result = distill.run(dc, progress=bool(config.get("progress_bar", True)))
    model_config, model = checkpoint.load_model(final_model_dir(workdir, source))
    lora.merge(model, lora.read_adapter(result["adapter_dir"], model_config))
    checkpoint.save_model(os.path.join(here, outputs.FINAL_MODEL_DIR), model_config, model)
    marker = {"budget": budget, "step": int(result["steps"]),
              "seconds": time.perf_counter() - t0, "final_loss": result["final_loss"],
              "samples_per_step": float(dc.batch_size),
              "num_params": model_config.num_params(),
              "finished": datetime.datetime.now().isoformat(timespec="seconds")}
    fileio.write_json_atomic(os.path.join(here, TRAIN_MARKER), marker)
    out[name] = marker
  return out


def _trained_from(config, workdir: str, trained: dict[str, dict], log, made: dict[str, str],
                  stage: str, config_of, done: str, announce, train,
                  product: str = outputs.FINAL_MODEL_DIR) -> dict[str, dict]:
  """Each of config.models in `made` {name: source}, trained from its source's final model
  by `train(c, progress=...) -> result` (a trainer's `run`) on `config_of(config,
  source_dir, W/models/<name>)`, a run whose output folder is W/models/<name>
  (checkpoints, metrics, `product`); skipped when its marker's budget (those settings and
  the source's marker) holds. {name: marker}."""
  out = {}
  for name in config.models:
    if name not in made:
      continue
    source = made[name]
    here = model_dir(workdir, name)
    c = config_of(config, final_model_dir(workdir, source), here)
    budget, marker = _made_model_state(
        workdir, name, source, trained, stage,
        {k: v for k, v in c.to_dict().items()
         if k not in ("model_dir", "output_dir", "compile_cache_dir")}, done, log,
        product=product)
    if marker is not None:
      out[name] = marker
      continue
    log(f"[reproduce] {announce(c)} for {name} from {source}")
    t0 = time.perf_counter()
    result = train(c, progress=bool(config.get("progress_bar", True)))
    marker = {"budget": budget, "step": int(result["steps"]),
              "seconds": time.perf_counter() - t0,
              "samples_per_step": float(c.prompts_per_step * c.group_size
                                        if "group_size" in c else c.batch_size),
              "num_params": trained[source].get("num_params"),
              "finished": datetime.datetime.now().isoformat(timespec="seconds")}
    if "last" in result:
      marker["last_reward"] = float(result["last"].get("reward_mean", float("nan")))
    if "plan_weights" in result:
      marker["plan_weights"] = list(result["plan_weights"])
    fileio.write_json_atomic(os.path.join(here, TRAIN_MARKER), marker)
    out[name] = marker
  return out


def reinforce_models(config, workdir: str, trained: dict[str, dict], log=print
                     ) -> dict[str, dict]:
  """Stage 4: each REINFORCED model of config.models, trained further from its source by
  GRPO on the lossless sampler (refusion_jax.rl with `settings.rl_config`; its folder holds
  the run's checkpoints and metrics and `final_model/`). {name: marker}."""
  return _trained_from(
      config, workdir, trained, log, settings.REINFORCED, "rl", settings.rl_config,
      "trained by RL", lambda c: (f"RL: {c.steps} steps x {c.prompts_per_step} prompts x "
                                  f"{c.group_size} lossless rollouts, lr {c.learning_rate:g}"),
      rl_trainer.run)


def draft_models(config, workdir: str, trained: dict[str, dict], log=print
                 ) -> dict[str, dict]:
  """Stage 4: each DRAFTED model of config.models: its source with draft adapters trained
  for acceptance on its own greedy answers (refusion_jax.drafter with
  `settings.drafter_config`; `final_model/` answers as its source does). {name: marker}."""
  return _trained_from(
      config, workdir, trained, log, settings.DRAFTED, "drafter", settings.drafter_config,
      "given draft adapters", lambda c: (f"draft adapters: rank {c.draft_rank}, {c.steps} "
                                         f"steps x {c.batch_size} of {c.num_prompts} own "
                                         "answers"),
      drafter.run)


def plan_models(config, workdir: str, trained: dict[str, dict], log=print
                ) -> dict[str, dict]:
  """Stage 4: each PLANNED planner of config.models: the selection policy trained for
  speed on its model's lossless sampler (refusion_jax.rl with `settings.planner_config`;
  `plan_weights.json`, also in its marker's "plan_weights"). {name: marker}."""
  return _trained_from(
      config, workdir, trained, log, settings.PLANNED, "planner", settings.planner_config,
      "trained for speed", lambda c: (f"the slot planner: {c.steps} steps x "
                                      f"{c.prompts_per_step} prompts x {c.group_size} greedy "
                                      "lossless plans, reward tokens per forward"),
      rl_trainer.run, product=PLAN_WEIGHTS_FILE)
