"""The decoding methods' options: each method registers once, here (no JAX import).

A method's class (`options.register`) holds its own fields with their rules,
descriptions and static / traced split, the rules between them (`check`), what it
needs of a model (`check_model`) and how its fields reach its compiled program
(`static`, `traced`). ReFusion's slot planners register the same way, as a group
its `planner` field chooses from (the MCTS planner: a host-side decoder). The
`DecodeConfig` that holds a method's options beside the shared settings is
settings.py.

Adding an option: a field of its method's class below (and, when it reaches the
program, its entry in the method's `Spec` or `Knobs` in decode/<method>.py), its
use in the decoder, and a test. Every surface (config files, lm-eval's model
arguments, the server's buckets, aot, cache keys, results files) follows.
"""

import dataclasses

import numpy as np

from refusion_jax.decode import options as opts
from refusion_jax.decode.options import (
  BOOL,
  NON_NEGATIVE,
  OPEN_UNIT,
  POSITIVE_INT,
  UNIT,
  MethodOptions,
  Rule,
  choice,
  one_of,
  option,
  register,
)

# ReFusion's verified infill (ALGORITHM.md "Past the paper"): "off" (the release),
# "correct" (the first draft that fails tau_t becomes the causal argmax), "exact" (a draft
# stands only where it is the causal argmax).
VERIFY_MODES = ("off", "correct", "exact", "lossless")
# The selection policy's per-slot features (decode/refusion.py plan_features) and the
# scale of its initial weights: sigmoid(PLAN_INIT_SCALE (p_first - tau_s)), a soft tau_s.
PLAN_FEATURES = ("p_first", "p_slot", "distance", "left_committed", "progress")
PLAN_INIT_SCALE = 20.0
# MDM: LLaDA's ranking, then Dream's samplers (its generation `alg`).
MDM_RANKINGS = ("confidence", "maskgit_plus", "topk_margin", "entropy", "origin")
# MDM: LLaDA's even split of a block's tokens over its steps, Dream's linear schedule.
MDM_SCHEDULES = ("llada", "dream")
# MDM: Fast-dLLM's prefix cache and dual cache.
MDM_CACHES = ("prefix", "dual")
# The smallest timestep of Dream's schedule (its diffusion_generate's `eps` default).
MDM_SCHEDULE_EPS = 1e-3


# Declarations several methods share (one flat name, one meaning).

def _block_size():
  return option(32, "b: tokens per serial block (ReFusion: a multiple of slot_size)",
                rule=POSITIVE_INT)


def _mdm_tokens_per_step():
  return option(1, "MDM / BD3-LM (LLaDA): tokens unmasked per step, unless mdm_threshold "
                "is set", rule=POSITIVE_INT, kind="traced")


def _mdm_threshold():
  return option(None, "MDM / BD3-LM (Fast-dLLM): every masked token at or above it is "
                "unmasked (at least one; BD3-LM: above it, strictly)",
                rule=UNIT.or_none(), kind="traced")


def _off_is_minus_one(value) -> np.float32:
  """An optional rule's value as a knob: -1 when unset (no probability is below it)."""
  return np.float32(-1.0 if value is None else value)


def _check_blocks(dc, block_size: int) -> None:
  if dc.gen_length % block_size:
    raise ValueError(f"decode.gen_length={dc.gen_length} must be a multiple of "
                     f"decode.block_size={block_size}")


def _needs_mask_token(dc, model_config) -> None:
  if model_config.mask_token_id is None:
    raise ValueError(f"decode.method={dc.method!r} needs a mask token, but the model config "
                     "has mask_token_id=None")


def _decode_as(objective: str) -> str:
  """The decode method a model trained with `objective` decodes with, as advice."""
  method = {"refusion": "refusion", "arm": "ar", "mdm": "mdm"}.get(objective)
  return f": decode it with decode.method={method!r}" if method else ""


def _needs_attention(model_config, attention: str, message: str) -> None:
  if model_config.attention != attention:
    raise ValueError(f"{message}, got {model_config.attention!r}")


# --- ReFusion's slot planners --------------------------------------------------------------


@register
@dataclasses.dataclass(frozen=True)
class ThresholdPlanner(MethodOptions):
  """The release's rule: the plan picks every slot whose first token's probability
  exceeds tau_s (slot_threshold), the most likely one when none does."""

  name = "threshold"
  title = "the threshold planner"
  group = "planner"


