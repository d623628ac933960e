"""BD3-LM block diffusion decoder vs a plain-Python loop without a KV cache."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from refusion_jax import config as config_lib
from refusion_jax.decode import bd3lm, engine, heads
from refusion_jax.decode import live as live_lib
from refusion_jax.decode import program as program_lib
from refusion_jax.decode.settings import DecodeConfig
from refusion_jax.model import Transformer
from tests.conftest import drive_live_batch

GEN = 12
BLOCK = 4
MASK = 3
PAD = 0
WIDTH = 8  # every test prompt fits


def _config(**overrides):
  base = dict(num_layers=2, vocab_size=64, hidden_size=32, num_heads=2, num_kv_heads=1,
              head_dim=16, mlp_dim=64, tie_embeddings=False, eos_token_id=None,
              mask_token_id=MASK, pad_token_id=PAD, attention="causal",
              max_position_embeddings=64)
  base.update(overrides)
  return config_lib.tiny(**base)


def _model(config, seed=0, scale=4.0):
  # Scaled-up random weights give peaked, varied predictions (std 0.02 is near uniform).
  model = Transformer(config, rngs=nnx.Rngs(seed))
  nnx.update(model, jax.tree.map(lambda x: x * scale, nnx.state(model, nnx.Param)))
  return model


def _decode_config(**overrides):
  base = dict(method="bd3lm", gen_length=GEN, slot_size=BLOCK, block_size=BLOCK,
              mdm_tokens_per_step=2)
  base.update(overrides)
  return DecodeConfig(**base)


# --- the oracle ---------------------------------------------------------------------------

ORACLE_LEN = WIDTH + GEN  # one compiled full call: shorter sequences are padded, masked out
_GUMBEL = heads._noise  # pylint: disable=protected-access  (the token picker's own noise)


@functools.partial(jax.jit, static_argnums=0)
def _full_call(graphdef, state, ids_bt, mask_btt):
  positions_bt = jnp.broadcast_to(jnp.arange(ids_bt.shape[1])[None], ids_bt.shape)
  return nnx.merge(graphdef, state)(ids_bt, positions_bt, attention_mask_btt=mask_btt)


def _bd3lm_mask(prompt_len: int, blocks: int) -> np.ndarray:
  """BD3-LM's attention over [prompt, blocks 0..blocks-1] (the last one being decoded):
  the prompt causal; a block token sees the prompt, the blocks before it and its own
  block both ways. Padding up to ORACLE_LEN sees only itself."""
  n = prompt_len + blocks * BLOCK
  block_of = np.full((ORACLE_LEN,), -1)
  block_of[prompt_len:n] = np.arange(n - prompt_len) // BLOCK
  q, k = np.arange(ORACLE_LEN)[:, None], np.arange(ORACLE_LEN)[None, :]
  bq, bk = block_of[:, None], block_of[None, :]
  sees = np.where(bq < 0, (bk < 0) & (k <= q), bk <= bq)
  sees &= (q < n) & (k < n)
  return sees | np.eye(ORACLE_LEN, dtype=bool)


def _oracle(model, prompt, per_step, threshold, eos, temperature=0.0, key=None):
  """Block diffusion on one unpadded row with the full forward and an explicit mask;
  returns (response tokens, commit steps, passes). Sampling draws the engine's noise:
  block token i of the row's pass n uses entry BLOCK + i of `pass_keys(key, n, 2 * BLOCK)`
  (a pass's layout is [clean block, current block])."""
  graphdef, state = nnx.split(model)
  gen, steps, passes = [], [], 0
  for block in range(GEN // BLOCK):
    cur = [None] * BLOCK
    mask = jnp.asarray(_bd3lm_mask(len(prompt), block + 1)[None])
    while any(t is None for t in cur):
      seq = list(prompt) + gen + [MASK if t is None else t for t in cur]
      ids = np.zeros((1, ORACLE_LEN), np.int32)
      ids[0, :len(seq)] = seq
      logits = np.asarray(_full_call(graphdef, state, jnp.asarray(ids), mask))[0]
      logits = logits[len(seq) - BLOCK:len(seq)].astype(np.float64)
      logits[:, MASK] = -np.inf
      probs = np.exp(logits - logits.max(-1, keepdims=True))
      probs /= probs.sum(-1, keepdims=True)
      if temperature > 0:
        keys = program_lib.pass_keys(jnp.asarray(key)[None], jnp.asarray([passes]), 2 * BLOCK)
        noise = np.asarray(_GUMBEL(keys[:, BLOCK:], 0, logits.shape[-1]))[0]
        draft = (logits / temperature + noise).argmax(-1)
      else:
        draft = probs.argmax(-1)
      conf = probs[np.arange(BLOCK), draft]
      masked = [i for i in range(BLOCK) if cur[i] is None]
      order = sorted(masked, key=lambda i: (-conf[i], i))
      if threshold is None:
        chosen = order[:per_step]
      else:
        chosen = [i for i in masked if conf[i] > threshold] or order[:1]
      for i in chosen:
        cur[i] = int(draft[i])
        steps.append((block * BLOCK + i, passes))
      passes += 1
    gen += cur
    if eos is not None and eos in cur:
      first = gen.index(eos)
      return gen[:first + 1], _steps_list(steps, first + 1), passes
  return gen, _steps_list(steps, GEN), passes


def _steps_list(steps, n):
  out = [-1] * GEN
  for position, step in steps:
    out[position] = step
  return out[:n]


PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13], [20, 4, 33, 17, 8, 40, 2]]


