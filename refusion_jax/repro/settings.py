"""What a reproduction config asks for, and whether it is well-formed.

The models a run can train (`MODELS`), the decoder rows of the table, the
decode settings of every row and task, the sweep points, and
`validate(config)`: every check of the config (the shipped base's SHA-256
included) before anything is trained, loaded or compiled. Decode settings are
built by `row_decode_configs` alone, so a setting that DecodeConfig refuses is
reported with its row and task.

ReFusion rows take their per-task settings (slot size, block size, tau_s,
tau_t) from a validation search (`scoring.select_settings`): a row with
options of its own that change which settings decode best (verification, a
model trained with the boundary label) is searched with them; the ablations
of one decoder (left to right, recomputed KV) take the settings of the row
they ablate (`Row.settings_of`).
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import importlib
import os
from typing import Callable, Mapping

import ml_collections

from refusion_jax import distill, drafter, runtime
from refusion_jax import tasks as tasks_lib
from refusion_jax.checks import is_int, is_real, require
from refusion_jax.decode.settings import DecodeConfig
from refusion_jax.rl import trainer as rl_trainer

# ReFusion's per-task knobs (config.decode.tasks.<task>), the paper's Table 5 columns.
TASK_SETTINGS = ("slot_size", "block_size", "slot_threshold", "token_threshold")
# What the sweep varies and the validation search chooses, one at a time, in this order
# (the block size too: the paper's Table 5 varies b per benchmark, 8 to 128).
SWEEP_PARAMS = ("slot_size", "block_size", "slot_threshold", "token_threshold")


# ---------------------------------------------------------------------------
# Decoder rows and their decode settings.


# The models a reproduction can train (config.models): name -> (objective, the train.*
# fields it sets). Each is fine-tuned from the same base on the same samples.
MODELS = {
    "arm": ("arm", {}),
    "mdm": ("mdm", {}),
    "bd3lm": ("bd3lm", {}),
    "refusion": ("refusion", {}),
    # ReFusion with the boundary label (ALGORITHM.md "Past the paper").
    "refusion_bl": ("refusion", {"boundary_label": True}),
}
# Models made from a trained one rather than trained from the base: name -> the model they
# are made from. "d2f": a D2F adapter distilled from the MDM (refusion_jax.distill with
# config.distill), merged into its weights.
DISTILLED = {"d2f": "mdm"}
# Models trained further by RL (refusion_jax.rl, configs/rl_lossless.py with config.rl):
# name -> the model they start from. "refusion_bl_rl": GRPO on the lossless sampler from
# the boundary-label ReFusion, whose rollouts are its own AR samples.
REINFORCED = {"refusion_bl_rl": "refusion_bl"}
# Models with draft adapters trained for acceptance (refusion_jax.drafter,
# configs/drafter_tiny.py with config.drafter): name -> the model they adapt. Its answers
# are its source's; only the passes can change.
DRAFTED = {"refusion_bl_drafter": "refusion_bl"}
# Slot planners trained for speed on a model's lossless sampler (refusion_jax.rl,
# configs/planner_lossless.py with config.planner): name -> the model whose plans they
# choose. A planner is weights (W/models/<name>/plan_weights.json), not a model: a row
# with `planner` decodes its own model with them.
PLANNED = {"refusion_bl_planner": "refusion_bl"}


@dataclasses.dataclass(frozen=True)
class Row:
  name: str
  model: str  # which trained model it decodes (a key of MODELS)
  description: str
  build: Callable[[ml_collections.ConfigDict, str], DecodeConfig]  # (config, task) -> settings
  # ReFusion rows: the row whose validation search gives this row's per-task settings (its
  # own name: it is searched, with `options`); None: not a ReFusion row.
  settings_of: str | None = None
  options: tuple = ()  # (field, value) DecodeConfig changes on top of the task settings
  plan_by: str | None = None  # a PLANNED name: decoded with its trained plan_weights


def refusion_decode_config(config, task: str, **changes) -> DecodeConfig:
  """ReFusion at `task`'s settings (config.decode.tasks), with `changes` on top."""
  settings = {k: config.decode.tasks[task][k] for k in TASK_SETTINGS}
  return DecodeConfig(method="refusion", gen_length=config.decode.gen_length,
                      **{**settings, **changes})


