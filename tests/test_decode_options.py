"""Decode options owned by their method (decode/options.py, methods.py, settings.py): every
surface derived from the registry, the static / traced split, another method's fields."""

import dataclasses
import pickle

import jax
import numpy as np
import pytest
from flax import nnx

from refusion_jax import config as config_lib
from refusion_jax.decode import engine, options, settings
from refusion_jax.decode import program as program_lib
from refusion_jax.decode.settings import DecodeConfig
from refusion_jax.lmeval import model as lm_model
from refusion_jax.model import Transformer
from refusion_jax.tokenizer import Tokenizer

SHAPE = dict(gen_length=16, block_size=8)
# Per method, a config its fields can be changed from, and per field a valid other value
# (data for the loops below, which run over whatever the registry declares).
BASE = {"ar": dict(gen_length=16), "refusion": dict(SHAPE, slot_size=4),
        "mdm": dict(SHAPE), "bd3lm": dict(SHAPE), "d2f": dict(SHAPE)}
OTHER = dict(
    slot_size=2, block_size=16, slot_threshold=0.5, token_threshold=0.7, left_to_right=True,
    recompute_kv=True, verify="correct", boundary_check=False, remask=True,
    remask_threshold=0.3, sample_drafts=True, record=True, planner="policy",
    plan_weights=(1.0, 0.0, 0.0, 0.0, 0.0, -0.5), plan_sample=True, mcts_budget=4, mcts_c=2.0,
    mcts_batch=2, mdm_tokens_per_step=2, mdm_threshold=0.8, mdm_ranking="entropy",
    mdm_steps=4, mdm_schedule="dream", mdm_ban_eos=True, mdm_defer_stop=True,
    mdm_cfg_scale=1.5, mdm_cache="dual", mdm_cache_refresh=2, mdm_factor=1.0,
    d2f_add_threshold=0.5, d2f_act_threshold=0.5, d2f_conf_threshold=0.5, d2f_window=1)
# What another field must say for a value to be valid (planner-owned fields need theirs;
# a ranking other than confidence needs a schedule; ...).
NEEDS = dict(plan_weights=dict(planner="policy"), plan_sample=dict(planner="policy"),
             mcts_budget=dict(planner="mcts"), mcts_c=dict(planner="mcts"),
             mcts_batch=dict(planner="mcts"), mdm_ranking=dict(mdm_steps=4),
             mdm_schedule=dict(mdm_steps=4), mdm_cache_refresh=dict(mdm_cache="prefix"),
             mdm_cfg_scale=dict(mdm_cfg_scale=1.0))  # on or off is static (a second forward)


def _own_fields(method):
  """(flat name, Field) of every field `method` can hold, its groups' members included."""
  out, cls = [], options.registry()[method]

  def add(c):
    for f in dataclasses.fields(c):
      out.append((f.name, f))
      if f.metadata.get("group"):
        for member in options.registry(f.metadata["group"]).values():
          add(member)
  add(cls)
  return out


def test_every_option_is_declared_once_with_a_description_and_a_rule():
  fields = settings.flat_fields()
  assert list(fields)[:6] == ["method", "gen_length", "temperature", "ignore_eos", "kv_chunk",
                              "matmul_precision"]
  for name, f in fields.items():
    assert settings.describe(name), name
    if f is not None and not f.metadata.get("group"):
      assert f.metadata["rule"].what and f.metadata["kind"] in options.KINDS, name
  # The config files' `decode`, lm-eval's model args and the tables here name them all.
  assert set(settings.config_dict()) == set(fields)
  assert set(OTHER) | {"method", *settings.SHARED_FIELDS} == set(fields)
  with pytest.raises(ValueError, match=r"unknown model arg\(s\) \['slots'\]; known: "
                     r"model_dir, .*, method, gen_length, .*mcts_budget.*d2f_window"):
    lm_model.RefusionLM(model=object(), tokenizer=object(), slots=3)
  # Each method's program names the method's own module.
  for name, cls in options.registry().items():
    assert program_lib.program(name).name == name and cls.module
    spec = program_lib.spec_of(DecodeConfig(method=name, gen_length=32))
    assert program_lib.program_of(spec) is program_lib.program(name) and not spec.program
  # A variant the options choose: ReFusion's lossless mode is a program of its own over
  # the method's Spec (a new program, no flag inside the method's).
  spec = program_lib.spec_of(DecodeConfig(method="refusion", gen_length=32, verify="lossless"))
  assert program_lib.program_of(spec).name == "refusion-lossless"
  assert type(spec) is program_lib.program("refusion").spec_type


@pytest.mark.parametrize("method", sorted(BASE))
def test_static_fields_make_a_program_traced_ones_only_knobs(method):
  """The split each method declares: a traced field changes the knobs and not the
  program (one compile for a threshold sweep), a static one the program."""
  mc = config_lib.tiny()
  base = DecodeConfig(method=method, **BASE[method])
  for name, f in _own_fields(method):
    if f.metadata.get("group") or f.metadata["kind"] == "host":
      continue
    changed = DecodeConfig(method=method, **{**BASE[method], **NEEDS.get(name, {}),
                                             name: OTHER[name]})
    before = base.replace(**NEEDS.get(name, {}))
    spec_same = program_lib.spec_of(changed) == program_lib.spec_of(before)
    knobs_a = jax.tree.leaves(program_lib.knobs_of(mc, before))
    knobs_b = jax.tree.leaves(program_lib.knobs_of(mc, changed))
    knobs_same = all(np.array_equal(a, b) for a, b in zip(knobs_a, knobs_b))
    if f.metadata["kind"] == "traced":
      assert spec_same and not knobs_same, (method, name)
    else:
      assert not spec_same, (method, name)


