"""ReFusion's verified infill (decode.verify, ALGORITHM.md "Past the paper") against the
plain-Python oracle of tests/test_decode_refusion.py, and against greedy AR decoding.

With one slot per block and `verify="exact"`, every committed token is the causal
argmax of the same weights: the decode equals `decode.method="ar"` token for token,
and so does the left-to-right ablation with verification (its slot-first tokens
checked against the previous token's prediction). With verification off, the decoder
is today's (the oracle tests of test_decode_refusion.py run with it off).
"""

import collections
import time

import jax
import numpy as np
import pytest

from refusion_jax.decode import engine, refusion, settings
from refusion_jax.decode.settings import DecodeConfig
from tests.test_decode_refusion import (
  Oracle,
  _check_row,
  _make_model,
  _pad,
  _random_prompts,
)

# A 2-layer model (the oracle's causal calls and the decoder share its programs); its
# EOS id is one this random model emits now and then.
_EOS_ID = 55
# (padded prompt, gen_length, slot, block): one program per group and verify setting.
_GROUPS = ((6, 16, 4, 8), (6, 16, 2, 8))


@pytest.fixture(scope="module")
def model():
  return _make_model(eos_id=_EOS_ID, num_layers=2)


def _batch_against_oracle(model, dc, prompts, pad_to, branches, **oracle):
  """Decodes `prompts` (padded to `pad_to`) as one batch and checks each row against its
  own single-prompt oracle (`oracle`: its own arguments); returns the oracle's results."""
  ids, lens = _pad(prompts, pad_to)
  out = jax.device_get(refusion.generate(model, ids, lens, dc))
  results = []
  for row, prompt in enumerate(prompts):
    results.append(Oracle(model, dc, branches, **oracle).decode(prompt))
    _check_row(out, row, results[-1], f"row {row}: prompt={prompt} {dc}")
  return results


def test_verified_decoding_matches_the_oracle(model):
  start = time.time()
  rs = np.random.RandomState(11)
  branches = collections.Counter()
  n_cases = eos_hits = 0
  compiled_before = refusion.compiled_cache_size()
  for p, g, k, blk in _GROUPS:
    for mode in ("correct", "exact"):
      for tau_s, tau_t in ((0.0, 0.9), (0.5, 0.3), (0.9, 0.05)):
        dc = DecodeConfig(gen_length=g, slot_size=k, block_size=blk, slot_threshold=tau_s,
                          token_threshold=tau_t, verify=mode,
                          boundary_check=bool(rs.rand() < 0.7),
                          recompute_kv=bool(rs.rand() < 0.3))
        for result in _batch_against_oracle(model, dc, _random_prompts(rs, 4, p), p, branches):
          eos_hits += result[1] < g
          n_cases += 1
  print(f"\n{n_cases} verified cases, {eos_hits} ended by EOS, branches: {dict(branches)}, "
        f"{time.time() - start:.1f}s")
  for branch in ("first_token_checked", "first_token_corrected", "gv_adjacent_first_checked",
                 "infill_corrected", "refresh_only_verify", "verify_later_slots_restart",
                 "eos_in_infill", "multi_round_infill", "recompute_kv"):
    assert branches[branch] > 0, f"branch {branch} never happened: {dict(branches)}"
  assert 0 < eos_hits < n_cases
  # "correct" and "exact", the boundary check (traced knobs) and every threshold share one
  # program per group.
  assert refusion.compiled_cache_size() - compiled_before <= len(_GROUPS)


