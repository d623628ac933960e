"""Training, one concern per module (the entry point is refusion_jax/train.py).

  settings.py   config checks and what a valid config resolves to (devices, mesh,
                tokenizer, model config), before any device work
  trainer.py    optimizer, step rngs, the sharded jitted train / eval steps, HF init rows
  loop.py       train_and_evaluate: resume, step, log, checkpoint, evaluate, export
"""