def _plan_weights_rule() -> Rule:
  n = len(PLAN_FEATURES) + 1
  return Rule(lambda w: isinstance(w, tuple) and (not w or len(w) == n) and all(
      opts.is_number(x) for x in w),
              f"be () or {n} finite numbers (a weight per feature {PLAN_FEATURES}, then the "
              "bias)")


@register
@dataclasses.dataclass(frozen=True)
class PolicyPlanner(MethodOptions):
  """A small selection policy (base frozen, trained by refusion_jax.rl): slot s is chosen
  with probability sigmoid(w . f_s + b) over PLAN_FEATURES; the most likely slot when
  none is. Traced: new weights never recompile."""

  name = "policy"
  title = "the policy planner"
  group = "planner"

  plan_weights: tuple = option(
      (), "w then b (refusion_jax.rl's plan_weights.json); () = the soft threshold "
      "sigmoid(PLAN_INIT_SCALE (p_first - slot_threshold))", rule=_plan_weights_rule(),
      kind="traced")
  plan_sample: bool = option(False, "each slot drawn from its probability (RL rollouts); "
                             "else chosen above one half", rule=BOOL, kind="traced")

  def __post_init__(self):
    if isinstance(self.plan_weights, list):
      object.__setattr__(self, "plan_weights", tuple(self.plan_weights))
    super().__post_init__()

  def check(self, dc) -> None:
    r = dc.options
    # Lossless decoding drafts the chosen slots' masks (decode/lossless.py `_plan`): the
    # choice changes the passes, never the answer.
    on = [x for x in _verify_or_remask(r) if x != "verify='lossless'"]
    if r.left_to_right or on:
      raise ValueError(
          "decode.planner='policy' chooses ReFusion's slots at each plan step (method="
          f"'refusion', left_to_right=False, verify='off' or 'lossless', remask=False); got method="
          f"{dc.method!r}, left_to_right={r.left_to_right}, verify={r.verify!r}, "
          f"remask={r.remask}")


@register
@dataclasses.dataclass(frozen=True)
class MctsPlanner(MethodOptions):
  """An MCTS search over which slot to commit next (decode/mcts.py): one slot per plan
  step with the left-to-right ablation's fill; host-driven, batch 1 per prompt."""

  name = "mcts"
  title = "the MCTS planner"
  group = "planner"
  host_decoder = "refusion_jax.decode.mcts:Decoder"

  mcts_budget: int = option(16, "simulations per plan step", rule=POSITIVE_INT, kind="host")
  mcts_c: float = option(1.0, "PUCT exploration", rule=NON_NEGATIVE, kind="host",
                         label="PUCT exploration")
  mcts_batch: int = option(8, "simulations per batched forward", rule=POSITIVE_INT,
                           kind="host")

  def check(self, dc) -> None:
    r = dc.options
    if r.left_to_right or _verify_or_remask(r) or r.record or r.recompute_kv:
      raise ValueError(
          "decode.planner='mcts' searches ReFusion's slot order (method='refusion', "
          "left_to_right, recompute_kv and record off, verify='off', remask=False); got "
          f"method={dc.method!r}, left_to_right={r.left_to_right}, "
          f"recompute_kv={r.recompute_kv}, record={r.record}, verify={r.verify!r}, "
          f"remask={r.remask}")


# --- the methods ---------------------------------------------------------------------------


def _verify_or_remask(r) -> list[str]:
  return ([f"verify={r.verify!r}"] if r.verify != "off" else []) + (
      ["remask=True"] if r.remask else [])


