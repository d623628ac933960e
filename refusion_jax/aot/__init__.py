"""Will it fit? Compile a program for a Cloud TPU slice on any machine, without a TPU.

  python -m refusion_jax.aot --program=train --topology=v5p-128 \\
      --config=configs/qwen3_8b_refusion.py [--config.field=value ...]
  python -m refusion_jax.aot --program=decode --topology=v5litepod-8 --model=qwen3_8b \\
      --config=configs/sample.py --config.decode.method=refusion --batch=16 --prompt_len=1024
  python -m refusion_jax.aot --program=rl --topology=v5p-128 \\
      --config=configs/qwen3_8b_refusion_rl.py

`--topology` is a Cloud TPU accelerator type as gcloud names it (`v4-128`,
`v5p-128`, `v5litepod-256` or `v5e-256`, `v6e-256`) or a libtpu topology
(`v5p:4x4x4`); `--num_slices` compiles for that many such slices (multislice).
libtpu (requirements-tpu.txt) describes the slice and XLA compiles the real
program for it (`refusion_jax.tpu`):

* train: the Trainer's train step (`Trainer.lower_train_step`) with the
  config's mesh, global batch, sequence length, dtypes, remat and loss chunk;
  the model is the config's preset and overrides (with `init_from_hf`: that
  folder's config.json when it is here, else the preset with the two special
  tokens the trainer adds, Qwen3's tokenizer giving 151,671 rows);
* decode: the decode method's programs (`compiled_lib.lower_program`: the whole
  batch in one program, the engine's admit and its loop of passes) at
  `--batch` rows and prompts `--prompt_len` wide, for the model `--model` (a
  preset name, or a folder whose config.json or model_config.json alone is
  read), its parameters split over `--mesh` (data,fsdp,tensor) as the sharding
  rules say; then one pass of each width of `--pass_widths` over the KV cache
  (the pass ReFusion, AR and BD3-LM decode with; MDM: one denoising pass of the
  canvas).

* rl: the RL policy step of an RL config (`rl.learner.make_policy_step`:
  `micro_batch` rollouts' training layouts of `layout_width` entries, the
  reference's log-probabilities, GRPO's loss, the update) on the mesh and model
  of its `train` recipe; estimated per step and per group of `group_size`.

Printed per chip: argument, output, aliased and temporary bytes and the
program code, their total against the chip's HBM ("fits" / "does not fit by
X GiB"), compile seconds, and estimates: flops (a hand count, since XLA counts
a scanned layer once: 6 x matmul parameters x tokens + attention for a train
step, 2 x parameters per token for a decode pass, plus recomputation), HBM
bytes (`hlo_traffic`, counted from the compiled program: XLA's own "bytes
accessed" is not), and the roofline time max(flops / peak, bytes / bandwidth)
from the chip table in `tpu.py` -> tokens/s per chip and MFU for training;
per pass width for decoding, against the floor a pass cannot go below (the
weights each chip reads plus its KV cache). Collectives and overlap are not
modelled: every time is an estimate.

The last line of stdout is one JSON object with everything printed. Exit
status: 0 fits, 3 does not fit (the compiler's numbers are printed), 2 bad
flags or config (one line naming the problem). Progress goes to stderr.

The package: `__main__` (the command line: flags, checks, exit statuses), `train`,
`decode` and `rl` (each kind's check: the program lowered for the slice, compiled,
estimated), `estimates` (compiling, memory, HBM traffic, hand flop counts, the roofline)
and `report` (what is printed).
"""

import os

# Only the host CPU runs anything; libtpu serves as a compiler for the described slice
# (set before JAX is imported by any of the package's modules).
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