def _pad(prompts, width=WIDTH):
  ids = np.zeros((len(prompts), width), np.int32)
  for i, p in enumerate(prompts):
    ids[i, :len(p)] = p
  return ids, np.array([len(p) for p in prompts], np.int32)


def _prompt_key(rng, i):
  """Prompt i of a call draws from fold_in(rng, i) (program_lib.prompt_keys)."""
  return np.asarray(jax.random.fold_in(program_lib.raw_key(rng), i))


def _eos_ending_block_zero(tokens):
  """A token first emitted inside row 0's first block, not at its end: as EOS it stops
  the row after that block and drops the block's later tokens."""
  for i in range(1, BLOCK - 1):
    if tokens[i] not in tokens[:i]:
      return tokens[i]
  raise AssertionError(f"no EOS candidate in {tokens[:BLOCK]}")


@pytest.mark.parametrize("per_step, threshold, temperature", [
    (2, None, 0.0), (1, 0.3, 0.0), (2, None, 1.3), (1, 0.1, 1.3)])
def test_matches_plain_python_oracle(per_step, threshold, temperature):
  rng = jax.random.PRNGKey(7)
  model = _model(_config())
  keys = [_prompt_key(rng, i) for i in range(len(PROMPTS))]
  free = [_oracle(model, p, per_step, threshold, None, temperature, k)
          for p, k in zip(PROMPTS, keys)]
  if threshold is not None:  # the threshold must commit several tokens in some pass
    assert any(passes < GEN for _, _, passes in free)
  eos = _eos_ending_block_zero(free[0][0])
  eos_model = _model(_config(eos_token_id=eos))
  dc = _decode_config(mdm_tokens_per_step=per_step, mdm_threshold=threshold,
                      temperature=temperature)
  out = jax.device_get(bd3lm.generate(eos_model, *_pad(PROMPTS), dc, rng))
  lengths = []
  for row, (prompt, key) in enumerate(zip(PROMPTS, keys)):
    tokens, steps, passes = _oracle(eos_model, prompt, per_step, threshold, eos, temperature,
                                    key)
    n = len(tokens)
    lengths.append(n)
    assert int(out.length_b[row]) == n
    np.testing.assert_array_equal(out.tokens_bg[row], tokens + [PAD] * (GEN - n))
    np.testing.assert_array_equal(out.commit_step_bg[row], steps + [-1] * (GEN - n))
    counters = {k: v[row] for k, v in out.counters.as_dict().items()}
    assert counters["plan_b"] == counters["nfe_b"] == counters["steps_b"] == passes
    assert counters["tokens_b"] == n and counters["prefill_b"] == 1
    assert counters["draft_b"] == counters["verify_b"] == counters["ar_b"] == 0
  # Row 0 stops after its first block, its tokens after the EOS dropped; rows end unevenly.
  assert lengths[0] < BLOCK and len(set(lengths)) > 1
  assert max(lengths) > BLOCK  # some row decodes past a block: its clean pass is shared


def test_ignore_eos_decodes_every_block():
  free = _oracle(_model(_config()), PROMPTS[0], 2, None, None)
  eos = _eos_ending_block_zero(free[0])
  model = _model(_config(eos_token_id=eos))
  out = jax.device_get(bd3lm.generate(model, *_pad(PROMPTS[:1]), _decode_config(
      ignore_eos=True), jax.random.PRNGKey(3)))
  assert int(out.length_b[0]) == GEN
  np.testing.assert_array_equal(out.tokens_bg[0], free[0])
  assert int(out.counters.plan_b[0]) == free[2] == GEN // 2  # 2 tokens a pass, no extra pass


def _as_lists(out, row):
  n = int(out.length_b[row])
  counters = {k: float(v[row]) for k, v in out.counters.as_dict().items()}
  return ([int(t) for t in out.tokens_bg[row, :n]],
          [int(s) for s in out.commit_step_bg[row, :n]], counters)


