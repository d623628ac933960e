"""The shared decoder protocol: engine, mixed-phase batches, traced knobs, the
token picker and ReFusion's named phase functions on hand-made cases."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from refusion_jax import config as config_lib
from refusion_jax import model as model_lib
from refusion_jax import sharding
from refusion_jax.decode import compiled as compiled_lib
from refusion_jax.decode import engine, heads, passes, refusion, settings
from refusion_jax.decode import live as live_lib
from refusion_jax.decode import program as program_lib
from refusion_jax.decode.counters import DecodeCounters
from refusion_jax.decode.settings import DecodeConfig
from refusion_jax.model import Transformer

VOCAB, MASK, PAD = 64, 3, 0


def _model(attention="causal", eos=None, seed=0, scale=4.0):
  cfg = config_lib.tiny(num_layers=2, vocab_size=VOCAB, hidden_size=32, num_heads=2,
                        num_kv_heads=1, head_dim=16, mlp_dim=64, tie_embeddings=False,
                        eos_token_id=eos, mask_token_id=MASK, pad_token_id=PAD,
                        attention=attention, max_position_embeddings=96)
  model = Transformer(cfg, rngs=nnx.Rngs(seed))
  nnx.update(model, jax.tree.map(lambda x: x * scale, nnx.state(model, nnx.Param)))
  return model


def _eos_for(model, dc, prompts):
  """A token that some texts (not all) emit after their first token: as EOS it ends
  them early, so the texts end unevenly. (One batched decode: a batch decodes each row
  as alone, so these are the texts the engine gives.)"""
  ids = np.zeros((len(prompts), SINGLE_WIDTH), np.int32)
  for i, p in enumerate(prompts):
    ids[i, :len(p)] = p
  out = jax.device_get(engine.Decoder(model, dc).generate(
      ids, np.asarray([len(p) for p in prompts], np.int32)))
  texts = [set(int(t) for t in out.tokens_bg[i, 1:int(out.length_b[i])])
           for i in range(len(prompts))]
  best, best_n = None, 0
  for tok in range(4, VOCAB):
    n = sum(tok in t for t in texts)
    if best_n < n < len(texts):
      best, best_n = tok, n
  assert best is not None
  return best


_CONFIGS = {
    "refusion": DecodeConfig(gen_length=16, slot_size=4, block_size=8, slot_threshold=0.5,
                             token_threshold=0.3),
    "ar": DecodeConfig(method="ar", gen_length=12, slot_size=4, block_size=4),
    "mdm": DecodeConfig(method="mdm", gen_length=8, slot_size=4, block_size=4,
                        mdm_threshold=0.4),
}


def _prompts(rs, n):
  # Mixed lengths across two buckets (<= 8 and 9..16 tokens).
  return [[int(x) for x in rs.randint(4, VOCAB, size=rs.choice([2, 5, 8, 11, 14]))]
          for _ in range(n)]


SINGLE_WIDTH = 16  # every test prompt fits: one compiled single decode per model and shape


def _single(model, dc, prompt, rng=None):
  """The prompt decoded alone (one row, right-padded to SINGLE_WIDTH: padding changes
  nothing, as the decoders' oracle tests show on padded prompts)."""
  ids = np.zeros((1, SINGLE_WIDTH), np.int32)
  ids[0, :len(prompt)] = prompt
  out = engine.Decoder(model, dc).generate(ids, np.asarray([len(prompt)], np.int32), rng)
  out = jax.device_get(out)
  n = int(out.length_b[0])
  counters = {k: float(v[0]) for k, v in out.counters.as_dict().items()}
  return [int(t) for t in out.tokens_bg[0, :n]], counters


@pytest.fixture(scope="module")
def models():
  rs = np.random.RandomState(0)
  probe = _prompts(rs, 8)
  out = {}
  for method, dc in _CONFIGS.items():
    attention = "bidirectional" if method == "mdm" else "causal"
    base = _model(attention)
    eos = _eos_for(base, dc, probe)
    out[method] = _model(attention, eos=eos)
  return out


@pytest.mark.parametrize("method, kv_chunk", [("refusion", None), ("ar", None), ("mdm", None),
                                              ("refusion", 3), ("ar", 3)])
def test_engine_equals_single_decodes_in_input_order(models, method, kv_chunk):
  # kv_chunk=3: attention reads each row's buffer (24 to 32 entries) three at a time,
  # only up to the longest live row, so how far it reads depends on the other rows.
  model, dc = models[method], _CONFIGS[method].replace(kv_chunk=kv_chunk)
  rs = np.random.RandomState(1)
  prompts = _prompts(rs, 11)
  eng = engine.Decoder(model, dc).engine(3)
  before = compiled_lib.compiled_programs()["step"]
  run = eng.run(prompts)
  buckets = {engine.bucket_width(len(p)) for p in prompts}
  assert len(buckets) == 2
  # One step program per bucket, and a second run compiles nothing.
  assert compiled_lib.compiled_programs()["step"] - before <= len(buckets)
  compiled = compiled_lib.compiled_programs()
  again = eng.run(prompts)
  assert compiled_lib.compiled_programs() == compiled
  lengths = []
  for i, prompt in enumerate(prompts):
    tokens, counters = _single(model, dc, prompt)
    assert run.results[i].index == i
    assert run.results[i].tokens == tokens, (method, i)
    assert run.results[i].counters == counters, (method, i)
    assert again.results[i].tokens == tokens
    lengths.append(len(tokens))
  assert min(lengths) < dc.gen_length, lengths  # some texts end early: rows are refilled
  # Every pass advanced several rows: far fewer passes than one prompt at a time.
  own = sum(r.counters["nfe_b"] for r in run.results)
  assert run.passes < own


_COMPILE_LISTENERS: list = []


def _on_duration(event, duration, fun_name="", **kwargs):
  del duration, kwargs
  if event == "/jax/core/compile/backend_compile_duration":
    for listener in _COMPILE_LISTENERS:
      listener(fun_name)


jax.monitoring.register_event_duration_secs_listener(_on_duration)


def test_warm_up_compiles_every_program_a_run_calls(models):
  # Parameters placed on a mesh (as `checkpoint.load_model(..., mesh)` and training
  # leave them) make every program's outputs mesh-committed: a run after warm_up must
  # still find each of its programs compiled, whatever the size of an admission.
  from refusion_jax import sharding  # pylint: disable=import-outside-toplevel
  model = sharding.shard_model(models["refusion"], sharding.make_mesh(devices=jax.devices()[:1]))
  rs = np.random.RandomState(6)
  prompts = [p[:8] for p in _prompts(rs, 9)]
  eng = engine.Decoder(model, _CONFIGS["refusion"]).engine(4, width=8)
  eng.warm_up()
  compiled: list[str] = []
  _COMPILE_LISTENERS.append(compiled.append)
  try:
    run = eng.run(prompts)
  finally:
    _COMPILE_LISTENERS.remove(compiled.append)
  assert run.admissions >= 2  # a first admission of 4, then refills of fewer
  # (host-side staging of new input shapes compiles tiny `stage` programs: not decode)
  assert [name for name in compiled if "engine" in name or "release" in name] == []


@pytest.mark.parametrize("kv_chunk", [None, 3])
def test_engine_on_a_multi_device_mesh_equals_one_device(models, kv_chunk):
  # kv_chunk=3: the loop over the live part slices a cache whose heads are split.
  from refusion_jax import sharding  # pylint: disable=import-outside-toplevel
  mesh = sharding.make_mesh(fsdp=2, tensor=2, devices=jax.devices()[:4])
  rs = np.random.RandomState(7)
  prompts = [p[:8] for p in _prompts(rs, 7)]
  dc = _CONFIGS["refusion"].replace(kv_chunk=kv_chunk)
  plain = engine.Decoder(models["refusion"], dc).engine(3, width=8).run(prompts)
  dec = engine.Decoder(sharding.shard_model(models["refusion"], mesh), dc)
  assert dec.place is not None and dec.place.mesh.size == 4
  run = dec.engine(3, width=8).run(prompts)
  assert [r.tokens for r in run.results] == [r.tokens for r in plain.results]


@pytest.mark.parametrize("method", ["refusion", "ar", "mdm"])
def test_engine_sampling_equals_the_batch_decode(models, method):
  # Per-prompt keys: prompt i draws from fold_in(rng, i) whichever row it lands in.
  model, dc = models[method], _CONFIGS[method].replace(temperature=1.3)
  rs = np.random.RandomState(2)
  prompts = [p[:8] for p in _prompts(rs, 7)]
  rng = jax.random.PRNGKey(5)
  dec = engine.Decoder(model, dc)
  run = dec.engine(2, width=8).run(prompts, rng)
  ids = np.zeros((len(prompts), 8), np.int32)
  for i, p in enumerate(prompts):
    ids[i, :len(p)] = p
  out = jax.device_get(dec.generate(ids, np.asarray([len(p) for p in prompts]), rng))
  for i in range(len(prompts)):
    assert run.results[i].tokens == [int(t) for t in out.tokens_bg[i, :int(out.length_b[i])]]
  greedy = engine.Decoder(model, dc.replace(temperature=0.0)).engine(2, width=8).run(prompts)
  assert any(a.tokens != b.tokens for a, b in zip(run.results, greedy.results))


def test_engine_passes_close_to_the_ideal(models):
  model, dc = models["refusion"], _CONFIGS["refusion"]
  rs = np.random.RandomState(3)
  prompts = [p[:8] for p in _prompts(rs, 40)]
  run = engine.Decoder(model, dc).engine(4, width=8).run(prompts)
  own = sum(r.counters["nfe_b"] for r in run.results)
  # Rows are refilled as soon as they finish: only the tail of the run is not full.
  assert run.passes <= 1.15 * own / 4 + dc.gen_length, (run.passes, own / 4)


def test_mixed_phase_batch_equals_rows_alone(models):
  model, dc = models["refusion"], _CONFIGS["refusion"]
  rs = np.random.RandomState(4)
  prompts = [p[:8] for p in _prompts(rs, 6)]
  dec = engine.Decoder(model, dc)
  ids = np.zeros((6, 8), np.int32)
  for i, p in enumerate(prompts):
    ids[i, :len(p)] = p
  lens = np.asarray([len(p) for p in prompts], np.int32)
  state = compiled_lib.init(dec.graphdef, dec.params, spec=dec.spec, rows=6, width=8,
                              place=dec.place)
  state = compiled_lib.admit(dec.graphdef, dec.params, state, jnp.asarray(ids),
                               jnp.asarray(lens), jnp.arange(6), jnp.arange(6),
                               program_lib.raw_key(jax.random.PRNGKey(0)), dec.knobs, spec=dec.spec,
                               place=dec.place)
  step = jax.jit(lambda s: refusion.step(nnx.merge(dec.graphdef, dec.params), dec.spec, s,
                                         dec.knobs))
  mixed = 0
  while bool((state.rows.phase_b >= program_lib.FIRST_PHASE).any()):
    phase_b = np.asarray(state.rows.phase_b)
    phases = set(phase_b[phase_b >= program_lib.FIRST_PHASE])
    mixed += len(phases) >= 2
    state = step(state)
  assert mixed > 0  # some passes fed rows in different phases
  out = jax.device_get(refusion.output(dec.spec, state, dec.knobs))
  for i, p in enumerate(prompts):
    tokens, counters = _single(model, dc, p)
    assert [int(t) for t in out.tokens_bg[i, :int(out.length_b[i])]] == tokens
    assert int(out.counters.nfe_b()[i]) == counters["nfe_b"]


@pytest.mark.parametrize("method", ["refusion", "ar"])
def test_engine_prefills_short_prompts_at_a_narrower_width(models, method, monkeypatch):
  model, dc = models[method], _CONFIGS[method]
  prompts = _prompts(np.random.RandomState(5), 9)  # 2 to 14 tokens, width 16
  eng = engine.Decoder(model, dc).engine(3, width=16, admit_widths=(4, 8))
  eng.warm_up()
  compiled = compiled_lib.compiled_programs()
  widths = []
  admit = compiled_lib.admit  # pylint: disable=protected-access

  def spy(graphdef, params, state, ids_ap, *args, **kwargs):
    widths.append(ids_ap.shape[1])
    return admit(graphdef, params, state, ids_ap, *args, **kwargs)
  monkeypatch.setattr(compiled_lib, "admit", spy)
  run = eng.run(prompts)
  monkeypatch.setattr(compiled_lib, "admit", admit)
  assert compiled_lib.compiled_programs() == compiled  # warm_up compiled every width and size
  assert min(widths) < 16 and set(widths) <= {4, 8, 16}
  wide = engine.Decoder(model, dc).engine(3, width=16).run(prompts)
  for i, prompt in enumerate(prompts):
    tokens, counters = _single(model, dc, prompt)
    assert run.results[i].tokens == tokens == wide.results[i].tokens
    assert run.results[i].counters == counters
  with pytest.raises(ValueError, match="admit_widths must be positive ints"):
    engine.Decoder(model, dc).engine(3, admit_widths=(0, 8))


def test_counters_read_back_to_the_host_give_the_same_dict_without_device_ops():
  """The offline engine takes each finished row's counters from host arrays: `as_dict`
  then computes with numpy, and every value and dtype equals the device's."""
  from refusion_jax.decode.counters import DecodeCounters  # pylint: disable=import-outside-toplevel
  rs = np.random.RandomState(0)
  c = DecodeCounters.zeros(64).replace(
      steps_b=jnp.asarray(rs.randint(0, 40, 64), jnp.int32),
      step_tpf_sum_b=jnp.asarray(rs.rand(64) * 30, jnp.float32),
      plan_b=jnp.asarray(rs.randint(0, 9, 64), jnp.int32), recompute_b=3)
  on_device, on_host = c.as_dict(), jax.device_get(c).as_dict()
  assert set(on_device) == set(on_host)
  for k, v in on_host.items():
    assert isinstance(v, np.ndarray), k
    assert v.dtype == on_device[k].dtype and np.array_equal(v, np.asarray(on_device[k])), k


def test_engine_takes_a_row_that_finishes_at_its_admission():
  """An AR prompt whose first token is EOS is done once prefilled: the engine takes its
  result before it frees the row (more prompts than rows, so its step stops on it)."""
  dc = _CONFIGS["ar"]
  prompts = _prompts(np.random.RandomState(3), 5)
  first = _single(_model(), dc, prompts[2])[0][0]
  model = _model(eos=first)
  assert _single(model, dc, prompts[2])[0] == [first]
  run = engine.Decoder(model, dc).engine(2, width=16).run(prompts)
  for i, prompt in enumerate(prompts):
    assert run.results[i].tokens == _single(model, dc, prompt)[0]


def test_an_unset_kv_chunk_follows_the_row_count(models, monkeypatch):
  """decode.kv_chunk unset: the platform's chunk only in programs over at least
  KV_CHUNK_AUTO_MIN_ROWS rows (a single CPU row reads its whole buffer), a set value
  at every row count, none for MDM; rows decode the same either way. (The CPU's chunk,
  64, exceeds these buffers: a chunk of 3 here.)"""
  monkeypatch.setitem(settings.KV_CHUNK_AUTO, "cpu", 3)
  monkeypatch.setitem(settings.KV_CHUNK_AUTO_MIN_ROWS, "cpu", 2)
  model, dc = models["refusion"], _CONFIGS["refusion"]
  auto = engine.Decoder(model, dc)
  if auto.platform != "cpu":
    pytest.skip("the CPU's defaults")
  assert auto.spec.kv_chunk == 3  # any number of rows (LiveBatch, aot)
  assert [auto.spec_for(r).kv_chunk for r in (1, 2, 16)] == [0, 3, 3]
  assert auto.spec_for(1) == dataclasses.replace(auto.spec, kv_chunk=0)
  assert (auto.engine(1).spec.kv_chunk, auto.engine(3).spec.kv_chunk) == (0, 3)
  for k in (0, 3):
    assert [engine.Decoder(model, dc.replace(kv_chunk=k)).spec_for(r).kv_chunk
            for r in (1, 16)] == [k, k]
  assert engine.Decoder(models["mdm"], _CONFIGS["mdm"]).spec_for(16).kv_chunk == 0
  assert [dc.kv_chunk_on("cpu", r) for r in (None, 1, 2)] == [3, 0, 3]
  assert [dc.kv_chunk_on(p, 1) for p in ("gpu", "tpu")] == [0, settings.KV_CHUNK_AUTO["tpu"]]
  # Three rows read their buffers three entries at a time, a single decode reads it whole.
  prompts = _prompts(np.random.RandomState(4), 6)
  run = auto.engine(3).run(prompts)
  for i, prompt in enumerate(prompts):
    assert run.results[i].tokens == _single(model, dc, prompt)[0]


@pytest.mark.parametrize("method, changes", [
    ("refusion", [dict(temperature=0.8), dict(slot_threshold=0.1, token_threshold=0.9),
                  dict(recompute_kv=True)]),
    ("ar", [dict(temperature=0.8), dict(temperature=2.0)]),
    ("mdm", [dict(temperature=0.8), dict(mdm_threshold=None, mdm_tokens_per_step=2),
             dict(mdm_threshold=0.9)]),
])
def test_knobs_never_recompile(models, method, changes):
  model, dc = models[method], _CONFIGS[method]
  ids, lens = np.asarray([[5, 6, 7, 0]], np.int32), np.asarray([3], np.int32)
  dec = engine.Decoder(model, dc)
  eng = dec.engine(2, width=4)
  jax.block_until_ready(dec.generate(ids, lens))
  eng.run([[5, 6, 7], [9, 9]])
  compiled = compiled_lib.compiled_programs()
  results = []
  for change in changes:
    other = engine.Decoder(model, dc.replace(**change))
    results.append(jax.device_get(other.generate(ids, lens, jax.random.PRNGKey(1))))
    other.engine(2, width=4).run([[5, 6, 7], [9, 9]], jax.random.PRNGKey(1))
  assert compiled_lib.compiled_programs() == compiled


# ----------------------------------------------------------------------------
# The token picker.


def test_token_stats_chunked_equals_full_softmax():
  rs = np.random.RandomState(0)
  h = jnp.asarray(rs.randn(2, 5, 8), jnp.float32)
  w = jnp.asarray(rs.randn(100, 8) * 2, jnp.float32)
  given = jnp.asarray(rs.randint(0, 100, size=(2, 5)), jnp.int32)
  logits = np.einsum("btd,vd->btv", np.asarray(h), np.asarray(w)).astype(np.float64)
  for banned in (None, 7):
    ref = logits.copy()
    if banned is not None:
      ref[..., banned] = -np.inf
    probs = np.exp(ref - ref.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    want_pick = probs.argmax(-1)
    # one piece; four with a clamped last; 30 with overlap. The weight as a tied
    # embedding [V, D] (a plain array or Unembed) and as an LM head [D, V].
    for chunk in (128, 32, 30):
      for unembed in (w, model_lib.Unembed(w, vocab_axis=0), model_lib.Unembed(w.T, vocab_axis=1)):
        s = heads.token_stats(h, unembed, given, banned_id=banned, vocab_chunk=chunk)
        np.testing.assert_array_equal(s.pick_bt, want_pick)
        np.testing.assert_allclose(s.p_pick_bt, probs.max(-1), rtol=1e-5)
        np.testing.assert_allclose(s.p_given_bt, np.take_along_axis(probs, np.asarray(given)[
            ..., None], -1)[..., 0], rtol=1e-5, atol=1e-12)


@pytest.mark.parametrize("layout", ["tied", "head"])
def test_token_stats_with_the_vocabulary_split_over_devices_equals_one_device(layout):
  # Tensor parallelism splits the vocabulary 8 ways; each device reduces its own part
  # in chunks (2 chunks of 128 per part, the last clamped) and the result is the
  # single-device one: greedy picks and both probabilities, sampled picks, the ban.
  rs = np.random.RandomState(3)
  v, d = 8 * 200, 16
  h = jnp.asarray(rs.randn(4, 3, d), jnp.float32)
  w = jnp.asarray(rs.randn(v, d) * 2, jnp.float32)
  # A tie across parts (columns 7 and 1300): the lower column wins, as argmax does.
  w = w.at[7].set(50.0 * jnp.ones(d)).at[1300].set(50.0 * jnp.ones(d))
  h = h.at[0, 0].set(jnp.ones(d))
  unembed = model_lib.Unembed(w, 0) if layout == "tied" else model_lib.Unembed(w.T, 1)
  given = jnp.asarray(rs.randint(0, v, size=(4, 3)), jnp.int32)
  sample = jnp.asarray(rs.rand(4, 3) < 0.5)
  keys = program_lib.pass_keys(jnp.asarray(rs.randint(0, 99, (4, 2)), jnp.uint32),
                          jnp.arange(4), 3)

  def stats(unembed, temperature, banned):
    return heads.token_stats(h, unembed, given, sample_bt=sample, temperature=temperature,
                             keys_bt2=keys, banned_id=banned, vocab_chunk=128)

  mesh = sharding.make_mesh(data=1, fsdp=1, tensor=8)
  rules = sharding.ShardingRules()
  axes = ("vocab", "embed") if layout == "tied" else ("embed", "vocab")
  placed = model_lib.Unembed(jax.device_put(unembed.w, jax.sharding.NamedSharding(
      mesh, sharding.logical_to_physical(axes, rules, unembed.w.shape, mesh))), unembed.vocab_axis)
  for temperature, banned in ((0.0, None), (0.0, 1300), (0.7, 3)):
    want = stats(unembed, jnp.float32(temperature), banned)
    with sharding.use_mesh(mesh, rules):
      assert sharding.split_count("vocab", v) == 8
      got = jax.jit(lambda u, t: stats(u, t, banned))(placed, jnp.float32(temperature))
    np.testing.assert_array_equal(np.asarray(got.pick_bt), np.asarray(want.pick_bt))
    np.testing.assert_allclose(np.asarray(got.p_pick_bt), np.asarray(want.p_pick_bt), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(got.p_given_bt), np.asarray(want.p_given_bt),
                               rtol=1e-5, atol=1e-12)
    if temperature == 0.0 and banned is None:
      assert int(want.pick_bt[0, 0]) == 7
  # No device gathers the whole projection: only [B, T] statistics cross devices.
  with sharding.use_mesh(mesh, rules):
    hlo = jax.jit(lambda u: stats(u, jnp.float32(0.0), None)).lower(placed).compile().as_text()
  gathered = [line for line in hlo.splitlines() if "all-gather(" in line and (
      f"[{v},{d}]" in line or f"[{d},{v}]" in line)]
  assert not gathered, gathered[:2]


def test_noise_of_a_column_is_the_same_in_every_chunking():
  keys = program_lib.pass_keys(jnp.asarray([[3, 4]], jnp.uint32), jnp.asarray([2]), 3)
  whole = np.asarray(heads._noise(keys, 0, 700))  # pylint: disable=protected-access
  assert whole.shape == (1, 3, 700) and len(np.unique(whole)) == whole.size
  for start, width in ((0, 256), (128, 300), (37, 200), (699, 1)):
    part = heads._noise(keys, jnp.int32(start), width)  # pylint: disable=protected-access
    np.testing.assert_array_equal(part, whole[..., start:start + width])
  # Another token's key draws other noise.
  assert not np.array_equal(whole[0, 0], whole[0, 1])


def test_noise_is_standard_gumbel():
  keys = program_lib.pass_keys(jnp.asarray([[3, 4], [5, 6]], jnp.uint32), jnp.asarray([2, 7]), 50)
  x = np.asarray(heads._noise(keys, 0, 4000)).ravel()  # pylint: disable=protected-access
  # 400,000 draws: mean Euler's gamma, variance pi^2 / 6, P(x < 0) = exp(-1).
  assert np.isfinite(x).all()
  assert abs(x.mean() - 0.5772) < 0.01 and abs(x.var() - np.pi**2 / 6) < 0.02
  assert abs((x < 0).mean() - np.exp(-1)) < 0.005


def test_compact_moves_fed_entries_to_the_front_in_layout_order():
  fed = jnp.asarray([[0, 1, 1, 0, 1], [1, 0, 0, 0, 0], [0, 0, 0, 0, 0]], bool)
  src, rank = passes.compact(fed)
  np.testing.assert_array_equal(np.asarray(src)[0, :3], [1, 2, 4])
  assert int(src[1, 0]) == 0
  np.testing.assert_array_equal(np.asarray(rank)[0], [-1, 0, 1, 1, 2])
  assert np.asarray(src).max() <= 4  # clipped to the layout


def test_chunk_columns_keep_one_chunk_within_the_logits_budget():
  assert heads.chunk_columns(1, 32768) == 32768  # AR at batch 1: one wide chunk
  assert heads.chunk_columns(64 * 128, 32768) == 2048  # 2^24 / 8192 columns
  assert heads.chunk_columns(64 * 128, 32768) * 64 * 128 <= heads.LOGITS_BUDGET
  assert heads.chunk_columns(10**9, 32768) == heads.MIN_CHUNK  # never thinner
  assert heads.chunk_columns(3000, 32768) % 128 == 0
  assert heads.chunk_columns(64 * 128, 512) == 512  # never wider than asked
  with pytest.raises(ValueError, match="must be > 0"):
    heads.chunk_columns(0, 512)


def test_token_stats_memory_does_not_grow_with_batch_times_width():
  # Qwen3's vocabulary, 64 rows x 128 fed tokens: one 32,768-column float32 chunk of
  # logits alone would be 1 GiB. Compiled from shapes; nothing runs.
  v, d = 151936, 16
  shape = jax.ShapeDtypeStruct
  def temp_bytes(b, t):
    fn = jax.jit(lambda h, w, g, s, k, temp: heads.token_stats(
        h, w, g, sample_bt=s, temperature=temp, keys_bt2=k))
    return fn.lower(shape((b, t, d), jnp.float32), shape((v, d), jnp.float32),
                    shape((b, t), jnp.int32), shape((b, t), bool), shape((b, t, 2), jnp.uint32),
                    shape((), jnp.float32)).compile().memory_analysis().temp_size_in_bytes
  wide = temp_bytes(64, 128)
  assert wide < 8 * heads.LOGITS_BUDGET * 4, wide / 2**20
  assert wide < 2 * temp_bytes(16, 128), "temporaries grew with the batch"


def test_pass_keys_are_derived_only_when_sampling():
  key_b2 = jnp.asarray([[0, 1], [5, 9]], jnp.uint32)
  pass_b = jnp.asarray([3, 0])
  full = np.asarray(program_lib.pass_keys(key_b2, pass_b, 4))
  assert full.shape == (2, 4, 2) and len({tuple(k) for k in full.reshape(-1, 2)}) == 8
  np.testing.assert_array_equal(program_lib.pass_keys(key_b2, pass_b, 4, jnp.float32(0.7)), full)
  np.testing.assert_array_equal(program_lib.pass_keys(key_b2, pass_b, 4, jnp.float32(0.0)),
                                np.zeros((2, 4, 2), np.uint32))


def test_token_stats_sampling_is_per_token_and_respects_the_ban():
  rs = np.random.RandomState(1)
  h = jnp.asarray(rs.randn(1, 4, 8) * 0.01, jnp.float32)  # near-uniform: samples vary
  w = jnp.asarray(rs.randn(50, 8), jnp.float32)
  given = jnp.zeros((1, 4), jnp.int32)
  keys = program_lib.pass_keys(jnp.asarray([[0, 1]], jnp.uint32), jnp.asarray([0]), 4)
  sample = jnp.asarray([[True, True, False, True]])
  picks = []
  for chunk in (64, 16):
    a = heads.token_stats(h, w, given, sample_bt=sample, temperature=jnp.float32(1.0),
                          keys_bt2=keys, banned_id=3, vocab_chunk=chunk)
    b = heads.token_stats(h, w, given, sample_bt=sample, temperature=jnp.float32(1.0),
                          keys_bt2=keys, banned_id=3, vocab_chunk=chunk)
    cold = heads.token_stats(h, w, given, sample_bt=sample, temperature=jnp.float32(0.0),
                             keys_bt2=keys, banned_id=3, vocab_chunk=chunk)
    np.testing.assert_array_equal(a.pick_bt, b.pick_bt)
    # The unsampled token is the argmax; a token's draw does not depend on the others.
    assert int(a.pick_bt[0, 2]) == int(cold.pick_bt[0, 2])
    alone = heads.token_stats(h[:, :1], w, given[:, :1], sample_bt=sample[:, :1],
                              temperature=jnp.float32(1.0), keys_bt2=keys[:, :1], banned_id=3,
                              vocab_chunk=chunk)
    assert int(alone.pick_bt[0, 0]) == int(a.pick_bt[0, 0])
    picks.append(np.asarray(a.pick_bt))
  # A column's noise does not depend on the chunking: one piece (64) and chunks of
  # 16 draw the same samples.
  np.testing.assert_array_equal(picks[0], picks[1])
  # 200 prompts' keys in one call: the ban holds and the draws spread.
  many = jnp.asarray([[i, 7] for i in range(200)], jnp.uint32)
  k = program_lib.pass_keys(many, jnp.zeros((200,), jnp.int32), 4)
  draws = np.asarray(heads.token_stats(
      jnp.broadcast_to(h, (200, 4, 8)), w, jnp.zeros((200, 4), jnp.int32),
      sample_bt=jnp.broadcast_to(sample, (200, 4)), temperature=jnp.float32(1.0), keys_bt2=k,
      banned_id=3, vocab_chunk=16).pick_bt).ravel().tolist()
  assert 3 not in draws and len(set(draws)) > 20


def test_width_index_picks_the_smallest_width_that_holds_every_row():
  widths = (4, 8, 16, 24)
  assert [int(passes.width_index(jnp.int32(n), widths)) for n in (0, 1, 4, 5, 9, 17, 24)] == [
      0, 0, 0, 1, 2, 3, 3]
  spec = functools.partial(refusion.Spec, method="refusion", gen_length=48, slot_size=4)
  assert refusion.widths(spec(block_size=24)) == (4, 8, 16, 24)
  assert refusion.widths(spec(block_size=48, left_to_right=True)) == (1, 5)


# ----------------------------------------------------------------------------
# ReFusion's phase functions on hand-made rows (k=2, block of 3 slots).

_SPEC = refusion.Spec(method="refusion", gen_length=12, slot_size=2, block_size=6)
_KNOBS = program_lib.knobs_of(
    config_lib.tiny(mask_token_id=MASK, eos_token_id=9, pad_token_id=PAD),
    DecodeConfig(gen_length=12, slot_size=2, block_size=6, slot_threshold=0.5))


def _row(**fields):
  r = refusion._empty_rows(_SPEC, 1, PAD).replace(
      phase_b=jnp.asarray([refusion.PLAN]), length_b=jnp.asarray([5]),
      prompt_len_b=jnp.asarray([5]))
  r = r.replace(counters=DecodeCounters.zeros(1))
  return r.replace(**{k: jnp.asarray([v]) for k, v in fields.items()})


def _out(pick=(0,) * 6, p_pick=(0.0,) * 6, p_prev=(0.0,) * 6):
  return passes.PassOut(pick_bn=jnp.asarray([pick], jnp.int32),
                        p_pick_bn=jnp.asarray([p_pick], jnp.float32),
                        p_prev_bn=jnp.asarray([p_prev], jnp.float32))


_LAY = refusion._Layout(_SPEC)


def _np(x):
  return np.asarray(x)[0].tolist()


def test_plan_chooses_confident_slots_or_the_best_one():
  r = _row(decided_bs=[True, False, False])
  out = _out(pick=(1, 2, 3, 4, 5, 6), p_pick=(0.9, 0, 0.6, 0, 0.3, 0))
  new = refusion.plan(_LAY, r, out, _KNOBS)
  assert _np(new.chosen_bs) == [False, True, False]  # slot 0 is decided already
  assert _np(new.draft_bt) == [1, 2, 3, 4, 5, 6] and _np(new.stage_bs)[1] == 0
  assert int(new.phase_b[0]) == refusion.GLOBAL and int(new.counters.plan_b[0]) == 1
  low = refusion.plan(_LAY, r, _out(p_pick=(0.9, 0, 0.2, 0, 0.3, 0)), _KNOBS)
  assert _np(low.chosen_bs) == [False, False, True]  # none above tau_s: the best one


def test_global_verify_commits_whole_slots_or_starts_each_slot_from_its_prefix():
  r = _row(phase_b=refusion.GLOBAL, chosen_bs=[True, False, True], draft_bt=[1, 2, 3, 4, 5, 6],
           stage_bs=[0, 0, 1])
  # Slot 0 whole (p(2|1) = 0.8): committed, KV staged at length..length+1.
  whole = refusion.global_verify(_LAY, r, _out(p_prev=(1, 0.8, 0, 0, 1, 0.1)), _KNOBS)
  assert int(whole.length_b[0]) == 7 and _np(whole.decided_bs) == [True, False, False]
  assert _np(whole.tokens_bg)[:2] == [1, 2] and int(whole.phase_b[0]) == refusion.PLAN
  # Slot 0 rejected at its second token; slot 2's second token accepted there: the infill
  # starts slot 0 from [1] and slot 2 from [5, 6].
  infill = refusion.global_verify(_LAY, r, _out(p_prev=(1, 0.1, 0, 0, 1, 0.7)), _KNOBS)
  assert int(infill.phase_b[0]) == refusion.DRAFT and int(infill.length_b[0]) == 5
  assert _np(infill.accepted_bt) == [True, False, False, False, True, True]
  # An EOS (9) inside the accepted prefix ends the text there.
  eos = refusion.global_verify(_LAY, r.replace(draft_bt=jnp.asarray([[9, 2, 3, 4, 5, 6]])),
                               _out(p_prev=(1, 0.9, 0, 0, 1, 0.9)), _KNOBS)
  assert int(eos.length_b[0]) == 6 and bool(eos.eos_b[0])
  assert _np(eos.decided_bs) == [True, True, True] and int(eos.phase_b[0]) == program_lib.DONE


def test_infill_draft_and_verify_round():
  r = _row(phase_b=refusion.DRAFT, chosen_bs=[True, False, True], draft_bt=[1, 2, 3, 4, 5, 6],
           accepted_bt=[True, False, False, False, True, True], stage_bs=[0, 0, 1])
  drafted = refusion.infill_draft(_LAY, r, _out(pick=(7, 8, 7, 7, 7, 7)), _KNOBS)
  assert _np(drafted.draft_bt) == [1, 8, 3, 4, 5, 6]  # only the pending token changes
  assert _np(drafted.verify_bs) == [True, False, True]  # first round: every chosen slot
  assert int(drafted.phase_b[0]) == refusion.VERIFY
  feed = refusion.infill_verify_feed(_LAY, drafted, _KNOBS)
  # Staging: slot 0 at length+0.., slot 2 (rank 1) at length+2..
  assert _np(feed.dest_bn) == [5, 6, -1, -1, 7, 8] and _np(feed.group_bn)[4] == 2
  done = refusion.infill_verify(_LAY, drafted, _out(p_prev=(1, 0.1, 0, 0, 1, 1)), _KNOBS)
  # The first pending token is accepted whatever its probability: both slots complete.
  assert int(done.phase_b[0]) == refusion.PLAN and int(done.length_b[0]) == 9
  assert _np(done.tokens_bg)[:6] == [1, 8, PAD, PAD, 5, 6]
  assert int(done.counters.verify_b[0]) == 1 and int(done.counters.steps_b[0]) == 1
  # With recompute_kv, two committed slots go through one more causal pass.
  knobs = _KNOBS.replace(recompute_kv=jnp.bool_(True))
  again = refusion.infill_verify(_LAY, drafted, _out(p_prev=(1, 0.1, 0, 0, 1, 1)), knobs)
  assert int(again.phase_b[0]) == refusion.RECOMPUTE and int(again.length_b[0]) == 5
  feed = refusion.recompute_feed(_LAY, again, refusion._infill_outcome(_LAY, again, knobs)[0])
  assert _np(feed.dest_bn) == [5, 6, -1, -1, 7, 8] and _np(feed.group_bn) == [0] * 6
  committed = refusion.recompute(_LAY, again, _out(), knobs)
  assert int(committed.length_b[0]) == 9 and int(committed.counters.recompute_b[0]) == 1


def test_infill_eos_drops_later_slots_and_commit_ends_the_block():
  r = _row(phase_b=refusion.VERIFY, chosen_bs=[True, True, True], draft_bt=[1, 9, 3, 4, 5, 6],
           accepted_bt=[True, False, True, False, True, False], stage_bs=[0, 1, 2],
           verify_bs=[True, True, True])
  new = refusion.infill_verify(_LAY, r, _out(p_prev=(1, 0.0, 1, 0.0, 1, 0.0)), _KNOBS)
  # EOS accepted in slot 0: slots 1, 2 removed, the text ends after [1, 9].
  assert int(new.length_b[0]) == 7 and bool(new.eos_b[0]) and int(new.phase_b[0]) == program_lib.DONE
  assert _np(new.tokens_bg)[:3] == [1, 9, PAD]
  # commit: a finished block moves on; the last block (or an EOS) finishes the row.
  c = refusion.commit(_LAY, _row(), jnp.asarray([[True] * 6]), jnp.asarray([[1] * 6]),
                      jnp.asarray([[True] * 3]), jnp.asarray([False]), _KNOBS)
  assert int(c.block_b[0]) == 1 and _np(c.decided_bs) == [False] * 3
  assert int(c.phase_b[0]) == refusion.PLAN and int(c.length_b[0]) == 11
  last = refusion.commit(_LAY, _row(block_b=1), jnp.asarray([[True] * 6]), jnp.asarray([[1] * 6]),
                         jnp.asarray([[True] * 3]), jnp.asarray([False]), _KNOBS)
  assert int(last.phase_b[0]) == program_lib.DONE


@pytest.mark.parametrize("method", ["refusion", "ar"])
def test_decode_program_holds_no_copy_of_the_kv_cache(method):
  # A long KV buffer and narrow passes: the cache is most of what a decode holds, and
  # the program's temporaries must stay well below one copy of it (a layer sliced out
  # of a stacked buffer, a transposed read or a loop-carried copy would each be one).
  cfg = config_lib.tiny(num_layers=2, vocab_size=VOCAB, hidden_size=32, num_heads=2,
                        num_kv_heads=2, head_dim=16, mlp_dim=64, mask_token_id=MASK,
                        pad_token_id=PAD, max_position_embeddings=1024)
  model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
  dc = DecodeConfig(method=method, gen_length=512, slot_size=4, block_size=8)
  d = engine.Decoder(model, dc)
  b, p = 4, 8
  shape = jax.ShapeDtypeStruct
  compiled = compiled_lib.generate.lower(  # pylint: disable=protected-access
      d.graphdef, d.params, shape((b, p), np.int32), shape((b,), np.int32),
      shape((2,), np.uint32), d.knobs, spec=d.spec).compile()
  memory = compiled.memory_analysis()
  cache_bytes = 2 * cfg.num_layers * b * cfg.num_kv_heads * (p + 512) * cfg.head_dim * 4
  assert memory.temp_size_in_bytes < 0.5 * cache_bytes, (memory.temp_size_in_bytes, cache_bytes)


def test_dispatches_pass_the_parameters_flat_and_decoders_share_programs(models):
  """A Decoder's dispatches pass `FlatParams`: the parameters' arrays in `nnx.State`'s
  leaf order under one interned structure, which `_merge` turns back into the model.
  A second Decoder of the same model reuses the first one's programs."""
  model, dc = models["ar"], _CONFIGS["ar"]
  a, b = engine.Decoder(model, dc), engine.Decoder(model, dc)
  leaves, treedef = jax.tree.flatten(a.params)
  flat_leaves, flat_def = jax.tree.flatten(a.flat)
  assert len(flat_leaves) == len(leaves) and all(x is y for x, y in zip(flat_leaves, leaves))
  assert a.flat.structure is b.flat.structure and a.flat.structure.value == treedef
  assert jax.tree.unflatten(flat_def, flat_leaves).structure is a.flat.structure
  merged = compiled_lib.merge(a.static, a.flat)  # pylint: disable=protected-access
  jax.tree.map(np.testing.assert_array_equal, nnx.state(merged), nnx.state(model))
  prompt = _prompts(np.random.RandomState(2), 1)[0]
  ids = np.zeros((1, SINGLE_WIDTH), np.int32)
  ids[0, :len(prompt)] = prompt
  lens = np.asarray([len(prompt)], np.int32)
  first = jax.device_get(a.generate(ids, lens).tokens_bg)
  compiled = compiled_lib.compiled_programs()
  np.testing.assert_array_equal(jax.device_get(b.generate(ids, lens).tokens_bg), first)
  assert compiled_lib.compiled_programs() == compiled


def test_live_batch_read_later_is_a_snapshot_of_its_dispatch_point(models):
  """A read dispatched before more passes gives the rows as they stood then (the
  passes dispatched after it, onto the donated state, change neither it nor the
  texts), and the decode still equals each prompt decoded alone."""
  model, dc = models["refusion"], _CONFIGS["refusion"]
  prompts = [p[:8] for p in _prompts(np.random.RandomState(5), 2)]
  dec = engine.Decoder(model, dc)
  keys = np.zeros((2, 2), np.uint32)
  live, ref = live_lib.LiveBatch(dec, 2, 8), live_lib.LiveBatch(dec, 2, 8)
  for batch in (live, ref):
    batch.admit(prompts, [0, 1], keys)
    batch.run(1, stop_on_done=False)
  later = live.read_later()
  live.run(2, stop_on_done=False)  # dispatched before the read is waited for
  early, now = later(), ref.read()
  assert early.passes == now.passes == 1
  for field in ("tokens_bg", "commit_step_bg", "phase_b", "nfe_b"):
    np.testing.assert_array_equal(getattr(early, field), getattr(now, field))
  assert live.read().passes == 3
  live.run(None, stop_on_done=False)
  done = live.read()
  assert (done.phase_b == program_lib.DONE).all()
  for r, p in enumerate(prompts):
    tokens, counters = _single(model, dc, p)
    assert done.tokens_bg[r, :int(done.length_b[r])].tolist() == tokens
    assert int(done.nfe_b[r]) == counters["nfe_b"]


def test_live_batch_free_runs_no_program_and_the_next_run_frees(models):
  """`free` dispatches nothing: a read shows the rows free at once (a read dispatched
  before it does not), the next run frees them on the device (a row cancelled
  mid-decode runs no further pass), and an admission into a freed row decodes it."""
  model, dc = models["ar"], _CONFIGS["ar"]
  prompts = [p[:8] for p in _prompts(np.random.RandomState(3), 3)]
  live = live_lib.LiveBatch(engine.Decoder(model, dc), 2, 8)
  live.admit(prompts[:2], [0, 1], np.zeros((2, 2), np.uint32))
  live.run(1, stop_on_done=False)
  before_free = live.read_later()
  state = live.state
  live.free([1])  # cancelled mid-decode
  assert live.state is state  # nothing dispatched
  snap = live.read()
  assert snap.phase_b.tolist() == [program_lib.FIRST_PHASE, program_lib.FREE]
  assert before_free().phase_b.tolist() == [program_lib.FIRST_PHASE] * 2
  live.run(1, stop_on_done=False)
  snap = live.read()
  assert snap.passes == 2 and snap.phase_b[1] == program_lib.FREE
  assert int(snap.nfe_b[1]) == 2  # its admission's token and the pass before the free
  assert int(snap.nfe_b[0]) == 3
  live.free([1])
  live.admit(prompts[2:], [1], np.zeros((1, 2), np.uint32))  # rewrites the row: not freed
  live.run(None, stop_on_done=False)
  done = live.read()
  assert (done.phase_b == program_lib.DONE).all()
  for r, p in ((0, prompts[0]), (1, prompts[2])):
    tokens, counters = _single(model, dc, p)
    assert done.tokens_bg[r, :int(done.length_b[r])].tolist() == tokens
    assert int(done.nfe_b[r]) == counters["nfe_b"]
  for bad in ([2], [-1], [0.5]):
    with pytest.raises(ValueError, match=r"free: rows \[.*\] are not rows of this batch"):
      live.free(bad)


@pytest.mark.parametrize("method", ["refusion", "ar"])
def test_live_batch_run_returns_once_a_row_is_done(models, method):
  """`run(stop_on_done=True)` returns once a row is done, at the pass where a twin
  batch run one pass at a time saw the first row finish; False: when none is active.
  Tokens and passes equal each prompt decoded alone."""
  model, dc = models[method], _CONFIGS[method]
  prompts = [p[:8] for p in _prompts(np.random.RandomState(11), 3)]
  dec = engine.Decoder(model, dc)
  keys = np.zeros((3, 2), np.uint32)
  twin = live_lib.LiveBatch(dec, 3, 8)
  twin.admit(prompts, [0, 1, 2], keys)
  done_at = [None] * 3
  while None in done_at:
    twin.run(1, stop_on_done=False)
    snap = twin.read()
    for r in range(3):
      if done_at[r] is None and snap.phase_b[r] == program_lib.DONE:
        done_at[r] = snap.passes
  order = sorted(done_at)
  live = live_lib.LiveBatch(dec, 3, 8)
  live.admit(prompts, [0, 1, 2], keys)
  live.run(None, stop_on_done=True)
  snap = live.read()
  assert snap.passes == order[0], done_at
  assert (snap.phase_b == program_lib.DONE).sum() >= 1
  live = live_lib.LiveBatch(dec, 3, 8)
  live.admit(prompts[:2], [0, 1], keys[:2])
  live.run(None, stop_on_done=False)  # runs until none is active
  snap = live.read()
  assert snap.passes == max(done_at[:2])
  for r, p in enumerate(prompts[:2]):
    tokens, counters = _single(model, dc, p)
    assert snap.tokens_bg[r, :int(snap.length_b[r])].tolist() == tokens
    assert int(snap.nfe_b[r]) == counters["nfe_b"]
  for bad in (-1, 2, 1.5, "2", None):
    with pytest.raises(ValueError, match="run: stop_on_done must be a bool"):
      live.run(1, stop_on_done=bad)


def test_live_batch_read_after_a_run_is_the_runs_own_output(models, monkeypatch):
  """A read right after a run (or after frees since) takes the rows the run program
  packed as it ended: no read program runs, and the snapshot equals the read
  program's. After an admission the read runs its own program."""
  model, dc = models["refusion"], _CONFIGS["refusion"]
  prompts = [p[:8] for p in _prompts(np.random.RandomState(9), 3)]
  live = live_lib.LiveBatch(engine.Decoder(model, dc), 3, 8, row_counts=(2,))
  real, calls = compiled_lib.live_read, []  # pylint: disable=protected-access
  monkeypatch.setattr(compiled_lib, "live_read", lambda *a, **k: calls.append(1) or real(*a, **k))

  def own_read():
    packed = real(live.state, live.knobs, spec=live.decoder.spec)
    return live_lib.PendingRead(packed, live._read_like)()  # pylint: disable=protected-access

  live.admit(prompts[:2], [0, 1], np.zeros((2, 2), np.uint32))
  live.read()
  assert len(calls) == 1  # after an admission: a read program
  for busy in ([0, 1], None):  # a run over 2 of the rows, then over all 3
    live.run(1, stop_on_done=False, busy=busy)
    snap, want = live.read(), own_read()
    assert len(calls) == 1, busy
    for field in ("tokens_bg", "commit_step_bg", "length_b", "phase_b", "nfe_b"):
      np.testing.assert_array_equal(getattr(snap, field), getattr(want, field))
    assert snap.passes == want.passes
  live.free([1])
  assert live.read().phase_b[1] == program_lib.FREE and len(calls) == 1
  live.admit(prompts[2:], [2], np.zeros((1, 2), np.uint32))
  assert live.read().phase_b[2] != program_lib.FREE and len(calls) == 2


@pytest.mark.parametrize("method", ["refusion", "ar", "mdm"])
def test_live_batch_passes_over_the_busy_rows_only_equal_full_passes(models, method):
  """Prompts joining and leaving a 6-row batch whose passes run over the busy rows
  only (2 or 4 of them where they fit, else all 6) and whose admissions prefill at
  8 tokens where the prompts fit, else 16: each prompt's tokens and passes equal its
  decode alone, and the smaller programs were really used."""
  model, dc = models[method], _CONFIGS[method]
  prompts = _prompts(np.random.RandomState(7), 9)
  dec = engine.Decoder(model, dc)
  live = live_lib.LiveBatch(dec, 6, 16, row_counts=(2, 4), admit_widths=(8,))
  assert live.row_counts == [2, 4] and live.admit_widths == [8, 16]
  assert live.admit_programs() == [(a, w) for a in (1, 2, 4, 6) for w in (8, 16)]
  live.warm_up()
  compiled = compiled_lib.compiled_programs()
  queue, jobs, results, sizes = list(range(len(prompts))), [None] * 6, {}, []
  while queue or any(j is not None for j in jobs):
    free = [r for r, j in enumerate(jobs) if j is None]
    # All rows fill at first (a full pass), then one prompt every third chunk: rows idle.
    if queue and free and (len(sizes) < 6 or len(sizes) % 3 == 0):
      k = min(len(free), len(queue), 6 - len(sizes) if len(sizes) < 6 else 1)
      take, queue = queue[:k], queue[k:]
      live.admit([prompts[i] for i in take], free[-k:], np.zeros((k, 2), np.uint32),
                 pids=[0] * k)
      for r, i in zip(free[-k:], take):
        jobs[r] = i
    busy = [r for r, j in enumerate(jobs) if j is not None]
    sizes.append(live._row_count(len(busy)))  # pylint: disable=protected-access
    live.run(1 + len(sizes) % 3, stop_on_done=False, busy=busy)
    snap = live.read()
    done = [r for r in busy if snap.phase_b[r] == program_lib.DONE]
    for r in done:
      results[jobs[r]] = (snap.tokens_bg[r, :int(snap.length_b[r])].tolist(),
                          int(snap.nfe_b[r]))
      jobs[r] = None
    live.free(done)
  assert compiled_lib.compiled_programs() == compiled  # warm_up compiled every size
  assert 6 in sizes and min(sizes) < 6, sizes
  assert set(live.admits_by_width) == {8, 16}, live.admits_by_width
  for i, p in enumerate(prompts):
    tokens, counters = _single(model, dc, p)
    assert results[i] == (tokens, counters["nfe_b"]), (method, i)


@pytest.mark.parametrize("scan", [False, True])
def test_kv_cache_take_and_put_rows(scan):
  cfg = config_lib.tiny(num_layers=2, vocab_size=VOCAB, hidden_size=32, num_heads=2,
                        num_kv_heads=1, head_dim=16, mlp_dim=64, scan_layers=scan)
  from refusion_jax.kv_cache import KVCache  # pylint: disable=import-outside-toplevel
  cache = KVCache.init(cfg, 5, 8)
  rs = np.random.RandomState(0)
  cache = jax.tree.map(lambda x: jnp.asarray(rs.randint(0, 100, x.shape)).astype(x.dtype), cache)
  idx = jnp.asarray([3, 0])
  sub = cache.take_rows(idx)
  k0 = cache.k if scan else cache.k[0]
  s0 = sub.k if scan else sub.k[0]
  row_axis = 1 if scan else 0
  np.testing.assert_array_equal(s0, np.take(k0, [3, 0], axis=row_axis))
  np.testing.assert_array_equal(sub.length_b, np.asarray(cache.length_b)[[3, 0]])
  back = cache.put_rows(idx, jax.tree.map(lambda x: x + 1, sub))
  for full, new in zip(jax.tree.leaves(cache), jax.tree.leaves(back)):
    full, new = np.asarray(full), np.asarray(new)
    axis = row_axis if full.ndim == (5 if scan else 4) else 0
    changed = np.take(new, [3, 0], axis=axis) - np.take(full, [3, 0], axis=axis)
    np.testing.assert_array_equal(changed, 1)
    np.testing.assert_array_equal(np.take(new, [1, 2, 4], axis=axis),
                                  np.take(full, [1, 2, 4], axis=axis))


def test_packed_reads_round_trip_every_leaf():
  # The engine's reads travel as one uint32 vector (one device-to-host copy); the
  # host gets back every leaf with its shape, dtype and value.
  tree = {"tokens": jnp.arange(12, dtype=jnp.int32).reshape(3, 4) - 5,
          "done": jnp.array([True, False, True]),
          "phase": jnp.array([-1, 7, 127], jnp.int8),
          "tpf": jnp.array([0.5, -1.25, 3e-8], jnp.float32),
          "half": jnp.array([1.5, -2.0], jnp.bfloat16),
          "passes": jnp.int32(2**31 - 1),
          "empty": jnp.zeros((0, 3), jnp.int32)}
  words = jax.jit(compiled_lib.pack32)(tree)  # pylint: disable=protected-access
  assert words.dtype == jnp.uint32 and words.ndim == 1
  back = compiled_lib.unpack32(np.asarray(words), jax.eval_shape(lambda: tree))  # pylint: disable=protected-access
  assert jax.tree.structure(back) == jax.tree.structure(tree)
  for k, v in tree.items():
    assert back[k].dtype == v.dtype and back[k].shape == v.shape, k
    np.testing.assert_array_equal(np.asarray(back[k]), np.asarray(v), err_msg=k)


def test_live_batch_rejects_bad_admit_widths(models):
  dec = engine.Decoder(models["ar"], _CONFIGS["ar"])
  for bad in ((0,), (9,), (4, True), ("4",)):
    with pytest.raises(ValueError, match=r"live batch admit_widths must be ints from 1 to "
                                         r"width=8, got \[.*\]"):
      live_lib.LiveBatch(dec, 2, 8, admit_widths=bad)


@pytest.mark.parametrize("method", ["refusion", "ar", "mdm"])
def test_matmul_precision_reaches_every_product_of_the_decode_programs(method):
  # decode.matmul_precision is traced into the programs: with "highest" every matrix
  # product of a decode program carries it (on a GPU, float32 products are otherwise
  # TF32, whose rounding varies with the kernel a product's shape selects); unset on
  # a CPU, none does (JAX's default, the programs as before).
  attention = "bidirectional" if method == "mdm" else "causal"
  cfg = config_lib.tiny(num_layers=1, vocab_size=VOCAB, hidden_size=32, num_heads=2,
                        num_kv_heads=2, head_dim=16, mlp_dim=64, mask_token_id=MASK,
                        pad_token_id=PAD, attention=attention)
  model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
  base = DecodeConfig(method=method, gen_length=8, slot_size=4, block_size=8)

  def products(dc):
    d = engine.Decoder(model, dc)
    assert d.spec.matmul_precision == dc.matmul_precision_on("cpu")
    texts = [compiled_lib.lower_program(d, name, rows=2, width=8).as_text()
             for name in ("generate", "admit", "run")]
    dots = [line for t in texts for line in t.splitlines() if "dot_general" in line]
    return len(dots), sum("HIGHEST" in line for line in dots)

  n, highest = products(base)
  assert n > 0 and highest == 0
  assert products(base.replace(matmul_precision="highest")) == (n, n)