def _mdm_decode_config(config, threshold) -> DecodeConfig:
  d = config.decode
  return DecodeConfig(method="mdm", gen_length=d.gen_length, slot_size=d.mdm_block_size,
                      block_size=d.mdm_block_size, mdm_tokens_per_step=d.mdm_tokens_per_step,
                      mdm_threshold=threshold)


def _bd3lm_decode_config(config) -> DecodeConfig:
  """BD3-LM block by block at its training block size, Fast-dLLM's threshold in a block."""
  d = config.decode
  return DecodeConfig(method="bd3lm", gen_length=d.gen_length,
                      block_size=int(config.train.bd3lm_block_size),
                      mdm_tokens_per_step=d.mdm_tokens_per_step, mdm_threshold=d.mdm_threshold)


def _d2f_decode_config(config) -> DecodeConfig:
  """D2F's pipelined decoder at the MDM's block, its three thresholds."""
  d = config.decode
  return DecodeConfig(method="d2f", gen_length=d.gen_length, slot_size=1,
                      block_size=d.mdm_block_size, d2f_add_threshold=d.d2f_add_threshold,
                      d2f_act_threshold=d.d2f_act_threshold,
                      d2f_conf_threshold=d.d2f_conf_threshold)


def _ar_decode_config(config) -> DecodeConfig:
  g = config.decode.gen_length
  return DecodeConfig(method="ar", gen_length=g, slot_size=g, block_size=g)


def _refusion_row(name: str, model: str, description: str, settings_of: str | None = None,
                  plan_by: str | None = None, **options) -> Row:
  return Row(name, model, description,
             lambda c, t: refusion_decode_config(c, t, **options),
             settings_of=settings_of or name, options=tuple(sorted(options.items())),
             plan_by=plan_by)


