"""D2F's distillation (refusion_jax.distill): the loss against a hand-worked case, the
mask ratios, and a short run that trains only the adapter, checkpoints, resumes and
exports a PEFT folder that decodes."""

import json
import math
import os
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import d2f_tiny
from refusion_jax import checkpoint, distill, lora, masks
from refusion_jax import config as config_lib
from refusion_jax.decode import engine
from refusion_jax.decode.settings import DecodeConfig
from refusion_jax.model import Transformer
from tests.test_lora import _random_adapter


def test_loss_by_hand():
  # Two positions, vocabulary 2; only the first is masked, at ratio 0.5.
  s = jnp.asarray([[[0.0, math.log(3.0)], [5.0, 0.0]]])  # student softmax (1/4, 3/4)
  t = jnp.asarray([[[math.log(2.0), 0.0], [0.0, 0.0]]])  # teacher softmax (2/3, 1/3)
  masked = jnp.asarray([[True, False]])
  p = jnp.asarray([[0.5, 1.0]])
  want = -(2 / 3 * math.log(1 / 4) + 1 / 3 * math.log(3 / 4)) / 0.5  # over 1 masked token
  loss, n = distill.loss_from_logits(s, t, masked, p)
  assert int(n) == 1 and float(loss) == pytest.approx(want, rel=1e-6)


def test_block_ratios_rise_within_the_range():
  u0 = jnp.asarray([0.0, 1.0, 0.5])
  u = jax.random.uniform(jax.random.key(0), (3, 6))
  blocks = jnp.asarray([6, 6, 1])
  r = np.asarray(distill.block_ratios(u0, u, 0.2, 0.7, blocks))
  assert r[0, 0] == pytest.approx(0.2) and r[1, 0] == pytest.approx(0.7)
  assert r[2, 0] == pytest.approx(0.45)
  for row, k in zip(r, (6, 6, 1)):
    assert np.all(np.diff(row[:k]) >= 0) and np.all(row[:k] <= 0.7 + 1e-6)
  # By hand: p_j = p_0 + sum_{i<=j} u_i (0.7 - p_0) / (K - 1).
  step = (0.7 - 0.2) / 5
  np.testing.assert_allclose(r[0, :6], 0.2 + np.cumsum(np.r_[0.0, np.asarray(u[0, 1:6])]) * step,
                             rtol=1e-6)


def test_noise_masks_only_the_response_at_its_blocks_ratio():
  tokens = jnp.arange(10, 42, dtype=jnp.int32).reshape(2, 16)
  plen, rlen = jnp.asarray([4, 6]), jnp.asarray([12, 10])
  ids, masked, p, block = distill.noise(tokens, plen, rlen, jax.random.key(1), mask_id=3,
                                        block_size=4, p_min=0.2, p_max=0.7)
  masked, p, block = np.asarray(masked), np.asarray(p), np.asarray(block)
  assert not masked[0, :4].any() and not masked[1, :6].any()
  assert np.all(np.asarray(ids)[masked] == 3)
  np.testing.assert_array_equal(block[0], [-1] * 4 + [0] * 4 + [1] * 4 + [2] * 4)
  for row in range(2):  # one ratio per block, never decreasing
    ratios = [p[row][block[row] == j] for j in range(block[row].max() + 1)]
    assert all(len(set(r.tolist())) == 1 for r in ratios)
    firsts = [r[0] for r in ratios]
    assert firsts == sorted(firsts) and 0.2 <= firsts[0] <= 0.7


def _mdm_dir(tmp_path):
  config = config_lib.tiny(num_layers=2, hidden_size=64, mlp_dim=128, num_heads=2,
                           num_kv_heads=1, head_dim=32, attention="bidirectional")
  model = Transformer(config, rngs=nnx.Rngs(0))
  path = tmp_path / "mdm"
  checkpoint.save_model(str(path), config, model)
  return str(path), config, model