@register
@dataclasses.dataclass(frozen=True)
class ReFusionOptions(MethodOptions):
  """ReFusion's plan-and-infill (ALGORITHM.md "Decoding"): the response of gen_length
  tokens is split into blocks of block_size decoded one after another, each made of
  slots of slot_size tokens. Exact definitions of the ablations and of the options past
  the paper (each off by default, so the release's tokens hold) in decode/refusion.py."""

  name = "refusion"
  title = "ReFusion"
  module = "refusion_jax.decode.refusion"

  slot_size: int = option(8, "k: tokens per slot", rule=POSITIVE_INT)
  block_size: int = _block_size()
  slot_threshold: float = option(0.9, "tau_s: the plan picks slots whose first-token "
                                 "probability exceeds it", rule=UNIT, kind="traced")
  token_threshold: float = option(0.4, "tau_t: verification accepts tokens whose AR "
                                  "probability exceeds it", rule=UNIT, kind="traced")
  left_to_right: bool = option(
      False, "ablation: one slot per step in position order, its first token from a plan "
      "pass, the rest one AR pass a token (no drafting, thresholds unused)", rule=BOOL,
      switch="is a ReFusion decoding ablation")
  recompute_kv: bool = option(
      False, "ablation: after an infill commits two or more slots, one causal pass "
      "recomputes their KV (the paper's Table 8)", rule=BOOL, kind="traced",
      switch="is a ReFusion decoding ablation")
  verify: str = option(
      "off", "past the paper: drafts checked against the causal argmax a pass computed, the "
      "first failing one replaced by it ('correct': a draft also stands above tau_t; "
      "'exact': only the argmax); 'lossless': the answer of decode.method='ar' token for "
      "token, at every temperature (decode/lossless.py); 'off' = the release",
      rule=one_of(VERIFY_MODES),
      switch="checks ReFusion's slots")
  boundary_check: bool = option(
      True, "with verify: slot-first tokens too, against a committed left neighbour's "
      "prediction (a train.boundary_label model)", rule=BOOL, kind="traced", under="verify")
  remask: bool = option(
      False, "past the paper: a slot committed before its left neighbour is re-checked when "
      "that neighbour commits, masked again from its first token at most remask_threshold",
      rule=BOOL, switch="checks ReFusion's slots")
  remask_threshold: float = option(0.5, "tau_remask: masked again from the first token at "
                                   "most this", rule=UNIT, kind="traced", label="tau_remask",
                                   under="remask")
  sample_drafts: bool = option(
      False, "RL rollouts: the infill's drafts drawn at the temperature as the plan's are "
      "(off: argmax, the release)", rule=BOOL, kind="traced",
      switch="samples ReFusion's infill drafts")
  record: bool = option(
      False, "RL rollouts: each committed token's deciding pass recorded "
      "(DecodeOutput.trace, scored by rl.replay; with verify='lossless' each final token's "
      "probability at the temperature, trace['p'])", rule=BOOL,
      switch="records ReFusion's parallel plan-and-infill")
  planner: MethodOptions = choice("planner", "threshold", "the slot planner: 'threshold' "
                                  "(tau_s), 'policy' or 'mcts' (a host-side search)")

  def check(self, dc) -> None:
    if self.block_size % self.slot_size:
      raise ValueError(f"decode.block_size={self.block_size} must be a multiple of "
                       f"decode.slot_size={self.slot_size}")
    _check_blocks(dc, self.block_size)
    if self.left_to_right and self.recompute_kv:
      raise ValueError(
          "decode.left_to_right=True and decode.recompute_kv=True cannot be combined: "
          "left-to-right decoding has no parallel infill, so there is no KV to recompute")
    if self.remask and self.left_to_right:
      raise ValueError("decode.remask=True re-checks a slot committed before its left "
                       "neighbour; decode.left_to_right=True commits slots in position order, "
                       "so there is none")
    if self.verify == "lossless":
      clash = [f"{name}=True" for name in ("left_to_right", "recompute_kv", "remask",
                                           "sample_drafts") if getattr(self, name)]
      if clash:
        raise ValueError(
            "decode.verify='lossless' checks every token causally in one fused pass (no "
            "left-to-right ablation, infill KV, re-masking or sampled infill drafts); got "
            + ", ".join(clash))
    if self.record and self.verify != "lossless" and (self.left_to_right
                                                      or _verify_or_remask(self)):
      raise ValueError(
          "decode.record=True records ReFusion's parallel plan-and-infill (method='refusion', "
          f"left_to_right=False, verify='off', remask=False); got method={dc.method!r}, "
          f"left_to_right={self.left_to_right}, verify={self.verify!r}, remask={self.remask}")

  def check_model(self, dc, model_config) -> None:
    if getattr(model_config, "objective", "") == "bd3lm":
      raise ValueError("decode.method='refusion' decodes slots a BD3-LM model never learnt "
                       "(ModelConfig.objective='bd3lm'): decode it with decode.method='bd3lm'")
    _needs_mask_token(dc, model_config)
    if model_config.shift_logits:
      raise ValueError(f"ReFusion decoding reads each slot's own logits; a "
                       f"{model_config.model_type!r} model predicts token i at position i-1 "
                       "(ModelConfig.shift_logits): decode it with decode.method='mdm'")

  @property
  def plan_weights_on(self) -> tuple:
    """The selection policy's weights then bias (its `plan_weights`, or the soft
    threshold at tau_s)."""
    weights = getattr(self.planner, "plan_weights", ())
    if weights:
      return tuple(float(x) for x in weights)
    return (PLAN_INIT_SCALE,) + (0.0,) * (len(PLAN_FEATURES) - 1) + (
        -PLAN_INIT_SCALE * float(self.slot_threshold),)

  def program_module(self, dc) -> str:
    # Lossless decoding is a program of its own over the same Spec and Knobs.
    return "refusion_jax.decode.lossless" if self.verify == "lossless" else self.module

  def static(self, dc) -> dict:
    # Left to right, blocks play no part (one program for every block size).
    return dict(slot_size=self.slot_size,
                block_size=dc.gen_length if self.left_to_right else self.block_size,
                left_to_right=self.left_to_right, verify=self.verify in ("correct", "exact"),
                remask=self.remask and not self.left_to_right,
                record=self.record and not self.left_to_right,
                plan_policy=self.planner.name == "policy" and not self.left_to_right)

  def traced(self, dc) -> dict:
    weights = self.plan_weights_on
    return dict(slot_threshold=np.float32(self.slot_threshold),
                token_threshold=np.float32(self.token_threshold),
                recompute_kv=np.bool_(self.recompute_kv),
                verify_exact=np.bool_(self.verify == "exact"),
                boundary_check=np.bool_(self.boundary_check),
                remask_threshold=np.float32(self.remask_threshold),
                sample_drafts=np.bool_(self.sample_drafts),
                plan_w=np.asarray(weights[:-1], np.float32), plan_b=np.float32(weights[-1]),
                plan_sample=np.bool_(getattr(self.planner, "plan_sample", False)))


