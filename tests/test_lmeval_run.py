"""`python -m refusion_jax.evaluate --config=configs/eval/<benchmark>.py`: results.json,
samples.jsonl, limit, completions, errors (a tiny random model, hand-made GSM8K data)."""

import importlib.util
import json
import os

import pytest

from refusion_jax import evaluate
from tests.conftest import save_tiny_random_model
# _offline (autouse): no hub, a private datasets cache; _gsm8k: a hand-made hub-format copy.
from tests.test_lmeval_benchmarks import _gsm8k, _offline  # noqa: F401

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GSM8K = os.path.join(REPO, "configs", "eval", "gsm8k.py")
SMALL = ["--config.decode.gen_length=16", "--config.decode.slot_size=4",
         "--config.decode.block_size=8", "--config.progress=false"]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
  root = str(tmp_path_factory.mktemp("hub"))
  _gsm8k(root)
  return root


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
  return save_tiny_random_model(str(tmp_path_factory.mktemp("run") / "model"), seed=1)


def _read(out):
  with open(os.path.join(out, "results.json")) as f:
    result = json.load(f)
  with open(os.path.join(out, "samples.jsonl")) as f:
    samples = [json.loads(line) for line in f]
  return result, samples


def test_benchmark_run_writes_results_and_samples(tmp_path, data_dir, model_dir):
  out = str(tmp_path / "out")
  returned = evaluate.main(["evaluate", f"--config={GSM8K}", f"--config.model_dir={model_dir}",
                            f"--config.output_dir={out}", f"--config.data_dir={data_dir}",
                            "--config.limit=3", "--config.batch_size=2",
                            "--config.enable_thinking=false", *SMALL])
  result, samples = _read(out)
  assert returned == result
  assert result["benchmark"] == "gsm8k" and result["task"] == "gsm8k_cot"
  assert result["metric"] == "exact_match,flexible-extract"
  assert result["method"] == "refusion" and result["model"] == "model"
  assert result["samples"] == 3 == len(samples) and result["limit"] == 3
  assert result["settings"]["decode"]["gen_length"] == 16
  assert result["settings"]["decode"]["slot_threshold"] == 0.9  # Table 5's GSM8K setting
  assert result["settings"]["num_fewshot"] == 0 and result["settings"]["batch_size"] == 2
  # The statistics are the samples' own, summed.
  assert result["tokens"] == sum(s["tokens"] for s in samples) > 0
  assert result["accuracy"] == pytest.approx(100 * sum(s["correct"] for s in samples) / 3)
  assert result["tokens_per_second"] == pytest.approx(result["tokens"] / result["seconds"])
  assert result["tokens_per_forward"] == pytest.approx(
      result["tokens"] / sum(s["nfe"] for s in samples))
  assert result["tpf_paper"] == pytest.approx(sum(s["tpf_paper"] for s in samples) / 3)
  assert result["avg_length"] == pytest.approx(result["tokens"] / 3)
  assert result["latency"] == pytest.approx(sum(s["seconds"] for s in samples) / 3)
  for s in samples:
    assert s["task"] == "gsm8k_cot" and s["prompt"].startswith("<|im_start|>user")
    assert set(s) >= {"completion", "extracted", "target", "correct", "tokens", "nfe",
                      "seconds", "generation"}
  assert [s["doc_id"] for s in samples] == [0, 1, 2]
  assert not [n for n in os.listdir(out) if ".tmp" in n]

  # The samples file is a completions file: re-scored without a model, same accuracy.
  again = str(tmp_path / "again")
  rescored = evaluate.main(["evaluate", f"--config={GSM8K}", f"--config.output_dir={again}",
                            f"--config.data_dir={data_dir}",
                            f"--config.completions={os.path.join(out, 'samples.jsonl')}"])
  assert rescored["accuracy"] == result["accuracy"] and rescored["samples"] == 3
  assert rescored["tokens_per_second"] is None and rescored["method"] == "completions"


def test_completions_are_scored_by_the_tasks_filters(tmp_path, data_dir):
  answers = tmp_path / "answers.jsonl"
  # Docs 0-2 of the hand-made test split: answers 42, 1,000 and 18.
  answers.write_text("".join(json.dumps(r) + "\n" for r in [
      {"doc_id": 0, "completion": "40 + 2 = 42. The answer is 42."},
      {"doc_id": 1, "completion": "So it costs $1,000 in total."},
      {"doc_id": 2, "completion": "Half of it: 17"},
  ]))
  out = str(tmp_path / "out")
  result = evaluate.main(["evaluate", f"--config={GSM8K}", f"--config.output_dir={out}",
                          f"--config.data_dir={data_dir}", f"--config.completions={answers}"])
  assert result["accuracy"] == pytest.approx(200 / 3)
  _, samples = _read(out)
  assert [s["correct"] for s in samples] == [1.0, 1.0, 0.0]