# What each "Past the paper" row switches on (the report names the lever each moves).
_VERIFY = dict(verify="correct")
ROWS: dict[str, Row] = {row.name: row for row in (
    Row("ARM-AR", "arm", "ARM, greedy left-to-right decoding with a KV cache",
        lambda c, t: _ar_decode_config(c)),
    Row("MDM-LLaDA", "mdm", "MDM, LLaDA decoding (fixed tokens per step, no KV cache)",
        lambda c, t: _mdm_decode_config(c, None)),
    Row("MDM-FastdLLM", "mdm", "MDM, Fast-dLLM threshold decoding",
        lambda c, t: _mdm_decode_config(c, c.decode.mdm_threshold)),
    Row("MDM-FastdLLM-dual", "mdm", "MDM, Fast-dLLM threshold decoding with its dual "
        "KV cache (refreshed at each block's first step)",
        lambda c, t: _mdm_decode_config(c, c.decode.mdm_threshold).replace(mdm_cache="dual")),
    Row("D2F", "d2f", "MDM with a D2F adapter distilled from it (block-causal), D2F's "
        "pipelined decoding over an exact KV cache", lambda c, t: _d2f_decode_config(c)),
    Row("BD3LM", "bd3lm", "BD3-LM, block diffusion with a KV cache, Fast-dLLM threshold "
        "in each block", lambda c, t: _bd3lm_decode_config(c)),
    _refusion_row("ReFusion", "refusion", "ReFusion, plan-and-infill"),
    _refusion_row("ReFusion-L2R", "refusion", "ReFusion model decoded left to right, one "
                  "slot per step, no drafting", settings_of="ReFusion", left_to_right=True),
    _refusion_row("ReFusion-recompute-KV", "refusion", "ReFusion, KV of infilled slots "
                  "recomputed instead of reused (paper's Table 8)", settings_of="ReFusion",
                  recompute_kv=True),
    # Past the paper (ALGORITHM.md): each lever alone, then together.
    _refusion_row("ReFusion-verify", "refusion", "ReFusion, verified infill: the causal "
                  "argmax replaces the first failing draft (slot-first tokens unchecked: "
                  "this model never learnt the slot boundary)", boundary_check=False,
                  **_VERIFY),
    _refusion_row("ReFusion-BL", "refusion_bl", "ReFusion trained with the boundary label, "
                  "the release's decoder"),
    _refusion_row("ReFusion-BL-verify", "refusion_bl", "ReFusion trained with the boundary "
                  "label, verified infill with the boundary check", **_VERIFY),
    _refusion_row("ReFusion-BL-L2R", "refusion_bl", "ReFusion trained with the boundary "
                  "label, decoded left to right", settings_of="ReFusion-BL-verify",
                  left_to_right=True),
    _refusion_row("ReFusion-BL-remask", "refusion_bl", "ReFusion trained with the boundary "
                  "label, verified infill and sub-slot re-masking (tau_remask 0.5)",
                  settings_of="ReFusion-BL-verify", remask=True, remask_threshold=0.5,
                  **_VERIFY),
    Row("ReFusion-BL-AR", "refusion_bl", "ReFusion trained with the boundary label, greedy "
        "AR decoding of its causal head (what lossless decoding returns)",
        lambda c, t: _ar_decode_config(c)),
    # Any setting gives the same answers; window 8 (slot 4, every slot drafted) is the
    # fastest on the validation split on a CPU (benchmarks/lossless_speed.py).
    _refusion_row("ReFusion-BL-lossless", "refusion_bl", "ReFusion trained with the boundary "
                  "label, lossless decoding (the AR answer; slots drafted and checked in one "
                  "fused pass; window 8, slot 4, tau_s 0)", settings_of="ReFusion-BL-verify",
                  verify="lossless", block_size=8, slot_size=4, slot_threshold=0.0),
    _refusion_row("ReFusion-BL-RL", "refusion_bl_rl", "ReFusion-BL-lossless's model after GRPO "
                  "on the lossless sampler (its rollouts its own AR samples; config.rl), "
                  "decoded as ReFusion-BL-lossless", settings_of="ReFusion-BL-verify",
                  verify="lossless", block_size=8, slot_size=4, slot_threshold=0.0),
    _refusion_row("ReFusion-BL-drafter", "refusion_bl_drafter", "ReFusion-BL-lossless with "
                  "draft adapters trained for acceptance on the model's own answers "
                  "(config.drafter; the same answers)", settings_of="ReFusion-BL-verify",
                  verify="lossless", block_size=8, slot_size=4, slot_threshold=0.0),
    _refusion_row("ReFusion-BL-planner", "refusion_bl", "ReFusion-BL-lossless with the slot "
                  "planner trained for speed (the selection policy, GRPO on tokens per "
                  "forward; config.planner; the same answers)", settings_of="ReFusion-BL-verify",
                  plan_by="refusion_bl_planner", verify="lossless", block_size=8, slot_size=4,
                  slot_threshold=0.0, planner="policy"),
)}


def with_planners(row_configs: Mapping[str, Mapping[str, DecodeConfig]],
                  plan_weights: Mapping[str, tuple]) -> dict[str, dict[str, DecodeConfig]]:
  """Each row with a `plan_by` planner decoded with its trained weights
  (`plan_weights` {PLANNED name: weights}, the planner stage's)."""
  out = {}
  for name, configs in row_configs.items():
    by = ROWS[name].plan_by
    out[name] = ({t: dc.replace(plan_weights=tuple(plan_weights[by])) for t, dc in configs.items()}
                 if by else dict(configs))
  return out


def row_decode_configs(config, chosen: Mapping[str, Mapping] | None = None
                       ) -> dict[str, dict[str, DecodeConfig]]:
  """{row: {task: DecodeConfig}} for config.eval.rows; raises naming the row and task.

  `chosen` {searched row: {task: settings}}: a ReFusion row decodes at the settings chosen
  for its `settings_of` row where there are some, else at config.decode.tasks."""
  configs = {}
  for name in config.eval.rows:
    configs[name] = {}
    row = ROWS[name]
    row_config = config
    if chosen and row.settings_of in chosen:
      row_config = with_task_settings(config, chosen[row.settings_of])
    for task in tasks_lib.TASKS:
      try:
        configs[name][task] = row.build(row_config, task)
      except (TypeError, ValueError) as e:
        raise ValueError(f"decode settings of row {name!r}, task {task!r} "
                         f"(config.decode / config.decode.tasks.{task}): {e}") from None
  return configs


