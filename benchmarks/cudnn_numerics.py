"""Numerics of `attention_impl="cudnn"` against the einsum path, on an NVIDIA GPU.

Two levels, bf16 compute, sequence lengths a multiple of 128:

* kernel: `attention_kernels.attend_full(impl="cudnn")` against `model.attend`
  (the einsum path, "xla") in bf16 and against `model.attend` in float32 on the
  same inputs upcast (the reference), causal and full, with and without right
  padding (`length_b`; only the real queries' rows are compared), GQA, head_dim
  128; outputs and the gradients of `sum(sin(out))` (padding rows zeroed).
* model: a small random Qwen3 (bf16 compute, float32 parameters) with
  attention_impl "cudnn" against the same weights with "xla": logits, the
  training loss (`objective.loss_fn`, ReFusion's causal objective and the MDM
  baseline's bidirectional one) and every parameter's gradient, in one jit;
  the float32 "xla" model is the reference.

For each comparison: max |a - b| and ||a - b|| / ||b||; for gradients the
largest relative norm error over the parameter leaves. bf16 operands are
expected to land between 1e-3 and 1e-2 relative to float32; the line that
matters is cudnn's error beside xla-bf16's error against the same reference.

  JAX_PLATFORMS=cuda python benchmarks/cudnn_numerics.py
  python benchmarks/cudnn_numerics.py --impl splash   # the same checks of splash (any machine)
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from refusion_jax import attention_kernels, masks, objective, runtime  # noqa: E402
from refusion_jax import config as config_lib  # noqa: E402
from refusion_jax.model import Transformer, attend  # noqa: E402

ROWS: list[tuple] = []
IMPL = "cudnn"


def _err(got, want):
  got = np.asarray(got, np.float64)
  want = np.asarray(want, np.float64)
  if not (np.isfinite(got).all()):
    return float("nan"), float("nan")
  return float(np.abs(got - want).max()), float(np.linalg.norm(got - want)
                                                / max(np.linalg.norm(want), 1e-30))


def report(what, got, want):
  mx, rel = _err(got, want)
  ROWS.append((what, mx, rel))
  print(f"{what:64s} max|diff| {mx:10.3e}   rel norm {rel:10.3e}", flush=True)


def kernel_checks(seed=0, b=2, t=256, n=16, k=8, h=128):
  keys = jax.random.split(jax.random.key(seed), 3)
  q32, k32, v32 = (jax.random.normal(key, (b, t, heads, h), jnp.float32)
                   for key, heads in zip(keys, (n, k, k)))
  q, kk, v = (x.astype(jnp.bfloat16) for x in (q32, k32, v32))
  q32, k32, v32 = (x.astype(jnp.float32) for x in (q, kk, v))  # the same values, upcast
  for causal in (True, False):
    for padded in (False, True):
      length_b = jnp.array([t, t - 106] if padded else [t, t], jnp.int32)
      if causal:
        mask_btt = masks.prefix_causal_btt(length_b, t)
      else:
        valid_bt = jnp.arange(t)[None, :] < length_b[:, None]
        mask_btt = jnp.broadcast_to(valid_bt[:, None, :], (b, t, t)) | jnp.eye(t, dtype=bool)
      valid = (jnp.arange(t)[None, :] < length_b[:, None])[:, :, None, None]
      kw = dict(impl=IMPL, causal=causal, length_b=length_b if padded else None)
      cudnn = jax.jit(lambda q, k, v, kw=kw: attention_kernels.attend_full(q, k, v, **kw))
      xla = jax.jit(lambda q, k, v, m=mask_btt: attend(q, k, v, m))
      tag = f"kernel {'causal' if causal else 'full'}{' padded' if padded else ''}"
      got, bf, ref = cudnn(q, kk, v), xla(q, kk, v), xla(q32, k32, v32)
      assert got.dtype == jnp.bfloat16, got.dtype
      sel = np.asarray(valid[:, :, 0, 0])
      f = lambda x, sel=sel: np.asarray(x, np.float32)[sel]  # noqa: E731
      report(f"{tag}: out cudnn vs f32 ref", f(got), f(ref))
      report(f"{tag}: out xla-bf16 vs f32 ref", f(bf), f(ref))
      report(f"{tag}: out cudnn vs xla-bf16", f(got), f(bf))

      def grads(fn, q, k, v, valid=valid):
        loss = lambda q, k, v: jnp.sum(jnp.sin(jnp.where(valid, fn(q, k, v), 0.0)  # noqa: E731
                                               .astype(jnp.float32)))
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)

      g_cu = grads(lambda q, k, v, kw=kw: attention_kernels.attend_full(q, k, v, **kw), q, kk, v)
      g_bf = grads(lambda q, k, v, m=mask_btt: attend(q, k, v, m), q, kk, v)
      g_ref = grads(lambda q, k, v, m=mask_btt: attend(q, k, v, m), q32, k32, v32)
      for name, a, bb, r in zip("qkv", g_cu, g_bf, g_ref):
        report(f"{tag}: d{name} cudnn vs f32 ref", a, r)
        report(f"{tag}: d{name} xla-bf16 vs f32 ref", bb, r)


def _batch(b, t, seed=0):
  rs = np.random.RandomState(seed)
  prompt_len = rs.randint(1, t // 4, b)
  response_len = np.minimum(rs.randint(t // 4, t, b), t - prompt_len)
  response_len[0] = t - prompt_len[0]
  return {"tokens": jnp.asarray(rs.randint(4, 512, (b, t)), jnp.int32),
          "prompt_len": jnp.asarray(prompt_len, jnp.int32),
          "response_len": jnp.asarray(response_len, jnp.int32)}


def _outputs(model, batch, positions_bt, objective_name):
  graphdef, state = nnx.split(model)

  @jax.jit
  def run(state, batch, positions_bt):
    model = nnx.merge(graphdef, state)

    def loss(m):
      return objective.loss_fn(m, batch, jax.random.key(7), objective=objective_name,
                               mask_id=3, pad_id=0)[0]

    value, grads = nnx.value_and_grad(loss)(model)
    return model(batch["tokens"], positions_bt), value, nnx.to_pure_dict(grads)

  text = run.lower(state, batch, positions_bt).as_text()
  logits, loss, grads = run(state, batch, positions_bt)
  return text, np.asarray(logits, np.float32), float(loss), grads


def model_checks(b=4, t=256):
  for objective_name in ("refusion", "mdm"):
    attention = objective.attention_for(objective_name)
    shape = dict(num_layers=2, hidden_size=256, num_heads=8, num_kv_heads=4, head_dim=64,
                 mlp_dim=512, vocab_size=512, max_position_embeddings=1024,
                 attention=attention)
    models = {name: Transformer(config_lib.tiny(attention_impl=impl, dtype=dtype, **shape),
                          rngs=nnx.Rngs(1))
              for name, impl, dtype in (("cudnn", IMPL, "bfloat16"),
                                        ("xla", "xla", "bfloat16"),
                                        ("ref", "xla", "float32"))}
    batch = _batch(b, t)
    pos = jnp.stack([jax.random.permutation(jax.random.key(i), t) for i in range(b)])
    out = {name: _outputs(m, batch, pos, objective_name) for name, m in models.items()}
    hlo = out["cudnn"][0]
    custom = "cudnn" in hlo.lower() if IMPL == "cudnn" else "tpu_custom_call" in hlo
    print(f"model {objective_name}: {IMPL} kernel in the lowered program: {custom}")
    tag = f"model {objective_name} ({attention})"
    for name in ("cudnn", "xla"):
      report(f"{tag}: logits {name}-bf16 vs f32 ref", out[name][1], out["ref"][1])
    report(f"{tag}: logits cudnn vs xla-bf16", out["cudnn"][1], out["xla"][1])
    for name in ("cudnn", "xla"):
      report(f"{tag}: loss {name}-bf16 vs f32 ref", out[name][2], out["ref"][2])
    print(f"  losses: cudnn {out['cudnn'][2]:.6f}  xla-bf16 {out['xla'][2]:.6f}  "
          f"f32 {out['ref'][2]:.6f}")
    for name in ("cudnn", "xla"):
      worst = ("", 0.0, 0.0)
      flat = jax.tree_util.tree_leaves_with_path(out[name][3])
      ref_flat = dict((jax.tree_util.keystr(p), x) for p, x in
                      jax.tree_util.tree_leaves_with_path(out["ref"][3]))
      for path, g in flat:
        mx, rel = _err(g, ref_flat[jax.tree_util.keystr(path)])
        if not rel <= worst[2]:
          worst = (jax.tree_util.keystr(path), mx, rel)
      ROWS.append((f"{tag}: grads {name}-bf16 vs f32 ref (worst leaf)", worst[1], worst[2]))
      print(f"{tag}: grads {name}-bf16 vs f32 ref, worst leaf {worst[0]}: max|diff| "
            f"{worst[1]:.3e}  rel norm {worst[2]:.3e}", flush=True)
    # All leaves as one vector.
    for name in ("cudnn", "xla"):
      got = np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in
                            jax.tree.leaves(out[name][3])])
      want = np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in
                             jax.tree.leaves(out["ref"][3])])
      report(f"{tag}: all grads {name}-bf16 vs f32 ref", got, want)


def main(argv=None):
  global IMPL
  runtime.start_up()  # the entry points' start-up: no libtpu errors where no TPU is
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--impl", default="cudnn", choices=["cudnn", "splash"],
                      help="the kernel checked (rows keep the name 'cudnn')")
  parser.add_argument("--checks", default="kernel,model", help="comma-separated: kernel, model")
  args = parser.parse_args(argv)
  IMPL = args.impl
  chosen = {"kernel": kernel_checks, "model": model_checks}
  # float32 dots exactly (no TF32) for the reference; bf16 operands are unaffected.
  jax.config.update("jax_default_matmul_precision", "highest")
  dev = jax.devices()[0]
  print(f"device: {dev.platform} ({dev.device_kind}); jax {jax.__version__}")
  failures = []
  for fn in (chosen[c.strip()] for c in args.checks.split(",") if c.strip()):
    try:
      fn()
    except Exception as e:  # pylint: disable=broad-except
      import traceback  # pylint: disable=import-outside-toplevel
      traceback.print_exc()
      failures.append(f"{fn.__name__}: {type(e).__name__}: {e}")
  print("\n| comparison | max abs diff | rel norm error |\n|---|---|---|")
  for what, mx, rel in ROWS:
    print(f"| {what} | {mx:.3e} | {rel:.3e} |")
  for f in failures:
    print("FAILED", f[:2000])
  return 1 if failures else 0


if __name__ == "__main__":
  sys.exit(main())
