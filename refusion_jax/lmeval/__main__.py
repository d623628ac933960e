"""lm-eval's own command line with the `refusion_jax` model and our tasks registered.

  python -m refusion_jax.lmeval --model refusion_jax \\
      --model_args model_dir=DIR,method=refusion,slot_size=32,block_size=128,enable_thinking=true \\
      --tasks gsm8k_cot --num_fewshot 0 --apply_chat_template --batch_size 16

lm-eval finds models only among those registered in its process and has no
plugin entry point, so this wrapper imports the registration
(refusion_jax.lmeval.model) and adds our task folder (humaneval_instruct_noprefix,
mbpp_zeroshot) to `--include_path`, then hands every argument to lm-eval.
Code tasks need `--confirm_run_unsafe_code`; their programs run in our
sandbox (refusion_jax/lmeval/sandbox.py). `python -m refusion_jax.evaluate
--config=configs/eval/<benchmark>.py` runs the paper's settings with speed
statistics; this is the plain lm-eval route for any other task.
"""

import sys

from lm_eval.__main__ import cli_evaluate

from refusion_jax import runtime
from refusion_jax.lmeval import (
  benchmarks,
  model,  # noqa: F401  (registers "refusion_jax")
)


def with_our_tasks(argv: list[str]) -> list[str]:
  """`argv` with our task folder as --include_path (lm-eval takes one folder)."""
  for arg in argv:
    if arg == "--include_path" or arg.startswith("--include_path="):
      raise SystemExit(
          "refusion_jax.lmeval: --include_path is set to our task folder "
          f"({benchmarks.TASKS_DIR}) and lm-eval takes only one; put your task YAMLs "
          "beside a copy of that folder's files and run lm-eval with that folder, after "
          "`import refusion_jax.lmeval.model` in the same process")
  return list(argv) + ["--include_path", benchmarks.TASKS_DIR]


def main() -> None:
  runtime.start_up(runtime.AUTO)  # quiet where no TPU is; programs kept by the one rule
  sys.argv = [sys.argv[0]] + with_our_tasks(sys.argv[1:])
  cli_evaluate()


if __name__ == "__main__":
  main()
