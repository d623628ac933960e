"""LLaDA-8B-Instruct (a HF folder) on one of the paper's benchmarks, with LLaDA's own
evaluation settings for that benchmark.

  python -m refusion_jax.evaluate --config=configs/eval/llada.py:gsm8k \\
      --config.model_dir=LLADA_DIR --config.output_dir=OUT

The argument after ":" is the benchmark (refusion_jax/lmeval/benchmarks.py; default
gsm8k). ReFusion does not state how it decoded LLaDA; these are the settings LLaDA's
authors evaluated the Instruct model with (its EVAL.md, "pure diffusion sampling", the
settings behind LLaDA's own Tables 1-2): greedy low-confidence remasking, one token a
step (steps = gen_length), one block the length of the answer, no guidance, and per
benchmark the answer length and the two EOS flags below. The prompts and answer checks
are the paper's harness (lm-eval), not LLaDA's OpenCompass, so the scores are not
LLaDA's published ones. `SEMI_AR` holds EVAL.md's semi-autoregressive variants
(GSM8K, MATH): `--config=configs/eval/llada.py:gsm8k-semi_ar`.
"""

from configs.eval import common

# benchmark: (gen_length, block_size, mdm_ban_eos = logits_eos_inf,
#             mdm_defer_stop = confidence_eos_eot_inf)
OFFICIAL = {
    "mmlu_pro": (256, 256, False, False),
    "arc_c": (512, 512, False, False),
    "gsm8k": (512, 512, False, True),
    "math": (512, 512, False, True),
    "gpqa": (64, 64, False, True),
    "humaneval": (512, 512, True, False),
    "mbpp": (256, 256, False, True),
}
SEMI_AR = {"gsm8k": (256, 8, False, False), "math": (512, 64, False, False)}


def get_config(arg: str = "gsm8k"):
  benchmark, _, variant = (arg or "gsm8k").partition("-")
  c = common.benchmark_config(benchmark)
  table = {"": OFFICIAL, "semi_ar": SEMI_AR}.get(variant)
  if table is None or c.benchmark not in table:
    raise ValueError(f"configs/eval/llada.py: no LLaDA setting {arg!r}; known: "
                     f"{sorted(OFFICIAL)} and {sorted(k + '-semi_ar' for k in SEMI_AR)}")
  gen_length, block_size, ban_eos, defer_stop = table[c.benchmark]
  c.enable_thinking = False  # LLaDA's template has no thinking switch
  c.decode.method = "mdm"
  c.decode.gen_length = gen_length
  c.decode.block_size = block_size
  c.decode.slot_size = block_size  # unused by MDM (block_size must be its multiple)
  c.decode.mdm_ranking = "confidence"  # low_confidence remasking
  c.decode.mdm_steps = gen_length  # one token a step
  c.decode.mdm_schedule = "llada"
  c.decode.mdm_ban_eos = ban_eos
  c.decode.mdm_defer_stop = defer_stop
  c.decode.mdm_cfg_scale = 0.0
  c.decode.temperature = 0.0
  return c