@pytest.mark.parametrize("flags, needle", [
    ([], "--config.output_dir=OUT is required"),
    (["--config.output_dir=/tmp/x", "--config.model_dir=/nonexistent"], "is not a folder"),
    (["--config.output_dir=/tmp/x", "--config.completions=/nonexistent.jsonl"], "is not a file"),
    (["--config.output_dir=/tmp/x", "--config.completions={c}", "--config.limit=0"],
     "--config.limit must be a positive int"),
    (["--config.output_dir=/tmp/x", "--config.model_dir={m}", "--config.decode.slot_size=5"],
     "--config.decode: decode.block_size=128 must be a multiple"),
    (["--config.output_dir=/tmp/x", "--config.model_dir={m}", "--config.batch_size=0"],
     "--config.batch_size must be a positive int"),
])
def test_bad_settings_are_named_before_any_work(tmp_path, model_dir, flags, needle):
  completions = tmp_path / "c.jsonl"
  completions.write_text('{"doc_id": 0, "completion": "1"}\n')
  flags = [f.format(c=completions, m=model_dir) for f in flags]
  with pytest.raises((ValueError, FileNotFoundError), match=needle):
    evaluate.main(["evaluate", f"--config={GSM8K}", *flags])


def test_every_benchmark_config_has_table_5_settings():
  expected = {"mmlu_pro": (16, 128, 0.9, 0.4), "arc_c": (8, 8, 0.8, 0.1),
              "gsm8k": (32, 128, 0.9, 0.4), "math": (32, 64, 0.8, 0.6),
              "gpqa": (8, 16, 0.8, 0.2), "humaneval": (32, 128, 0.9, 0.4),
              "mbpp": (32, 128, 0.9, 0.3)}
  for name, (k, b, ts, tt) in expected.items():
    path = os.path.join(REPO, "configs", "eval", f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"eval_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    c = module.get_config()
    d = c.decode
    assert (c.benchmark, d.gen_length, d.slot_size, d.block_size, d.slot_threshold,
            d.token_threshold, d.method, d.temperature) == (name, 512, k, b, ts, tt,
                                                            "refusion", 0.0)
    assert c.batch_size == 1 and c.enable_thinking is True


def _drop_last_line(body: str) -> str:
  lines = body.rstrip("\n").split("\n")
  return "\n".join(lines[:-1]) + "\n"


def test_humaneval_canonical_solutions_score_100_through_completions(tmp_path):
  from refusion_jax.lmeval import code  # pylint: disable=import-outside-toplevel
  problems = code.humaneval_problems()
  humaneval = os.path.join(REPO, "configs", "eval", "humaneval.py")
  scores = {}
  for name, edit in (("canonical", lambda b: b), ("truncated", _drop_last_line)):
    answers = tmp_path / f"{name}.jsonl"
    answers.write_text("".join(
        json.dumps({"task_id": p["task_id"], "completion": edit(p["canonical_solution"])}) + "\n"
        for p in problems))
    out = str(tmp_path / name)
    scores[name] = evaluate.main(["evaluate", f"--config={humaneval}",
                                  f"--config.output_dir={out}", f"--config.completions={answers}",
                                  "--config.progress=false"])
    _, samples = _read(out)
    assert len(samples) == 164
  assert scores["canonical"]["accuracy"] == 100.0 and scores["canonical"]["samples"] == 164
  assert scores["truncated"]["accuracy"] < 50.0


def test_mbpp_completions_run_their_three_tests(tmp_path):
  from tests.test_code_eval import MBPP_DOCS, MBPP_WRONG  # pylint: disable=import-outside-toplevel
  import pyarrow as pa  # pylint: disable=import-outside-toplevel
  import pyarrow.parquet  # pylint: disable=import-outside-toplevel,unused-import
  repo = tmp_path / "hub" / "google-research-datasets" / "mbpp"
  (repo / "full").mkdir(parents=True)
  pa.parquet.write_table(pa.Table.from_pylist(MBPP_DOCS), str(repo / "full" / "test-0.parquet"))
  (repo / "README.md").write_text(
      "---\nconfigs:\n- config_name: full\n  data_files:\n  - split: test\n"
      "    path: full/test-*\n---\n")
  answers = tmp_path / "answers.jsonl"
  rows = [{"task_id": d["task_id"], "completion": d["code"]} for d in MBPP_DOCS[:3]]
  rows += [{"task_id": d["task_id"], "completion": MBPP_WRONG[d["task_id"]]} for d in MBPP_DOCS[3:]]
  rows.append({"task_id": MBPP_DOCS[0]["task_id"], "completion": MBPP_WRONG[9001]})
  answers.write_text("".join(json.dumps(r) + "\n" for r in rows))
  mbpp = os.path.join(REPO, "configs", "eval", "mbpp.py")
  result = evaluate.main(["evaluate", f"--config={mbpp}", f"--config.output_dir={tmp_path / 'o'}",
                          f"--config.data_dir={tmp_path / 'hub'}",
                          f"--config.completions={answers}", "--config.progress=false"])
  # Doc 9001: one right, one wrong answer (0.5); 9002, 9003 right; 9004, 9005 wrong.
  assert result["accuracy"] == pytest.approx(100 * 2.5 / 5)
  assert result["samples"] == 5 and result["completions_scored"] == 6