def sweep_configs(config) -> dict[tuple[str, float], dict[str, DecodeConfig]]:
  """{(param, value): {task: DecodeConfig}}: each parameter varied alone at the task settings."""
  points = {}
  for param in SWEEP_PARAMS:
    values = tuple(config.sweep_grid[param])
    if not values:
      raise ValueError(f"config.sweep_grid.{param} is empty")
    for value in values:
      configs = {}
      for task in tasks_lib.TASKS:
        try:
          configs[task] = refusion_decode_config(config, task, **{param: value})
        except (TypeError, ValueError) as e:
          raise ValueError(f"config.sweep_grid.{param}={value!r} (task {task!r}): {e}") from None
      points[(param, value)] = configs
  return points


def with_task_settings(config, chosen: Mapping[str, Mapping]) -> ml_collections.ConfigDict:
  """A copy of `config` whose decode.tasks are `chosen`."""
  c = copy.deepcopy(config)
  with c.unlocked():
    for t, settings in chosen.items():
      for k, v in settings.items():
        c.decode.tasks[t][k] = v
  return c


# ---------------------------------------------------------------------------
# What the config switches on; the shipped base's checksum.


def has_base(config) -> bool:
  """Whether the models start from a base (the shipped one, or one stage 1 trains)."""
  return bool(config.base.get("pretrained", "")) or config.base.num_train_steps > 0


def select_enabled(config) -> bool:
  """Whether ReFusion's task settings are chosen on the validation split."""
  return bool(config.get("select", {}).get("enabled", False))


def searched_rows(config) -> list[str]:
  """The rows whose settings a validation search chooses: each ReFusion row's
  `settings_of`, in the order config.eval.rows first needs them."""
  out = []
  for name in config.eval.rows:
    of = ROWS[name].settings_of
    if of is not None and of not in out:
      out.append(of)
  return out


def _sha256(path: str) -> str:
  digest = hashlib.sha256()
  with open(path, "rb") as f:
    for chunk in iter(lambda: f.read(1 << 20), b""):
      digest.update(chunk)
  return digest.hexdigest()


def check_pretrained_base(folder: str) -> str:
  """The SHA-256 of a shipped base's weights, checked against its checksum file."""
  weights = os.path.join(folder, "model.safetensors")
  listed = weights + ".sha256"
  for path in (os.path.join(folder, "config.json"), weights, listed):
    if not os.path.isfile(path):
      raise FileNotFoundError(f"config.base.pretrained={folder!r}: {os.path.basename(path)} is "
                              "missing (bash launch/train_base.sh makes the shipped base)")
  with open(listed, encoding="utf-8") as f:
    expected = (f.read().split() or [""])[0]
  actual = _sha256(weights)
  if actual != expected:
    raise ValueError(f"config.base.pretrained={folder!r}: model.safetensors has SHA-256 "
                     f"{actual}, its checksum file says {expected!r} (a damaged or "
                     "replaced file; restore it or rerun launch/train_base.sh)")
  return actual


def _trained_from_config(config, recipe: str, section: str, model_dir: str, output_dir: str,
                         decode_nested: bool) -> ml_collections.ConfigDict:
  """configs/<recipe>.py's fields with config.<section>'s on top, run on `model_dir` into
  `output_dir`: the config of a stage that trains something from a trained model. Its
  answers are as long as the rows' (`decode.gen_length`, or `gen_length` unless
  `decode_nested`)."""
  # Not at the top: as distill_config's `configs` import.
  c = importlib.import_module(f"configs.{recipe}").get_config()
  (c.decode if decode_nested else c).gen_length = config.decode.gen_length
  c.update(config.get(section, ml_collections.ConfigDict()).to_dict())
  c.model_dir, c.output_dir = model_dir, output_dir
  c.compile_cache_dir = config.get("compile_cache_dir", runtime.AUTO)
  return c


