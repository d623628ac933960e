"""LLaDA's sampler on the MDM decoder, against a plain restatement of LLaDA's `generate`
(shared/TABLE1-BASELINES.md section 1.5): the even split of a block's tokens over its
steps, low-confidence remasking, Gumbel noise in LLaDA's own form, its two EOS flags
and classifier-free guidance; and the stop ids every decoder ends a response at.
"""

import collections
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from refusion_jax import config as config_lib
from refusion_jax import hf
from refusion_jax.decode import autoregressive, heads, mdm
from refusion_jax.decode import program as program_lib
from refusion_jax.decode.settings import DecodeConfig
from tests.test_llada import FIXTURES, LLADA

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PROMPTS = [[5, 9, 30, 7, 2], [11, 4, 60]]


def test_llada_schedule_splits_a_block_evenly_remainder_first():
  assert mdm.llada_counts(7, 3) == (3, 2, 2)
  assert mdm.llada_counts(32, 32) == (1,) * 32
  assert mdm.llada_counts(4, 6) == (1, 1, 1, 1, 0, 0)
  assert sum(mdm.llada_counts(13, 5)) == 13


def _with_ids(model, eos, stops=()):
  """The same weights with other EOS / stop ids (the logits do not depend on them)."""
  graphdef, state = nnx.split(model)
  other = nnx.merge(graphdef, state)
  other.config = model.config.replace(eos_token_id=eos, stop_token_ids=tuple(stops))
  return other


def _softmax(z):
  z = z - z.max(-1, keepdims=True)
  e = np.exp(z)
  return e / e.sum(-1, keepdims=True)


