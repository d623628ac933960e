"""Dream-7B: its folders loaded and exported, its logits against transformers, and its
samplers (maskgit_plus, topk_margin, entropy, origin on the linear schedule) against a
plain-Python loop.

The fixture tests/fixtures/hf_tiny/dream is a Qwen2ForCausalLM with random biases saved
with Dream's config.json; its goldens are transformers' Qwen2 logits with every token
attending to every token, and those shifted by one (scripts/make_hf_fixture.py).
"""

import functools
import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from refusion_jax import config as config_lib
from refusion_jax import hf
from refusion_jax.decode import engine, heads, mdm, methods
from refusion_jax.decode import program as program_lib
from refusion_jax.decode.settings import DecodeConfig

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "hf_tiny")
DREAM = os.path.join(FIXTURES, "dream")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GEN = 8


@functools.lru_cache(maxsize=None)
def _load():
  return hf.load(DREAM)


def _copy(tmp_path):
  dst = tmp_path / "dream"
  shutil.copytree(DREAM, dst)
  return dst


def _edit_config(folder, **changes):
  path = folder / "config.json"
  cfg = json.loads(path.read_text())
  for key, value in changes.items():
    if value is None:
      cfg.pop(key, None)
    else:
      cfg[key] = value
  path.write_text(json.dumps(cfg))


# ---------------------------------------------------------------- loading


def test_logits_match_transformers_bidirectional_and_shifted():
  config, model = _load()
  assert (config.model_type, config.attention, config.shift_logits, config.qkv_bias,
          config.qk_norm) == ("dream", "bidirectional", True, True, False)
  assert (config.mask_token_id, config.eos_token_id, config.pad_token_id) == (151, 1, 0)
  golden = np.load(os.path.join(DREAM, "golden.npz"))
  ids = golden["input_ids"]
  positions = np.broadcast_to(np.arange(ids.shape[1]), ids.shape)
  raw = np.asarray(model(ids, positions))
  np.testing.assert_allclose(raw, golden["logits_bidir"], atol=1e-4, rtol=0)
  shifted = np.asarray(model.token_logits(ids, positions))
  np.testing.assert_allclose(shifted, golden["logits_shifted"], atol=1e-4, rtol=0)
  # The shift is real: token i's prediction is position i-1's output.
  assert np.abs(shifted[:, 1:] - raw[:, 1:]).max() > 1e-2
  np.testing.assert_array_equal(shifted[:, 0], raw[:, 0])


def test_config_json_mapping():
  config, _ = _load()
  assert config == config_lib.from_hf_config(DREAM)  # auto_map etc. ignored
  hf_config = config_lib.to_hf_config(config)
  assert hf_config["model_type"] == "Dream" and hf_config["architectures"] == ["DreamModel"]
  assert hf_config["mask_token_id"] == 151 and "auto_map" not in hf_config
  assert config_lib.from_hf_config(hf_config) == config
  # Dream-v0-7B's config.json: Qwen2.5-7B's shapes, the preset.
  dream = config_lib.from_hf_config(os.path.join(FIXTURES, "configs", "dream_v0_7b.json"))
  assert dream == config_lib.dream_7b()
  assert dream.mask_token_id == 151666 and round(dream.num_params() / 1e9, 2) == 7.62
  assert config_lib.get_preset("dream_7b") == dream


@pytest.mark.parametrize("scan_layers", [False, True])
def test_load_save_round_trip_is_byte_equal(tmp_path, scan_layers):
  config, model = hf.load(DREAM, scan_layers=scan_layers)
  hf.save(config, model, tmp_path / "out")
  assert sorted(os.listdir(tmp_path / "out")) == ["config.json", "model.safetensors"]
  before = load_file(os.path.join(DREAM, "model.safetensors"))
  after = load_file(tmp_path / "out" / "model.safetensors")
  assert sorted(before) == sorted(after)
  for name, value in before.items():
    assert value.dtype == after[name].dtype and value.shape == after[name].shape, name
    assert value.tobytes() == after[name].tobytes(), name
  assert hf.read_config(tmp_path / "out") == config.replace(scan_layers=False)
  reread = config_lib.from_hf_config(tmp_path / "out")
  assert reread.model_type == "dream" and reread.shift_logits