def test_exact_verification_with_one_slot_per_block_is_greedy_ar(model):
  rs = np.random.RandomState(12)
  prompts = _random_prompts(rs, 8, 6)
  ids, lens = _pad(prompts, 6)
  g = 16
  ar = jax.device_get(engine.Decoder(
      model, DecodeConfig(method="ar", gen_length=g, slot_size=g, block_size=g)).generate(
          ids, lens))
  lengths = np.asarray(ar.length_b)
  assert lengths.min() < g and lengths.max() == g  # some answers end at EOS
  for k in (2, 4):
    for ltr in (False, True):
      for tau_t in (0.0, 1.0):
        dc = DecodeConfig(gen_length=g, slot_size=k, block_size=k, slot_threshold=0.5,
                          token_threshold=tau_t, verify="exact", left_to_right=ltr)
        out = jax.device_get(refusion.generate(model, ids, lens, dc))
        np.testing.assert_array_equal(out.tokens_bg, ar.tokens_bg, err_msg=str(dc))
        np.testing.assert_array_equal(out.length_b, ar.length_b, err_msg=str(dc))
        if ltr:  # one pass per token, as AR decoding
          np.testing.assert_array_equal(out.counters.nfe_b(), out.length_b)
  # Without verification the same settings decode otherwise (masked drafts stand).
  off = refusion.generate(model, ids, lens, dc.replace(verify="off", left_to_right=False))
  assert not np.array_equal(np.asarray(off.tokens_bg), ar.tokens_bg)


@pytest.mark.parametrize("fields, needle", [
    (dict(verify="yes"), "decode.verify must be one of"),
    (dict(verify="exact", method="ar"), "has none"),
    (dict(verify="correct", method="mdm"), "has none"),
    (dict(verify="exact", method="bd3lm"), "has none"),
    (dict(remask=True, method="ar"), "has none"),
    (dict(remask=1), "decode.remask must be a bool"),
    (dict(verify="exact", boundary_check="no"), "decode.boundary_check must be a bool"),
    (dict(remask=True, remask_threshold=1.5), "tau_remask"),
    (dict(remask=True, remask_threshold=-0.1), "tau_remask"),
    (dict(remask=True, left_to_right=True), "position order"),
])
def test_bad_options_fail_before_compiling(model, fields, needle):
  with pytest.raises(ValueError, match=needle):
    DecodeConfig(**{**dict(gen_length=16, slot_size=4, block_size=8), **fields})
  size = refusion.compiled_cache_size()
  dc = DecodeConfig(gen_length=16, slot_size=4, block_size=8)
  for name, value in fields.items():
    object.__setattr__(dc, name, value)
  ids, lens = _pad([[5, 6, 7]], 6)
  with pytest.raises(ValueError, match=needle):
    engine.Decoder(model, dc).generate(ids, lens)
  assert refusion.compiled_cache_size() == size


# ----------------------------------------------------------------------------
# Sub-slot re-masking (decode.remask).

# The oracle's context grows by the ghosts of re-checked entries: a wider full call.
_REMASK_WIDTH = 80


def test_remasking_matches_the_oracle(model):
  start = time.time()
  rs = np.random.RandomState(13)
  branches = collections.Counter()
  n_cases = remasked = 0
  compiled_before = refusion.compiled_cache_size()
  for p, g, k, blk in ((6, 16, 4, 16), (6, 16, 2, 8)):
    for verify in ("off", "correct"):
      for tau_s, tau_t, tau_r in ((0.0, 0.3, 0.5), (0.5, 0.6, 0.3), (0.2, 0.1, 0.8)):
        dc = DecodeConfig(gen_length=g, slot_size=k, block_size=blk, slot_threshold=tau_s,
                          token_threshold=tau_t, verify=verify, remask=True,
                          remask_threshold=tau_r, recompute_kv=bool(rs.rand() < 0.3))
        for result in _batch_against_oracle(model, dc, _random_prompts(rs, 3, p), p, branches,
                                            width=_REMASK_WIDTH):
          remasked += result[2]["remasked"]
          n_cases += 1
  print(f"\n{n_cases} re-masking cases, {remasked} slots masked again, branches: "
        f"{dict(branches)}, {time.time() - start:.1f}s")
  for branch in ("remask_early_slot", "remask_recheck_rides_on_plan", "remask_recheck_pass",
                 "remask_masked_again", "remask_shorter_slot", "remask_kept_whole",
                 "infill_of_a_remasked_slot", "first_token_checked_in_remasked_slot",
                 "eos_in_global_verify", "eos_in_infill"):
    assert branches[branch] > 0, f"branch {branch} never happened: {dict(branches)}"
  # Verification on or off is static (two programs per group); thresholds are traced.
  assert refusion.compiled_cache_size() - compiled_before <= 4


