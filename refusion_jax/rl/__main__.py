"""`python -m refusion_jax.rl --config=configs/rl_tiny.py --config.model_dir=M --config.output_dir=O`."""

from ml_collections import config_flags

from refusion_jax import entry_flags
from refusion_jax.rl import trainer

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "RL config file (configs/rl_tiny.py).", lock_config=True)

if __name__ == "__main__":
  # Bad settings and inputs (config fields, folders, data rows) are ValueErrors: one line.
  entry_flags.run_program(lambda argv: trainer.main(argv, _CONFIG), "refusion_jax.rl",
                          user_errors=(ValueError, FileNotFoundError))
