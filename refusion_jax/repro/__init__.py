"""The miniature reproduction, one concern per module (the entry point is
refusion_jax/reproduce.py).

  settings.py   decoder rows, decode settings per row and task, sweep points, and
                every check of a reproduction config (the shipped base's SHA-256 too)
  stages.py     training: the base (stage 1) and the models fine-tuned from it
  scoring.py    cached evaluations: the table's rows, the validation search, the sweep
  report.py     the table, the targets, the sweep table and the plots
  pipeline.py   run(config, workdir): the stages in order, the files written
"""
