"""Evaluation entry point: the paper's benchmarks, or the bundled suite.

  python -m refusion_jax.evaluate --config=configs/eval/<benchmark>.py \\
      --config.model_dir=DIR --config.output_dir=OUT
  python -m refusion_jax.evaluate --config=configs/eval/synthetic.py \\
      --config.model_dir=W/models/refusion/final_model --config.decode.gen_length=32

The seven benchmarks of the paper's Table 1 run through lm-eval
(refusion_jax/lmeval/run.py). The rest of this module is the bundled suite:
held-out problems decoded with any decoder and scored by exact match.

Two measurements per task, as in the paper's tables:

* accuracy: every problem decoded by the continuous-batching engine
  (`decode.engine`, `batch_size` rows; each prompt decodes exactly as it would
  alone) and scored with the task's exact-match `score`; the engine's
  throughput (tokens over its wall time, compiles excluded) is reported as
  `engine_tokens_per_sec`;
* speed: the first `speed_per_task` problems decoded one at a time (batch 1,
  like the paper), after an untimed warm-up call with the same shapes so that
  compilation is excluded. Each timed problem is decoded `speed_repeats` times
  and its fastest wall time kept (decodes are deterministic at temperature 0
  and at a fixed seed, so the repeats do the same work; the minimum drops
  pauses caused by other load on the machine). Tokens per second counts
  generated tokens up to and including EOS over the summed wall seconds;
  tokens per forward is tokens / NFE with every forward pass counted (plan,
  verification, drafts, infill verifies); `tpf_paper` is the paper's TPF
  (per sample the mean over steps of tokens / passes in the step, then the
  mean over samples).

All prompts are right-padded to one width (`prompt_width`), so one compiled
program serves every prompt of a decode config.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from typing import Mapping, Sequence

import jax
import numpy as np
import tqdm
from absl import flags
from ml_collections import config_flags

from refusion_jax import entry_flags, fileio, loading, runtime
from refusion_jax import tasks as tasks_lib
from refusion_jax.config import ModelConfig
from refusion_jax.decode import engine as engine_lib
from refusion_jax.decode.settings import DecodeConfig

# ---------------------------------------------------------------------------
# Problems.


@dataclasses.dataclass(frozen=True)
class Problem:
  query: str
  task: str
  prompt_ids: tuple[int, ...]


def read_problems(path: str, tokenizer, per_task: int = 0,
                  task_names: Sequence[str] | None = None) -> list[Problem]:
  """Problems of a `{"query": ...}` JSONL file, the first `per_task` of each task (0 = all).

  Tasks come from each query's first word (refusion_jax.tasks); only
  `task_names` are kept when given. File order is kept.
  """
  if not isinstance(per_task, int) or isinstance(per_task, bool) or per_task < 0:
    raise ValueError(f"per_task must be an int >= 0 (0 = all), got {per_task!r}")
  if task_names is not None:
    unknown = [t for t in task_names if t not in tasks_lib.TASKS]
    if unknown:
      raise ValueError(f"unknown task name(s) {unknown}; known: {sorted(tasks_lib.TASKS)}")
  if not os.path.isfile(path):
    raise FileNotFoundError(f"problem file {path!r} does not exist")
  counts: dict[str, int] = {}
  problems = []
  for where, row in fileio.jsonl_rows(path):
    if not isinstance(row, dict) or not isinstance(row.get("query"), str) or not row["query"]:
      raise ValueError(f"{where}: expected an object with a non-empty string 'query'")
    try:
      task = tasks_lib.task_of(row["query"]).name
    except ValueError as e:
      raise ValueError(f"{where}: {e}") from None
    if task_names is not None and task not in task_names:
      continue
    if per_task and counts.get(task, 0) >= per_task:
      continue
    counts[task] = counts.get(task, 0) + 1
    problems.append(Problem(row["query"], task, tuple(tokenizer.encode_prompt(row["query"]))))
  if not problems:
    raise ValueError(f"{path}: no problems (task_names={task_names})")
  return problems


def prompt_width(problems: Sequence[Problem], model_config: ModelConfig, gen_length: int,
                 multiple: int = 16) -> int:
  """One padded prompt width for all problems (longest rounded up to `multiple`)."""
  longest = max(len(p.prompt_ids) for p in problems)
  limit = model_config.max_position_embeddings - gen_length
  if longest > limit:
    raise ValueError(f"the longest prompt has {longest} tokens; with gen_length={gen_length} "
                     f"it exceeds max_position_embeddings={model_config.max_position_embeddings}")
  if not isinstance(multiple, int) or multiple <= 0:
    raise ValueError(f"prompt bucket multiple must be a positive int, got {multiple!r}")
  return max(longest, min(-(-longest // multiple) * multiple, limit))


# ---------------------------------------------------------------------------
# Decoding.


def _batch_arrays(prompts: Sequence[Sequence[int]], rows: int, width: int):
  """`[rows, width]` right-padded ids and lengths; missing rows repeat the first prompt."""
  if len(prompts) > rows:
    raise ValueError(f"{len(prompts)} prompts do not fit in a batch of {rows}")
  ids_bp = np.zeros((rows, width), np.int32)
  lens_b = np.zeros((rows,), np.int32)
  for r in range(rows):
    ids = prompts[r] if r < len(prompts) else prompts[0]
    if len(ids) > width:
      raise ValueError(f"a prompt of {len(ids)} tokens is wider than prompt_width={width}")
    ids_bp[r, :len(ids)] = ids
    lens_b[r] = len(ids)
  return ids_bp, lens_b


def _progress(total: int, desc: str, enabled: bool):
  if not enabled:
    return None
  return tqdm.tqdm(total=total, desc=desc, unit="prob", leave=False, file=sys.stderr)


def _task_configs(problems: Sequence[Problem], decode_configs) -> dict[str, DecodeConfig]:
  tasks = sorted({p.task for p in problems})
  if isinstance(decode_configs, DecodeConfig):
    return {t: decode_configs for t in tasks}
  missing = [t for t in tasks if t not in decode_configs]
  if missing:
    raise ValueError(f"no decode config for task(s) {missing}")
  for t in tasks:
    if not isinstance(decode_configs[t], DecodeConfig):
      raise TypeError(f"decode config of task {t!r} must be a DecodeConfig, "
                      f"got {type(decode_configs[t]).__name__}")
  return {t: decode_configs[t] for t in tasks}


def evaluate(model, tokenizer, problems: Sequence[Problem],
             decode_configs: DecodeConfig | Mapping[str, DecodeConfig], *,
             batch_size: int = 16, speed_per_task: int = 20, speed_repeats: int = 5,
             width: int | None = None, seed: int = 0, progress: bool = True,
             desc: str = "eval") -> dict:
  """Accuracy (batched) and batch-1 speed per task; see the module docstring.

  Args:
    model: a `Transformer` whose attention fits the decoders' methods.
    tokenizer: decodes generated ids to text for scoring.
    problems: from `read_problems`.
    decode_configs: one DecodeConfig, or one per task (the paper tunes them per
      benchmark, its Table 5).
    batch_size: rows per accuracy batch (a short last batch is padded to it).
    speed_per_task: problems per task timed at batch 1 (0 = no timing).
    speed_repeats: decodes per timed problem; its fastest one is counted.
    width: padded prompt width (None: from `prompt_width`).
    seed: rng for temperature > 0.

  Returns:
    JSON-able dict: "per_task" {task: metrics}, "average" (mean over tasks of
    accuracy, tokens/s and tokens/forward), "decode" {task: DecodeConfig
    fields} and "samples" (one record per problem).
  """
  if not problems:
    raise ValueError("evaluate: no problems")
  if not isinstance(batch_size, int) or batch_size <= 0:
    raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
  if not isinstance(speed_per_task, int) or speed_per_task < 0:
    raise ValueError(f"speed_per_task must be an int >= 0, got {speed_per_task!r}")
  if not isinstance(speed_repeats, int) or isinstance(speed_repeats, bool) or speed_repeats < 1:
    raise ValueError(f"speed_repeats must be an int >= 1, got {speed_repeats!r}")
  configs = _task_configs(problems, decode_configs)
  config = model.config
  if width is None:
    width = prompt_width(problems, config, max(c.gen_length for c in configs.values()))
  for c in configs.values():
    # Checked for every task first, so a bad config fails before any compile.
    c.check_fits(config, width)
  rng = jax.random.key(seed)

  per_task, samples = {}, []
  for task, decode_config in configs.items():
    task_problems = [p for p in problems if p.task == task]
    prompts = [list(p.prompt_ids) for p in task_problems]
    decoder = engine_lib.decoder_for(model, decode_config)
    eng = decoder.engine(batch_size, width=width)
    eng.warm_up()  # compiles excluded from the engine's time
    bar = _progress(len(prompts), f"{desc} {task} acc", progress)
    run = eng.run(prompts, rng, progress=bar)
    if bar is not None:
      bar.close()
    tokens = nfe = correct = corrected = refresh = 0
    tpf_paper = 0.0
    for problem, res in zip(task_problems, run.results):
      n = len(res.tokens)
      text = tokenizer.decode(res.tokens, skip_special_tokens=True)
      ok = bool(tasks_lib.score(problem.query, text))
      correct += ok
      tokens += n
      nfe_r = int(res.counters["nfe_b"])
      nfe += nfe_r
      tpf_paper += res.counters["tpf_paper_b"]
      corrected += int(res.counters.get("corrected_b", 0))
      refresh += int(res.counters.get("refresh_b", 0))
      samples.append({"task": task, "query": problem.query, "text": text, "correct": ok,
                      "tokens": n, "nfe": nfe_r, "tpf_paper": res.counters["tpf_paper_b"],
                      **({"search_rows": int(res.counters["search_rows_b"])}
                         if "search_rows_b" in res.counters else {})})

    timed = prompts[:speed_per_task]
    speed_tokens, seconds = 0, 0.0
    if timed:
      def one(ids, key):
        ids_bp, lens_b = _batch_arrays([ids], 1, width)
        return jax.block_until_ready(decoder.generate(ids_bp, lens_b, key))
      # Warm-up: the same shapes compile (and are cached) before the clock starts.
      one(timed[0], rng)
      bar = _progress(len(timed), f"{desc} {task} speed", progress)
      for i, ids in enumerate(timed):
        fastest = float("inf")
        for _ in range(speed_repeats):
          t0 = time.perf_counter()
          out = one(ids, jax.random.fold_in(rng, i))
          fastest = min(fastest, time.perf_counter() - t0)
        seconds += fastest
        speed_tokens += int(out.length_b[0])
        if bar is not None:
          bar.update(1)
      if bar is not None:
        bar.close()
    per_task[task] = {
        "n": len(prompts), "correct": correct, "accuracy": 100.0 * correct / len(prompts),
        "tokens": tokens, "nfe": nfe, "tokens_per_forward": tokens / nfe if nfe else 0.0,
        "tpf_paper": tpf_paper / len(prompts),
        # Verified infill (decode.verify): tokens a causal argmax replaced, and verify
        # passes run only to feed corrected tokens (0 without verification).
        "corrected": corrected, "refresh_passes": refresh,
        "speed_n": len(timed), "speed_repeats": speed_repeats,
        "speed_tokens": speed_tokens, "speed_seconds": seconds,
        "tokens_per_sec": speed_tokens / seconds if seconds > 0 else None,
        "engine_rows": batch_size, "engine_passes": run.passes,
        "engine_seconds": run.seconds,
        "engine_tokens_per_sec": tokens / run.seconds if run.seconds > 0 else None}

  tps = [m["tokens_per_sec"] for m in per_task.values()]
  average = {
      "accuracy": float(np.mean([m["accuracy"] for m in per_task.values()])),
      "tokens_per_forward": float(np.mean([m["tokens_per_forward"] for m in per_task.values()])),
      "tpf_paper": float(np.mean([m["tpf_paper"] for m in per_task.values()])),
      "corrected_per_answer": float(np.mean([m["corrected"] / m["n"]
                                             for m in per_task.values()])),
      "tokens_per_sec": float(np.mean(tps)) if all(t is not None for t in tps) else None}
  return {"per_task": per_task, "average": average,
          "decode": {t: c.flat() for t, c in configs.items()},
          "samples": samples}


def summary_lines(result: dict) -> list[str]:
  """One human-readable line per task plus the average."""
  lines = []
  for task, m in result["per_task"].items():
    tps = "n/a" if m["tokens_per_sec"] is None else f"{m['tokens_per_sec']:.1f}"
    lines.append(f"{task:10s} acc {m['accuracy']:6.2f} ({m['correct']}/{m['n']})  "
                 f"tok/s {tps:>8s}  tok/fwd {m['tokens_per_forward']:.2f}")
  a = result["average"]
  tps = "n/a" if a["tokens_per_sec"] is None else f"{a['tokens_per_sec']:.1f}"
  lines.append(f"{'average':10s} acc {a['accuracy']:6.2f}          tok/s {tps:>8s}  "
               f"tok/fwd {a['tokens_per_forward']:.2f}")
  return lines


# ---------------------------------------------------------------------------
# Entry point (thin; everything above is importable). Its flags live in their own
# FlagValues: refusion_jax.train and refusion_jax.sample define a global --config.


def run_synthetic(c) -> dict:
  """The bundled suite (`configs/eval/synthetic.py`): prints a summary; with
  `output_dir`, writes results.json (the model, method and sample count, per-task
  metrics, their means, the decode settings) and samples.jsonl (one record per problem),
  which `evaluate_table` tabulates."""
  model_ref = c.model_dir
  c.model_dir = loading.model_dir(c.model_dir)  # a shipped model's short name: its folder
  if not c.data or not os.path.isfile(c.data):
    raise ValueError(f"--config.data={c.data!r} is not a file")
  if c.output_dir and os.path.lexists(c.output_dir) and not os.path.isdir(c.output_dir):
    raise ValueError(f"--config.output_dir={c.output_dir!r} exists and is not a folder")
  try:
    decode_config = DecodeConfig(**c.decode.to_dict())
  except (TypeError, ValueError) as e:
    raise ValueError(f"--config.decode: {e}") from None
  # The tokenizer is checked against the model's config before the weights load.
  tokenizer = loading.load_tokenizer(c.model_dir, loading.read_model_config(c.model_dir),
                                     c.tokenizer_dir)
  problems = read_problems(c.data, tokenizer, per_task=c.per_task)
  _, model = loading.load_model(c.model_dir, adapter_dir=c.get("adapter_dir", ""))
  result = evaluate(model, tokenizer, problems, decode_config, batch_size=c.batch_size,
                    speed_per_task=c.speed_per_task, speed_repeats=c.speed_repeats,
                    seed=c.seed, desc=decode_config.method)
  print("\n".join(summary_lines(result)))
  if c.output_dir:
    os.makedirs(c.output_dir, exist_ok=True)
    samples = os.path.join(c.output_dir, "samples.jsonl")
    fileio.write_text_atomic(samples, "".join(json.dumps(r, ensure_ascii=False) + "\n"
                                              for r in result["samples"]))
    out = os.path.join(c.output_dir, "results.json")
    summary = {"benchmark": "synthetic", "model": model_ref.rstrip("/"),
               "method": decode_config.method, "samples": len(result["samples"]),
               **{k: v for k, v in result.items() if k != "samples"}}
    fileio.write_json_atomic(out, summary)
    print(f"wrote {out} and {samples}", file=sys.stderr)
  return result


def main(argv: Sequence[str]) -> dict:
  """Parses `argv` (program name first) and runs the evaluation its --config names."""

  fv = flags.FlagValues()
  config_flag = config_flags.DEFINE_config_file(
      "config", None, "Evaluation config: configs/eval/<benchmark>.py (one of the paper's "
      "seven) or configs/eval/synthetic.py (the bundled suite).", flag_values=fv,
      lock_config=True, sys_argv=list(argv))
  rest = entry_flags.parse_flags(list(argv), fv)
  if len(rest) > 1:
    raise ValueError(f"unexpected arguments: {rest[1:]}")
  c = config_flag.value
  if c is None:
    raise ValueError("--config=configs/eval/<benchmark>.py is required (mmlu_pro, arc_c, "
                     "gsm8k, math, gpqa, humaneval, mbpp, or synthetic for the bundled suite)")
  runtime.start_up(c.get("compile_cache_dir", runtime.AUTO))
  if c.benchmark == "synthetic":
    return run_synthetic(c)
  from refusion_jax.lmeval import (
    run,  # lm-eval (the eval extra): the paper's benchmarks only
  )
  return run.run(c)


if __name__ == "__main__":
  with entry_flags.errors_reported("refusion_jax.evaluate", (ValueError, OSError, TypeError)):
    main(sys.argv)