def rl_config(config, model_dir: str, output_dir: str) -> ml_collections.ConfigDict:
  """refusion_jax.rl's config for a REINFORCED model: configs/rl_lossless.py's fields with
  config.rl's on top (its decode nested: `rl.decode.<field>`)."""
  return _trained_from_config(config, "rl_lossless", "rl", model_dir, output_dir, True)


def planner_config(config, model_dir: str, output_dir: str) -> ml_collections.ConfigDict:
  """refusion_jax.rl's config for a PLANNED planner: configs/planner_lossless.py's fields
  with config.planner's on top (`planner.decode.<field>` too)."""
  return _trained_from_config(config, "planner_lossless", "planner", model_dir, output_dir,
                              True)


def drafter_config(config, model_dir: str, output_dir: str) -> ml_collections.ConfigDict:
  """refusion_jax.drafter's config for a DRAFTED model: configs/drafter_tiny.py's fields
  with config.drafter's on top."""
  return _trained_from_config(config, "drafter_tiny", "drafter", model_dir, output_dir, False)


def distill_config(config, base_dir: str, output_dir: str) -> ml_collections.ConfigDict:
  """refusion_jax.distill's config for a DISTILLED model: configs/d2f_tiny.py's fields
  with config.distill's on top."""
  # Not at the top: which `configs` this is (a checkout's or the package's copy) is settled
  # only when the command line reads its config file (packaged.use_packaged_configs).
  from configs import d2f_tiny
  c = d2f_tiny.get_config()
  c.update(config.get("distill", ml_collections.ConfigDict()).to_dict())
  c.base_dir, c.output_dir = base_dir, output_dir
  c.train_files = tuple(config.train.data.train_files)
  return c


# ---------------------------------------------------------------------------
# Validation (before anything is trained, loaded or compiled).