@register
@dataclasses.dataclass(frozen=True)
class ArOptions(MethodOptions):
  """Greedy or sampled left-to-right decoding with a KV cache (a causal model)."""

  name = "ar"
  title = "AR"
  module = "refusion_jax.decode.autoregressive"

  def check_model(self, dc, model_config) -> None:
    _needs_attention(model_config, "causal", "AR decoding needs a causal model, but "
                     "ModelConfig.attention")


@register
@dataclasses.dataclass(frozen=True)
class MdmOptions(MethodOptions):
  """Masked diffusion (a bidirectional model) block by block: LLaDA's sampler, Dream's
  samplers and Fast-dLLM's caches and rules (decode/mdm.py)."""

  name = "mdm"
  title = "MDM"
  module = "refusion_jax.decode.mdm"

  block_size: int = _block_size()
  mdm_tokens_per_step: int = _mdm_tokens_per_step()
  mdm_threshold: float | None = _mdm_threshold()
  mdm_ranking: str = option(
      "confidence", "which masked positions of the block a step unmasks: 'confidence' "
      "(LLaDA: the draft's plain softmax probability); Dream's, under the softmax at the "
      "temperature: 'maskgit_plus' (the draft's probability), 'topk_margin' (top-1 minus "
      "top-2), 'entropy' (negative entropy), 'origin' (each masked position revealed with "
      "probability 1 - s/t; needs mdm_steps)", rule=one_of(MDM_RANKINGS), switch=True)
  mdm_steps: int | None = option(
      None, "a schedule of this many steps in all (a multiple of the blocks; block_size = "
      "gen_length: one canvas, as Dream decodes); unset: mdm_tokens_per_step a step",
      rule=POSITIVE_INT.or_none("unmask mdm_tokens_per_step a step"), switch=True)
  mdm_schedule: str | None = option(
      None, "how mdm_steps share a block's tokens: 'llada' (evenly) or 'dream' (its linear "
      "schedule on timesteps linspace(1, MDM_SCHEDULE_EPS, n + 1)); unset: LLaDA's with the "
      "'confidence' ranking, else Dream's", rule=one_of(MDM_SCHEDULES).or_none("by "
                                                                           "mdm_ranking"))
  mdm_ban_eos: bool = option(False, "LLaDA's logits_eos_inf: EOS is never drafted", rule=BOOL,
                             kind="traced", switch="is one of LLaDA's sampler options")
  mdm_defer_stop: bool = option(
      False, "LLaDA's confidence_eos_eot_inf: a draft that is EOS or a stop id scores 0, so "
      "it waits to the block's last steps", rule=BOOL, kind="traced",
      switch="is one of LLaDA's sampler options")
  mdm_cfg_scale: float = option(
      0.0, "classifier-free guidance scale s: cond + s (cond - uncond), uncond with the "
      "prompt masked (a second forward, so whether s > 0 is static); 0: off",
      rule=Rule(lambda v: opts.is_number(v) and v >= 0, "be a number >= 0 (0: no guidance)"),
      kind="traced", switch="is one of LLaDA's sampler options")
  mdm_cache: str | None = option(
      None, "Fast-dLLM's approximate KV cache: 'prefix' (the block and what follows it "
      "fed, attending to the cached prefix) or 'dual' (the block alone); unset: none",
      rule=one_of(MDM_CACHES).or_none("no cache"), switch="is one of Fast-dLLM's options")
  mdm_cache_refresh: int = option(
      0, "with mdm_cache: a full pass also every this many steps of a block (0: at block "
      "starts only)", rule=opts.non_negative_int("0: at block starts only"), kind="traced",
      under="mdm_cache")
  mdm_factor: float | None = option(
      None, "Fast-dLLM's factor rule f: the n most confident with (n + 1)(1 - c_n) < f "
      "unmasked (the first always); unset: off",
      rule=Rule(lambda v: opts.is_number(v) and v > 0, "be a number > 0").or_none(),
      kind="traced", switch="is one of Fast-dLLM's options")

  @property
  def mdm_schedule_on(self) -> str:
    """`mdm_schedule` resolved: "llada" for the "confidence" ranking, else "dream"."""
    if self.mdm_schedule is not None:
      return self.mdm_schedule
    return "llada" if self.mdm_ranking == "confidence" else "dream"

  def steps_per_block(self, dc) -> int | None:
    """Steps of the schedule per block (None: no schedule)."""
    return None if self.mdm_steps is None else self.mdm_steps // dc.num_blocks

  def check(self, dc) -> None:
    _check_blocks(dc, self.block_size)
    steps = self.mdm_steps
    if steps is not None and steps % dc.num_blocks:
      raise ValueError(
          f"decode.mdm_steps={steps} must be a multiple of the number of blocks "
          f"(decode.gen_length / decode.block_size = {dc.num_blocks}): each block takes "
          "mdm_steps / blocks steps")
    if self.mdm_ranking == "origin" and steps is None:
      raise ValueError("decode.mdm_ranking='origin' reveals each masked position with "
                       "probability 1 - s/t of Dream's schedule; it needs decode.mdm_steps")
    rules = [f"decode.{n}={getattr(self, n)}" for n in ("mdm_threshold", "mdm_steps",
                                                         "mdm_factor")
             if getattr(self, n) is not None]
    if len(rules) > 1:
      raise ValueError(f"{' and '.join(rules)} are {('two', 'three')[len(rules) - 2]} rules "
                       "for how many tokens a step unmasks; set one")
    for name in ("mdm_threshold", "mdm_defer_stop", "mdm_factor"):
      if getattr(self, name) not in (None, False) and self.mdm_ranking != "confidence":
        raise ValueError(f"decode.{name} compares tokens' probabilities; it needs "
                         f"decode.mdm_ranking='confidence', got {self.mdm_ranking!r}")
    if self.mdm_ranking == "origin" and self.mdm_schedule == "llada":
      raise ValueError("decode.mdm_ranking='origin' reveals positions with the probabilities "
                       "of Dream's schedule; it needs decode.mdm_schedule='dream' (or None)")
    if self.mdm_cache_refresh and self.mdm_cache is None:
      raise ValueError(f"decode.mdm_cache_refresh={self.mdm_cache_refresh} refreshes a cache; "
                       "decode.mdm_cache is None (set 'prefix' or 'dual')")
    if self.mdm_cache and self.mdm_cfg_scale:
      raise ValueError("decode.mdm_cache with decode.mdm_cfg_scale > 0: classifier-free "
                       "guidance runs without a cache (Fast-dLLM has no guidance)")

  def check_model(self, dc, model_config) -> None:
    # A causal model never saw masked tokens after its context: MDM decoding would be noise.
    _needs_attention(model_config, "bidirectional", "MDM decoding needs a bidirectional "
                     "model (ModelConfig.attention='bidirectional')")
    _needs_mask_token(dc, model_config)

  def static(self, dc) -> dict:
    steps = self.steps_per_block(dc) or 0
    out = dict(block_size=self.block_size, mdm_ranking=self.mdm_ranking,
               mdm_steps_per_block=steps,
               mdm_schedule=self.mdm_schedule_on if steps and self.mdm_ranking != "origin"
               else "",
               mdm_cfg=self.mdm_cfg_scale > 0, mdm_cache=self.mdm_cache or "")
    if not self.mdm_cache:  # the whole canvas each step: no KV buffer to read in chunks
      out["kv_chunk"] = 0
    return out

  def traced(self, dc) -> dict:
    return dict(mdm_threshold=_off_is_minus_one(self.mdm_threshold),
                mdm_tokens_per_step=np.int32(self.mdm_tokens_per_step),
                mdm_ban_eos=np.bool_(self.mdm_ban_eos),
                mdm_defer_stop=np.bool_(self.mdm_defer_stop),
                cfg_scale=np.float32(self.mdm_cfg_scale),
                mdm_factor=_off_is_minus_one(self.mdm_factor),
                cache_refresh=np.int32(self.mdm_cache_refresh))