def _llada_generate(model, prompt, dc, key, mask, eos, eot):
  """LLaDA's generate() for one row, restated in float64 NumPy. One departure, ours:
  the mask token is never drafted. The uniforms of its Gumbel noise are the decoder's
  (heads._noise gives -log(-log u)), drawn in LLaDA's form exp(l) / (-log u)^T."""
  p_len, g, block = len(prompt), dc.gen_length, dc.block_size
  x = np.array(list(prompt) + [mask] * g)
  blocks = g // block
  steps = dc.mdm_steps // blocks
  temp, cfg = dc.temperature, dc.mdm_cfg_scale

  def logits_of(ids):
    ids = jnp.asarray(ids[None], jnp.int32)
    positions = jnp.arange(ids.shape[1])[None]
    return np.asarray(model(ids, positions))[0].astype(np.float64)

  passes = 0
  for nb in range(blocks):
    start, end = p_len + nb * block, p_len + (nb + 1) * block
    m = int((x[start:end] == mask).sum())
    budget = [m // steps + (1 if i < m % steps else 0) for i in range(steps)]
    for i in range(steps):
      mask_index = x == mask
      logits = logits_of(x)
      if cfg > 0:
        un = x.copy()
        un[:p_len] = mask
        un_logits = logits_of(un)
        logits = un_logits + (cfg + 1) * (logits - un_logits)
      logits[:, mask] = -np.inf  # ours: the mask token is never drafted
      if dc.mdm_ban_eos:
        logits[:, eos] = -np.inf
      if temp > 0:
        pass_key = jax.random.fold_in(jnp.asarray(key), passes)
        keys = jnp.stack([jax.random.fold_in(pass_key, j) for j in range(g)])[None]
        gumbel = np.asarray(heads._noise(keys, 0, logits.shape[-1]))[0].astype(np.float64)  # pylint: disable=protected-access
        u = np.exp(-np.exp(-gumbel))
        noisy = np.full_like(logits, -np.inf)
        noisy[p_len:] = np.exp(logits[p_len:]) / (-np.log(u)) ** temp
        x0 = np.argmax(noisy, -1)
      else:
        x0 = np.argmax(logits, -1)
      if dc.mdm_defer_stop:
        # confidence_eos_eot_inf: the noisy logits' EOS and the clean logits' EoT; at
        # temperature 0 the two are one array, so both columns go.
        logits[:, eot] = -np.inf
        if temp == 0:
          logits[:, eos] = -np.inf
      p = _softmax(logits)
      x0_p = p[np.arange(len(x)), x0]
      x0_p[end:] = -np.inf
      x0 = np.where(mask_index, x0, x)
      confidence = np.where(mask_index, x0_p, -np.inf)
      order = sorted(range(len(x)), key=lambda j: (-confidence[j], j))
      for j in order[:budget[i]]:
        x[j] = x0[j]
      passes += 1
  return x[p_len:].tolist()


def _pad(prompts, width=8):
  ids = np.zeros((len(prompts), width), np.int32)
  for i, p in enumerate(prompts):
    ids[i, :len(p)] = p
  return ids, np.array([len(p) for p in prompts], np.int32)


@pytest.fixture(scope="module")
def llada():
  config, model = hf.load(LLADA, dtype="float32")
  return config, model


CASES = [
    dict(),
    dict(mdm_ban_eos=True),
    dict(mdm_defer_stop=True),
    dict(mdm_defer_stop=True, temperature=0.7),
    dict(mdm_cfg_scale=1.5),
    dict(mdm_cfg_scale=0.5, mdm_defer_stop=True, mdm_ban_eos=True, temperature=0.7,
         block_size=12, mdm_steps=12),
]


@pytest.mark.parametrize("settings", CASES)
def test_decoder_matches_plain_llada_generate(llada, settings):
  config, model = llada
  mask = config.mask_token_id
  base = dict(method="mdm", gen_length=12, slot_size=4, block_size=4, mdm_steps=9)
  dc = DecodeConfig(**{**base, **settings})
  assert dc.mdm_schedule_on == "llada"  # the "confidence" ranking's own schedule
  rng = jax.random.PRNGKey(5)
  keys = [np.asarray(k) for k in program_lib.prompt_keys(rng, jnp.arange(len(PROMPTS)))]
  # EOS and end of turn: the two tokens the plain sampler drafts most, but not first in a
  # row, so that the flags act and the answers run past their first token.
  free = [_llada_generate(model, p, dc.replace(mdm_ban_eos=False, mdm_defer_stop=False),
                          k, mask, -1, -1) for p, k in zip(PROMPTS, keys)]
  counts = collections.Counter(t for f in free for t in f if t not in (free[0][0], free[1][0]))
  (eos, _), (eot, _) = counts.most_common(2)
  out = mdm.generate(_with_ids(model, eos, (eot,)), *_pad(PROMPTS), dc, rng)
  for row, prompt in enumerate(PROMPTS):
    want = _llada_generate(model, prompt, dc, keys[row], mask, eos, eot)
    stop = next((j for j, t in enumerate(want) if t in (eos, eot)), len(want) - 1)
    n = int(out.length_b[row])
    assert n == stop + 1, (row, want, np.asarray(out.tokens_bg[row]))
    np.testing.assert_array_equal(np.asarray(out.tokens_bg[row, :n]), want[:n])
  if settings.get("mdm_ban_eos"):
    assert eos not in np.asarray(out.tokens_bg).tolist()


def test_guidance_and_flags_change_what_is_decoded(llada):
  """The options are live: each one's answer differs from the plain sampler's."""
  config, model = llada
  dc = DecodeConfig(method="mdm", gen_length=12, slot_size=4, block_size=4,
                               mdm_steps=12)
  base = np.asarray(mdm.generate(model, *_pad(PROMPTS), dc).tokens_bg)
  guided = np.asarray(mdm.generate(model, *_pad(PROMPTS), dc.replace(mdm_cfg_scale=2.0)).tokens_bg)
  assert not np.array_equal(base, guided)
  eos = collections.Counter(base[0].tolist()).most_common(1)[0][0]
  banned = mdm.generate(_with_ids(model, eos), *_pad(PROMPTS), dc.replace(mdm_ban_eos=True,
                                                                          ignore_eos=False))
  assert eos not in np.asarray(banned.tokens_bg).tolist()


def test_options_share_one_program_and_guidance_has_its_own(llada):
  _, model = llada
  dc = DecodeConfig(method="mdm", gen_length=8, slot_size=4, block_size=4,
                               mdm_steps=8)
  spec = program_lib.spec_of(dc)
  assert spec.mdm_schedule == "llada" and not spec.mdm_cfg
  for changes in (dict(mdm_ban_eos=True), dict(mdm_defer_stop=True), dict(temperature=0.5)):
    assert program_lib.spec_of(dc.replace(**changes)) == spec
  assert program_lib.spec_of(dc.replace(mdm_cfg_scale=1.0)) == spec.__class__(
      **{**spec.__dict__, "mdm_cfg": True})
  assert program_lib.spec_of(dc.replace(mdm_cfg_scale=3.0)) == program_lib.spec_of(
      dc.replace(mdm_cfg_scale=1.0))
  assert program_lib.spec_of(dc.replace(mdm_schedule="dream")).mdm_schedule == "dream"


@pytest.mark.parametrize("changes, match", [
    (dict(mdm_schedule="cosine"), r"decode.mdm_schedule must be one of \('llada', 'dream'\)"),
    (dict(mdm_ranking="origin", mdm_steps=8, mdm_schedule="llada"),
     r"'origin' .* needs decode.mdm_schedule='dream'"),
    (dict(mdm_defer_stop=True, mdm_ranking="entropy", mdm_steps=8),
     r"mdm_defer_stop .* needs decode.mdm_ranking='confidence'"),
    (dict(mdm_cfg_scale=-1.0), r"mdm_cfg_scale must be a number >= 0"),
    (dict(mdm_ban_eos=1), r"mdm_ban_eos must be a bool"),
    (dict(method="refusion", mdm_ban_eos=True),
     r"mdm_ban_eos=True is one of LLaDA's sampler options; it needs decode.method='mdm' "
     r"\(decode.method='refusion' has none\)"),
    (dict(method="bd3lm", mdm_cfg_scale=1.0), r"mdm_cfg_scale=1.0 .*'bd3lm' has none"),
])
def test_bad_llada_options_are_one_error(changes, match):
  base = dict(method="mdm", gen_length=8, slot_size=4, block_size=4)
  with pytest.raises(ValueError, match=match):
    DecodeConfig(**{**base, **changes})


# ------------------------------------------------------------------ stop ids


def test_any_stop_id_ends_an_answer_and_ignore_eos_ends_none():
  """Llama-3-Instruct ends a turn with <|eot_id|> and its base with <|end_of_text|>: an
  AR decode stops at whichever comes first."""
  config, model = hf.load(f"{FIXTURES}/llama_gqa", dtype="float32")
  dc = DecodeConfig(method="ar", gen_length=10, slot_size=10, block_size=10)
  ids, lens = _pad([[5, 9, 30, 7]])
  free = np.asarray(autoregressive.generate(_with_ids(model, None), ids, lens, dc).tokens_bg[0])
  first = next(j for j in range(2, 10) if free[j] not in free[:j])
  stop = int(free[first])
  out = autoregressive.generate(_with_ids(model, 0 if stop else 1, (stop,)), ids, lens, dc)
  assert int(out.length_b[0]) == first + 1
  np.testing.assert_array_equal(np.asarray(out.tokens_bg[0, :first + 1]), free[:first + 1])
  out = autoregressive.generate(_with_ids(model, 0 if stop else 1, (stop,)), ids, lens,
                                dc.replace(ignore_eos=True))
  assert int(out.length_b[0]) == 10
  np.testing.assert_array_equal(np.asarray(out.tokens_bg[0]), free)


def test_stop_ids_come_from_the_folder_and_the_family(tmp_path):
  import json  # pylint: disable=import-outside-toplevel,multiple-imports
  import shutil
  folder = tmp_path / "llama"
  shutil.copytree(f"{FIXTURES}/llama_gqa", folder)
  (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, 7, 3]}))
  config = config_lib.from_hf_config(folder)
  # generation_config.json's list, once each (the family's ids lie outside 120 tokens).
  assert (config.eos_token_id, config.stop_token_ids) == (2, (3, 7))
  assert config_lib.llama3_8b().stop_token_ids == (config_lib.LLAMA3_EOS_ID,)
  assert config_lib.llada_8b().stop_token_ids == (config_lib.LLADA_EOT_ID,)
  (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, 4, 5, 6]}))
  with pytest.raises(ValueError, match="end-of-response ids .* at most 4 are supported"):
    config_lib.from_hf_config(folder)
  (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": "3"}))
  with pytest.raises(ValueError, match="eos_token_id must be an id or a list of ids"):
    config_lib.from_hf_config(folder)
  knobs = program_lib.knobs_of(config_lib.llada_8b(), DecodeConfig(method="mdm"))
  assert bool(knobs.is_stop(config_lib.LLADA_EOT_ID)) and bool(knobs.is_stop(126081))
  assert not bool(knobs.is_stop(5))
  knobs = program_lib.knobs_of(config_lib.llada_8b(),
                          DecodeConfig(method="mdm", ignore_eos=True))
  assert not bool(knobs.is_stop(config_lib.LLADA_EOT_ID))


# ------------------------------------------------------------ the token picker


@pytest.mark.parametrize("vocab_chunk", [1024, 64])
def test_unscored_ids_leave_the_softmax_but_can_be_picked(vocab_chunk):
  rng = np.random.default_rng(0)
  v, d = 200, 16
  w = rng.normal(size=(v, d)).astype(np.float32)
  h = rng.normal(size=(2, 3, d)).astype(np.float32)
  logits = np.einsum("btd,vd->btv", h, w).astype(np.float64)
  top = np.argmax(logits, -1)
  unscored = np.array([int(top[0, 0]), 17, -1], np.int32)
  given = np.full((2, 3), 17, np.int32)
  stats = heads.token_stats(jnp.asarray(h), jnp.asarray(w), jnp.asarray(given),
                            banned_id=jnp.array([int(top[1, 2]), -1]),
                            unscored_ids=jnp.asarray(unscored), vocab_chunk=vocab_chunk)
  banned = logits.copy()
  banned[..., int(top[1, 2])] = -np.inf
  pick = np.argmax(banned, -1)
  kept = banned.copy()
  kept[..., [int(top[0, 0]), 17]] = -np.inf
  p = _softmax(kept)
  np.testing.assert_array_equal(np.asarray(stats.pick_bt), pick)
  assert int(stats.pick_bt[0, 0]) == int(top[0, 0]) and float(stats.p_pick_bt[0, 0]) == 0.0
  np.testing.assert_allclose(np.asarray(stats.p_pick_bt),
                             np.take_along_axis(p, pick[..., None], -1)[..., 0], atol=1e-6)
  np.testing.assert_array_equal(np.asarray(stats.p_given_bt), 0.0)


def _eval_config(arg: str):
  from absl import flags  # pylint: disable=g-import-not-at-top
  from ml_collections import config_flags  # pylint: disable=g-import-not-at-top
  argv = [__file__, f"--config={REPO}/configs/eval/{arg}"]
  fv = flags.FlagValues()
  flag = config_flags.DEFINE_config_file("config", None, "", flag_values=fv, sys_argv=argv)
  fv(argv)
  return flag.value


@pytest.mark.parametrize("arg, expected", [
    ("llada.py:mmlu_pro", (256, 256, 256, False, False)),
    ("llada.py:gsm8k", (512, 512, 512, False, True)),
    ("llada.py:gpqa", (64, 64, 64, False, True)),
    ("llada.py:humaneval", (512, 512, 512, True, False)),
    ("llada.py:gsm8k-semi_ar", (256, 8, 256, False, False)),
])
def test_llada_eval_configs_are_its_official_settings(arg, expected):
  c = _eval_config(arg)
  dc = DecodeConfig(**c.decode.to_dict())
  assert (dc.gen_length, dc.block_size, dc.mdm_steps, dc.mdm_ban_eos,
          dc.mdm_defer_stop) == expected
  assert (dc.method, dc.mdm_ranking, dc.mdm_schedule_on, dc.temperature,
          dc.mdm_cfg_scale) == ("mdm", "confidence", "llada", 0.0, 0.0)
  spec = program_lib.spec_of(dc)
  assert spec.mdm_steps_per_block == dc.block_size  # one token a step
  assert not c.enable_thinking


def test_llada_eval_config_refuses_an_unknown_setting():
  from absl import flags  # pylint: disable=g-import-not-at-top
  with pytest.raises(flags.IllegalFlagValueError, match="no LLaDA setting .arc_c-semi_ar"):
    _eval_config("llada.py:arc_c-semi_ar")


def test_llama_eval_config_is_greedy_ar():
  c = _eval_config("llama.py:mbpp")
  dc = DecodeConfig(**c.decode.to_dict())
  assert (c.benchmark, dc.method, dc.temperature, c.enable_thinking) == ("mbpp", "ar", 0.0,
                                                                          False)
