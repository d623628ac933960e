"""The paper's tables in miniature: `python -m refusion_jax.reproduce --config=configs/repro_tiny.py`.

The paper's Table 2 in miniature: as in the paper (every model fine-tuned from
a pretrained AR model, Qwen3-8B, on the same samples), ARM, MDM, BD3-LM and
ReFusion are each fine-tuned from the shipped pretrained base
(refusion_jax/assets/base_tiny, configs/base_tiny.py) on the same samples, one
epoch of the training split in packed rows (train.* is shared; the objective
and, for MDM, bidirectional attention are set per model by
refusion_jax/repro/stages.py); ReFusion's decode settings (slot size, block
size, tau_s, tau_t) are chosen per task on the validation split, as the
paper's Table 5 varies them per benchmark; then every decoder is scored on
the held-out test split and the report sets the paper's Table 2 beside ours.
`--config.base.pretrained='' --config.base.num_train_steps=2000` trains a base
here first instead. Sized for ~15 minutes on 2 CPU cores, set-up included:
four fine-tunes of a 4-layer d=128 model over the 20,000 training samples (9
packed rows of 64 tokens per step), the validation search and the evaluation.
"""

import ml_collections

from configs import common
from refusion_jax import tasks


def decode_settings(slot_size, block_size, slot_threshold, token_threshold):
  """ReFusion's per-task knobs, the paper's Table 5 columns."""
  d = ml_collections.ConfigDict()
  d.slot_size = slot_size  # k: tokens per slot
  d.block_size = block_size  # b: tokens per serial block (multiple of k)
  d.slot_threshold = slot_threshold  # tau_s: plan picks slots above this first-token prob
  d.token_threshold = token_threshold  # tau_t: verification accepts tokens above this prob
  return d


