"""Decode prompts with a trained model.

  python -m refusion_jax.sample --config=configs/sample.py \\
      --config.model_dir=DIR --config.prompt="What is 2+3?"

The model is loaded by `loading`'s rule: a HF checkpoint folder (config.json +
safetensors), a refusion_jax model folder, or the short name of a shipped model:
`--config.model_dir=base_tiny` names the tiny pretrained Qwen3 base shipped inside
the package (refusion_jax/assets/base_tiny, `refusion_jax.packaged.BASE_TINY_DIR`)
unless the working directory has a folder of that name; with `configs/sample.py`
read from the installed package when the working directory has none, this runs
anywhere after `pip install` (the base is a causal ARM pretrained on the bundled
tasks: it answers "4230"):

  python -m refusion_jax.sample --config=configs/sample.py \\
      --config.model_dir=base_tiny --config.decode.method=ar --config.prompt="copy 4230"

Mask and EOS ids come from the model's config. Tokenizer (`loading`'s rule):
`tokenizer_dir`, else `model_dir` when it holds a tokenizer.json, else the bundled
tiny tokenizer when the model has `config.tiny()`'s vocabulary and special ids;
otherwise there is none (prompts must then be token ids and "text" is null).

Prompts go through the continuous-batching engine (`decode.engine`) with
`batch_size` rows (fewer when there are fewer prompts): when a row finishes,
the next prompt is prefilled into it, without recompiling. Every prompt is
padded to one width, its length rounded up to a multiple of `prompt_bucket`,
so that new prompts reuse the compiled programs. Each prompt decodes exactly
as it would alone (at temperature > 0 it draws from `fold_in(seed key, its
index)`). Results go to `output_json` (atomically) as a JSON list, one object
per prompt in input order, with its own counters and `seconds` (from its
admission to the end of the engine call that finished it); progress and
timings go to stderr.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time

import jax
import ml_collections
import tqdm
from ml_collections import config_flags

from refusion_jax import entry_flags, fileio, loading, runtime, trace
from refusion_jax.decode import engine as engine_lib
from refusion_jax.decode.settings import DecodeConfig


def _log(message: str) -> None:
  print(message, file=sys.stderr, flush=True)


def check_flags(c: ml_collections.ConfigDict) -> None:
  """Everything that can be checked before loading anything, besides the model folder
  (`loading.model_dir`)."""
  given = [name for name in ("prompt", "prompt_ids", "prompts_file") if c[name]]
  if len(given) != 1:
    raise ValueError("set exactly one of --config.prompt, --config.prompt_ids, "
                     f"--config.prompts_file (got {given or 'none'})")
  if c.prompts_file and not os.path.isfile(c.prompts_file):
    raise FileNotFoundError(f"--config.prompts_file={c.prompts_file!r} does not exist")
  if c.tokenizer_dir and not os.path.isdir(c.tokenizer_dir):
    raise FileNotFoundError(f"--config.tokenizer_dir={c.tokenizer_dir!r} does not exist")
  for name in ("batch_size", "prompt_bucket"):
    if not isinstance(c[name], int) or c[name] <= 0:
      raise ValueError(f"--config.{name} must be a positive int, got {c[name]!r}")
  runtime.check_compile_cache(c.get("compile_cache_dir", runtime.AUTO))
  for name in ("output_json", "trace_html"):
    path = c[name]
    if path and path != "-" and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
      raise FileNotFoundError(f"--config.{name}={path!r}: its folder does not exist")
  if c.trace_html == "-":
    raise ValueError("--config.trace_html must be a file path, not '-'")


def decode_config_from(c: ml_collections.ConfigDict) -> DecodeConfig:
  try:
    return DecodeConfig(**c.decode.to_dict())
  except (TypeError, ValueError) as e:
    raise ValueError(f"--config.decode: {e}") from None


def _parse_ids(text: str, where: str) -> list[int]:
  try:
    ids = [int(t) for t in text.split(",") if t.strip()]
  except ValueError:
    raise ValueError(f"{where}={text!r}: expected comma-separated token ids like '1,2,3'") from None
  if not ids:
    raise ValueError(f"{where} is empty")
  return ids


def read_prompts(c: ml_collections.ConfigDict, tokenizer) -> list[tuple[str, list[int]]]:
  """`[(label, prompt ids)]` from prompt, prompt_ids or prompts_file."""
  def encode(query, where):
    if tokenizer is None:
      raise ValueError(f"{where}: a text query needs a tokenizer; set --config.tokenizer_dir "
                       "or give prompt_ids")
    if not isinstance(query, str) or not query:
      raise ValueError(f"{where}: 'query' must be a non-empty string, got {query!r}")
    found = fileio.not_unicode(query)
    if found:
      raise ValueError(f"{where}: the query is not valid Unicode: a lone surrogate at "
                       f"character {found[1]}")
    return tokenizer.encode_prompt(query)

  if c.prompt:
    return [(c.prompt, encode(c.prompt, "--config.prompt"))]
  if c.prompt_ids:
    ids = _parse_ids(c.prompt_ids, "--config.prompt_ids")
    return [(c.prompt_ids, ids)]
  prompts = []
  for where, row in fileio.jsonl_rows(c.prompts_file):
    if not isinstance(row, dict) or ("query" in row) == ("prompt_ids" in row):
      raise ValueError(f"{where}: expected an object with exactly one of 'query' or "
                       "'prompt_ids'")
    if "query" in row:
      prompts.append((row["query"], encode(row["query"], where)))
    else:
      ids = row["prompt_ids"]
      if (not isinstance(ids, list) or not ids
          or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids)):
        raise ValueError(f"{where}: 'prompt_ids' must be a non-empty list of ints")
      prompts.append((",".join(map(str, ids)), ids))
  if not prompts:
    raise ValueError(f"{c.prompts_file}: no prompts")
  return prompts


def bucket_length(longest: int, multiple: int, limit: int) -> int:
  """Prompt width: `longest` rounded up to `multiple`, but at most `limit` (>= longest)."""
  return max(longest, min(math.ceil(longest / multiple) * multiple, limit))


def batch_rows(n: int, batch_size: int) -> int:
  """Rows of a batch holding n prompts: the next power of two, at most batch_size."""
  return min(batch_size, 1 << (n - 1).bit_length())


def run(c: ml_collections.ConfigDict) -> list[dict]:
  """Loads, decodes and writes the results; returns them."""
  c.model_dir = loading.model_dir(c.model_dir)  # a shipped model's short name: its folder
  check_flags(c)
  decode_config = decode_config_from(c)
  # Everything that can be wrong with the inputs is checked from the model's config
  # alone, before the weights load.
  model_config = loading.read_model_config(c.model_dir)
  tokenizer = loading.load_tokenizer(c.model_dir, model_config, c.tokenizer_dir, required=False)
  prompts = read_prompts(c, tokenizer)
  for i, (_, ids) in enumerate(prompts):
    bad = [t for t in ids if not 0 <= t < model_config.vocab_size]
    if bad:
      raise ValueError(f"prompt {i}: token id {bad[0]} is outside the vocabulary "
                       f"[0, {model_config.vocab_size})")
  longest = max(len(ids) for _, ids in prompts)
  decode_config.check_fits(model_config, longest)
  width = bucket_length(longest, c.prompt_bucket,
                        model_config.max_position_embeddings - decode_config.gen_length)
  rows = batch_rows(len(prompts), c.batch_size)

  runtime.use_compile_cache(c.get("compile_cache_dir", runtime.AUTO))  # before any compile
  t0 = time.perf_counter()
  model_config, model = loading.load_model(c.model_dir, scan_layers=c.get("scan_layers"),
                                           adapter_dir=c.get("adapter_dir", ""))
  _log(f"[sample] loaded {c.model_dir} ({model_config.num_layers} layers, d="
       f"{model_config.hidden_size}, vocab {model_config.vocab_size}) in "
       f"{time.perf_counter() - t0:.1f}s")
  decoder = engine_lib.decoder_for(model, decode_config)  # compiled, or a host-side search
  eng = decoder.engine(rows, width=width)
  rng = jax.random.key(c.seed)
  if c.warmup:
    t = time.perf_counter()
    eng.warm_up()
    _log(f"[sample] warm-up (compile) {time.perf_counter() - t:.1f}s")
  bar = None
  if len(prompts) > 1:
    bar = tqdm.tqdm(total=len(prompts), desc="sample", unit="prompt", leave=False,
                    file=sys.stderr)
  run_ = eng.run([ids for _, ids in prompts], rng, progress=bar)
  if bar is not None:
    bar.close()
  _log(summary_line(run_, len(prompts), rows, c.warmup))
  results, records = [], []
  for (label, _), res in zip(prompts, run_.results):
    tokens = res.tokens
    n = len(tokens)
    nfe = int(res.counters["nfe_b"])
    text = None if tokenizer is None else tokenizer.decode(tokens, skip_special_tokens=True)
    results.append({"prompt": label, "tokens": tokens, "text": text, "nfe": nfe,
                    "tokens_per_forward": n / nfe if nfe else 0.0,
                    "tpf_paper": res.counters["tpf_paper_b"], "seconds": res.seconds})
    if decode_config.verify != "off" or decode_config.remask:
      # What the options past the paper did, and the passes they cost.
      results[-1].update({k: int(res.counters[f"{k}_b"]) for k in (
          "corrected", "refresh", "recheck", "remasked", "remasked_tokens")})
    steps = res.commit_steps
    if c.trace or c.trace_html:
      pieces = trace.token_pieces(tokens, None if tokenizer is None else tokenizer.decode)
      records.append({"prompt": label, "pieces": pieces, "steps": steps,
                      "meta": f"{decode_config.method}: {n} tokens, {nfe} forward passes"})
      if c.trace:
        _log(f"[trace] prompt {len(results) - 1}: {label!r}\n" + trace.ansi(pieces, steps))

  if c.trace_html:
    fileio.write_text_atomic(c.trace_html, trace.html(records, f"Decoding order ({decode_config.method})"))
    _log(f"[sample] wrote {c.trace_html}")
  text = json.dumps(results, indent=2, ensure_ascii=False) + "\n"
  if c.output_json == "-":
    sys.stdout.write(text)
    sys.stdout.flush()
  elif c.output_json:
    fileio.write_text_atomic(c.output_json, text)
    _log(f"[sample] wrote {c.output_json}")
  return results


def _plural(n: int, word: str, words: str = "") -> str:
  return f"{n} {word}" if n == 1 else f"{n} {words or word + 's'}"


def summary_line(run_, prompts: int, rows: int, warmed_up: bool) -> str:
  """What a sample run did, under the names its JSON uses: `nfe` is each prompt's forward
  passes (its prefill included), summed over the prompts; the engine's batched passes,
  each advancing every busy row, follow when there are several prompts."""
  tokens = sum(len(r.tokens) for r in run_.results)
  nfe = sum(int(r.counters["nfe_b"]) for r in run_.results)
  line = (f"[sample] {_plural(prompts, 'prompt')} through {_plural(rows, 'row')}: "
          f"{_plural(tokens, 'token')}, nfe {nfe}")
  if prompts > 1:
    line += (f" ({_plural(run_.passes, 'batched pass', 'batched passes')}, "
             f"{_plural(run_.admissions, 'admission')})")
  line += f" in {run_.seconds:.2f}s"
  if not warmed_up:  # compiled, or loaded from the compilation cache, inside the run
    line += " (programs compiled or loaded included; --config.warmup=true excludes them)"
  return line


def define_flags():
  """--config; defined only when run as a program, so this module can be imported
  beside the other entry points (train, reproduce) without clashing flags."""
  return config_flags.DEFINE_config_file(
      "config", None, "Sampling config file (configs/sample.py).", lock_config=True)


def main(argv, config_flag):
  run(entry_flags.config_value(argv, config_flag, "configs/sample.py"))


if __name__ == "__main__":
  _config_flag = define_flags()
  entry_flags.run_program(lambda argv: main(argv, _config_flag), "refusion_jax.sample",
                          user_errors=(ValueError, OSError, TypeError))
