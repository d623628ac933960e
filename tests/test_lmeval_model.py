"""The lm-eval model `refusion_jax`: answer handling, chat template, lm-eval end to end."""

import json
import os
import socket
import subprocess
import sys
import textwrap

import lm_eval
import numpy as np
import pytest
from lm_eval.api.instance import Instance
from lm_eval.api.registry import get_model
from lm_eval.tasks import TaskManager

from refusion_jax import checkpoint
from refusion_jax.decode import engine
from refusion_jax.decode.settings import DecodeConfig
from refusion_jax.lmeval import model as lm_model
from refusion_jax.tokenizer import Tokenizer
from tests.conftest import save_tiny_random_model

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DECODE = dict(gen_length=16, slot_size=4, block_size=8)


@pytest.fixture(scope="module")
def tok():
  return Tokenizer.tiny()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
  return save_tiny_random_model(str(tmp_path_factory.mktemp("lm") / "model"), seed=3)


def test_answer_handling_cuts_retokenizes_and_unfences(tok):
  assert lm_model.cut_at_stop("ab\nassert x\n# Test", ["\n# Test", "\nassert"]) == "ab"
  assert lm_model.cut_at_stop("abc", ["", "z"]) == "abc"
  assert lm_model.fenced_body("see ```python\nx = 1\n```\nmore") == "x = 1\n"
  assert lm_model.fenced_body("```python\nx = 1") == "x = 1"
  assert lm_model.fenced_body("no fence ```py\nx```") == "no fence ```py\nx```"
  # Special tokens stay in the text the stop sequences are searched in, then go.
  ids = tok.encode("12 ") + [tok.token_to_id(tok.eos_token)] + tok.encode("34.5")
  assert tok.eos_token in tok.decode(ids)
  assert lm_model.answer_text(tok, ids, ["."]) == tok.decode(tok.encode("12 34"))
  assert lm_model.answer_text(tok, ids, [tok.eos_token]) == "12 "
  assert lm_model.answer_text(tok, tok.encode("```python\nab```"), []) == "ab"


def test_chat_template_continues_a_gen_prefix(model_dir, tok):
  lm = lm_model.RefusionLM(model_dir, **DECODE, enable_thinking=False, progress=False)
  user = [{"role": "user", "content": "copy 12"}]
  plain = lm.apply_chat_template(user)
  assert plain == tok.apply_chat_template(user, add_generation_prompt=True,
                                          enable_thinking=False)
  prefixed = lm.apply_chat_template(user + [{"role": "assistant", "content": "Answer:"}],
                                    add_generation_prompt=False)
  assert prefixed == plain + "Answer:"
  thinking = lm_model.RefusionLM(model_dir, **DECODE, enable_thinking=True, progress=False)
  assert thinking.apply_chat_template(user) == tok.apply_chat_template(
      user, add_generation_prompt=True, enable_thinking=True)