def get_config():
  c = ml_collections.ConfigDict()

  # Training, shared by the three models (same data, size, steps, tokens).
  c.train = common.base_config()
  c.train.model.num_layers = 4  # d=128, 4 layers (the tiny preset)
  c.train.data.seq_len = 64  # longest bundled example is 58 tokens (prompt + answer + EOS)
  c.train.data.packing = "best_fit"  # whole samples share rows (87% of row tokens real, not 51%)
  c.train.mdm_response_len = 24  # MDM's answers EOS-padded to decode.gen_length, not the row
  c.train.slot_sizes = (2, 4, 8)  # the paper's 4..32 for 512-token answers, scaled to <= 17
  c.train.global_batch_size = 9  # packed rows per step: ~15 samples (ARM, ReFusion; MDM ~9)
  c.train.num_train_steps = 0  # 0: steps from num_epochs, each model's own (MDM's samples,
  #                              EOS-padded to 24 answer tokens, fill more rows)
  c.train.num_epochs = 1  # fine-tune: every model sees the 20,000 training samples once
  c.train.optimizer.learning_rate = 3e-3  # fine-tune peak AdamW rate, the base's own
  c.train.eval_every_steps = 0  # no periodic eval loss: the table is the evaluation
  c.train.checkpoint.every_steps = 100  # resume points if the run is interrupted
  c.train.bd3lm_block_size = 8  # BD3-LM's blocks (the paper's Table 2); its decoder's too
  # Models to train (repro.settings.MODELS): the four objectives, and ReFusion trained with
  # the boundary label (ALGORITHM.md "Past the paper"); then made from them
  # (repro.settings.DISTILLED): "d2f", a D2F adapter distilled from the MDM; and
  # (repro.settings.REINFORCED) "refusion_bl_rl", the boundary-label ReFusion after GRPO on
  # the lossless sampler; (DRAFTED) "refusion_bl_drafter", it with draft adapters trained
  # for acceptance; (PLANNED) "refusion_bl_planner", a slot planner trained for its speed.
  c.models = ("arm", "mdm", "bd3lm", "refusion", "refusion_bl", "d2f", "refusion_bl_rl",
              "refusion_bl_drafter", "refusion_bl_planner")
  # D2F's distillation of the MDM (refusion_jax.distill; configs/d2f_tiny.py's fields,
  # these on top; its samples are train.data.train_files).
  c.distill = ml_collections.ConfigDict()
  c.distill.steps = 600
  c.distill.batch_size = 16
  c.distill.seq_len = 64
  c.distill.block_size = 8  # the MDM's decode block
  c.distill.lora_rank = 16
  c.distill.lora_alpha = 16.0
  c.distill.learning_rate = 1e-3
  # RL of refusion_bl on the lossless sampler (refusion_jax.rl; configs/rl_lossless.py's
  # fields, these on top, `rl.decode.*` included; its prompts are its train_file, the
  # training split; the rollouts answer at decode.gen_length).
  c.rl = ml_collections.ConfigDict()
  c.rl.steps = 400
  c.rl.learning_rate = 5e-5
  # Draft adapters for refusion_bl (refusion_jax.drafter; configs/drafter_tiny.py's fields,
  # these on top; its answers: the model's own to the training split's first prompts).
  c.drafter = ml_collections.ConfigDict()
  c.drafter.steps = 600
  # refusion_bl's slot planner (refusion_jax.rl; configs/planner_lossless.py's fields, these
  # on top: the selection policy on greedy lossless rollouts, reward tokens per forward).
  c.planner = ml_collections.ConfigDict()
  c.planner.steps = 200

  # The base every model starts from (the paper fine-tunes from a pretrained AR model,
  # Qwen3-8B): the shipped pretrained causal ARM (configs/base_tiny.py, trained once by
  # launch/train_base.sh, checked against its SHA-256). With pretrained="" and
  # num_train_steps > 0, stage 1 trains a base here instead and exports it in HF layout;
  # with both unset the three train from scratch. MDM switches to bidirectional attention.
  c.base = ml_collections.ConfigDict()
  c.base.pretrained = common.BASE_TINY_DIR  # HF folder of the shipped base ("" = none)
  c.base.num_train_steps = 0  # stage-1 steps when pretrained="" (0 = no base: from scratch)
  c.base.learning_rate = 6e-3  # stage-1 peak AdamW rate

  # ReFusion's decode settings per task, chosen on the validation split (never the test
  # split) as the paper's Table 5 chooses them per benchmark: each of slot size, tau_s and
  # tau_t in turn over sweep_grid, best validation accuracy, ties to more tokens/forward.
  c.select = ml_collections.ConfigDict()
  c.select.enabled = True  # False: decode.tasks as written below
  c.select.data = common.TINY_VALID  # the validation split
  c.select.per_task = 0  # validation problems per task (0 = all, 30 each)

  # Held-out evaluation.
  c.eval = ml_collections.ConfigDict()
  c.eval.data = common.TINY_TEST  # JSONL of held-out {"query", "response"}
  c.eval.per_task = 0  # problems per task scored for accuracy (0 = all, 30 each)
  c.eval.speed_per_task = 20  # problems per task timed one at a time (batch 1)
  c.eval.speed_repeats = 5  # decodes per timed problem; the fastest counts (drops load pauses)
  c.eval.batch_size = 15  # rows per batched accuracy decode (30 problems per task: 2 batches)
  c.eval.prompt_bucket = 16  # prompts padded to one width, a multiple of this
  c.eval.rows = ("ARM-AR", "MDM-LLaDA", "MDM-FastdLLM", "MDM-FastdLLM-dual", "D2F", "BD3LM",
                 "ReFusion", "ReFusion-L2R",
                 "ReFusion-recompute-KV", "ReFusion-verify", "ReFusion-BL",
                 "ReFusion-BL-verify", "ReFusion-BL-L2R",
                 "ReFusion-BL-remask", "ReFusion-BL-AR",
                 "ReFusion-BL-lossless", "ReFusion-BL-RL", "ReFusion-BL-drafter",
                 "ReFusion-BL-planner")  # decoders in the table
  #                                                             (repro.settings.ROWS)

  # Decoding.
  c.decode = ml_collections.ConfigDict()
  c.decode.gen_length = 24  # every answer (at most 16 tokens + EOS) fits
  c.decode.mdm_block_size = 8  # MDM semi-autoregressive block (LLaDA-style)
  c.decode.mdm_tokens_per_step = 1  # LLaDA: tokens unmasked per denoising step
  c.decode.mdm_threshold = 0.9  # Fast-dLLM: unmask every token above this confidence
  # D2F's thresholds (its LLaDA evaluation's tau_act and tau_conf; tau_add its HumanEval and
  # MATH value); its blocks are the MDM's.
  c.decode.d2f_add_threshold = 0.1
  c.decode.d2f_act_threshold = 0.95
  c.decode.d2f_conf_threshold = 0.9
  c.decode.tasks = ml_collections.ConfigDict()  # ReFusion per task (paper's Table 5)
  for name in tasks.TASKS:
    c.decode.tasks[name] = decode_settings(slot_size=4, block_size=24, slot_threshold=0.9,
                                           token_threshold=0.4)

  # Optional sweep (the paper's Figure 4): ReFusion over slot size and thresholds.
  c.sweep = False  # also run the sweep and write sweep_*.png
  c.sweep_grid = ml_collections.ConfigDict()
  c.sweep_grid.slot_size = (2, 4, 8)  # varied alone (also the validation search's grid)
  c.sweep_grid.block_size = (8, 24)  # varied alone (multiples of every slot size above)
  c.sweep_grid.slot_threshold = (0.5, 0.7, 0.9)  # varied alone
  c.sweep_grid.token_threshold = (0.1, 0.4, 0.7, 0.9)  # varied alone
  c.sweep_grid.per_task = 10  # problems per task (accuracy and batch-1 speed)

  c.seed = 0  # decode rng (only used at temperature > 0)
  # Compiled programs kept here and loaded by a rerun: "auto" ($JAX_COMPILATION_CACHE_DIR,
  # else ~/.cache/refusion_jax/jax), a folder, or "" (none)
  c.compile_cache_dir = "auto"
  c.progress_bar = True  # tqdm bars for training, evaluation and the sweep
  return c
