"""Mask builders against masks written out by hand."""

import numpy as np
import pytest

from refusion_jax import masks


def _m(rows):
  return np.array([[c == "1" for c in row] for row in rows.split()], bool)


def test_causal():
  np.testing.assert_array_equal(masks.causal_tt(3), _m("100 110 111"))


def test_cache_valid():
  np.testing.assert_array_equal(masks.cache_valid_bs(np.array([0, 2, 4]), 4),
                                _m("0000 1100 1111"))


def test_prefix_causal_hides_padding_keys():
  got = masks.prefix_causal_btt(np.array([2, 4]), 4)
  # Row 0 has 2 prompt tokens: padding queries see the prompt and themselves only.
  np.testing.assert_array_equal(got[0], _m("1000 1100 1110 1101"))
  np.testing.assert_array_equal(got[1], masks.causal_tt(4))


def test_subset_causal_skips_non_members():
  # Tokens 0, 2 and 3 take part (e.g. chosen slots of size 1); token 1 does not.
  got = masks.subset_causal_btt(np.array([[True, False, True, True]]))
  np.testing.assert_array_equal(got[0], _m("1000 0100 1010 1011"))


def test_subset_causal_over_slots_is_the_concatenation():
  # Slots of 2: slots 0 and 2 chosen, slot 1 not. Chosen tokens form one causal
  # sequence (slot 2 sees all of slot 0), the unchosen slot is invisible.
  member = np.array([[1, 1, 0, 0, 1, 1]], bool)
  got = masks.subset_causal_btt(member)
  np.testing.assert_array_equal(got[0], _m("100000 110000 001000 000100 110010 110011"))


def test_slot_local_is_block_diagonal():
  member = np.array([[1, 1, 0, 0, 1, 1]], bool)
  got = masks.slot_local_btt(member, 2)
  # Slot 2 no longer sees slot 0: each slot sees only its own earlier tokens.
  np.testing.assert_array_equal(got[0], _m("100000 110000 001000 000100 000010 000011"))
  all_in = masks.slot_local_btt(np.ones((1, 6), bool), 3)
  np.testing.assert_array_equal(all_in[0], _m("100000 110000 111000 000100 000110 000111"))


def test_slot_local_rejects_partial_slots():
  with pytest.raises(ValueError, match="slot_size=4"):
    masks.slot_local_btt(np.ones((1, 6), bool), 4)