def test_model_args_and_generative_only(model_dir):
  cls = get_model("refusion_jax")
  assert cls is lm_model.RefusionLM
  lm = cls.create_from_arg_string(
      f"model_dir={model_dir},method=ar,gen_length=16,slot_size=4,block_size=8,"
      "enable_thinking=false,progress=false", {"batch_size": 3, "device": None})
  assert lm.rows == 3 and lm.decode_config.method == "ar" and lm.enable_thinking is False
  assert lm.decode_config.kv_chunk is None  # per platform
  chunked = cls.create_from_arg_string(
      f"model_dir={model_dir},gen_length=16,slot_size=4,block_size=8,kv_chunk=8", {})
  assert chunked.decode_config.kv_chunk == 8
  with pytest.raises(ValueError, match="model arg kv_chunk must be an int"):
    cls(model_dir, kv_chunk="many")
  assert lm.decode_config.matmul_precision is None  # per platform
  precise = cls.create_from_arg_string(
      f"model_dir={model_dir},gen_length=16,slot_size=4,block_size=8,matmul_precision=highest",
      {})
  assert precise.decode_config.matmul_precision == "highest"
  with pytest.raises(ValueError, match="decode.matmul_precision must be one of"):
    cls(model_dir, matmul_precision="fp64")
  options = cls.create_from_arg_string(
      f"model_dir={model_dir},gen_length=16,slot_size=4,block_size=8,verify=exact,"
      "boundary_check=false,remask=true,remask_threshold=0.25", {})
  dc = options.decode_config
  assert (dc.verify, dc.boundary_check, dc.remask, dc.remask_threshold) == (
      "exact", False, True, 0.25)
  with pytest.raises(ValueError, match="decode.verify must be one of"):
    cls(model_dir, verify="always")
  with pytest.raises(ValueError, match=r"unknown model arg\(s\) \['slots'\]"):
    cls(model_dir, slots=3)
  with pytest.raises(ValueError, match="batch_size='auto' is not supported"):
    cls(model_dir, batch_size="auto")
  with pytest.raises(ValueError, match="model_dir=... is required"):
    cls()
  with pytest.raises(ValueError, match="block_size=8 must be a multiple"):
    cls(model_dir, slot_size=3, block_size=8, gen_length=16)
  with pytest.raises(lm_model.GenerativeOnlyError, match="generative only"):
    lm.loglikelihood([object()])
  with pytest.raises(lm_model.GenerativeOnlyError, match="rolling"):
    lm.loglikelihood_rolling([object()])


def _requests(contexts, until):
  return [Instance(request_type="generate_until", doc={}, arguments=(c, {"until": until}),
                   idx=0, metadata=("t", i, 1)) for i, c in enumerate(contexts)]


def test_generate_until_equals_single_decodes_and_any_batch(model_dir, tok):
  contexts = [tok.apply_chat_template([{"role": "user", "content": q}],
                                      enable_thinking=False)
              for q in ("sort 539", "copy 12", "lookup a=1 b=2 ? b", "sort 21", "copy 4")]
  until = ["sk|", "\n"]  # a random model's text is mostly "<|mask|>" tokens
  answers = {}
  for rows in (1, 3):
    lm = lm_model.RefusionLM(model_dir, **DECODE, batch_size=rows, progress=False)
    answers[rows] = lm.generate_until(_requests(contexts, until))
    assert [r.doc_id for r in lm.records] == list(range(len(contexts)))
    assert lm.decode_seconds > 0 and lm.passes > 0
  assert answers[1] == answers[3]
  # Oracle: the one-call decoder on the padded batch (a row of a batch decodes exactly as
  # it would alone: tests/test_decode_engine.py), then the answer handling by hand.
  _, model = checkpoint.load_model(model_dir)
  ids = [tok.encode(c) for c in contexts]
  ids_bp = np.zeros((len(ids), max(map(len, ids))), np.int32)
  for i, row in enumerate(ids):
    ids_bp[i, :len(row)] = row
  out = engine.generate(model, ids_bp, np.asarray([len(r) for r in ids], np.int32),
                        DecodeConfig(**DECODE))
  for i, (answer, record) in enumerate(zip(answers[1], lm.records)):
    n = int(out.length_b[i])
    text = tok.decode([int(t) for t in out.tokens_bg[i, :n]])
    cuts = [text.find(u) for u in until if u in text]
    cut = text[:min(cuts)] if cuts else text
    assert answer == tok.decode(tok.encode(cut), skip_special_tokens=True)
    assert record.tokens == n and record.passes == int(out.counters.nfe_b()[i])
    assert record.generation == text
  assert any(a != tok.decode(tok.encode(r.generation), skip_special_tokens=True)
             for a, r in zip(answers[1], lm.records))  # some stop sequence did cut


def _write_task(folder, docs):
  data = folder / "docs.jsonl"
  data.write_text("".join(json.dumps(d) + "\n" for d in docs))
  (folder / "tiny_gen.yaml").write_text(textwrap.dedent(f"""\
      task: tiny_gen
      dataset_path: json
      dataset_kwargs:
        data_files:
          test: {data}
      output_type: generate_until
      test_split: test
      doc_to_text: "{{{{question}}}}"
      doc_to_target: "{{{{answer}}}}"
      gen_prefix: "Answer:"
      generation_kwargs:
        until: ["sk|", "\\n"]
      metric_list:
        - metric: exact_match
          aggregation: mean
          higher_is_better: true
      metadata:
        version: 1.0
      """))