@pytest.mark.parametrize("method", sorted(BASE))
def test_another_methods_switch_is_refused_its_setting_ignored(method):
  own = {name for name, _ in _own_fields(method)}
  base = DecodeConfig(method=method, **BASE[method])
  for name, f in settings.flat_fields().items():
    if f is None or name in own or name in settings.SHARED_FIELDS:
      continue
    value = OTHER[name]
    if f.metadata["switch"]:
      owner = options.owners(name)[0].name
      with pytest.raises(ValueError, match=rf"decode.{name}=.* it needs decode.method="
                                           rf"'{owner}' \(decode.method='{method}' has none\)"):
        DecodeConfig(method=method, **BASE[method], **{name: value})
      assert getattr(base, name) == settings.defaults()[name]  # reads as off
    else:
      assert DecodeConfig(method=method, **BASE[method], **{name: value}) == base, name
      with pytest.raises(AttributeError, match=f"decode.{name} belongs to"):
        getattr(base, name)


def test_flat_names_route_to_the_method_and_round_trip():
  dc = DecodeConfig(method="mdm", gen_length=16, block_size=8, mdm_cache="dual", slot_size=3)
  assert dc.options == options.registry()["mdm"](block_size=8, mdm_cache="dual")
  assert "slot_size" not in dc.flat() and dc.flat()["mdm_cache"] == "dual"
  assert DecodeConfig.from_flat(dc.flat()) == dc
  assert pickle.loads(pickle.dumps(dc)) == dc and hash(pickle.loads(pickle.dumps(dc))) == hash(dc)
  mcts = DecodeConfig(**SHAPE, slot_size=4, planner="mcts", mcts_budget=3)
  assert (mcts.planner, mcts.mcts_budget, mcts.is_host) == ("mcts", 3, True)
  assert mcts.switches_on() == {"planner": "mcts"}
  # A new method keeps the shared settings and what it shares by name (the block).
  ar = mcts.replace(method="ar", temperature=0.5)
  assert (ar.method, ar.gen_length, ar.temperature, ar.flat().keys() - {"method"}) == (
      "ar", 16, 0.5, set(settings.SHARED_FIELDS))
  assert mcts.replace(method="mdm").block_size == 8
  # AR has no blocks: a response of any length.
  assert DecodeConfig(method="ar", gen_length=20, block_size=32).num_blocks == 1
  with pytest.raises(ValueError, match="unknown decode field"):
    DecodeConfig(slot_sizes=4)


def test_a_host_side_planner_runs_where_offered_and_is_refused_by_name_elsewhere(tmp_path):
  """lm-eval and evaluate run the MCTS planner (engine.decoder_for); the server refuses it
  at its config, before any model loads."""
  from configs import serve as serve_config  # pylint: disable=import-outside-toplevel
  from refusion_jax import serve  # pylint: disable=import-outside-toplevel
  c = serve_config.get_config()
  c.decode.planner = "mcts"
  with pytest.raises(ValueError, match="decode.planner='mcts' is a host-driven search; serve "
                                       "runs compiled decoders only"):
    serve.decode_configs(c)
  mc = config_lib.tiny(num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1, head_dim=16,
                       mlp_dim=64)
  model = Transformer(mc, rngs=nnx.Rngs(0))
  dc = DecodeConfig(gen_length=8, slot_size=4, block_size=8, planner="mcts", mcts_budget=2)
  host = engine.decoder_for(model, dc)
  assert not isinstance(host, engine.Decoder)
  assert isinstance(engine.decoder_for(model, dc.replace(planner="threshold")), engine.Decoder)
  with pytest.raises(ValueError, match="host-driven search"):
    engine.Decoder(model, dc)
  prompts = [[5, 6, 7], [8, 9]]
  want = [r.tokens for r in host.engine(1).run(prompts).results]
  lm = lm_model.RefusionLM(model=model, tokenizer=Tokenizer.tiny(), gen_length=8, slot_size=4,
                           block_size=8, planner="mcts", mcts_budget="2", progress=False)
  assert [out[0] for out in lm.decode(prompts)] == want


def test_a_decoder_that_needs_its_own_training_refuses_another_by_name():
  """BD3-LM decodes blocks only a BD3-LM-trained model learnt (and ReFusion slots a
  BD3-LM model never learnt): a model folder says what it was trained for (the shipped
  ones included, through HF's config.json); an unknown one ("") is decoded as asked."""
  from refusion_jax import loading  # pylint: disable=import-outside-toplevel
  shipped = loading.read_model_config("refusion_tiny")
  assert (shipped.objective, loading.read_model_config("base_tiny").objective) == (
      "refusion", "arm")
  bd3 = DecodeConfig(method="bd3lm", gen_length=16, block_size=8)
  with pytest.raises(ValueError, match="trained with 'refusion' .* decode it with "
                                       "decode.method='refusion'"):
    bd3.check_fits(shipped, 8)
  bd3.check_fits(shipped.replace(objective="bd3lm"), 8)
  bd3.check_fits(shipped.replace(objective=""), 8)
  with pytest.raises(ValueError, match="decode it with decode.method='bd3lm'"):
    DecodeConfig(**SHAPE, slot_size=4).check_fits(shipped.replace(objective="bd3lm"), 8)
  assert config_lib.from_hf_config(config_lib.to_hf_config(shipped)).objective == "refusion"
