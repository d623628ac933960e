"""The paper's Tables 1, 2 and 3 from evaluation results files.

  python -m refusion_jax.evaluate_table OUT_DIR_OR_results.json ... \\
      [--table=0|1|2|3] [--output=table.md] [--baseline=LABEL] [--notpf]

`--table=0` (the default) tabulates whatever the files hold, as below.
`--table=1`, `--table=2` and `--table=3` lay the files out as the paper's tables, every
row of the paper in its order whether a file fills it or not (an empty one
reads "missing" with what would fill it). Table 1, the nine systems: rows by method,
the results' `model_type` and, for an MDM, whether it decoded with Fast-dLLM's rules
or caches (a threshold, a factor or a cache) or with its own sampler; each row's
decode settings are listed under the table (`TABLE1`). Table 2, the controlled comparison
(each model retrained from one base on the same samples), rows by method: ar
(the retrained Qwen3-8B), mdm (LLaDA), bd3lm (BD3-LMs), refusion; Table 3, the
Qwen2.5 backbone, rows by method and the results' `model_type` (written by
`lmeval`): refusion on a "qwen2" model (ReFusion trained on Qwen2.5-7B) and mdm
on a "dream" model (Dream-7B-Instruct). Two different models filling one row
are an error naming both. Speed-up is over the table's first row.

Each input is a `results.json` written by `python -m refusion_jax.evaluate` (or
the folder holding one: its `--config.output_dir`). The bundled suite's
(`configs/eval/synthetic.py`) get their own table, a column per task. One row per (model, method)
pair, labelled with the model's name, or "NAME (method)" when that name has
rows for several methods; rows are ordered ar, mdm, bd3lm, d2f, refusion (the
paper's order, BD3-LM from its Table 2), then by first appearance. Columns are the paper's seven benchmarks in
its order, each cell "accuracy (%) / tokens per second" with two decimals;
a benchmark a row lacks is "–". Avg is the mean over the benchmarks the row has
and is marked "(k/7)" when it covers k < 7 of them. A run made with `limit` is
marked "†" and listed under the table.

Speed-up is each row's mean tokens per second over the baseline row's, both
taken over the benchmarks the two rows share. The baseline is the row given
by --baseline (its label, or "NAME (method)"), else the one row whose method
is "ar"; with no such row, or several, there is no speed-up column (a note
says why). A second table (left out with --notpf) gives tokens per forward
pass (every pass counted) / the paper's TPF per benchmark.

The markdown goes to stdout and, with --output, to that file (written
atomically). A file that is missing, not JSON, lacks a required field, has a
field of the wrong type or an unknown benchmark or method, or repeats another
file's (model, method, benchmark) is an error naming the file(s) and field;
the exit status is then 2.
"""

from __future__ import annotations

import math
import os
import sys
from typing import Any, Iterable, Mapping, Sequence

from absl import app, flags

from refusion_jax import fileio
from refusion_jax.decode.settings import DecodeConfig

BENCHMARKS = ("mmlu_pro", "arc_c", "gsm8k", "math", "gpqa", "humaneval", "mbpp")
TITLES = {"mmlu_pro": "MMLU-Pro", "arc_c": "ARC-C", "gsm8k": "GSM8K", "math": "MATH",
          "gpqa": "GPQA", "humaneval": "HumanEval", "mbpp": "MBPP"}
METHODS = ("ar", "mdm", "bd3lm", "d2f", "refusion")  # also the row order
RESULTS_FILE = "results.json"
MISSING = "–"
LIMITED = "†"

# Required fields and what they must hold. `limit` is optional (absent = null).
_NUMBER_FIELDS = ("accuracy", "tokens_per_second", "tokens_per_forward", "tpf_paper")
_REQUIRED = ("benchmark", "model", "method", "samples") + _NUMBER_FIELDS


def _where(result: Mapping[str, Any], index: int) -> str:
  return result.get("source") or f"result #{index}"


def _is_int(value: Any) -> bool:
  return isinstance(value, int) and not isinstance(value, bool)


