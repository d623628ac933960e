"""Table 1 from results.json files: layout, averages and speed-up computed by hand,
row labels, limited runs, the baseline choice, errors and the command line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from refusion_jax import evaluate_table as et

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _result(benchmark: str, model: str, method: str, accuracy: float, tps: float,
            tpf: float = 1.0, tpf_paper: float = 1.0, **fields) -> dict:
  return {"benchmark": benchmark, "task": f"{benchmark}_task", "model": model,
          "model_dir": f"/models/{model}", "method": method, "accuracy": accuracy,
          "samples": 164, "tokens": 12345, "seconds": 99.1, "latency": 0.6,
          "tokens_per_second": tps, "tokens_per_forward": tpf, "tpf_paper": tpf_paper,
          "avg_length": 75.3, "settings": {"gen_length": 512}, "limit": None, **fields}


def _write(folder, name: str, result: dict) -> str:
  """Writes `result` to folder/name/results.json; returns the folder/name path."""
  out = folder / name
  out.mkdir()
  (out / "results.json").write_text(json.dumps(result))
  return str(out)


# Two models on three benchmarks. Hand-computed:
#   Qwen3-8B (ar):  accuracy (90 + 80 + 70) / 3 = 80.00, tokens/s (30 + 40 + 50) / 3 = 40.00
#   ReFusion-8B:    accuracy (85 + 78.66 + 65.5) / 3 = 76.3867 -> 76.39,
#                   tokens/s (90 + 103.9 + 96.1) / 3 = 96.6667 -> 96.67,
#                   speed-up 96.6667 / 40 = 2.4167 -> 2.42x,
#                   tokens per forward (2.5 + 2.1 + 2.3) / 3 = 2.30, TPF (3 + 3.3 + 3.6) / 3 = 3.30
TWO_MODELS = [
    _result("mbpp", "ReFusion-8B", "refusion", 65.5, 96.1, 2.3, 3.6),
    _result("gsm8k", "ReFusion-8B", "refusion", 85.0, 90.0, 2.5, 3.0),
    _result("humaneval", "ReFusion-8B", "refusion", 78.66, 103.9, 2.1, 3.3),
    _result("gsm8k", "Qwen3-8B", "ar", 90.0, 30.0),
    _result("humaneval", "Qwen3-8B", "ar", 80.0, 40.0),
    _result("mbpp", "Qwen3-8B", "ar", 70.0, 50.0),
]
HEADER = "| Model | MMLU-Pro | ARC-C | GSM8K | MATH | GPQA | HumanEval | MBPP | Avg |"

TWO_MODELS_TABLE = f"""## Table 1: accuracy (%) / tokens per second

{HEADER} Speed-up vs Qwen3-8B |
|:---|---:|---:|---:|---:|---:|---:|---:|---:|---:|
| Qwen3-8B | – | – | 90.00 / 30.00 | – | – | 80.00 / 40.00 | 70.00 / 50.00 | 80.00 / 40.00 (3/7) | 1.00× |
| ReFusion-8B | – | – | 85.00 / 90.00 | – | – | 78.66 / 103.90 | 65.50 / 96.10 | 76.39 / 96.67 (3/7) | 2.42× |

- Avg is the mean over the benchmarks a row has; (k/7) marks a row with k of the 7.
- Speed-up: the row's mean tokens per second over Qwen3-8B's, both over the benchmarks the two rows share.

## Tokens per forward pass (every pass counted) / the paper's TPF