@pytest.mark.parametrize("family", ["mistral", "gpt2"])
def test_other_families_are_refused_in_one_line(tmp_path, family):
  folder = _copy(tmp_path)
  _edit_config(folder, model_type=family)
  with pytest.raises(ValueError) as info:
    hf.load(folder)
  message = str(info.value)
  assert "\n" not in message
  assert message.endswith(f"model_type='{family}' is not supported; supported: "
                          "qwen3, qwen2, Dream, llama, llada")


@pytest.mark.parametrize("changes, match", [
    (dict(mask_token_id=None), r"model_type='Dream' needs mask_token_id"),
    (dict(mask_token_id=400), r"mask_token_id=400 is outside the vocabulary of 152"),
    (dict(attention_bias=False), r"attention_bias=false, but Dream's q, k and v"),
    (dict(use_sliding_window=True), r"use_sliding_window=true"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0}), r"rope_type='yarn'"),
])
def test_config_json_errors(tmp_path, changes, match):
  folder = _copy(tmp_path)
  _edit_config(folder, **changes)
  with pytest.raises(ValueError, match=match):
    hf.load(folder)


def test_a_dream_model_is_bidirectional():
  with pytest.raises(ValueError, match="model_type='dream' needs attention='bidirectional'"):
    config_lib.dream_7b(attention="causal")
  with pytest.raises(ValueError, match="needs attention='bidirectional'"):
    config_lib.from_hf_config(DREAM, attention="causal")


def test_a_qwen3_folder_labelled_dream_names_every_mismatch(tmp_path):
  folder = tmp_path / "gqa"
  shutil.copytree(os.path.join(FIXTURES, "gqa"), folder)
  _edit_config(folder, model_type="Dream", mask_token_id=5)
  with pytest.raises(ValueError, match="attention_bias=false, but Dream's"):
    hf.load(folder)  # Qwen3's config.json says so
  _edit_config(folder, attention_bias=None)  # the tensors are checked one by one
  with pytest.raises(ValueError) as info:
    hf.load(folder)
  message = str(info.value)
  assert ("unexpected tensor 'model.layers.0.self_attn.q_norm.weight' (a dream model has "
          "none: config.json says model_type='Dream')") in message
  assert "missing tensor 'model.layers.1.self_attn.k_proj.bias'" in message
  assert "(10 problem(s))" in message


def test_a_wrong_shape_is_named(tmp_path):
  folder = _copy(tmp_path)
  _edit_config(folder, intermediate_size=80)
  with pytest.raises(ValueError, match=r"'model.layers.0.mlp.gate_proj.weight' has shape "
                                       r"\[96, 64\], expected \[80, 64\]"):
    hf.load(folder)


# ---------------------------------------------------------------- schedule and settings


def test_schedule_counts_equal_dreams_torch_counts():
  with open(os.path.join(DREAM, "schedule.json")) as f:
    schedules = json.load(f)
  assert len(schedules) >= 10
  for entry in schedules:
    counts = mdm.schedule_counts(entry["masked"], entry["steps"])
    assert list(counts) == entry["counts"], (entry["masked"], entry["steps"])
    assert sum(counts) == entry["masked"]
  probs = mdm.schedule_reveal_probs(4)
  assert probs[-1] == 1.0 and np.all(np.diff(probs) > 0) and probs[0] > 0


@pytest.mark.parametrize("changes, match", [
    (dict(mdm_ranking="random"), r"decode.mdm_ranking must be one of"),
    (dict(mdm_steps=0), r"decode.mdm_steps must be a positive int or None"),
    (dict(mdm_steps=True), r"decode.mdm_steps must be a positive int or None"),
    (dict(mdm_steps=5, block_size=4), r"decode.mdm_steps=5 must be a multiple of the number "
                                      r"of blocks \(decode.gen_length / decode.block_size = 2\)"),
    (dict(mdm_ranking="origin"), r"'origin' .* needs decode.mdm_steps"),
    (dict(mdm_steps=8, mdm_threshold=0.5), r"two rules .* set one"),
    (dict(mdm_ranking="entropy", mdm_threshold=0.5), r"needs decode.mdm_ranking='confidence'"),
])
def test_decode_config_errors(changes, match):
  base = dict(method="mdm", gen_length=GEN, slot_size=4, block_size=GEN)
  base.update(changes)
  with pytest.raises(ValueError, match=match):
    DecodeConfig(**base)


