"""Draft adapters (ModelConfig.draft_rank) and their trainer (refusion_jax.drafter):
adapters change the drafts and no answer; the acceptance benchmark compares drafts at
identical answers. (The trainer trains them alone, on the model's own answers: the main
job's drafter stage, tests/test_reproduce.py; its resume: tests/test_loop.py.)"""

import dataclasses
import os

import jax
import numpy as np
import pytest
from flax import nnx

from benchmarks import drafter_acceptance
from configs import drafter_tiny
from configs.common import ASSETS_DIR, TINY_VALID
from refusion_jax import checkpoint, drafter, hf, loading
from refusion_jax.decode import engine
from refusion_jax.decode.settings import DecodeConfig
from refusion_jax.model import Transformer
from tests.test_order_oracle import PROMPTS, _model

MODEL = os.path.join(ASSETS_DIR, "refusion_tiny")


def _lossless(**kw):
  return DecodeConfig(gen_length=24, slot_size=4, block_size=8, slot_threshold=0.0,
                      verify="lossless", **kw)


def _adapted(rank=8, scale=3.0):
  base = _model()
  adapted = drafter.with_adapters(base, rank, seed=1)
  for i, layer in enumerate(adapted.layers):
    assert np.all(np.asarray(layer.mlp.draft_b[...]) == 0)  # new: they change nothing yet
    layer.mlp.draft_b[...] = scale * jax.random.normal(jax.random.key(i),
                                                       layer.mlp.draft_b[...].shape)
  return base, adapted


def test_draft_adapters_change_the_drafts_and_no_answer():
  base, headed = _adapted()
  assert headed.config.draft_rank == 8 and base.config.draft_rank == 0
  for temperature in (0.0, 0.8):
    outs = {}
    for name, model, dc in (("ar", base, DecodeConfig(method="ar", gen_length=24,
                                                      temperature=temperature)),
                            ("ar, headed", headed, DecodeConfig(method="ar", gen_length=24,
                                                                temperature=temperature)),
                            ("lossless", base, _lossless(temperature=temperature)),
                            ("lossless, headed", headed, _lossless(temperature=temperature))):
      run = engine.Decoder(model, dc).engine(rows=2).run(PROMPTS, rng=jax.random.PRNGKey(4))
      outs[name] = ([r.tokens for r in run.results],
                    [r.counters["nfe_b"] for r in run.results])
    answers = [v[0] for v in outs.values()]
    assert all(a == answers[0] for a in answers)  # every answer the model's own AR answer
    assert outs["lossless, headed"][1] != outs["lossless"][1]  # the drafts did change
  # Only the mask token's entries see the adapters.
  ids = np.asarray([[5, 9, 3, 3, 17]], np.int32)
  pos = np.arange(5, dtype=np.int32)[None]
  a, b = np.asarray(base(ids, pos)), np.asarray(headed(ids, pos))
  np.testing.assert_array_equal(a[:, :2], b[:, :2])
  assert np.abs(a[:, 2:4] - b[:, 2:4]).max() > 1e-3
  with pytest.raises(ValueError, match="has draft adapters of rank 8"):
    drafter.with_adapters(headed, 4, seed=0)
  with pytest.raises(ValueError, match="draft adapters .* which no HF family has"):
    hf.save(headed.config, headed, "/tmp/never-written")


def test_a_model_with_adapters_saves_and_loads(tmp_path):
  _, adapted = _adapted()
  checkpoint.save_model(str(tmp_path / "m"), adapted.config, adapted)
  config, back = checkpoint.load_model(str(tmp_path / "m"))
  assert config.draft_rank == 8
  np.testing.assert_array_equal(np.asarray(back.layers[1].mlp.draft_b[...]),
                                np.asarray(adapted.layers[1].mlp.draft_b[...]))
  with pytest.raises(ValueError, match="draft_rank must be an int >= 0"):
    dataclasses.replace(config, draft_rank=-1)


def test_the_acceptance_benchmark_compares_drafts_at_identical_answers(tmp_path):
  _, model = loading.load_model(MODEL)
  adapted = drafter.with_adapters(model, 4, seed=0)
  for i, layer in enumerate(adapted.layers):
    layer.mlp.draft_b[...] = 0.5 * jax.random.normal(jax.random.key(i),
                                                     layer.mlp.draft_b[...].shape)
  other = str(tmp_path / "adapted")
  checkpoint.save_model(other, adapted.config, adapted)
  report = drafter_acceptance.main([f"--models={MODEL},{other}", f"--problems={TINY_VALID}",
                                    "--per_task=1", "--rows=8"])
  a, b = report[MODEL], report[other]
  assert b["differ"] == 0 and a["all"] != b["all"]  # the same answers, other drafts
  for r in (a, b):
    assert 0 < r["all"]["acceptance"] <= 1
    assert r["all"]["tpf"] == pytest.approx(1 + r["all"]["accepted_per_pass"])
  assert set(a["per_task"]) == {"arith", "copy", "fib", "lookup", "reverse", "sort", "template"}


def test_bad_settings_are_one_line(tmp_path):
  c = drafter_tiny.get_config()
  c.model_dir, c.output_dir = MODEL, str(tmp_path / "x")
  for field, value, match in (("steps", 0, "steps must be a positive int"),
                              ("draft_rank", -2, "draft_rank must be a positive int"),
                              ("window", 1, "window must be an int >= 2"),
                              ("learning_rate", 0.0, "learning_rate must be > 0"),
                              ("model_dir", str(tmp_path / "nope"), "is not a folder")):
    bad = drafter_tiny.get_config()
    bad.update(c.to_dict())
    bad[field] = value
    with pytest.raises((ValueError, FileNotFoundError), match=match):
      drafter.check_config(bad)
  assert not os.path.exists(tmp_path / "x")


def test_scanned_layers_adapt_as_unrolled_ones():
  _, unrolled = _adapted()
  config = dataclasses.replace(unrolled.config, scan_layers=True)
  scanned = Transformer(config, rngs=nnx.Rngs(1))
  flat = dict(nnx.to_flat_state(nnx.state(unrolled, nnx.Param)))
  for path, var in nnx.to_flat_state(nnx.state(scanned, nnx.Param)):
    if path[0] == "layers":
      value = np.stack([np.asarray(flat[("layers", i) + path[1:]].get_value())
                        for i in range(config.num_layers)])
    else:
      value = np.asarray(flat[path].get_value())
    var.set_value(value)
  ids = np.asarray([[5, 9, 3, 3, 17, 3]], np.int32)
  pos = np.arange(6, dtype=np.int32)[None]
  np.testing.assert_allclose(np.asarray(scanned(ids, pos)), np.asarray(unrolled(ids, pos)),
                             atol=1e-5)