def test_batch_equals_single_decodes_and_programs_are_shared():
  model = _model(_config(), seed=1)
  dc = _decode_config(mdm_threshold=0.3)
  dec = engine.Decoder(model, dc)
  batch = jax.device_get(dec.generate(*_pad(PROMPTS)))
  for row, prompt in enumerate(PROMPTS):
    # Alone, unpadded (another width: another program).
    single = jax.device_get(dec.generate(*_pad([prompt], len(prompt))))
    assert _as_lists(single, 0) == _as_lists(batch, row)
  # The buffer read kv_chunk entries at a time decodes the same.
  chunked = jax.device_get(engine.Decoder(model, dc.replace(kv_chunk=2)).generate(
      *_pad(PROMPTS)))
  for row in range(len(PROMPTS)):
    assert _as_lists(chunked, row) == _as_lists(batch, row)
  # Fields BD3-LM ignores (slots, ReFusion's thresholds), and the traced knobs, share
  # one program; slot_size need not divide the block.
  before = bd3lm.compiled_programs()
  other = [[1 + t % 60 for t in p[::-1]] for p in PROMPTS]
  again = bd3lm.generate(model, *_pad(other), dc)
  for changes in (dict(slot_size=3, slot_threshold=0.5, token_threshold=0.1),
                  dict(mdm_threshold=None, mdm_tokens_per_step=3, temperature=0.7)):
    jax.block_until_ready(bd3lm.generate(model, *_pad(other), dc.replace(**changes)))
  assert bd3lm.compiled_programs() == before
  assert program_lib.spec_of(dc) == program_lib.spec_of(dc.replace(slot_size=3, slot_threshold=0.2))
  assert not np.array_equal(np.asarray(again.tokens_bg), batch.tokens_bg)


@pytest.mark.parametrize("temperature", [0.0, 1.3])
def test_engine_continuous_batching_equals_one_by_one(temperature):
  rs = np.random.RandomState(0)
  prompts = [[int(x) for x in rs.randint(4, 64, size=rs.choice([2, 4, 6, 8]))]
             for _ in range(7)]
  base = _model(_config(), seed=2)
  dc = _decode_config(mdm_tokens_per_step=1, mdm_threshold=0.5, temperature=temperature)
  rng = jax.random.PRNGKey(11)
  free = jax.device_get(engine.Decoder(base, dc).generate(*_pad(prompts), rng))
  # An EOS some texts (not all) emit: they end early and their rows are refilled.
  texts = [set(_as_lists(free, i)[0][1:]) for i in range(len(prompts))]
  eos = max(range(4, 64), key=lambda t: (sum(t in x for x in texts) < len(texts),
                                         sum(t in x for x in texts)))
  model = _model(_config(eos_token_id=eos), seed=2)
  dec = engine.Decoder(model, dc)
  want = jax.device_get(dec.generate(*_pad(prompts), rng))  # prompt i: fold_in(rng, i)
  run = dec.engine(2, width=WIDTH).run(prompts, rng)
  lengths = []
  for i, prompt in enumerate(prompts):
    tokens, steps, counters = _as_lists(want, i)
    assert run.results[i].tokens == tokens, i
    assert run.results[i].commit_steps == steps, i
    assert run.results[i].counters == counters, i
    lengths.append(len(tokens))
    if temperature == 0.0:  # greedy: the prompt decoded alone is the same
      single = jax.device_get(dec.generate(*_pad([prompt])))
      assert _as_lists(single, 0) == (tokens, steps, counters)
  assert min(lengths) < GEN and len(set(lengths)) > 1, lengths
  # Every pass advanced both rows while prompts waited: fewer passes than one by one.
  assert run.passes < sum(r.counters["nfe_b"] for r in run.results)
  # A live batch run a few passes at a time, prompts joining as rows free up, is the same.
  got = drive_live_batch(live_lib.LiveBatch(dec, 2, WIDTH), prompts, program_lib.raw_key(rng), 2)
  assert got == {i: _as_lists(want, i)[0] for i in range(len(prompts))}