def check_result(result: Any, where: str) -> None:
  """Raises ValueError naming `where` and the field when `result` is not a usable result."""
  if not isinstance(result, dict):
    raise ValueError(f"{where}: expected a JSON object, got {type(result).__name__}")
  for field in _REQUIRED:
    if field not in result:
      raise ValueError(f"{where}: required field {field!r} is missing")
  if result["benchmark"] not in BENCHMARKS:
    raise ValueError(f"{where}: field 'benchmark' is {result['benchmark']!r}, not one of "
                     f"{', '.join(BENCHMARKS)}")
  if result["method"] not in METHODS:
    raise ValueError(f"{where}: field 'method' is {result['method']!r}, not one of "
                     f"{', '.join(METHODS)}")
  if not isinstance(result["model"], str) or not result["model"].strip():
    raise ValueError(f"{where}: field 'model' must be a non-empty string, got "
                     f"{result['model']!r}")
  for field in _NUMBER_FIELDS:
    value = result[field]
    if (not isinstance(value, (int, float)) or isinstance(value, bool)
        or not math.isfinite(value) or value < 0):
      raise ValueError(f"{where}: field {field!r} must be a finite number >= 0, got {value!r}")
  if result["accuracy"] > 100:
    raise ValueError(f"{where}: field 'accuracy' is {result['accuracy']!r}; it is a percentage "
                     "(0 to 100)")
  if not _is_int(result["samples"]) or result["samples"] < 0:
    raise ValueError(f"{where}: field 'samples' must be an int >= 0, got {result['samples']!r}")
  limit = result.get("limit")
  if limit is not None and (not _is_int(limit) or limit <= 0):
    raise ValueError(f"{where}: field 'limit' must be null or an int > 0, got {limit!r}")


def _check_unique(results: Sequence[Mapping[str, Any]]) -> None:
  seen: dict[tuple[str, str, str], int] = {}
  for i, r in enumerate(results):
    key = (r["model"], r["method"], r["benchmark"])
    if key in seen:
      j = seen[key]
      raise ValueError(
          f"{_where(results[j], j)} and {_where(r, i)} both hold model {key[0]!r}, method "
          f"{key[1]!r}, benchmark {key[2]!r}: give one of them")
    seen[key] = i


def results_path(path: str) -> str:
  """`path` itself, or `path/results.json` when `path` is a folder."""
  if os.path.isdir(path):
    inside = os.path.join(path, RESULTS_FILE)
    if not os.path.isfile(inside):
      raise FileNotFoundError(f"{path} is a folder without a {RESULTS_FILE}")
    return inside
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{path} does not exist (expected a {RESULTS_FILE} or the "
                            "evaluation output folder holding one)")
  return path


def load_results(paths: Iterable[str]) -> list[dict]:
  """The checked results of each path (a results.json or its folder), in order.

  Each result gets a "source" field: the file it was read from.
  """
  results, files = [], []
  for path in paths:
    file = results_path(path)
    if os.path.realpath(file) in (os.path.realpath(f) for f in files):
      raise ValueError(f"{file} is given more than once")
    files.append(file)
    result = fileio.read_json(file)
    if is_bundled(result):
      check_bundled(result, file)
    else:
      check_result(result, file)
    results.append({**result, "source": file})
  if not results:
    raise ValueError("no results files given")
  _check_unique([r for r in results if not is_bundled(r)])
  return results


# --- the bundled suite (configs/eval/synthetic.py): its own tasks, its own table ---------


def is_bundled(result: Any) -> bool:
  """Whether `result` is the bundled suite's (`evaluate` on configs/eval/synthetic.py:
  per-task metrics under "per_task" and their means under "average")."""
  return isinstance(result, dict) and "per_task" in result and "average" in result


def check_bundled(result: Mapping[str, Any], where: str) -> None:
  per_task = result["per_task"]
  if not isinstance(per_task, dict) or not per_task:
    raise ValueError(f"{where}: field 'per_task' must be a non-empty object of tasks")
  for task, m in per_task.items():
    for field in ("accuracy", "tokens_per_forward"):
      value = m.get(field) if isinstance(m, dict) else None
      if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{where}: per_task.{task}.{field} must be a number >= 0, got "
                         f"{value!r}")