def _config(base, out, **changes):
  c = d2f_tiny.get_config()
  c.base_dir, c.output_dir = base, str(out)
  c.steps, c.batch_size, c.save_every, c.lora_rank, c.lora_alpha = 4, 4, 2, 4, 4.0
  c.seq_len = 48
  c.update(changes)
  return c


def test_a_short_run_trains_only_the_adapter_resumes_and_decodes(tmp_path, capsys):
  base_dir, config, base = _mdm_dir(tmp_path)
  distill.main(["distill"], types.SimpleNamespace(value=_config(base_dir, tmp_path / "a")))
  printed = capsys.readouterr()
  out = json.loads(printed.out)
  assert out["steps"] == 4 and os.path.isdir(out["adapter_dir"])
  # It ends on a line naming what it wrote and how to decode with it.
  assert printed.err.strip().splitlines()[-1] == (
      f"[distill] wrote {out['adapter_dir']} (decode with it: python -m refusion_jax.sample "
      f"--config=configs/sample.py --config.model_dir={base_dir} "
      f"--config.adapter_dir={out['adapter_dir']} --config.decode.method=d2f "
      "--config.prompt=...)")
  lines = [json.loads(x) for x in open(tmp_path / "a" / "metrics.jsonl")]
  assert [x["step"] for x in lines] == [1, 2, 3, 4] and all(x["masked_tokens"] > 0
                                                            for x in lines)
  adapter = lora.read_adapter(out["adapter_dir"], config)
  assert adapter.rank == 4 and len(adapter.tensors) == 2 * 4
  assert max(float(np.abs(b).max()) for _, b in adapter.tensors.values()) > 0  # B moved
  # Only the adapter is saved: a checkpoint's parameters are the LoRA factors alone.
  ckpts = sorted(os.listdir(tmp_path / "a" / "checkpoints"))
  assert ckpts == ["2", "4"]
  tree = json.loads((tmp_path / "a" / "checkpoints" / "4" / "state" / "_METADATA").read_text())
  params = [k for k in tree["tree_metadata"] if k.startswith("('params'")]
  assert len(params) == 2 * 4 * 2 and all("_lora_a'" in k or "_lora_b'" in k for k in params)
  # Two steps, then two more from the checkpoint: the same adapter as four at once.
  half = distill.run(_config(base_dir, tmp_path / "b", steps=2), progress=False)
  assert half["steps"] == 2
  distill.run(_config(base_dir, tmp_path / "b"), progress=False)
  resumed = lora.read_adapter(tmp_path / "b" / "adapter", config)
  for k, (a, b) in adapter.tensors.items():
    np.testing.assert_allclose(resumed.tensors[k][0], a, atol=1e-6)
    np.testing.assert_allclose(resumed.tensors[k][1], b, atol=1e-6)
  # The merged model decodes with D2F.
  merged = lora.merge(checkpoint.load_model(base_dir)[1], adapter)
  dc = DecodeConfig(method="d2f", gen_length=8, block_size=4, slot_size=1)
  res = engine.Decoder(merged, dc).engine(2).run([[5, 6, 7], [8, 9]])
  assert all(r.tokens for r in res.results)
  del base


def test_bad_configs_are_one_line(tmp_path):
  base_dir, _, _ = _mdm_dir(tmp_path)
  for changes, match in ((dict(base_dir=""), "base_dir is required"),
                         (dict(output_dir=""), "output_dir is required"),
                         (dict(p_min=0.8, p_max=0.7), "p_min=0.8 and p_max=0.7"),
                         (dict(steps=0), "steps must be a positive int"),
                         (dict(train_files=("/nope.jsonl",)), "is not a file")):
    with pytest.raises(ValueError, match=match):
      distill.check_config(_config(base_dir, tmp_path / "x", **changes))
  causal = config_lib.tiny(num_layers=1)
  checkpoint.save_model(str(tmp_path / "arm"), causal, Transformer(causal, rngs=nnx.Rngs(0)))
  with pytest.raises(ValueError, match="D2F adapts an MDM"):
    distill.run(_config(str(tmp_path / "arm"), tmp_path / "y"), progress=False)