@pytest.mark.parametrize("change, match", [
    (dict(decode=dict(method="mdm")), "method='bd3lm'"),
    (dict(model=dict(attention="bidirectional")), r"causal-backbone .* decode.method='mdm'"),
    (dict(model=dict(mask_token_id=None)), "mask_token_id"),
    (dict(decode=dict(mdm_ranking="entropy")), r"decode.mdm_ranking='entropy' .* MDM"),
    (dict(decode=dict(mdm_steps=6)), r"decode.mdm_steps=6 is one of MDM's options; it "
                                     r"needs decode.method='mdm' \(decode.method='bd3lm' has none"),
    (dict(decode=dict(gen_length=60)), "max_position_embeddings"),
    (dict(lens=[3, 0, 3]), r"prompt_len_b\[1\]=0"),
])
def test_bad_inputs_fail_before_compile(change, match):
  model = _model(_config(**change.get("model", {})))
  ids, lens = _pad(PROMPTS)
  if "lens" in change:
    lens = np.array(change["lens"], np.int32)
  before = bd3lm.compiled_programs()
  with pytest.raises(ValueError, match=match):
    bd3lm.generate(model, ids, lens, _decode_config(**change.get("decode", {})))
  assert bd3lm.compiled_programs() == before


def test_bad_decode_configs_name_the_field():
  with pytest.raises(ValueError, match=r"decode.gen_length=10 must be a multiple of "
                                       r"decode.block_size=4"):
    _decode_config(gen_length=10)
  with pytest.raises(ValueError, match="decode.mdm_tokens_per_step must be a positive int"):
    _decode_config(mdm_tokens_per_step=0)
  with pytest.raises(ValueError, match="decode.mdm_threshold must lie in"):
    _decode_config(mdm_threshold=1.5)
  with pytest.raises(ValueError, match="decode.recompute_kv=True is a ReFusion"):
    _decode_config(recompute_kv=True)
  # ReFusion's slot rule does not apply: a block of 4 with slots of 3 is a valid config.
  assert _decode_config(slot_size=3).block_size == BLOCK


def test_serve_buckets_ignore_the_slot_size():
  from refusion_jax.serve import scheduler  # pylint: disable=import-outside-toplevel
  dc = _decode_config(slot_size=3)
  assert scheduler.bucket_of(dc) == scheduler.bucket_of(_decode_config()) == scheduler.Bucket(
      "bd3lm", GEN, BLOCK, BLOCK)
  parsed = scheduler.parse_buckets("bd3lm:24:2:8, bd3lm:12:1:4", dc)
  # The second entry is the default's shape whatever its slot size: not a new bucket.
  assert [scheduler.bucket_of(d).name for d in parsed] == ["bd3lm:12:4:4", "bd3lm:24:8:8"]


# --- a trained model ----------------------------------------------------------------------


def test_a_trained_tiny_bd3lm_decodes_its_training_answers():
  # Four prompts, each with an answer of 9 tokens + EOS (EOS-padded to 3 blocks of 4 by the
  # objective): trained with objective.loss_fn("bd3lm") until it knows them, the decoder
  # must give the answers back, one token per step and at a threshold.
  import optax  # pylint: disable=import-outside-toplevel

  from refusion_jax import objective  # pylint: disable=import-outside-toplevel

  eos = 1
  rng = np.random.default_rng(0)
  prompts = [rng.integers(4, 64, 3 + i).tolist() for i in range(4)]
  answers = [rng.integers(4, 64, 9).tolist() + [eos] for _ in range(4)]
  seq_len = 20
  tokens = np.zeros((4, seq_len), np.int32)
  for r, (p, a) in enumerate(zip(prompts, answers)):
    tokens[r, :len(p) + len(a)] = p + a
  batch = {"tokens": tokens, "prompt_len": np.array([len(p) for p in prompts], np.int32),
           "response_len": np.array([len(a) for a in answers], np.int32)}
  config = _config(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, mlp_dim=128,
                   eos_token_id=eos)
  model = Transformer(config, rngs=nnx.Rngs(1))
  optimizer = nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)

  @nnx.jit
  def train_step(model, optimizer, key):
    def loss(m):
      return objective.loss_fn(m, batch, key, objective="bd3lm", mask_id=MASK, pad_id=PAD,
                               bd3lm_block_size=BLOCK)[0]
    value, grads = nnx.value_and_grad(loss)(model)
    optimizer.update(model, grads)
    return value

  losses = [float(train_step(model, optimizer, jax.random.key(s))) for s in range(400)]
  assert np.mean(losses[-20:]) < 0.05 * np.mean(losses[:20]), (losses[:3], losses[-3:])
  ids, lens = _pad(prompts)
  for threshold in (None, 0.9):
    dc = _decode_config(gen_length=GEN, mdm_tokens_per_step=1, mdm_threshold=threshold)
    out = jax.device_get(bd3lm.generate(model, ids, lens, dc))
    for r, a in enumerate(answers):
      assert out.tokens_bg[r, :len(a)].tolist() == a, (threshold, r)
      assert int(out.length_b[r]) == len(a)
    passes = out.counters.nfe_b()
    if threshold is None:
      assert (passes == GEN).all()  # one token per step, three whole blocks
    else:
      assert (passes < GEN).all()  # a confident model commits several tokens a pass