def _bundled_key(result: Mapping[str, Any]) -> tuple[str, str]:
  """(model, method) of a bundled result; files written before they carried them name
  the model by their folder and the method by their decode settings."""
  model = result.get("model") or os.path.basename(os.path.dirname(result["source"]))
  method = result.get("method") or next(iter(result.get("decode", {}).values()),
                                        {}).get("method", "?")
  return model, method


def bundled_markdown(results: Sequence[Mapping[str, Any]]) -> str:
  """The bundled suite's results: a row per (model, method), a column per task, each cell
  "accuracy (%) / tokens per second" (– where the speed was not timed), then the mean."""
  tasks: list[str] = []
  for r in results:
    tasks += [t for t in r["per_task"] if t not in tasks]
  header = ["Model", *tasks, "Avg", "Tok/fwd"]
  lines = ["## The bundled suite: accuracy (%) / tokens per second", "",
           "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  seen = set()
  for r in results:
    model, method = _bundled_key(r)
    if (model, method) in seen:
      raise ValueError(f"{r['source']}: a second bundled result of model {model!r}, method "
                       f"{method!r}: give one of them")
    seen.add((model, method))
    cells = []
    for t in tasks:
      m = r["per_task"].get(t)
      tps = None if m is None else m.get("tokens_per_sec")
      cells.append(MISSING if m is None else
                   f"{m['accuracy']:.2f} / {MISSING if tps is None else f'{tps:.2f}'}")
    a = r["average"]
    tps = a.get("tokens_per_sec")
    cells.append(f"{a['accuracy']:.2f} / {MISSING if tps is None else f'{tps:.2f}'}")
    cells.append(f"{a['tokens_per_forward']:.2f}")
    lines.append(f"| {_md(model)} ({method}) | " + " | ".join(cells) + " |")
  return "\n".join(lines) + "\n"


def _md(text: str) -> str:
  """`text` safe inside a markdown table cell."""
  return text.replace("|", "\\|")


def _mean(values: Sequence[float]) -> float:
  return sum(values) / len(values)


def _rows(results: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Mapping[str, Any]]]:
  """{label: {benchmark: result}} in table order."""
  keys: list[tuple[str, str]] = []
  for r in results:
    if (r["model"], r["method"]) not in keys:
      keys.append((r["model"], r["method"]))
  keys.sort(key=lambda k: METHODS.index(k[1]))  # stable: first appearance within a method
  methods_of: dict[str, int] = {}
  for model, _ in keys:
    methods_of[model] = methods_of.get(model, 0) + 1
  label = {k: k[0] if methods_of[k[0]] == 1 else f"{k[0]} ({k[1]})" for k in keys}
  if len(set(label.values())) < len(label):  # a name like "M (ar)" beside model M's rows
    label = {k: f"{k[0]} ({k[1]})" for k in keys}
  rows: dict[str, dict[str, Mapping[str, Any]]] = {label[k]: {} for k in keys}
  for r in results:
    rows[label[(r["model"], r["method"])]][r["benchmark"]] = r
  return rows


def _pick_baseline(rows: Mapping[str, Mapping[str, Mapping[str, Any]]],
                   baseline: str | None) -> tuple[str | None, str | None]:
  """(baseline label or None, a note saying why there is none)."""
  if baseline is not None:
    for name, cells in rows.items():
      first = next(iter(cells.values()))
      if baseline in (name, f"{first['model']} ({first['method']})"):
        return name, None
    raise ValueError(f"--baseline={baseline!r} is not a row; rows: "
                     + ", ".join(repr(n) for n in rows))
  ar = [name for name, cells in rows.items() if next(iter(cells.values()))["method"] == "ar"]
  if len(ar) == 1:
    return ar[0], None
  if not ar:
    return None, "No speed-up column: no row has method ar; pick one with --baseline=LABEL."
  return None, (f"No speed-up column: {len(ar)} rows have method ar ({', '.join(ar)}); "
                "pick one with --baseline=LABEL.")


