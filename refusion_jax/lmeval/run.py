"""One of the paper's benchmarks, end to end: `python -m refusion_jax.evaluate
--config=configs/eval/<benchmark>.py --config.model_dir=DIR --config.output_dir=OUT`.

The benchmark's lm-eval task runs zero-shot with the chat template through
the `refusion_jax` model (refusion_jax/lmeval/model.py), decoded with the
config's `decode` settings (the paper's Table 5 by default; `decode.method=ar`
gives the AR row with the same code). Written to `output_dir`:

* `results.json`: `accuracy` (percent, lm-eval's metric named by the
  benchmark), `samples`, `tokens` (generated, up to and including EOS, before
  the stop-sequence cut), `seconds` (decode wall time, compiles excluded),
  `latency` (mean seconds per sample from its admission to its end),
  `tokens_per_second` (tokens / seconds), `tokens_per_forward` (tokens over
  every forward pass), `tpf_paper` (the paper's TPF, mean over samples),
  `avg_length` (tokens per sample), the settings and the model;
* `samples.jsonl`: one line per sample: task, doc_id (and task_id where the
  document has one), prompt, the raw generation, `completion` (the answer
  after the answer handling), `extracted` (the program or answer lm-eval's
  filter scored), target, correct, tokens, passes, tpf_paper, seconds.

`samples.jsonl` is itself a completions file: `--config.completions=FILE`
scores the completions of any such file without a model, through the same
filters and metrics (speed fields are then null).

With `distributed=true` every JAX process runs this; the processes split the
decoding (model.py) and process 0 writes the files.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Any

import jax
import lm_eval

from refusion_jax import distributed, fileio, loading
from refusion_jax.decode.settings import DecodeConfig
from refusion_jax.lmeval import benchmarks, replay, sandbox
from refusion_jax.lmeval import model as model_lib

RESULTS = "results.json"
SAMPLES = "samples.jsonl"
CODE_BENCHMARKS = ("humaneval", "mbpp")


def _log(message: str) -> None:
  print(f"refusion_jax.evaluate: {message}", file=sys.stderr, flush=True)


def check_config(c) -> tuple[benchmarks.Benchmark, DecodeConfig]:
  """Every setting checked before anything loads, decodes or compiles."""
  bench = benchmarks.get(c.benchmark)
  if not c.output_dir:
    raise ValueError("--config.output_dir=OUT is required (results.json and samples.jsonl "
                     "are written there)")
  if os.path.isfile(c.output_dir):
    raise ValueError(f"--config.output_dir={c.output_dir!r} is a file")
  if c.completions:
    if not os.path.isfile(c.completions):
      raise FileNotFoundError(f"--config.completions={c.completions!r} is not a file")
  elif not c.model_dir:
    raise ValueError("--config.model_dir is required (a model folder or a shipped model's "
                     "name) unless --config.completions gives the answers")
  else:
    loading.model_dir(c.model_dir)  # a shipped name, or a folder: one rule everywhere
  if c.limit is not None and (not isinstance(c.limit, int) or c.limit < 1):
    raise ValueError(f"--config.limit must be a positive int, got {c.limit!r}")
  if not isinstance(c.batch_size, int) or isinstance(c.batch_size, bool) or c.batch_size < 1:
    raise ValueError(f"--config.batch_size must be a positive int, got {c.batch_size!r}")
  if c.data_dir and not os.path.isdir(c.data_dir):
    raise FileNotFoundError(f"--config.data_dir={c.data_dir!r} is not a folder")
  try:
    decode_config = DecodeConfig(**c.decode.to_dict())
  except (TypeError, ValueError) as e:
    raise ValueError(f"--config.decode: {e}") from None
  return bench, decode_config


def _configure_sandbox(c) -> None:
  wall = float(c.sandbox_wall_seconds)
  if not wall > 0:
    raise ValueError(f"--config.sandbox_wall_seconds must be > 0, got {wall}")
  limits = sandbox.Limits(wall_seconds=wall, cpu_seconds=max(1, math.ceil(wall)))
  allow_no_namespaces = bool(c.get("sandbox_allow_no_namespaces", False))
  sandbox.configure(limits, allow_network=bool(c.sandbox_allow_network), progress=c.progress,
                    allow_no_namespaces=allow_no_namespaces)
  # Refuse now rather than after the decoding when the namespaces cannot be made.
  sandbox.check_platform(bool(c.sandbox_allow_network), allow_no_namespaces)


def run(c) -> dict[str, Any]:
  """Runs the benchmark the config names; returns the results.json dict."""
  bench, decode_config = check_config(c)
  if bench.name in CODE_BENCHMARKS:
    _configure_sandbox(c)
  if c.get("distributed", False):
    distributed.initialize()
  tm = benchmarks.task_manager(benchmark=bench)
  data_dir = c.data_dir or None
  settings = {
      # As results.json holds it (a tuple field is a list there).
      "decode": {k: list(v) if isinstance(v, tuple) else v
                 for k, v in decode_config.flat().items()},
      "batch_size": c.batch_size,
      "enable_thinking": c.enable_thinking, "seed": c.seed, "num_fewshot": 0,
      "apply_chat_template": True, "limit": c.limit, "data_dir": c.data_dir,
      "lm_eval": lm_eval.__version__, "processes": jax.process_count()}
  if c.completions:
    result, samples = _score_completions(c, bench, tm, data_dir)
  else:
    result, samples = _decode_and_score(c, bench, decode_config, tm, data_dir)
  result.update({"benchmark": bench.name, "title": bench.title, "task": bench.task,
                 "metric": bench.metric, "limit": c.limit, "settings": settings})
  if jax.process_index() == 0:
    _write(c.output_dir, result, samples)
  _log(f"{bench.title}: accuracy {result['accuracy']:.2f} on {result['samples']} samples"
       + ("" if result.get("tokens_per_second") is None else
          f", {result['tokens_per_second']:.2f} tokens/s, {result['tokens_per_forward']:.2f} "
          f"tokens/forward, TPF (paper) {result['tpf_paper']:.2f}"))
  return result


def _decode_and_score(c, bench, decode_config: DecodeConfig, tm, data_dir):
  task_dict = benchmarks.load_tasks(bench, data_dir=data_dir, tm=tm)
  lm = model_lib.RefusionLM(
      c.model_dir, tokenizer_dir=c.tokenizer_dir, adapter_dir=c.get("adapter_dir", ""),
      batch_size=c.batch_size,
      enable_thinking=c.enable_thinking, seed=c.seed, progress=c.progress,
      **decode_config.flat())
  t0 = time.perf_counter()
  out = lm_eval.simple_evaluate(
      model=lm, tasks=benchmarks.top_level(task_dict), task_manager=tm, num_fewshot=0,
      limit=c.limit, apply_chat_template=True, log_samples=True, confirm_run_unsafe_code=True,
      bootstrap_iters=0, verbosity="WARNING")
  wall = time.perf_counter() - t0
  records = {(r.task, r.doc_id): r for r in lm.records}
  samples = []
  for task in sorted(task_dict["tasks"]):
    for s in out["samples"].get(task, []):
      if s["filter"] != bench.metric_filter:
        continue
      r = records[(task, s["doc_id"])]
      row = {"task": task, "doc_id": s["doc_id"]}
      if isinstance(s.get("doc"), dict) and "task_id" in s["doc"]:
        row["task_id"] = s["doc"]["task_id"]
      row.update({
          "prompt": r.prompt, "generation": r.generation, "completion": r.answer,
          "extracted": s["filtered_resps"][0] if s["filtered_resps"] else None,
          "target": s.get("target"), "correct": float(s[bench.metric_name]),
          "tokens": r.tokens, "nfe": r.passes, "tpf_paper": r.tpf_paper,
          "seconds": r.seconds, "prompt_tokens": r.prompt_tokens,
          "prompt_truncated": r.truncated})
      samples.append(row)
  n = len(lm.records)
  tokens = sum(r.tokens for r in lm.records)
  passes = sum(r.passes for r in lm.records)
  result = {
      "accuracy": benchmarks.accuracy(out, bench),
      "samples": n, "tokens": tokens, "seconds": lm.decode_seconds,
      "latency": sum(r.seconds for r in lm.records) / n if n else None,
      "tokens_per_second": tokens / lm.decode_seconds if lm.decode_seconds > 0 else None,
      "tokens_per_forward": tokens / passes if passes else None,
      "tpf_paper": sum(r.tpf_paper for r in lm.records) / n if n else None,
      "avg_length": tokens / n if n else None,
      "nfe": passes, "engine_passes": lm.passes, "wall_seconds": wall,
      "model": os.path.basename(os.path.normpath(c.model_dir)), "model_dir": c.model_dir,
      "model_type": lm.model.config.model_type,
      "method": decode_config.method, "completions": None}
  return result, samples


def _score_completions(c, bench, tm, data_dir):
  rows = replay.read_completions(c.completions)
  scored = replay.score_completions(bench, rows, data_dir=data_dir, tm=tm, limit=c.limit)
  result = {
      "accuracy": scored["accuracy"], "samples": scored["documents"],
      "completions_scored": scored["completions"], "tokens": None, "seconds": None,
      "latency": None, "tokens_per_second": None, "tokens_per_forward": None,
      "tpf_paper": None, "avg_length": None,
      "model": os.path.basename(os.path.normpath(c.completions)), "model_dir": None,
      "method": "completions", "completions": c.completions}
  return result, scored["samples"]


def _write(output_dir: str, result: dict, samples: list[dict]) -> None:
  os.makedirs(output_dir, exist_ok=True)
  path = os.path.join(output_dir, SAMPLES)
  tmp = f"{path}.tmp{os.getpid()}"
  try:
    with open(tmp, "w", encoding="utf-8") as f:
      for row in samples:
        f.write(json.dumps(row, ensure_ascii=False, default=str) + "\n")
    os.replace(tmp, path)
  finally:
    if os.path.exists(tmp):
      os.remove(tmp)
  fileio.write_json_atomic(os.path.join(output_dir, RESULTS), result)
  _log(f"wrote {os.path.join(output_dir, RESULTS)} and {path}")
