"""The RL check: the policy step of an RL config on its training recipe's slice."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from refusion_jax import sharding, tpu
from refusion_jax.aot.estimates import (
  Memory,
  compile_program,
  hbm_traffic,
  rl_flops,
  roofline,
  xla_flops,
)
from refusion_jax.aot.report import program_entry
from refusion_jax.aot.train import slice_trainer
from refusion_jax.rl import learner as rl_learner
from refusion_jax.rl import trainer as rl_trainer


def check_rl(config, tpu_slice: tpu.Slice) -> dict:
  """The RL policy step (`rl.learner.make_policy_step`) of `config.micro_batch` rollouts
  on the mesh and model of `config.train`, the reference's parameters beside the policy's."""
  for name in ("train", "layout_width", "layout_tokens", "micro_batch", "group_size"):
    if name not in config:
      raise ValueError(f"--config has no {name!r}: --program=rl takes an RL config "
                       "(configs/qwen3_8b_refusion_rl.py)")
  width, tokens, rows = int(config.layout_width), int(config.layout_tokens), int(config.micro_batch)
  if min(width, tokens, rows) < 1 or tokens > width:
    raise ValueError(f"config.layout_width={width}, layout_tokens={tokens} and micro_batch="
                     f"{rows} must be positive, with layout_tokens <= layout_width")
  rl_trainer.check_config(config, need_model=False)
  if config.train_policy != "model":
    raise ValueError(f"--program=rl compiles the model's policy step (train_policy='model'); "
                     f"config.train_policy={config.train_policy!r} (the selector's step is a "
                     "handful of weights)")
  trainer, mc, source, sizes, devices = slice_trainer(
      config.train, tpu_slice, what=f"RL policy step ({rows} rollouts of {width} entries)",
      seq_len=width, name="config.layout_width", total_steps=1, prefix="config.train.")
  mesh = trainer.mesh
  tx = rl_learner.make_optimizer(config)
  params = {"model": trainer.abstract_params}
  param_sh = {"model": trainer.param_shardings}
  abstract_opt = jax.eval_shape(tx.init, params)
  opt_sh = optax.tree_map_params(tx, lambda _, s: s, abstract_opt, param_sh,
                                 transform_non_params=lambda _: trainer.replicated)
  abstract_opt = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                              abstract_opt, opt_sh)
  reference = config.beta > 0
  step = rl_learner.make_policy_step(
      lambda p: nnx.merge(trainer.graphdef, p), tx, temperature=float(config.decode.temperature),
      epsilon=config.epsilon, epsilon_high=config.epsilon_high, beta=config.beta)
  shapes = {"ids": ((rows, width), jnp.int32), "positions": ((rows, width), jnp.int32),
            "attention": ((rows, width, width), jnp.bool_),
            "score_at": ((rows, tokens), jnp.int32), "targets": ((rows, tokens), jnp.int32),
            "valid": ((rows, tokens), jnp.bool_)}
  batch_sh = {k: sharding.data_sharding(mesh, trainer.rules, len(shp))
              for k, (shp, _) in shapes.items()}
  batch = {k: jax.ShapeDtypeStruct(shp, dt, sharding=batch_sh[k])
           for k, (shp, dt) in shapes.items()}
  if rl_trainer.lossless(config):  # the causal layout scores with the mask token kept
    batch_sh["scored_mask"] = trainer.replicated
    batch["scored_mask"] = jax.ShapeDtypeStruct((), jnp.bool_, sharding=trainer.replicated)
  adv_sh = sharding.data_sharding(mesh, trainer.rules, 1)
  adv = jax.ShapeDtypeStruct((rows,), jnp.float32, sharding=adv_sh)
  ref_sh = param_sh if reference else None
  jitted = jax.jit(step, in_shardings=(param_sh, opt_sh, ref_sh, batch_sh, adv_sh),
                   out_shardings=(param_sh, opt_sh, trainer.replicated),
                   donate_argnums=(0, 1))
  with sharding.use_mesh(mesh, trainer.rules):
    lowered = jitted.lower(params, abstract_opt, params if reference else None, batch, adv)
  compiled, seconds = compile_program(lowered, f"RL policy step for {tpu_slice.name}")
  memory = Memory.of(compiled)
  chips = len(devices)
  model_flops, executed = rl_flops(mc, rows, width, tokens, reference)
  nbytes = hbm_traffic(compiled)
  estimated = roofline(executed / chips, nbytes, tpu_slice.chip)
  group = int(config.group_size)
  return {
      "model": source, "params": mc.num_params(), "mesh": sizes,
      "programs": [program_entry("rl_step", memory, seconds)],
      "rollouts": rows, "layout_width": width, "layout_tokens": tokens,
      "reference": reference, "remat": mc.remat, "group_size": group,
      "flops": executed / chips, "model_flops": model_flops / chips, "bytes": nbytes,
      "xla_flops": xla_flops(compiled),
      "flops_source": "hand count per chip: 6 x matmul params x layout entries (LM head on "
                      "the scored tokens) + einsum attention, the reference's forward, "
                      "recomputation",
      "estimated_s": estimated,
      "estimated_s_per_group": estimated * group / rows,
  }