def _speed_up(cells: Mapping[str, Mapping[str, Any]],
              base: Mapping[str, Mapping[str, Any]]) -> str:
  shared = [b for b in BENCHMARKS if b in cells and b in base]
  if not shared:
    return MISSING
  base_tps = _mean([base[b]["tokens_per_second"] for b in shared])
  if base_tps == 0:
    return MISSING
  return f"{_mean([cells[b]['tokens_per_second'] for b in shared]) / base_tps:.2f}×"


def _table(rows: Mapping[str, Mapping[str, Mapping[str, Any]]], fields: tuple[str, str],
           extra_header: Sequence[str] = (),
           extra_cells: Mapping[str, Sequence[str]] | None = None) -> list[str]:
  header = ["Model", *(TITLES[b] for b in BENCHMARKS), "Avg", *extra_header]
  lines = ["| " + " | ".join(header) + " |",
           "|:---|" + "---:|" * (len(header) - 1)]
  for name, cells in rows.items():
    out = [_md(name)]
    for b in BENCHMARKS:
      r = cells.get(b)
      if r is None:
        out.append(MISSING)
      else:
        mark = LIMITED if r.get("limit") is not None else ""
        out.append(f"{r[fields[0]]:.2f} / {r[fields[1]]:.2f}{mark}")
    present = [cells[b] for b in BENCHMARKS if b in cells]
    if not present:  # a paper table's row no file fills
      avg = MISSING
    else:
      avg = (f"{_mean([r[fields[0]] for r in present]):.2f} / "
             f"{_mean([r[fields[1]] for r in present]):.2f}")
    if present and len(present) < len(BENCHMARKS):
      avg += f" ({len(present)}/{len(BENCHMARKS)})"
    out.append(avg)
    out.extend((extra_cells or {}).get(name, ()))
    lines.append("| " + " | ".join(out) + " |")
  return lines


def table_markdown(results: Sequence[Mapping[str, Any]], baseline: str | None = None,
                   tpf: bool = True) -> str:
  """Table 1 (and, with `tpf`, the tokens-per-forward table) as markdown.

  `results` are results.json objects (as `load_results` returns them; hand-made
  ones are checked the same way). `baseline` is a row label (see the module
  docstring); None picks the one ar row.
  """
  if not results:
    raise ValueError("no results to tabulate")
  for i, r in enumerate(results):
    check_result(r, _where(r, i) if isinstance(r, dict) else f"result #{i}")
  _check_unique(results)
  rows = _rows(results)
  base, no_base = _pick_baseline(rows, baseline)
  extra_header, extra_cells = [], None
  if base is not None:
    extra_header = [f"Speed-up vs {_md(base)}"]
    extra_cells = {name: [_speed_up(cells, rows[base])] for name, cells in rows.items()}
  lines = ["## Table 1: accuracy (%) / tokens per second", ""]
  lines += _table(rows, ("accuracy", "tokens_per_second"), extra_header, extra_cells)

  notes = []
  if any(len(cells) < len(BENCHMARKS) for cells in rows.values()):
    notes.append(f"Avg is the mean over the benchmarks a row has; (k/{len(BENCHMARKS)}) marks "
                 f"a row with k of the {len(BENCHMARKS)}.")
  if base is not None:
    notes.append(f"Speed-up: the row's mean tokens per second over {base}'s, both over the "
                 "benchmarks the two rows share.")
  if no_base:
    notes.append(no_base)
  limited = [f"{name} {TITLES[b]}: limit {r['limit']}, {r['samples']} samples"
             for name, cells in rows.items() for b in BENCHMARKS
             if b in cells and (r := cells[b]).get("limit") is not None]
  if limited:
    notes.append(f"{LIMITED} Run on the first N samples only (`limit` N; for MMLU-Pro, of "
                 "each subject): " + "; ".join(limited) + ".")
  if notes:
    lines += [""] + [f"- {n}" for n in notes]
  if tpf:
    lines += ["", "## Tokens per forward pass (every pass counted) / the paper's TPF", ""]
    lines += _table(rows, ("tokens_per_forward", "tpf_paper"))
  return "\n".join(lines) + "\n"