@register
@dataclasses.dataclass(frozen=True)
class Bd3lmOptions(MethodOptions):
  """Block diffusion (BD3-LM): blocks decoded one after another over a KV cache, each by
  unmasking (LLaDA's count or Fast-dLLM's threshold a step)."""

  name = "bd3lm"
  title = "BD3-LM"
  module = "refusion_jax.decode.bd3lm"

  block_size: int = _block_size()
  mdm_tokens_per_step: int = _mdm_tokens_per_step()
  mdm_threshold: float | None = _mdm_threshold()

  def check(self, dc) -> None:
    _check_blocks(dc, self.block_size)

  def check_model(self, dc, model_config) -> None:
    trained = getattr(model_config, "objective", "")
    if trained and trained != "bd3lm":
      raise ValueError(f"decode.method='bd3lm' decodes a model trained with the BD3-LM "
                       f"objective; this one was trained with {trained!r} (ModelConfig."
                       f"objective){_decode_as(trained)}")
    # Committed blocks live in a KV cache computed once: a bidirectional model's earlier
    # tokens would have to see the later blocks, which a cache cannot give.
    _needs_attention(model_config, "causal", "BD3-LM decoding needs a causal-backbone model "
                     "trained with the BD3-LM layout (ModelConfig.attention='causal'; a "
                     "bidirectional MDM model decodes with decode.method='mdm')")
    _needs_mask_token(dc, model_config)

  def traced(self, dc) -> dict:
    return dict(mdm_threshold=_off_is_minus_one(self.mdm_threshold),
                mdm_tokens_per_step=np.int32(self.mdm_tokens_per_step))