def validate(config) -> dict[str, dict[str, DecodeConfig]]:
  """Checks the reproduction fields; returns {row: {task: DecodeConfig}}."""
  models = tuple(config.models)
  made = {**DISTILLED, **REINFORCED, **DRAFTED, **PLANNED}
  unknown = [m for m in models if m not in MODELS and m not in made]
  if not models or unknown:
    raise ValueError(f"config.models={models!r}: each must be one of "
                     f"{sorted(MODELS) + sorted(made)}")
  for name in models:
    if name in made and made[name] not in models:
      raise ValueError(f"config.models: {name!r} is made from the {made[name]!r} model, "
                       f"which config.models={models!r} does not train")
  if any(m in REINFORCED for m in models):
    probe = rl_config(config, "", "")
    try:
      rl_trainer.check_config(probe, need_model=False)
    except ValueError as e:
      raise ValueError(f"config.rl: {e}") from None
    if probe.train_policy != "model":
      raise ValueError(f"config.rl.train_policy={probe.train_policy!r}: the RL stage makes "
                       f"the model {sorted(REINFORCED)} (train_policy='model')")
  if any(m in PLANNED for m in models):
    probe = planner_config(config, "", "")
    try:
      rl_trainer.check_config(probe, need_model=False)
    except ValueError as e:
      raise ValueError(f"config.planner: {e}") from None
    if not rl_trainer.planner_for_speed(probe):
      raise ValueError(f"config.planner: the planner stage trains the selection policy on "
                       f"lossless rollouts (train_policy='selector', decode.verify='lossless'); "
                       f"got train_policy={probe.train_policy!r}, decode.verify="
                       f"{probe.decode.get('verify', 'off')!r}")
  if any(m in DRAFTED for m in models):
    try:
      drafter.check_config(drafter_config(config, "", ""), need_model=False)
    except ValueError as e:
      raise ValueError(f"config.drafter: {e}") from None
  if any(m in DISTILLED for m in models):
    probe = distill_config(config, "", "")
    probe.base_dir, probe.output_dir = config.eval.data, "-"  # the fields it fills itself
    try:
      distill.check_config(probe, need_dirs=False)
    except ValueError as e:
      raise ValueError(f"config.distill: {e}") from None
  steps, epochs = config.train.num_train_steps, config.train.num_epochs
  require(is_int(steps) and (steps > 0 or (steps == 0 and is_int(epochs) and epochs > 0)),
          "train.num_train_steps", steps, "a positive int (the models train for the same "
          "number of steps), or 0 with train.num_epochs > 0 (the same samples)")
  pretrained = config.base.get("pretrained", "")
  if pretrained:
    check_pretrained_base(pretrained)
    if config.base.num_train_steps:
      raise ValueError("config.base.pretrained and config.base.num_train_steps > 0 both ask "
                       "for a base: set one (pretrained='' trains stage 1 instead)")
  base_steps = config.base.num_train_steps
  require(is_int(base_steps) and base_steps >= 0, "base.num_train_steps", base_steps,
          "an int >= 0 (0 = no base stage)")
  base_lr = config.base.learning_rate
  if base_steps:
    require(is_real(base_lr) and base_lr > 0, "base.learning_rate", base_lr, "a number > 0")
  rows = tuple(config.eval.rows)
  if not rows:
    raise ValueError("config.eval.rows is empty")
  for name in rows:
    if name not in ROWS:
      raise ValueError(f"config.eval.rows: unknown row {name!r}; known: {list(ROWS)}")
    for needed in (ROWS[name].model, ROWS[ROWS[name].settings_of].model
                   if ROWS[name].settings_of else None, ROWS[name].plan_by):
      if needed is not None and needed not in models:
        raise ValueError(f"config.eval.rows: row {name!r} needs the {needed!r} model, "
                         f"which config.models={models!r} does not train")
  if not os.path.isfile(config.eval.data):
    raise ValueError(f"config.eval.data={config.eval.data!r} is not a file")
  runtime.check_compile_cache(config.get("compile_cache_dir", runtime.AUTO),
                              "config.compile_cache_dir")
  for field in ("batch_size", "prompt_bucket", "speed_repeats"):
    value = config.eval[field]
    require(is_int(value) and value > 0, f"eval.{field}", value, "a positive int")
  for field in ("per_task", "speed_per_task"):
    value = config.eval[field]
    require(is_int(value) and value >= 0, f"eval.{field}", value, "an int >= 0")
  missing = [t for t in tasks_lib.TASKS if t not in config.decode.tasks]
  if missing:
    raise ValueError(f"config.decode.tasks has no settings for task(s) {missing}")
  configs = row_decode_configs(config)
  if select_enabled(config):
    if not searched_rows(config):
      raise ValueError("config.select.enabled=true chooses ReFusion rows' settings; "
                       "config.eval.rows has none")
    if not os.path.isfile(config.select.data):
      raise ValueError(f"config.select.data={config.select.data!r} is not a file")
    if os.path.abspath(config.select.data) == os.path.abspath(config.eval.data):
      raise ValueError("config.select.data is the test split (config.eval.data): decode "
                       "settings must be chosen on a validation split")
    for param in SWEEP_PARAMS:
      if not tuple(config.sweep_grid[param]):
        raise ValueError(f"config.sweep_grid.{param} is empty")
    # The search may pair any slot size it tries with any block size it tries.
    for task in tasks_lib.TASKS:
      slots = set(config.sweep_grid.slot_size) | {config.decode.tasks[task].slot_size}
      blocks = set(config.sweep_grid.block_size) | {config.decode.tasks[task].block_size}
      for k in sorted(slots):
        for b in sorted(blocks):
          if b % k:
            raise ValueError(f"config.sweep_grid: the validation search may pair slot_size={k} "
                             f"with block_size={b} (task {task!r}), and {b} is not a multiple "
                             f"of {k}")
  if config.sweep:
    if "refusion" not in models:
      raise ValueError("config.sweep=true needs the 'refusion' model in config.models")
    per_task = config.sweep_grid.per_task
    require(is_int(per_task) and per_task > 0, "sweep_grid.per_task", per_task,
            "a positive int")
    sweep_configs(config)  # raises on a bad grid value
  return configs