# The paper's comparison tables: (row label, method, model_type or None = any).
PAPER_TABLES = {
    2: ("Table 2: the controlled comparison (every model retrained from one base on the "
        "same samples)",
        (("Qwen3-8B retrained (AR)", "ar", None), ("LLaDA retrained (MDM)", "mdm", None),
         ("BD3-LMs retrained (block diffusion)", "bd3lm", None), ("ReFusion", "refusion", None))),
    3: ("Table 3: the Qwen2.5 backbone",
        (("ReFusion (Qwen2.5-7B)", "refusion", "qwen2"),
         ("Dream-7B-Instruct", "mdm", "dream"))),
}


# Table 1 (the paper's order): (row label, method, model_type or None = any, MDM decoding:
# "own" = its own sampler, "fast" = Fast-dLLM's threshold, factor or cache, None = any).
TABLE1 = (
    ("Llama-3-8B-Instruct", "ar", "llama", None),
    ("Qwen3-8B", "ar", "qwen3", None),
    ("LLaDA-8B-Instruct", "mdm", "llada", "own"),
    ("LLaDA w/ Fast-dLLM", "mdm", "llada", "fast"),
    ("LLaDA w/ D2F", "d2f", "llada", None),
    ("Dream-7B-Instruct", "mdm", "dream", "own"),
    ("Dream w/ Fast-dLLM", "mdm", "dream", "fast"),
    ("Dream w/ D2F", "d2f", "dream", None),
    ("ReFusion", "refusion", None, None),
)
PAPER_TABLES[1] = ("Table 1: the nine systems", tuple(TABLE1))


def _decode_of(result: Mapping[str, Any]) -> Mapping[str, Any]:
  settings = result.get("settings")
  decode = settings.get("decode") if isinstance(settings, Mapping) else None
  return decode if isinstance(decode, Mapping) else {}


def _mdm_kind(result: Mapping[str, Any]) -> str:
  d = _decode_of(result)
  fast = any(d.get(k) is not None for k in ("mdm_threshold", "mdm_factor", "mdm_cache"))
  return "fast" if fast else "own"


def settings_line(result: Mapping[str, Any]) -> str:
  """The decode settings a result ran with that matter to its method (unset ones left
  out), e.g. `gen_length 512, block_size 32, mdm_threshold 0.9, mdm_cache dual`."""
  d = _decode_of(result)
  if not d:
    return "(no decode settings recorded)"
  try:  # a file written when every method's fields were kept drops the others' here
    summary = DecodeConfig.from_flat({"method": result["method"], **d}, lenient=True).summary()
  except (TypeError, ValueError) as e:
    return f"(decode settings unreadable: {e})"
  return ", ".join(f"{k} {v}" for k, v in summary.items())


