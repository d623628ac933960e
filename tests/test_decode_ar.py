"""Left-to-right decoder vs a plain-Python loop over the full causal model call."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from refusion_jax import config as config_lib
from refusion_jax.decode import autoregressive
from refusion_jax.decode.settings import DecodeConfig
from refusion_jax.model import Transformer

GEN = 8


def _config(**overrides):
  base = dict(num_layers=2, vocab_size=64, hidden_size=32, num_heads=2, num_kv_heads=1,
              head_dim=16, mlp_dim=64, tie_embeddings=False, eos_token_id=None,
              max_position_embeddings=64)
  base.update(overrides)
  return config_lib.tiny(**base)


def _model(config, seed=0, scale=4.0):
  # Scaled-up random weights give peaked, varied predictions (std 0.02 is near uniform).
  model = Transformer(config, rngs=nnx.Rngs(seed))
  nnx.update(model, jax.tree.map(lambda x: x * scale, nnx.state(model, nnx.Param)))
  return model


@functools.partial(jax.jit, static_argnums=0)
def _full_call(graphdef, state, ids_bt):
  positions_bt = jnp.broadcast_to(jnp.arange(ids_bt.shape[1])[None], ids_bt.shape)
  return nnx.merge(graphdef, state)(ids_bt, positions_bt)


def _oracle(model, prompt, gen_length, eos):
  """Greedy decoding by re-running the whole causal sequence for every token.

  The sequence is zero-filled to a fixed width (causal attention: later
  filler cannot change earlier logits) so that the call compiles once.
  """
  width = 16
  graphdef, state = nnx.split(model)
  ids = list(prompt)
  out = []
  for _ in range(gen_length):
    logits = _full_call(graphdef, state, jnp.asarray([ids + [0] * (width - len(ids))]))
    token = int(np.argmax(np.asarray(logits[0, len(ids) - 1])))
    out.append(token)
    ids.append(token)
    if token == eos:
      break
  return out


PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13], [20, 4, 33, 17, 8, 40, 2]]


def _pad(prompts, width=8):
  ids = np.zeros((len(prompts), width), np.int32)
  for i, p in enumerate(prompts):
    ids[i, :len(p)] = p
  return ids, np.array([len(p) for p in prompts], np.int32)


def _decode_config(**overrides):
  base = dict(method="ar", gen_length=GEN, slot_size=8, block_size=8)
  base.update(overrides)
  return DecodeConfig(**base)


def _check_against_oracle(model, prompts, eos, **overrides):
  ids, lens = _pad(prompts)
  out = autoregressive.generate(model, ids, lens, _decode_config(**overrides))
  pad = model.config.pad_token_id
  for row, prompt in enumerate(prompts):
    want = _oracle(model, prompt, GEN, eos)
    n = len(want)
    assert int(out.length_b[row]) == n
    np.testing.assert_array_equal(np.asarray(out.tokens_bg[row, :n]), want)
    assert (np.asarray(out.tokens_bg[row, n:]) == pad).all()
    np.testing.assert_array_equal(np.asarray(out.commit_step_bg[row]),
                                  [i if i < n else -1 for i in range(GEN)])
    counters = {k: int(v[row]) for k, v in out.counters.as_dict().items()}
    assert counters["nfe_b"] == counters["ar_b"] == counters["tokens_b"] == n
    assert counters["prefill_b"] == 1 and counters["plan_b"] == 0
    assert float(out.counters.tpf_paper_b()[row]) == 1.0  # one token per pass
  return out


def test_matches_full_causal_oracle_with_eos_stop():
  model = _model(_config())
  free = [_oracle(model, p, GEN, None) for p in PROMPTS]
  # An EOS that row 0 first produces mid-response, so that rows stop at different times.
  eos = next(t for i, t in enumerate(free[0]) if i >= 2 and t not in free[0][:i])
  eos_model = _model(_config(eos_token_id=eos))
  out = _check_against_oracle(eos_model, PROMPTS, eos)
  lengths = np.asarray(out.length_b)
  assert lengths[0] < GEN and len(set(lengths.tolist())) > 1
  # decode.ignore_eos: EOS ends nothing (the model without EOS's decode), same program.
  before = autoregressive.compiled_programs()
  ignored = autoregressive.generate(eos_model, *_pad(PROMPTS), _decode_config(ignore_eos=True))
  for row, want in enumerate(free):
    assert int(ignored.length_b[row]) == GEN
    np.testing.assert_array_equal(np.asarray(ignored.tokens_bg[row]), want)
  assert autoregressive.compiled_programs() == before


def test_a_qwen2_model_decodes_like_its_full_causal_calls():
  # Qwen2.5's layers (q/k/v biases, no q/k norm) through the cached passes.
  model = _model(_config(model_type="qwen2"))
  keys = iter(jax.random.split(jax.random.key(5), 64))
  nnx.update(model, jax.tree.map(
      lambda x: jax.random.normal(next(keys), x.shape, x.dtype) * 0.5,
      nnx.state(model, lambda path, _: path[-1] in ("q_bias", "k_bias", "v_bias"))))
  assert float(jnp.abs(model.layers[0].attn.k_bias[...]).max()) > 0.1
  _check_against_oracle(model, PROMPTS, None)


def test_live_prefix_attention_matches_the_oracle_and_single_rows():
  # decode.kv_chunk=2: every pass reads the buffer (8 + 8 entries) two entries at a time
  # up to the longest row's live prefix; rows of 3, 5 and 7 prompt tokens stop at
  # different passes (EOS), and each decodes as it does alone.
  model = _model(_config())
  free = [_oracle(model, p, GEN, None) for p in PROMPTS]
  eos = next(t for i, t in enumerate(free[0]) if i >= 2 and t not in free[0][:i])
  eos_model = _model(_config(eos_token_id=eos))
  out = _check_against_oracle(eos_model, PROMPTS, eos, kv_chunk=2)
  assert len(set(np.asarray(out.length_b).tolist())) > 1
  for row, prompt in enumerate(PROMPTS):
    single = autoregressive.generate(eos_model, *_pad([prompt]), _decode_config(kv_chunk=2))
    np.testing.assert_array_equal(np.asarray(single.tokens_bg[0]), np.asarray(out.tokens_bg[row]))


def test_batch_equals_single_decodes_and_no_recompile():
  model = _model(_config(), seed=1)
  ids, lens = _pad(PROMPTS)
  batch = autoregressive.generate(model, ids, lens, _decode_config())
  for row, prompt in enumerate(PROMPTS):
    single = autoregressive.generate(model, *_pad([prompt]), _decode_config())
    np.testing.assert_array_equal(np.asarray(single.tokens_bg[0]), np.asarray(batch.tokens_bg[row]))
  before = autoregressive.compiled_programs()
  other = [[1 + t % 60 for t in p[::-1]] for p in PROMPTS]
  again = autoregressive.generate(model, *_pad(other), _decode_config())
  jax.block_until_ready(again.tokens_bg)
  # Settings this decoder ignores (ReFusion's thresholds) share the program too.
  autoregressive.generate(model, *_pad(other), _decode_config(slot_threshold=0.5, token_threshold=0.1))
  assert autoregressive.compiled_programs() == before
  assert not np.array_equal(np.asarray(again.tokens_bg), np.asarray(batch.tokens_bg))


def test_tiny_temperature_is_greedy_and_sampling_uses_rng():
  model = _model(_config(), seed=2)
  ids, lens = _pad(PROMPTS)
  greedy = autoregressive.generate(model, ids, lens, _decode_config())
  cold = autoregressive.generate(model, ids, lens, _decode_config(temperature=1e-6),
                                 jax.random.key(3))
  np.testing.assert_array_equal(np.asarray(cold.tokens_bg), np.asarray(greedy.tokens_bg))
  hot = [np.asarray(autoregressive.generate(model, ids, lens, _decode_config(temperature=5.0),
                                            jax.random.key(s)).tokens_bg) for s in range(2)]
  assert not np.array_equal(hot[0], hot[1])


@pytest.mark.parametrize("change, match", [
    (dict(decode=dict(method="mdm")), "method='ar'"),
    (dict(model=dict(attention="bidirectional")), "causal model"),
    (dict(decode=dict(gen_length=64, block_size=8)), "max_position_embeddings"),
    (dict(lens=[0, 2, 3]), r"prompt_len_b\[0\]=0"),
    (dict(lens=[3, 9, 3]), r"prompt_len_b\[1\]=9"),
    (dict(token=70), r"prompt_ids_bp\[0, 1\]=70"),
])
def test_bad_inputs_fail_before_compile(change, match):
  model = _model(_config(**change.get("model", {})))
  ids, lens = _pad(PROMPTS)
  if "lens" in change:
    lens = np.array(change["lens"], np.int32)
  if "token" in change:
    ids[0, 1] = change["token"]
  before = autoregressive.compiled_programs()
  with pytest.raises(ValueError, match=match):
    autoregressive.generate(model, ids, lens, _decode_config(**change.get("decode", {})))
  assert autoregressive.compiled_programs() == before