def test_lm_eval_runs_the_registered_model_end_to_end(model_dir, tmp_path, monkeypatch, tok):
  monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
  docs = [{"question": q, "answer": "x"} for q in ("sort 539", "copy 12", "sort 21")]
  _write_task(tmp_path, docs)
  samples = {}
  for rows in (1, 3):
    lm = lm_model.RefusionLM(model_dir, **DECODE, batch_size=rows, enable_thinking=False,
                             progress=False)
    out = lm_eval.simple_evaluate(model=lm, tasks=["tiny_gen"],
                                  task_manager=TaskManager(include_path=str(tmp_path),
                                                           include_defaults=False),
                                  apply_chat_template=True, log_samples=True, verbosity="ERROR")
    samples[rows] = sorted(out["samples"]["tiny_gen"], key=lambda s: s["doc_id"])
    for s, record in zip(samples[rows], sorted(lm.records, key=lambda r: r.doc_id)):
      prompt = s["arguments"][0][0]
      assert prompt.endswith("<|im_start|>assistant\nAnswer:") or prompt.endswith("Answer:")
      assert prompt == record.prompt
      assert s["resps"] == [[record.answer]]
      generation = record.generation
      cut = generation[:min([generation.find(u) for u in ("sk|", "\n") if u in generation],
                            default=len(generation))]
      assert record.answer == tok.decode(tok.encode(cut), skip_special_tokens=True)
    # Every answer differs from "x", so exact match is 0 by lm-eval's own metric.
    assert out["results"]["tiny_gen"]["exact_match,none"] == 0.0
  assert [s["resps"] for s in samples[1]] == [s["resps"] for s in samples[3]]


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def test_processes_split_the_requests_and_agree(model_dir, tmp_path, tok):
  contexts = [tok.apply_chat_template([{"role": "user", "content": f"copy {n}"}],
                                      enable_thinking=False) for n in (1, 22, 333, 4444, 5)]
  script = tmp_path / "worker.py"
  script.write_text(textwrap.dedent(f"""\
      import json, sys
      import jax
      from refusion_jax import distributed
      distributed.initialize()  # JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID
      from lm_eval.api.instance import Instance
      from refusion_jax.lmeval import model as lm_model
      contexts = json.loads(sys.argv[1])
      lm = lm_model.RefusionLM({model_dir!r}, gen_length=16, slot_size=4, block_size=8,
                               batch_size=2, progress=False)
      reqs = [Instance(request_type="generate_until", doc={{}}, arguments=(c, {{"until": ["e"]}}),
                       idx=0, metadata=("t", i, 1)) for i, c in enumerate(contexts)]
      answers = lm.generate_until(reqs)
      print("RESULT " + json.dumps([answers, [r.tokens for r in lm.records],
                                    jax.process_index(), jax.process_count()]))
      """))
  port = _free_port()
  procs = []
  for pid in range(2):
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
               JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(pid),
               XLA_FLAGS="--xla_force_host_platform_device_count=1", PYTHONPATH=REPO)
    procs.append(subprocess.Popen([sys.executable, str(script), json.dumps(contexts)], cwd=REPO,
                                  env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True))
  outs = []
  try:
    for p in procs:
      out, _ = p.communicate(timeout=240)
      assert p.returncode == 0, out[-3000:]
      outs.append(json.loads(out.split("RESULT ", 1)[1].splitlines()[0]))
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  assert {o[2] for o in outs} == {0, 1} and all(o[3] == 2 for o in outs)
  assert outs[0][:2] == outs[1][:2]
  single = lm_model.RefusionLM(model_dir, **DECODE, batch_size=1, progress=False)
  assert single.generate_until(_requests(contexts, ["e"])) == outs[0][0]
  assert [r.tokens for r in single.records] == outs[0][1]