def _d2f_threshold(default: float, doc: str):
  return option(default, doc, rule=OPEN_UNIT, kind="traced")


@register
@dataclasses.dataclass(frozen=True)
class D2fOptions(MethodOptions):
  """Discrete diffusion forcing (D2F, ALGORITHM.md "Table 1's baselines"): blocks
  pipelined over an exact KV cache by three thresholds."""

  name = "d2f"
  title = "D2F"
  module = "refusion_jax.decode.d2f"

  block_size: int = _block_size()
  d2f_add_threshold: float = _d2f_threshold(0.1, "tau_add: a block of masks is appended "
                                            "once the last block is this decoded")
  d2f_act_threshold: float = _d2f_threshold(0.95, "tau_act: a block is fully activated "
                                            "once its predecessor is this decoded")
  d2f_conf_threshold: float = _d2f_threshold(0.9, "tau_conf: every active block commits its "
                                             "masked tokens above it (a fully activated one "
                                             "at least its most confident)")
  d2f_window: int = option(4, "blocks in flight at most (the widest pass d2f_window * "
                           "block_size tokens)", rule=Rule(POSITIVE_INT.test,
                                                           "be a positive int (blocks in flight)"))

  def check(self, dc) -> None:
    _check_blocks(dc, self.block_size)

  def check_model(self, dc, model_config) -> None:
    _needs_attention(model_config, "bidirectional", "D2F decoding needs an MDM (ModelConfig."
                     "attention='bidirectional') with a D2F adapter, got attention")
    _needs_mask_token(dc, model_config)

  def static(self, dc) -> dict:
    return dict(block_size=self.block_size, d2f_window=min(self.d2f_window, dc.num_blocks))

  def traced(self, dc) -> dict:
    return dict(d2f_add=np.float32(self.d2f_add_threshold),
                d2f_act=np.float32(self.d2f_act_threshold),
                d2f_conf=np.float32(self.d2f_conf_threshold))