{HEADER}
|:---|---:|---:|---:|---:|---:|---:|---:|---:|
| Qwen3-8B | – | – | 1.00 / 1.00 | – | – | 1.00 / 1.00 | 1.00 / 1.00 | 1.00 / 1.00 (3/7) |
| ReFusion-8B | – | – | 2.50 / 3.00 | – | – | 2.10 / 3.30 | 2.30 / 3.60 | 2.30 / 3.30 (3/7) |
"""


def test_two_models_from_files(tmp_path):
  paths = [_write(tmp_path, f"run{i}", r) for i, r in enumerate(TWO_MODELS)]
  paths[0] = os.path.join(paths[0], "results.json")  # a file and folders both work
  results = et.load_results(paths)
  assert [r["source"] for r in results] == [
      paths[0], *(os.path.join(p, "results.json") for p in paths[1:])]
  assert et.table_markdown(results) == TWO_MODELS_TABLE


def test_without_tpf_table_and_with_all_seven():
  results = [_result(b, "M", "refusion", 50.0 + i, 10.0 * (i + 1))
             for i, b in enumerate(et.BENCHMARKS)]
  # accuracy (50 + ... + 56) / 7 = 53.00; tokens/s (10 + ... + 70) / 7 = 40.00; no ar row.
  assert et.table_markdown(results, tpf=False) == f"""## Table 1: accuracy (%) / tokens per second

{HEADER}
|:---|---:|---:|---:|---:|---:|---:|---:|---:|
| M | 50.00 / 10.00 | 51.00 / 20.00 | 52.00 / 30.00 | 53.00 / 40.00 | 54.00 / 50.00 | 55.00 / 60.00 | 56.00 / 70.00 | 53.00 / 40.00 |