def test_remasking_that_keeps_everything_is_the_release_decoder(model):
  """tau_remask = 0 keeps every token it re-checks: the release's tokens, plus the
  re-check passes; a row's tokens and counters are the same alone as in a batch."""
  rs = np.random.RandomState(14)
  prompts = _random_prompts(rs, 6, 6)
  ids, lens = _pad(prompts, 6)
  dc = DecodeConfig(gen_length=16, slot_size=4, block_size=16, slot_threshold=0.0,
                    token_threshold=0.3)
  release = jax.device_get(refusion.generate(model, ids, lens, dc))
  kept = jax.device_get(refusion.generate(model, ids, lens, dc.replace(
      remask=True, remask_threshold=0.0)))
  np.testing.assert_array_equal(kept.tokens_bg, release.tokens_bg)
  c = kept.counters
  assert int(c.recheck_b.sum()) > 0 and int(c.remasked_b.sum()) == 0
  np.testing.assert_array_equal(c.nfe_b() - c.recheck_b, release.counters.nfe_b())
  masked = jax.device_get(refusion.generate(model, ids, lens, dc.replace(
      remask=True, remask_threshold=0.9)))
  assert int(masked.counters.remasked_b.sum()) > 0
  for row in range(len(prompts)):
    one_ids, one_lens = _pad([prompts[row]], 6)
    one = jax.device_get(refusion.generate(model, one_ids, one_lens, dc.replace(
        remask=True, remask_threshold=0.9)))
    np.testing.assert_array_equal(masked.tokens_bg[row], one.tokens_bg[0])
    for name, value in masked.counters.as_dict().items():
      assert int(value[row]) == int(one.counters.as_dict()[name][0]), (row, name)


def test_server_buckets_of_other_methods_drop_the_options():
  """A server whose default decode verifies and re-masks still serves AR and MDM buckets:
  the options belong to ReFusion's buckets only."""
  from refusion_jax.serve import scheduler  # pylint: disable=import-outside-toplevel
  default = DecodeConfig(gen_length=16, slot_size=4, block_size=8, verify="exact",
                         remask=True, remask_threshold=0.2)
  parsed = scheduler.parse_buckets("ar:16, mdm:16:4:8, refusion:32:4:8", default)
  assert [(d.method, d.verify, d.remask) for d in parsed] == [
      ("refusion", "exact", True), ("ar", "off", False), ("mdm", "off", False),
      ("refusion", "exact", True)]
  assert parsed[-1].remask_threshold == 0.2


def test_the_options_reach_every_entry_point_config():
  """sample's and serve's configs (configs/sample.py), the benchmark configs and lmeval's
  model args all carry the options, off by default."""
  from configs import sample as sample_config  # pylint: disable=import-outside-toplevel
  from configs.eval import common as eval_common  # pylint: disable=import-outside-toplevel
  from refusion_jax.lmeval import model as lm_model  # pylint: disable=import-outside-toplevel
  for decode in (sample_config.get_config().decode, eval_common.decode_fields()):
    dc = DecodeConfig(**decode.to_dict())
    assert (dc.verify, dc.boundary_check, dc.remask, dc.remask_threshold) == (
        "off", True, False, 0.5)
    assert DecodeConfig(**{**decode.to_dict(), "verify": "exact", "remask": True}).remask
  # lm-eval's model args are the flat decode fields at these defaults (and nothing else
  # besides lm_model.MODEL_ARGS).
  defaults = settings.defaults()
  assert all(defaults[n] == d for n, d in (("verify", "off"), ("boundary_check", True),
                                           ("remask", False), ("remask_threshold", 0.5)))
  assert not set(lm_model.MODEL_ARGS) & set(settings.flat_fields())
