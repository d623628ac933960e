"""The slot planner trained for speed on the lossless sampler (python -m refusion_jax.rl).

  python -m refusion_jax.rl --config=configs/planner_lossless.py \\
      --config.model_dir=runs/repro_tiny/models/refusion_bl/final_model --config.output_dir=OUT

configs/rl_lossless.py with the selection policy trained in place of the model
(`train_policy='selector'`, base frozen): under lossless decoding the slots a pass drafts
change no answer, only the passes, so each rollout's reward is its tokens per forward and
GRPO compares the plans of one prompt's greedy rollouts (the same answer, the slots drawn
from the policy). OUT/plan_weights.json decodes with `--decode.planner=policy
--decode.plan_weights=...` (benchmarks/planner_speed.py measures it against the threshold
rule at identical answers).
"""

from configs import rl_lossless


def get_config():
  c = rl_lossless.get_config()
  c.train_policy = "selector"
  c.decode.temperature = 0.0  # greedy answers: a group differs in its plans alone
  # The start: every slot drawn with probability one half (the soft threshold at tau_s 0
  # chooses every slot almost surely: no plan of a group would differ).
  c.decode.plan_weights = (0.0,) * 6
  c.beta = 0.0  # no reference: the plan cannot move an answer away from the model's
  c.learning_rate = 0.05
  c.steps = 200
  c.save_every = 50
  return c
