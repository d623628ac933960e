"""The exhaustive slot-order oracle (refusion_jax.decode.order_oracle): its position
order is the jitted left-to-right decoder token for token; every order is visited once."""

import math

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from refusion_jax import config as config_lib
from refusion_jax.decode import order_oracle, refusion
from refusion_jax.decode.settings import DecodeConfig
from refusion_jax.model import Transformer

MASK, EOS = 3, 59  # 59: a token this model emits early for some prompts


def _model(**overrides):
  cfg = config_lib.tiny(vocab_size=96, hidden_size=32, num_layers=2, num_heads=2,
                        num_kv_heads=1, head_dim=16, mlp_dim=64, tie_embeddings=False,
                        max_position_embeddings=128, eos_token_id=EOS, mask_token_id=MASK,
                        pad_token_id=0, bos_token_id=2, **overrides)
  model = Transformer(cfg, rngs=nnx.Rngs(7))
  # As the decoder's own oracle tests do: a sharper head, small embeddings.
  model.lm_head[...] = (model.lm_head[...] * 60.0).at[:, MASK].set(0.0)
  model.embed[...] = (model.embed[...] * 0.1).at[MASK].set(0.0)
  return model


PROMPTS = [[5, 9, 17, 4], [11, 30, 2, 8, 21, 40], [7, 7], [60, 1, 2, 90, 33]]


@pytest.mark.parametrize("gen_length, slot_size", [(12, 4), (12, 3)])
def test_the_position_order_is_the_left_to_right_decoder(gen_length, slot_size):
  model = _model()
  dc = DecodeConfig(gen_length=gen_length, slot_size=slot_size, block_size=gen_length,
                    left_to_right=True)
  width = max(len(p) for p in PROMPTS)
  ids = np.zeros((len(PROMPTS), width), np.int32)
  for i, p in enumerate(PROMPTS):
    ids[i, :len(p)] = p
  out = refusion.generate(model, jnp.asarray(ids), jnp.asarray([len(p) for p in PROMPTS]), dc)
  n = gen_length // slot_size
  ended = 0
  for i, prompt in enumerate(PROMPTS):
    results = order_oracle.all_orders(model, prompt, gen_length=gen_length,
                                      slot_size=slot_size)
    assert len(results) == math.factorial(n) == len({r.order for r in results})
    ltr = next(r for r in results if r.order == tuple(range(n)))
    want = [int(t) for t in out.tokens_bg[i, :int(out.length_b[i])]]
    assert list(ltr.tokens) == want
    assert ltr.passes == int(out.counters.nfe_b()[i]) or want[-1] == EOS
    ended += want[-1] == EOS and len(want) < gen_length
  assert 0 < ended < len(PROMPTS)  # some answers end at EOS, some run to the end


def test_a_slot_ends_at_any_stop_id_as_the_decoder_does():
  # A token the position order emits mid-answer (not EOS) made one of the model's other
  # stop ids: the oracle's position order ends there, as the left-to-right decoder does;
  # under ignore_eos nothing ends a slot.
  prompt = PROMPTS[0]
  plain = order_oracle.all_orders(_model(), prompt, gen_length=12, slot_size=4,
                                  orders=[(0, 1, 2)])[0]
  stop = next(t for t in plain.tokens[1:-1] if t != EOS)
  model = _model(stop_token_ids=(stop,))
  got = order_oracle.all_orders(model, prompt, gen_length=12, slot_size=4, orders=[(0, 1, 2)])
  assert list(got[0].tokens) == list(plain.tokens[:plain.tokens.index(stop) + 1])
  out = refusion.generate(model, jnp.asarray([prompt]), jnp.asarray([len(prompt)]),
                          DecodeConfig(gen_length=12, slot_size=4, block_size=12,
                                       left_to_right=True))
  assert list(got[0].tokens) == [int(t) for t in out.tokens_bg[0, :int(out.length_b[0])]]
  ignored = order_oracle.all_orders(model, prompt, gen_length=12, slot_size=4,
                                    orders=[(0, 1, 2)], ignore_eos=True)
  assert len(ignored[0].tokens) == 12


def test_orders_can_be_chosen_and_bad_ones_are_refused():
  model = _model()
  some = [(2, 0, 1), (0, 1, 2)]
  results = order_oracle.all_orders(model, PROMPTS[0], gen_length=12, slot_size=4, orders=some)
  assert sorted(r.order for r in results) == sorted(some)
  full = {r.order: r for r in order_oracle.all_orders(model, PROMPTS[0], gen_length=12,
                                                      slot_size=4)}
  for r in results:
    assert r == full[r.order]
  with pytest.raises(ValueError, match="not a permutation"):
    order_oracle.all_orders(model, PROMPTS[0], gen_length=12, slot_size=4, orders=[(0, 0, 1)])
  with pytest.raises(ValueError, match="at most 7"):
    order_oracle.all_orders(model, PROMPTS[0], gen_length=16, slot_size=2)
  with pytest.raises(ValueError, match="multiple of slot_size"):
    order_oracle.all_orders(model, PROMPTS[0], gen_length=10, slot_size=4)


def test_summary_by_hand():
  rs = [order_oracle.OrderResult((0, 1), (5, 6), 4), order_oracle.OrderResult((1, 0), (5, 7), 4)]
  s = order_oracle.summarize(rs, lambda t: list(t) == [5, 7])
  assert (s.orders, s.correct, s.left_to_right, s.distinct_answers) == (2, 1, False, 2)