def paper_table_markdown(results: Sequence[Mapping[str, Any]], table: int,
                         tpf: bool = True) -> str:
  """The paper's Table 1, 2 or 3 (`PAPER_TABLES`): every row, filled from `results` or
  marked missing; the speed-up is over the table's first row when it is filled."""
  if table not in PAPER_TABLES:
    raise ValueError(f"--table must be 0, 1, 2 or 3, got {table!r}")
  for i, r in enumerate(results):
    check_result(r, _where(r, i) if isinstance(r, dict) else f"result #{i}")
  _check_unique(results)
  title, layout = PAPER_TABLES[table]
  rows: dict[str, dict[str, Mapping[str, Any]]] = {}
  missing = []
  for label, method, model_type, *kind in layout:
    fits = [r for r in results if r["method"] == method
            and (model_type is None or r.get("model_type") == model_type)
            and (not kind or kind[0] is None or _mdm_kind(r) == kind[0])]
    models = sorted({r["model"] for r in fits})
    if len(models) > 1:
      raise ValueError(f"table {table}, row {label!r}: results of {len(models)} models fill it "
                       f"({', '.join(models)}); give the files of one")
    rows[label] = {r["benchmark"]: r for r in fits}
    if not fits:
      need = f"method {method}" + (f", model_type {model_type}" if model_type else "")
      if kind and kind[0]:
        need += (", decoded with Fast-dLLM's threshold, factor or cache" if kind[0] == "fast"
                 else ", decoded with its own sampler (no threshold, factor or cache)")
      missing.append(f"{label}: missing (no results file with {need})")
  first = layout[0][0]
  base = first if rows[first] else None
  extra_header, extra_cells = [], None
  if base is not None:
    extra_header = [f"Speed-up vs {_md(base)}"]
    extra_cells = {name: [_speed_up(cells, rows[base]) if cells else MISSING]
                   for name, cells in rows.items()}
  lines = [f"## {title}: accuracy (%) / tokens per second", ""]
  lines += _table(rows, ("accuracy", "tokens_per_second"), extra_header, extra_cells)
  notes = missing + [f"{LIMITED} {name} {TITLES[b]}: limit {r['limit']}, {r['samples']} samples"
                     for name, cells in rows.items() for b in BENCHMARKS
                     if b in cells and (r := cells[b]).get("limit") is not None]
  if notes:
    lines += [""] + [f"- {n}" for n in notes]
  if table == 1:
    lines += ["", "Decode settings of each row:", ""]
    for name, cells in rows.items():
      by_settings: dict[str, list[str]] = {}
      for b in BENCHMARKS:
        if b in cells:
          by_settings.setdefault(settings_line(cells[b]), []).append(TITLES[b])
      for line, benches in by_settings.items():
        lines.append(f"- {_md(name)} ({', '.join(benches)}): {line}")
  if tpf:
    lines += ["", "## Tokens per forward pass (every pass counted) / the paper's TPF", ""]
    lines += _table(rows, ("tokens_per_forward", "tpf_paper"))
  return "\n".join(lines) + "\n"


def define_flags() -> tuple[flags.FlagHolder, ...]:
  """--output, --baseline, --tpf, --table; defined only when run as a program, so this
  module can be imported beside the other entry points without clashing flags."""
  return (
      flags.DEFINE_string("output", None, "Also write the markdown to this file (atomically)."),
      flags.DEFINE_string("baseline", None, "Label of the speed-up baseline row (default: the "
                          "one row whose method is ar)."),
      flags.DEFINE_bool("tpf", True, "Add the tokens-per-forward / paper TPF table."),
      flags.DEFINE_integer("table", 0, "0: every (model, method) the files hold; 1 / 2 / 3: "
                           "the paper's Table 1 / 2 / 3 rows, a missing one named."),
  )


def main(argv: Sequence[str], output: flags.FlagHolder, baseline: flags.FlagHolder,
         tpf: flags.FlagHolder, table: flags.FlagHolder | None = None) -> None:
  if len(argv) < 2:
    raise app.UsageError("give one or more results.json files or evaluation output folders")
  which = 0 if table is None else table.value
  try:
    loaded = load_results(argv[1:])
    results = [r for r in loaded if not is_bundled(r)]
    bundled = [r for r in loaded if is_bundled(r)]
    parts = []
    if results and which == 0:
      parts.append(table_markdown(results, baseline=baseline.value, tpf=tpf.value))
    elif results:
      if baseline.value is not None:
        raise ValueError("--baseline applies to --table=0 (the paper's tables compare with "
                         "their first row)")
      parts.append(paper_table_markdown(results, which, tpf=tpf.value))
    if bundled:
      if which:
        raise ValueError(f"{bundled[0]['source']} is the bundled suite's (no row of the "
                         f"paper's Table {which}); use --table=0")
      parts.append(bundled_markdown(bundled))
    text = "\n".join(parts)
    if output.value:
      fileio.write_text_atomic(output.value, text)
  except (ValueError, FileNotFoundError) as e:
    print(f"refusion_jax.evaluate_table: error: {e}", file=sys.stderr)
    sys.exit(2)
  sys.stdout.write(text)
  if output.value:
    print(f"wrote {output.value}", file=sys.stderr)


if __name__ == "__main__":
  _flags = define_flags()
  app.run(lambda argv: main(argv, *_flags))