def test_decode_config_spec():
  dc = DecodeConfig(method="mdm", gen_length=16, slot_size=4, block_size=4,
                               mdm_ranking="entropy", mdm_steps=12)
  assert dc.options.steps_per_block(dc) == 3
  spec = program_lib.spec_of(dc)
  assert (spec.mdm_ranking, spec.mdm_steps_per_block) == ("entropy", 3)
  # Another method refuses Dream's samplers by name (they would change nothing there).
  ar = dict(method="ar", gen_length=16, slot_size=4, block_size=4)
  with pytest.raises(ValueError, match="mdm_ranking='origin' is one of MDM's options"):
    DecodeConfig(**ar, mdm_ranking="origin", mdm_steps=3)


# ---------------------------------------------------------------- the sampler's scores


@pytest.mark.parametrize("temperature", [0.0, 0.7])
@pytest.mark.parametrize("vocab_chunk", [40, heads.DEFAULT_VOCAB_CHUNK])
def test_sampler_stats_against_numpy(temperature, vocab_chunk):
  rng = np.random.default_rng(0)
  b, t, d, v, banned = 2, 5, 16, 152, 151
  h = rng.normal(size=(b, t, d)).astype(np.float32)
  w = (2.0 * rng.normal(size=(v, d))).astype(np.float32)
  keys = np.asarray(program_lib.pass_keys(jnp.zeros((b, 2), jnp.uint32) + jnp.uint32(7),
                                     jnp.arange(b), t))
  stats = jax.jit(functools.partial(heads.sampler_stats, banned_id=banned,
                                    vocab_chunk=vocab_chunk))(
      jnp.asarray(h), jnp.asarray(w), temperature=jnp.float32(temperature), keys_bt2=keys)
  logits = np.einsum("btd,vd->btv", h.astype(np.float64), w.astype(np.float64))
  z = logits / (temperature if temperature > 0 else 1.0)
  z[..., banned] = -np.inf
  p = np.exp(z - z.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  if temperature > 0:
    noise = np.asarray(heads._noise(jnp.asarray(keys), 0, v))  # pylint: disable=protected-access
    pick = np.argmax(z + noise, -1)
  else:
    pick = np.argmax(z, -1)
  top = np.sort(p, -1)[..., ::-1]
  np.testing.assert_array_equal(np.asarray(stats.pick_bt), pick)
  np.testing.assert_allclose(np.asarray(stats.p_pick_bt),
                             np.take_along_axis(p, pick[..., None], -1)[..., 0], atol=1e-5)
  np.testing.assert_allclose(np.asarray(stats.margin_bt), top[..., 0] - top[..., 1], atol=1e-5)
  neg_entropy = np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0).sum(-1)
  np.testing.assert_allclose(np.asarray(stats.neg_entropy_bt), neg_entropy, atol=1e-4)
  assert not np.any(np.asarray(stats.pick_bt) == banned)


# ---------------------------------------------------------------- decoding


@functools.partial(jax.jit, static_argnums=0)
def _raw_logits(graphdef, state, ids_bt):
  positions_bt = jnp.broadcast_to(jnp.arange(ids_bt.shape[1])[None], ids_bt.shape)
  return nnx.merge(graphdef, state)(ids_bt, positions_bt)