def test_the_student_mask_is_block_causal_within_the_row():
  m = np.asarray(masks.block_causal_btt(jnp.asarray([3]), 2, 7))[0]
  assert m[0, :3].all() and not m[0, 3:].any() and m[4, :5].all() and not m[4, 5:].any()


def test_entry_points_merge_an_adapter_at_load(tmp_path):
  from refusion_jax import loading  # pylint: disable=import-outside-toplevel
  base_dir, config, base = _mdm_dir(tmp_path)
  adapter = _random_adapter(config, rank=2, alpha=2.0)
  lora.save_adapter(tmp_path / "ad", config, adapter)
  _, merged = loading.load_model(base_dir, adapter_dir=str(tmp_path / "ad"))
  want = lora.merge(checkpoint.load_model(base_dir)[1], adapter)
  ids = jnp.asarray([[5, 6, 7, 3]])
  pos = jnp.arange(4)[None]
  np.testing.assert_array_equal(np.asarray(merged(ids, pos)), np.asarray(want(ids, pos)))
  assert np.abs(np.asarray(merged(ids, pos)) - np.asarray(base(ids, pos))).max() > 1e-3
  with pytest.raises(ValueError, match="scan_layers=True cannot be combined"):
    loading.load_model(base_dir, scan_layers=True, adapter_dir=str(tmp_path / "ad"))


def test_a_shifted_model_distils_reading_each_token_one_position_left(tmp_path):
  config = config_lib.tiny(num_layers=1, hidden_size=64, mlp_dim=128, num_heads=2,
                           num_kv_heads=1, head_dim=32, attention="bidirectional",
                           model_type="dream")
  model = Transformer(config, rngs=nnx.Rngs(0))
  checkpoint.save_model(str(tmp_path / "dream"), config, model)
  out = distill.run(_config(str(tmp_path / "dream"), tmp_path / "d", steps=2), progress=False)
  assert os.path.isdir(out["adapter_dir"]) and math.isfinite(out["final_loss"])
  # The loss reads logits shifted by one: equal to the unshifted loss on logits moved right.
  tokens = jnp.asarray([[5, 6, 7, 8, 9, 10, 11, 12]], jnp.int32)
  plen, rlen = jnp.asarray([3]), jnp.asarray([5])
  loss, _ = distill.distill_loss(model, model, tokens, plen, rlen, jax.random.key(0),
                                 mask_id=3, block_size=2, p_min=0.5, p_max=0.5)
  ids, masked, p, _ = distill.noise(tokens, plen, rlen, jax.random.key(0), mask_id=3,
                                    block_size=2, p_min=0.5, p_max=0.5)
  pos = jnp.arange(8)[None]
  l_s = model(ids, pos, attention_mask_btt=(masks.block_causal_btt(plen, 2, 8)
                                            | jnp.eye(8, dtype=bool)[None]))
  l_t = model(ids, pos, attention_mask_btt=jnp.ones((1, 8, 8), bool))
  shift = lambda x: jnp.concatenate([x[:, :1], x[:, :-1]], axis=1)
  want, _ = distill.loss_from_logits(shift(l_s), shift(l_t), masked, p)
  assert float(loss) == pytest.approx(float(want), rel=1e-5) and float(loss) > 0


def test_the_command_line_reports_a_bad_setting_in_one_line(tmp_path):
  import subprocess  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  done = subprocess.run([sys.executable, "-m", "refusion_jax.distill",
                         "--config=configs/d2f_tiny.py", f"--config.base_dir={tmp_path}/nope",
                         f"--config.output_dir={tmp_path}/out"], cwd=repo,
                        capture_output=True, text=True, check=False,
                        env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert done.returncode == 2, done.stderr
  assert done.stderr.strip().splitlines()[-1] == (
      f"refusion_jax.distill: error: --config.base_dir='{tmp_path}/nope' is not a folder (nor "
      "a shipped model: base_tiny, refusion_tiny)")
  assert not os.path.exists(tmp_path / "out")  # nothing written
