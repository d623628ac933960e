"""Block-wise MDM decoder vs a plain-Python LLaDA / Fast-dLLM loop."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from refusion_jax import config as config_lib
from refusion_jax.decode import mdm
from refusion_jax.decode.settings import DecodeConfig
from refusion_jax.model import Transformer

GEN = 8
BLOCK = 4
MASK = 3


def _config(**overrides):
  base = dict(num_layers=2, vocab_size=64, hidden_size=32, num_heads=2, num_kv_heads=1,
              head_dim=16, mlp_dim=64, tie_embeddings=False, eos_token_id=None,
              mask_token_id=MASK, attention="bidirectional", max_position_embeddings=64)
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


def _oracle(model, prompt, per_step, threshold, eos):
  """LLaDA's loop on one unpadded row; returns (response tokens, commit steps, passes)."""
  graphdef, state = nnx.split(model)
  gen = [None] * GEN
  steps = [-1] * GEN
  passes = 0
  for block in range(GEN // BLOCK):
    span = range(block * BLOCK, (block + 1) * BLOCK)
    while any(gen[i] is None for i in span):
      seq = list(prompt) + [MASK if t is None else t for t in gen]
      logits = np.asarray(_full_call(graphdef, state, jnp.asarray([seq])))[0, len(prompt):]
      logits = logits.astype(np.float64)
      logits[:, MASK] = -np.inf
      probs = np.exp(logits - logits.max(-1, keepdims=True))
      probs /= probs.sum(-1, keepdims=True)
      draft = probs.argmax(-1)
      conf = probs.max(-1)
      masked = [i for i in span if gen[i] is None]
      order = sorted(masked, key=lambda i: (-conf[i], i))
      if threshold is None:
        chosen = order[:per_step]
      else:
        chosen = [i for i in masked if conf[i] >= threshold] or order[:1]
      for i in chosen:
        gen[i] = int(draft[i])
        steps[i] = passes
      passes += 1
      if eos is not None and eos in gen:
        first = gen.index(eos)
        if all(t is not None for t in gen[:first]):
          return gen[:first + 1], steps[:first + 1], passes
  return gen, steps, passes


PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13], [20, 4, 33, 17, 8, 40, 2]]


def _pad(prompts, width=8):
  ids = np.zeros((len(prompts), width), np.int32)
  for i, p in enumerate(prompts):
    ids[i, :len(p)] = p
  return ids, np.array([len(p) for p in prompts], np.int32)


def _decode_config(**overrides):
  base = dict(method="mdm", gen_length=GEN, slot_size=BLOCK, block_size=BLOCK,
              mdm_tokens_per_step=2)
  base.update(overrides)
  return DecodeConfig(**base)


@pytest.mark.parametrize("per_step, threshold", [(2, None), (1, 0.3)])
def test_matches_plain_python_llada(per_step, threshold):
  model = _model(_config())
  free = [_oracle(model, p, per_step, threshold, None) for p in PROMPTS]
  if threshold is not None:
    # The threshold variant must actually unmask several tokens in some pass.
    assert any(passes < GEN for _, _, passes in free)
  # An EOS that row 0 decodes in its first block, so that rows stop at different times.
  eos = next(t for t in free[0][0][:BLOCK] if free[0][0].index(t) > 0)
  eos_model = _model(_config(eos_token_id=eos))
  dc = _decode_config(mdm_tokens_per_step=per_step, mdm_threshold=threshold)
  out = mdm.generate(eos_model, *_pad(PROMPTS), dc)
  pad = eos_model.config.pad_token_id
  lengths = []
  for row, prompt in enumerate(PROMPTS):
    tokens, steps, passes = _oracle(eos_model, prompt, per_step, threshold, eos)
    n = len(tokens)
    lengths.append(n)
    assert int(out.length_b[row]) == n
    np.testing.assert_array_equal(np.asarray(out.tokens_bg[row]), tokens + [pad] * (GEN - n))
    np.testing.assert_array_equal(np.asarray(out.commit_step_bg[row]), steps + [-1] * (GEN - n))
    counters = {k: int(v[row]) for k, v in out.counters.as_dict().items()}
    assert counters["plan_b"] == counters["nfe_b"] == passes
    assert counters["tokens_b"] == n and counters["prefill_b"] == 0
  assert lengths[0] < GEN and len(set(lengths)) > 1


def test_batch_equals_single_decodes_and_no_recompile():
  model = _model(_config(), seed=1)
  dc = _decode_config()
  batch = mdm.generate(model, *_pad(PROMPTS), dc)
  for row, prompt in enumerate(PROMPTS):
    single = mdm.generate(model, *_pad([prompt]), dc)
    np.testing.assert_array_equal(np.asarray(single.tokens_bg[0]), np.asarray(batch.tokens_bg[row]))
    assert int(single.counters.plan_b[0]) == int(batch.counters.plan_b[row])
  before = mdm.compiled_programs()
  other = [[1 + t % 60 for t in p[::-1]] for p in PROMPTS]
  again = mdm.generate(model, *_pad(other), dc)
  jax.block_until_ready(again.tokens_bg)
  # Settings this decoder ignores (ReFusion's thresholds) share the program too.
  mdm.generate(model, *_pad(other), _decode_config(slot_threshold=0.5, token_threshold=0.1))
  assert mdm.compiled_programs() == before
  assert not np.array_equal(np.asarray(again.tokens_bg), np.asarray(batch.tokens_bg))


@pytest.mark.parametrize("change, match", [
    (dict(decode=dict(method="ar")), "method='mdm'"),
    (dict(model=dict(attention="causal")), "bidirectional model"),
    (dict(model=dict(mask_token_id=None)), "mask_token_id"),
    (dict(decode=dict(gen_length=64)), "max_position_embeddings"),
    (dict(lens=[3, 0, 3]), r"prompt_len_b\[1\]=0"),
])
def test_bad_inputs_fail_before_compile(change, match):
  model = _model(_config(**change.get("model", {})))
  ids, lens = _pad(PROMPTS)
  if "lens" in change:
    lens = np.array(change["lens"], np.int32)
  before = mdm.compiled_programs()
  with pytest.raises(ValueError, match=match):
    mdm.generate(model, ids, lens, _decode_config(**change.get("decode", {})))
  assert mdm.compiled_programs() == before