def _oracle(model, prompt, dc, key, eos, mask):
  """Dream's sampler on one unpadded row, in plain Python: returns (response tokens,
  commit steps, passes). `key` is the row's raw key (program_lib.prompt_keys)."""
  graphdef, state = nnx.split(model)
  g, block = dc.gen_length, dc.block_size
  blocks = g // block
  steps = None if dc.mdm_steps is None else dc.mdm_steps // blocks
  ts = None if steps is None else np.linspace(1.0, methods.MDM_SCHEDULE_EPS, steps + 1)
  temp = dc.temperature
  gen, commit = [None] * g, [-1] * g
  passes = 0
  for blk in range(blocks):
    span = range(blk * block, (blk + 1) * block)
    i = 0
    while any(gen[j] is None for j in span):
      seq = list(prompt) + [mask if tok is None else tok for tok in gen]
      raw = np.asarray(_raw_logits(graphdef, state, jnp.asarray([seq])))[0].astype(np.float64)
      # Dream's shift: the prediction for position c is the output at c - 1.
      logits = raw[len(prompt) - 1:len(prompt) - 1 + g]
      z = logits / (temp if temp > 0 else 1.0)
      z[:, mask] = -np.inf
      p = np.exp(z - z.max(-1, keepdims=True))
      p /= p.sum(-1, keepdims=True)
      pass_key = jax.random.fold_in(jnp.asarray(key), passes)
      if temp > 0:
        keys = jnp.stack([jax.random.fold_in(pass_key, j) for j in range(g)])[None]
        noise = heads._noise(keys, 0, z.shape[-1])  # pylint: disable=protected-access
        draft = np.argmax(z + np.asarray(noise)[0], -1)
      else:
        draft = np.argmax(z, -1)
      if dc.mdm_ranking == "confidence":  # LLaDA: the plain softmax
        plain = np.where(np.arange(z.shape[-1]) == mask, -np.inf, logits)
        q = np.exp(plain - plain.max(-1, keepdims=True))
        score = q[np.arange(g), draft] / q.sum(-1)
      elif dc.mdm_ranking == "maskgit_plus":
        score = p[np.arange(g), draft]
      elif dc.mdm_ranking == "topk_margin":
        top = np.sort(p, -1)[:, ::-1]
        score = top[:, 0] - top[:, 1]
      else:  # entropy (origin ranks nothing)
        score = np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0).sum(-1)
      masked = [j for j in span if gen[j] is None]
      order = sorted(masked, key=lambda j: (-score[j], j))
      if steps is None:
        chosen = order[:dc.mdm_tokens_per_step]
      elif dc.mdm_ranking == "origin":
        prob = np.float32(1.0 - ts[i + 1] / ts[i]) if i < steps - 1 else np.float32(1.0)
        chosen = [j for j in masked
                  if float(jax.random.uniform(jax.random.fold_in(pass_key, g + j))) < prob]
      elif dc.mdm_schedule_on == "llada":  # the block's masks at its start, split evenly
        if i == 0:
          at_start = len(masked)
        k = at_start // steps + (1 if i < at_start % steps else 0)
        chosen = order[:k]
      else:
        k = len(masked) if i == steps - 1 else int(len(masked) * (1.0 - ts[i + 1] / ts[i]))
        chosen = order[:k]
      for j in chosen:
        gen[j], commit[j] = int(draft[j]), passes
      passes += 1
      i += 1
      if eos is not None and eos in gen:
        first = gen.index(eos)
        if all(tok is not None for tok in gen[:first]):
          return gen[:first + 1], commit[:first + 1], passes
  return gen, commit, passes


PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13], [20, 4, 33, 17, 8, 40, 2], [70, 71]]


def _pad(prompts, width=8):
  ids = np.zeros((len(prompts), width), np.int32)
  for i, p in enumerate(prompts):
    ids[i, :len(p)] = p
  return ids, np.array([len(p) for p in prompts], np.int32)


def _with_eos(model, eos):
  """The same weights with another EOS id (the oracle's logits do not depend on it)."""
  graphdef, state = nnx.split(model)
  other = nnx.merge(graphdef, state)
  other.config = model.config.replace(eos_token_id=eos)
  return other


def _decode_config(**changes):
  base = dict(method="mdm", gen_length=GEN, slot_size=4, block_size=GEN)
  base.update(changes)
  return DecodeConfig(**base)


# (ranking, settings): Dream's whole canvas on its schedule, blocks on the schedule, a
# fixed count per step, LLaDA's ranking on its own schedule (an even split: 8 tokens
# over 4 steps, 2 a step) and on Dream's.
CASES = [
    ("maskgit_plus", dict(mdm_steps=4)),
    ("topk_margin", dict(mdm_steps=8)),
    ("entropy", dict(mdm_steps=4)),
    ("origin", dict(mdm_steps=4)),
    ("maskgit_plus", dict(block_size=4, mdm_steps=6)),
    ("origin", dict(block_size=4, mdm_steps=4)),
    ("entropy", dict(block_size=4, mdm_tokens_per_step=2)),
    ("confidence", dict(mdm_steps=4)),
    ("confidence", dict(mdm_steps=4, mdm_schedule="dream")),
]