- No speed-up column: no row has method ar; pick one with --baseline=LABEL.
"""


def test_labels_order_limits_and_speed_up_over_shared_benchmarks():
  results = [
      _result("gsm8k", "Qwen3-8B", "refusion", 80.0, 60.0, limit=100, samples=100),
      _result("gsm8k", "Qwen3-8B", "ar", 90.0, 30.0),
      _result("math", "Qwen3-8B", "ar", 50.0, 10.0),
      _result("mmlu_pro", "LLaDA", "mdm", 40.0, 5.0, limit=10, samples=140),
  ]
  # The ar row has GSM8K and MATH; the refusion row only GSM8K: 60 / 30 = 2.00x.
  # LLaDA shares no benchmark with the ar row: "–".
  table = et.table_markdown(results, tpf=False)
  assert table.splitlines()[2:8] == [
      f"{HEADER} Speed-up vs Qwen3-8B (ar) |",
      "|:---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
      "| Qwen3-8B (ar) | – | – | 90.00 / 30.00 | 50.00 / 10.00 | – | – | – "
      "| 70.00 / 20.00 (2/7) | 1.00× |",
      "| LLaDA | 40.00 / 5.00† | – | – | – | – | – | – | 40.00 / 5.00 (1/7) | – |",
      "| Qwen3-8B (refusion) | – | – | 80.00 / 60.00† | – | – | – | – "
      "| 80.00 / 60.00 (1/7) | 2.00× |",
      ""]
  assert table.splitlines()[-1] == (
      "- † Run on the first N samples only (`limit` N; for MMLU-Pro, of each subject): "
      "LLaDA MMLU-Pro: limit 10, 140 samples; Qwen3-8B (refusion) GSM8K: limit 100, "
      "100 samples.")


def test_baseline_choice():
  results = [_result("gsm8k", "A", "ar", 90.0, 30.0), _result("gsm8k", "B", "ar", 91.0, 15.0),
             _result("gsm8k", "C", "refusion", 85.0, 60.0)]
  several = et.table_markdown(results, tpf=False)
  assert "Speed-up" not in several.splitlines()[2]
  assert ("- No speed-up column: 2 rows have method ar (A, B); pick one with "
          "--baseline=LABEL.") in several.splitlines()
  rows = et.table_markdown(results, baseline="B", tpf=False).splitlines()[4:7]
  assert [row.rsplit("|", 2)[1].strip() for row in rows] == ["2.00×", "1.00×", "4.00×"]
  # The long form "NAME (method)" names a row whose label is the bare name.
  assert et.table_markdown(results, baseline="C (refusion)", tpf=False).splitlines()[4] \
      .endswith("| 0.50× |")
  with pytest.raises(ValueError, match=r"--baseline='D' is not a row; rows: 'A', 'B', 'C'"):
    et.table_markdown(results, baseline="D")


def test_pipe_in_a_model_name_is_escaped():
  table = et.table_markdown([_result("gsm8k", "a|b", "ar", 90.0, 30.0)], tpf=False)
  assert "| a\\|b | – | – | 90.00 / 30.00 |" in table
  assert "Speed-up vs a\\|b |" in table


# ---------------------------------------------------------------------------
# Errors name the file(s) and the field.


def test_duplicate_names_both_files(tmp_path):
  first = _write(tmp_path, "one", _result("gsm8k", "M", "ar", 90.0, 30.0))
  second = _write(tmp_path, "two", _result("gsm8k", "M", "ar", 91.0, 31.0))
  with pytest.raises(ValueError) as e:
    et.load_results([first, second])
  assert str(e.value) == (
      f"{first}/results.json and {second}/results.json both hold model 'M', method 'ar', "
      "benchmark 'gsm8k': give one of them")
  with pytest.raises(ValueError, match="is given more than once"):
    et.load_results([first, os.path.join(first, "results.json")])
  # Hand-made results are checked too.
  with pytest.raises(ValueError, match="result #0 and result #1 both hold model 'M'"):
    et.table_markdown([_result("gsm8k", "M", "ar", 1.0, 1.0),
                       _result("gsm8k", "M", "ar", 2.0, 2.0)])


@pytest.mark.parametrize("change,message", [
    ({"accuracy": None}, "required field 'accuracy' is missing"),
    ({"benchmark": None}, "required field 'benchmark' is missing"),
    ({"tpf_paper": None}, "required field 'tpf_paper' is missing"),
    ({"benchmark": "hellaswag"},
     "field 'benchmark' is 'hellaswag', not one of mmlu_pro, arc_c, gsm8k, math, gpqa, "
     "humaneval, mbpp"),
    ({"method": "arm"}, "field 'method' is 'arm', not one of ar, mdm, bd3lm, d2f, refusion"),
    ({"model": ""}, "field 'model' must be a non-empty string"),
    ({"accuracy": "78.66"}, "field 'accuracy' must be a finite number >= 0, got '78.66'"),
    ({"tokens_per_second": -1.0}, "field 'tokens_per_second' must be a finite number >= 0"),
    ({"tokens_per_forward": float("nan")}, "field 'tokens_per_forward' must be a finite number"),
    ({"accuracy": 101.0}, "field 'accuracy' is 101.0; it is a percentage (0 to 100)"),
    ({"samples": True}, "field 'samples' must be an int >= 0, got True"),
    ({"limit": 0}, "field 'limit' must be null or an int > 0, got 0"),
])
def test_bad_field_names_file_and_field(tmp_path, change, message):
  result = _result("gsm8k", "M", "ar", 90.0, 30.0)
  for field, value in change.items():
    if value is None:
      del result[field]
    else:
      result[field] = value
  path = _write(tmp_path, "run", result)
  with pytest.raises(ValueError) as e:
    et.load_results([path])
  assert str(e.value).startswith(f"{path}/results.json: ")
  assert message in str(e.value)


def test_bad_files(tmp_path):
  (tmp_path / "empty").mkdir()
  with pytest.raises(FileNotFoundError, match=r"empty is a folder without a results.json"):
    et.load_results([str(tmp_path / "empty")])
  with pytest.raises(FileNotFoundError, match=r"nope does not exist"):
    et.load_results([str(tmp_path / "nope")])
  bad = tmp_path / "bad.json"
  bad.write_text("{not json")
  with pytest.raises(ValueError, match=rf"{bad}: not valid JSON"):
    et.load_results([str(bad)])
  listed = tmp_path / "list.json"
  listed.write_text("[]")
  with pytest.raises(ValueError, match=rf"{listed}: expected a JSON object, got list"):
    et.load_results([str(listed)])
  with pytest.raises(ValueError, match="no results files given"):
    et.load_results([])


# ---------------------------------------------------------------------------
# The command line.


def _cli(*args: str) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-m", "refusion_jax.evaluate_table", *args], cwd=REPO,
                        capture_output=True, text=True, timeout=60)


def test_cli_prints_and_writes_output(tmp_path):
  paths = [_write(tmp_path, f"run{i}", r) for i, r in enumerate(TWO_MODELS)]
  out = tmp_path / "tables" / "table.md"
  out.parent.mkdir()
  out.write_text("old table\n")
  # Flags may come between the inputs.
  done = _cli(*paths[:3], f"--output={out}", *paths[3:])
  assert done.returncode == 0, done.stderr
  assert done.stdout == TWO_MODELS_TABLE
  assert out.read_text() == TWO_MODELS_TABLE
  assert os.listdir(out.parent) == ["table.md"]  # no temporary file left behind
  assert f"wrote {out}" in done.stderr

  done = _cli(*paths, "--notpf", "--baseline=ReFusion-8B")
  assert done.returncode == 0, done.stderr
  assert "Tokens per forward" not in done.stdout
  assert "| Qwen3-8B | – | – | 90.00 / 30.00 | – | – | 80.00 / 40.00 | 70.00 / 50.00 | " \
         "80.00 / 40.00 (3/7) | 0.41× |" in done.stdout.splitlines()


def test_cli_errors(tmp_path):
  first = _write(tmp_path, "one", _result("gsm8k", "M", "ar", 90.0, 30.0))
  second = _write(tmp_path, "two", _result("gsm8k", "M", "ar", 91.0, 31.0))
  out = tmp_path / "table.md"
  done = _cli(first, second, f"--output={out}")
  assert done.returncode == 2
  assert done.stdout == ""
  assert "refusion_jax.evaluate_table: error: " in done.stderr
  assert f"{first}/results.json and {second}/results.json both hold" in done.stderr
  assert not out.exists()
  done = _cli(f"--output={tmp_path / 'missing' / 'table.md'}", first)
  assert done.returncode == 2
  assert "does not exist" in done.stderr and done.stdout == ""
  done = _cli()
  assert done.returncode != 0
  assert "give one or more results.json files or evaluation output folders" in done.stderr


# ---------------------------------------------------------------- the paper's Tables 2 and 3


def test_table2_every_row_in_the_papers_order_missing_ones_named():
  results = [
      _result("gsm8k", "refusion-qwen3", "refusion", 80.0, 60.0, 3.0, 3.5),
      _result("gsm8k", "arm-qwen3", "ar", 90.0, 30.0),
      _result("gsm8k", "bd3lm-qwen3", "bd3lm", 70.0, 45.0, 2.0, 2.0),
  ]
  text = et.paper_table_markdown(results, 2)
  lines = text.splitlines()
  assert lines[0].startswith("## Table 2: the controlled comparison")
  body = [line for line in lines if line.startswith("| ") and "---" not in line][1:5]
  assert [b.split(" | ")[0] for b in body] == [
      "| Qwen3-8B retrained (AR)", "| LLaDA retrained (MDM)",
      "| BD3-LMs retrained (block diffusion)", "| ReFusion"]
  # Hand-computed: ReFusion 60 / 30 = 2.00x, BD3-LM 45 / 30 = 1.50x; LLaDA has no file.
  assert body[0].endswith("| 90.00 / 30.00 (1/7) | 1.00× |")
  assert body[1] == "| LLaDA retrained (MDM) | – | – | – | – | – | – | – | – | – |"
  assert body[2].endswith("| 70.00 / 45.00 (1/7) | 1.50× |")
  assert body[3].endswith("| 80.00 / 60.00 (1/7) | 2.00× |")
  assert "- LLaDA retrained (MDM): missing (no results file with method mdm)" in lines
  assert "| ReFusion | – | – | 3.00 / 3.50 |" in text  # the tokens-per-forward table


def test_table3_rows_by_backbone():
  results = [
      _result("mbpp", "dream-7b", "mdm", 50.0, 20.0, model_type="dream"),
      _result("mbpp", "llada", "mdm", 40.0, 10.0, model_type="qwen3"),  # not Table 3's
      _result("mbpp", "refusion-qwen3", "refusion", 68.0, 90.0, model_type="qwen3"),
  ]
  text = et.paper_table_markdown(results, 3, tpf=False)
  assert "| Dream-7B-Instruct | – | – | – | – | – | – | 50.00 / 20.00 | 50.00 / 20.00 (1/7) |" \
      in text
  assert "- ReFusion (Qwen2.5-7B): missing (no results file with method refusion, model_type " \
         "qwen2)" in text
  assert "Speed-up" not in text  # its first row is missing: nothing to compare with
  results.append(_result("gsm8k", "refusion-qwen25", "refusion", 70.0, 80.0, model_type="qwen2"))
  text = et.paper_table_markdown(results, 3, tpf=False)
  assert "| ReFusion (Qwen2.5-7B) | – | – | 70.00 / 80.00 |" in text and "Speed-up" in text


def test_paper_table_refuses_two_models_in_one_row_and_a_bad_table():
  results = [_result("gsm8k", "a", "ar", 90.0, 30.0), _result("mbpp", "b", "ar", 70.0, 50.0)]
  with pytest.raises(ValueError, match=r"row 'Qwen3-8B retrained \(AR\)': results of 2 models "
                     r"fill it \(a, b\)"):
    et.paper_table_markdown(results, 2)
  with pytest.raises(ValueError, match="--table must be 0, 1, 2 or 3, got 4"):
    et.paper_table_markdown(results, 4)


def test_cli_table2(tmp_path):
  a = _write(tmp_path, "arm", _result("gsm8k", "arm", "ar", 90.0, 30.0))
  r = _write(tmp_path, "ref", _result("gsm8k", "ref", "refusion", 80.0, 60.0))
  proc = subprocess.run([sys.executable, "-m", "refusion_jax.evaluate_table", a, r,
                         "--table=2"], cwd=REPO, capture_output=True, text=True, check=False)
  assert proc.returncode == 0, proc.stderr
  assert "## Table 2: the controlled comparison" in proc.stdout
  assert "BD3-LMs retrained (block diffusion): missing" in proc.stdout
  proc = subprocess.run([sys.executable, "-m", "refusion_jax.evaluate_table", a, "--table=2",
                         "--baseline=arm"], cwd=REPO, capture_output=True, text=True, check=False)
  assert proc.returncode == 2 and "--baseline applies to --table=0" in proc.stderr


def _decoded(benchmark, model, method, acc, tps, model_type, **decode):
  base = {"method": method, "gen_length": 512, "block_size": 32, "slot_size": 32,
          "mdm_steps": None, "mdm_threshold": None, "mdm_factor": None, "mdm_cache": None,
          "mdm_ban_eos": False, "mdm_defer_stop": False, "mdm_cfg_scale": 0.0,
          "mdm_ranking": "confidence", "mdm_tokens_per_step": 1, "verify": "off",
          "d2f_add_threshold": 0.1, "d2f_act_threshold": 0.95, "d2f_conf_threshold": 0.9,
          "slot_threshold": 0.9, "token_threshold": 0.4}
  return _result(benchmark, model, method, acc, tps, model_type=model_type,
                 settings={"decode": {**base, **decode}})


def test_table1_the_nine_rows_in_the_papers_order_with_their_settings():
  results = [
      _decoded("gsm8k", "Qwen3-8B", "ar", 90.0, 30.0, "qwen3"),
      _decoded("gsm8k", "Meta-Llama-3-8B-Instruct", "ar", 80.0, 40.0, "llama"),
      _decoded("gsm8k", "LLaDA-8B-Instruct", "mdm", 70.0, 6.0, "llada", mdm_steps=512,
               block_size=512, mdm_defer_stop=True),
      _decoded("gsm8k", "LLaDA-8B-Instruct-fast", "mdm", 69.0, 50.0, "llada",
               mdm_threshold=0.9, mdm_cache="prefix"),
      _decoded("gsm8k", "LLaDA-D2F", "d2f", 71.0, 60.0, "llada", block_size=64,
               d2f_add_threshold=0.7),
      _decoded("gsm8k", "Dream-v0-Instruct-7B", "mdm", 75.0, 9.0, "dream", mdm_steps=512,
               mdm_ranking="entropy", block_size=512),
      _decoded("gsm8k", "ReFusion", "refusion", 85.0, 90.0, "qwen3"),
  ]
  text = et.paper_table_markdown(results, 1, tpf=False)
  body = [line.split(" | ")[0][2:] for line in text.splitlines()
          if line.startswith("| ") and "---" not in line][1:]
  assert body == ["Llama-3-8B-Instruct", "Qwen3-8B", "LLaDA-8B-Instruct", "LLaDA w/ Fast-dLLM",
                  "LLaDA w/ D2F", "Dream-7B-Instruct", "Dream w/ Fast-dLLM", "Dream w/ D2F",
                  "ReFusion"]
  # Hand-computed speed-ups over the first row (Llama-3, 40 tok/s): ReFusion 90 / 40.
  assert "| ReFusion | – | – | 85.00 / 90.00 | – | – | – | – | 85.00 / 90.00 (1/7) | 2.25× |" \
      in text
  assert ("- Dream w/ Fast-dLLM: missing (no results file with method mdm, model_type dream, "
          "decoded with Fast-dLLM's threshold, factor or cache)") in text
  assert "- Dream w/ D2F: missing (no results file with method d2f, model_type dream)" in text
  # The method's own settings, then its switches that are on (DecodeConfig.summary).
  assert ("- LLaDA-8B-Instruct (GSM8K): gen_length 512, block_size 512, mdm_tokens_per_step 1, "
          "mdm_steps 512, mdm_defer_stop True") in text
  assert ("- LLaDA w/ Fast-dLLM (GSM8K): gen_length 512, block_size 32, mdm_tokens_per_step 1, "
          "mdm_threshold 0.9, mdm_cache_refresh 0, mdm_cache prefix") in text
  assert ("- LLaDA w/ D2F (GSM8K): gen_length 512, block_size 64, d2f_add_threshold 0.7, "
          "d2f_act_threshold 0.95, d2f_conf_threshold 0.9, d2f_window 4") in text
  assert ("- Dream-7B-Instruct (GSM8K): gen_length 512, block_size 512, mdm_tokens_per_step 1, "
          "mdm_ranking entropy, mdm_steps 512") in text
  assert ("- ReFusion (GSM8K): gen_length 512, slot_size 32, block_size 32, slot_threshold 0.9, "
          "token_threshold 0.4") in text
  assert "- Qwen3-8B (GSM8K): gen_length 512" in text


def test_the_bundled_suites_results_get_their_own_table(tmp_path):
  """The bundled suite's results.json (per-task metrics) is tabulated a column per task,
  also one written before it named its model and method (its folder, its decode)."""
  old = {"per_task": {"sort": {"accuracy": 50.0, "tokens_per_sec": 12.5,
                               "tokens_per_forward": 2.0},
                      "copy": {"accuracy": 100.0, "tokens_per_sec": None,
                               "tokens_per_forward": 3.0}},
         "average": {"accuracy": 75.0, "tokens_per_sec": None, "tokens_per_forward": 2.5},
         "decode": {"sort": {"method": "refusion"}}, "samples": []}
  (tmp_path / "runA").mkdir()
  (tmp_path / "runA" / "results.json").write_text(json.dumps(old))
  text = et.bundled_markdown(et.load_results([str(tmp_path / "runA")]))
  assert "| Model | sort | copy | Avg | Tok/fwd |" in text
  assert "| runA (refusion) | 50.00 / 12.50 | 100.00 / – | 75.00 / – | 2.50 |" in text
  bad = dict(old, per_task={"sort": {"accuracy": "x"}})
  (tmp_path / "bad.json").write_text(json.dumps(bad))
  with pytest.raises(ValueError, match=r"per_task.sort.accuracy must be a number"):
    et.load_results([str(tmp_path / "bad.json")])
