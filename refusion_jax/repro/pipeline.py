"""The paper's main comparison in miniature, from config to report: `run(config, W)`.

0. Stage 1 (`config.base.num_train_steps` > 0) trains one causal ARM "base"
   model in `W/models/base` and exports it in HF layout (`W/models/base/hf`),
   the miniature of the paper's pretrained Qwen3 start; or the shipped base
   (`config.base.pretrained`, SHA-256 checked) stands in for it.
1. Trains ARM, MDM and ReFusion models of one size on the same data for the
   same number of tokens (`config.train`, only the objective and MDM's
   bidirectional attention differ) in `W/models/<name>`: with a base, each is
   fine-tuned from it (`init_from_hf`); without, each starts from scratch. An
   interrupted run resumes from the trainer's checkpoints; a finished stage
   (the base included) is skipped (`stages`). Then the models and planners made
   from trained ones (D2F's distillation, RL, draft adapters, the slot planner).
2. With `config.select.enabled`, chooses ReFusion's decode settings per task
   on the validation split (`scoring.select_settings`), once for each searched
   row (`settings.searched_rows`: the plain decoder, and each "Past the paper"
   row with its own model or options).
3. Scores every decoder row on the held-out problems, each result cached in
   `W/results/<row>.json` (`scoring.evaluate_rows`).
4. Writes `W/table.md` and `W/speed_accuracy.png` (`report`) and prints the
   table. With `config.sweep`, also `W/sweep.md` and `W/sweep.png` (the
   paper's Figure 4: ReFusion's accuracy and speed as slot size and each
   threshold vary).
"""

from __future__ import annotations

import datetime
import os
import time

from refusion_jax import fileio, runtime
from refusion_jax.repro import report, scoring, settings, stages
from refusion_jax.training import settings as train_settings

TABLE_FILE = "table.md"
PLOT_FILE = "speed_accuracy.png"
SWEEP_PLOT_FILE = "sweep.png"
SWEEP_TABLE_FILE = "sweep.md"


def run(config, workdir: str, log=print) -> dict:
  """Trains, evaluates, writes table.md and speed_accuracy.png; returns the results."""
  if not workdir:
    raise ValueError("--workdir is required")
  workdir = os.path.abspath(workdir)
  row_configs = settings.validate(config)
  runtime.use_compile_cache(config.get("compile_cache_dir", runtime.AUTO))
  os.makedirs(workdir, exist_ok=True)
  t0 = time.perf_counter()
  base, new_base = stages.train_base(config, workdir, log)
  trained = stages.train_models(config, workdir, log, restart=new_base)
  distilled = stages.distill_models(config, workdir, trained, log)
  # Models made from trained ones (D2F's distillation, RL): what the report lists apart.
  distilled.update(stages.reinforce_models(config, workdir, trained, log))
  distilled.update(stages.draft_models(config, workdir, trained, log))
  planners = stages.plan_models(config, workdir, trained, log)
  distilled.update(planners)
  plan_weights = {name: m["plan_weights"] for name, m in planners.items()}
  row_configs = settings.with_planners(row_configs, plan_weights)
  train_seconds = time.perf_counter() - t0
  markers = {**trained, **distilled}  # what each row's results are keyed on
  tokenizer = train_settings.load_tokenizer(config.train)
  models = scoring.TrainedModels(workdir)
  chosen = None
  if settings.select_enabled(config):
    chosen = {row: scoring.select_settings(config, workdir, markers, models, tokenizer, log,
                                           row=row)
              for row in settings.searched_rows(config)}
    row_configs = settings.with_planners(settings.row_decode_configs(config, chosen),
                                         plan_weights)
    if "ReFusion" in chosen:  # what the sweep and the report's settings line start from
      config = settings.with_task_settings(config, chosen["ReFusion"])
  results = scoring.evaluate_rows(config, workdir, row_configs, markers, models, tokenizer, log)
  when = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
  table = report.render_table(config, results, trained, when, scoring.machine(), base,
                              chosen=chosen, distilled=distilled)
  fileio.write_text_atomic(os.path.join(workdir, TABLE_FILE), table)
  report.write_speed_accuracy_plot(results, os.path.join(workdir, PLOT_FILE))
  sweep = None
  if config.sweep:
    sweep = scoring.run_sweep(config, workdir, trained, models, tokenizer, log)
    report.write_sweep_plot(sweep, os.path.join(workdir, SWEEP_PLOT_FILE))
    fileio.write_text_atomic(os.path.join(workdir, SWEEP_TABLE_FILE),
                             report.render_sweep_table(sweep, config.sweep_grid.per_task))
  log(table)
  log(f"[reproduce] wrote {os.path.join(workdir, TABLE_FILE)} and "
      f"{os.path.join(workdir, PLOT_FILE)}" + (" and the sweep" if sweep else "")
      + f" (training phase {train_seconds:.0f}s, total {time.perf_counter() - t0:.0f}s)")
  return {"results": results, "trained": trained, "distilled": distilled, "base": base,
          "table": table,
          "sweep": sweep, "chosen": chosen}