@pytest.mark.parametrize("temperature", [0.0, 0.7])
@pytest.mark.parametrize("ranking, settings", CASES)
def test_rankings_match_plain_python(ranking, settings, temperature):
  config, model = _load()
  dc = _decode_config(mdm_ranking=ranking, temperature=temperature, **settings)
  rng = jax.random.PRNGKey(3)
  keys = [np.asarray(k) for k in program_lib.prompt_keys(rng, jnp.arange(len(PROMPTS)))]
  mask = config.mask_token_id
  # An EOS that row 0 decodes after its first position, so that rows stop at different
  # times (and some before their last step).
  free = _oracle(model, PROMPTS[0], dc, keys[0], None, mask)[0]
  eos = next((tok for tok in free[1:] if free.index(tok) > 0), free[-1])
  eos_model = _with_eos(model, eos)
  out = mdm.generate(eos_model, *_pad(PROMPTS), dc, rng)
  pad = config.pad_token_id
  lengths, passes_all = [], []
  for row, prompt in enumerate(PROMPTS):
    tokens, steps, passes = _oracle(model, prompt, dc, keys[row], eos, mask)
    n = len(tokens)
    lengths.append(n)
    passes_all.append(passes)
    assert int(out.length_b[row]) == n, row
    np.testing.assert_array_equal(np.asarray(out.tokens_bg[row]), tokens + [pad] * (GEN - n))
    np.testing.assert_array_equal(np.asarray(out.commit_step_bg[row]), steps + [-1] * (GEN - n))
    counters = {k: float(v[row]) for k, v in out.counters.as_dict().items()}
    assert counters["plan_b"] == counters["nfe_b"] == counters["steps_b"] == passes
    assert counters["tokens_b"] == n and counters["prefill_b"] == 0
  if dc.mdm_steps is not None and ranking != "origin":
    # The schedule's pass count, less where an EOS ended a row early.
    assert max(passes_all) <= dc.mdm_steps
    assert all(p == dc.mdm_steps for p, n in zip(passes_all, lengths) if n == GEN)


@pytest.mark.parametrize("ranking, settings", [("entropy", dict(mdm_steps=4)),
                                               ("maskgit_plus", dict(mdm_tokens_per_step=3))])
def test_batch_equals_single_decodes_and_no_recompile(ranking, settings):
  _, model = _load()
  dc = _decode_config(mdm_ranking=ranking, **settings)
  batch = mdm.generate(model, *_pad(PROMPTS), dc)
  for row, prompt in enumerate(PROMPTS):
    single = mdm.generate(model, *_pad([prompt]), dc)
    np.testing.assert_array_equal(np.asarray(single.tokens_bg[0]),
                                  np.asarray(batch.tokens_bg[row]))
    np.testing.assert_array_equal(np.asarray(single.commit_step_bg[0]),
                                  np.asarray(batch.commit_step_bg[row]))
    assert int(single.counters.plan_b[0]) == int(batch.counters.plan_b[row])
  before = mdm.compiled_programs()
  other = [[1 + t % 140 for t in p[::-1]] for p in PROMPTS]
  again = mdm.generate(model, *_pad(other), dc)
  jax.block_until_ready(again.tokens_bg)
  # A new temperature is a traced knob: the same program.
  mdm.generate(model, *_pad(other), dc.replace(temperature=0.5), jax.random.PRNGKey(1))
  assert mdm.compiled_programs() == before
  assert not np.array_equal(np.asarray(again.tokens_bg), np.asarray(batch.tokens_bg))


