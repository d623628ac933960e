"""Training, one concern per module (the entry point is refusion_jax/train.py).

  loop.py        the loop every trainer shares (supervised, `distill`, `rl.trainer`):
                 restore, step, checkpoint, SIGTERM / Ctrl-C, metrics, progress
  metrics.py     the metrics writer: W/metrics.jsonl, TensorBoard, the progress bar
  settings.py    config checks and what a valid config resolves to (devices, mesh,
                 tokenizer, model config), before any device work
  trainer.py     optimizer, step rngs, the sharded jitted train / eval steps, HF init rows
  supervised.py  train_and_evaluate: checks, the supervised task on the loop, export
  outputs.py     the files a run writes, and the export guard
"""