@pytest.mark.parametrize("ranking, temperature", [("origin", 0.0), ("topk_margin", 0.7)])
def test_engine_continuous_batching_matches_plain_python(ranking, temperature):
  config, model = _load()
  dc = _decode_config(mdm_ranking=ranking, mdm_steps=4, temperature=temperature)
  decoder = engine.Decoder(model, dc)
  rng = jax.random.PRNGKey(5)
  prompts = PROMPTS + [[3, 4], [100, 101, 102, 103, 104, 105]]
  run = decoder.engine(2, width=8).run(prompts, rng)  # 6 prompts through 2 rows
  assert run.admissions > 1
  key = program_lib.raw_key(rng)
  for i, prompt in enumerate(prompts):
    tokens, steps, passes = _oracle(model, prompt, dc, np.asarray(jax.random.fold_in(key, i)),
                                    config.eos_token_id, config.mask_token_id)
    result = run.results[i]
    assert result.tokens == tokens and result.commit_steps == steps, i
    assert result.counters["nfe_b"] == result.counters["plan_b"] == passes
    assert result.counters["tokens_b"] == len(tokens)


def test_sample_cli_with_a_dream_folder():
  proc = subprocess.run(
      [sys.executable, "-m", "refusion_jax.sample", "--config=configs/sample.py",
       f"--config.model_dir={DREAM}", "--config.prompt_ids=5,6,7",
       "--config.decode.method=mdm", "--config.decode.mdm_ranking=entropy",
       "--config.decode.mdm_steps=4", f"--config.decode.gen_length={GEN}",
       f"--config.decode.block_size={GEN}", "--config.decode.slot_size=4",
       "--config.prompt_bucket=8", "--config.output_json=-"],
      cwd=REPO, capture_output=True, text=True, timeout=300,
      env=dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu"))
  assert proc.returncode == 0, proc.stderr
  results = json.loads(proc.stdout)
  _, model = _load()
  expected = mdm.generate(model, *_pad([[5, 6, 7]]), _decode_config(mdm_ranking="entropy",
                                                                   mdm_steps=4))
  n = int(expected.length_b[0])
  assert results[0]["tokens"] == [int(t) for t in np.asarray(expected.tokens_bg[0, :n])]
  assert results[0]["nfe"] == int(expected.counters.nfe_b()[0])
  assert results[0]["tokens_per_forward"] == pytest.approx(n / results[0]["nfe"])


@pytest.mark.parametrize("method, match", [("refusion", r"decode it with decode.method='mdm'"),
                                           ("ar", r"AR decoding needs a causal model")])
def test_other_decoders_refuse_a_dream_model(method, match):
  _, model = _load()
  with pytest.raises(ValueError, match=match):
    engine.Decoder(model, DecodeConfig(method=method, gen_length=GEN, slot_size=4,
                                                  block_size=GEN))


@pytest.mark.parametrize("benchmark", ["gsm8k", "humaneval"])
def test_eval_config_decodes_as_dream(benchmark):
  from absl import flags  # pylint: disable=g-import-not-at-top
  from ml_collections import config_flags  # pylint: disable=g-import-not-at-top

  argv = [__file__, f"--config={REPO}/configs/eval/dream.py:{benchmark}",
          "--config.decode.mdm_ranking=origin"]
  fv = flags.FlagValues()
  flag = config_flags.DEFINE_config_file("config", None, "", flag_values=fv, sys_argv=argv)
  fv(argv)
  c = flag.value
  assert c.benchmark == benchmark
  dc = DecodeConfig(**c.decode.to_dict())
  assert (dc.method, dc.gen_length, dc.block_size, dc.mdm_steps, dc.mdm_ranking,
          dc.temperature) == ("mdm", 512, 512, 512, "origin", 0.0)
  spec = program_lib.spec_of(dc)
  assert (spec.block_size, spec.mdm_steps_per_block) == (512, 512)


def test_training_a_dream_model_is_refused():
  _, model = _load()
  batch = {"tokens": np.array([[5, 6, 7, 8]], np.int32), "prompt_len": np.array([2], np.int32),
           "response_len": np.array([2], np.int32)}
  from refusion_jax import objective  # pylint: disable=import-outside-toplevel
  with pytest.raises(ValueError, match="a Dream model.*training one is not supported"):
    objective.loss_fn(model, batch, jax.random.key(0), objective="mdm",
                      mask_id=model.config.mask_token_id, pad_id=0, eos_id=7)
