"""An OpenAI-compatible HTTP server on the continuous-batching engine.

  python -m refusion_jax.serve --config=configs/serve.py --config.model_dir=DIR

(`--config.model_dir=base_tiny`: the tiny base shipped in the package.)

`scheduler` runs the engine on its own thread (requests join rows as rows free
up; shapes come from buckets compiled at start-up), `engine_process` runs that
thread in a process of its own (the default: HTTP work and the engine loop
then never wait on one interpreter lock), `app` is the Starlette app
(endpoints, streaming of the committed prefix, errors in OpenAI's shape,
Prometheus metrics), `text` makes text deltas that are never revised, and
`protocol` checks the OpenAI request fields. `build` loads a model and returns
the app ready to run under uvicorn.
"""

from __future__ import annotations

import os
import sys
import time

import jax
import ml_collections

from refusion_jax import loading, runtime
from refusion_jax.decode.settings import DecodeConfig
from refusion_jax.serve import app as app_lib
from refusion_jax.serve import engine_process
from refusion_jax.serve import scheduler as sched_lib


def _log(message: str) -> None:
  print(message, file=sys.stderr, flush=True)


def check_flags(c: ml_collections.ConfigDict) -> None:
  """Everything that can be checked before loading anything."""
  loading.model_dir(c.model_dir)
  if c.tokenizer_dir and not os.path.isdir(c.tokenizer_dir):
    raise FileNotFoundError(f"--config.tokenizer_dir={c.tokenizer_dir!r} does not exist")
  for name in ("rows", "max_prompt_len", "max_queue", "max_lanes", "chunk_passes",
               "max_request_bytes"):
    if not isinstance(c[name], int) or isinstance(c[name], bool) or c[name] <= 0:
      raise ValueError(f"--config.{name} must be a positive int, got {c[name]!r}")
  if not isinstance(c.port, int) or not 0 <= c.port < 65536:
    raise ValueError(f"--config.port must be in [0, 65536), got {c.port!r}")
  parse_row_counts(c.row_counts, c.rows, "cpu")
  parse_admit_widths(c.admit_widths, c.max_prompt_len)
  runtime.check_compile_cache(c.compile_cache_dir)
  if c.engine not in ("process", "thread"):
    raise ValueError(f"--config.engine must be \"process\" or \"thread\", got {c.engine!r}")
  for name in ("request_timeout_s", "drain_timeout_s"):
    if not isinstance(c[name], (int, float)) or c[name] <= 0:
      raise ValueError(f"--config.{name} must be a positive number, got {c[name]!r}")


def _auto_or_ints(text, field: str, noun: str, plural: str, example: str, limit_field: str,
                  limit: int, auto) -> tuple[int, ...]:
  """A `--config.FIELD` list: "auto" (`auto()`), "" (none) or ints from 1 to limit - 1
  such as `example`, sorted and without repeats; anything else is named in the error."""
  if not isinstance(text, str):
    raise ValueError(f"--config.{field} must be a string (\"auto\", \"\" or {plural} such "
                     f"as \"{example}\"), got {text!r}")
  text = text.strip()
  if text == "auto":
    return auto()
  values = []
  for part in filter(None, (p.strip() for p in text.split(","))):
    try:
      n = int(part)
    except ValueError:
      n = None
    if n is None or not 1 <= n < limit:
      raise ValueError(f"--config.{field}: {part!r} is not a {noun} from 1 to {limit - 1} "
                       f"(--config.{limit_field}={limit}); give \"auto\", \"\" or {plural} "
                       f"such as \"{example}\"")
    values.append(n)
  return tuple(sorted(set(values)))


def parse_row_counts(text, rows: int, platform: str) -> tuple[int, ...]:
  """`--config.row_counts`: "auto" (on a CPU every multiple of rows/4 below rows and
  every power of two below rows/4, so that a lightly loaded server runs passes over
  a row or two; elsewhere none: an accelerator's pass costs about the same over
  fewer rows), "" (none), or counts such as "4,8,12" (each from 1 to rows - 1)."""
  def auto():
    if platform != "cpu":
      return ()
    step = max(1, rows // 4)
    small = {1 << k for k in range(step.bit_length()) if 1 << k < step}
    return tuple(sorted(small | set(range(step, rows, step))))
  return _auto_or_ints(text, "row_counts", "row count", "counts", "4,8,12", "rows", rows, auto)


def parse_admit_widths(text, width: int) -> tuple[int, ...]:
  """`--config.admit_widths`: prefill widths compiled besides `--config.max_prompt_len`
  (an admission prefills at the narrowest that holds its prompts; each width adds
  an admission program per admission size, compiled at start-up): "auto" (the four
  largest powers of two from 16 below it), "" (none), or widths such as "32,64"."""
  def auto():
    return tuple(1 << k for k in range(4, max(4, width.bit_length())) if 1 << k < width)[-4:]
  return _auto_or_ints(text, "admit_widths", "prompt width", "widths", "32,64",
                       "max_prompt_len", width, auto)


def make_scheduler(c: ml_collections.ConfigDict, *, metrics=None):
  """The model loaded and its `Scheduler`, every bucket compiled (the engine thread
  not started). Runs in the engine process under `--config.engine=process`."""
  check_flags(c)
  # The rule of every entry point, before loading (that may compile already).
  cache = runtime.use_compile_cache(c.compile_cache_dir)
  configs = decode_configs(c)
  t = time.perf_counter()
  model_config, model = loading.load_model(c.model_dir, scan_layers=c.get("scan_layers"),
                                           adapter_dir=c.get("adapter_dir", ""))
  for dc in configs:
    dc.check_fits(model_config, c.max_prompt_len)
  scheduler = sched_lib.Scheduler(model, configs, rows=c.rows, width=c.max_prompt_len,
                                  max_queue=c.max_queue, max_lanes=c.max_lanes,
                                  chunk_passes=c.chunk_passes, metrics=metrics,
                                  row_counts=parse_row_counts(c.row_counts, c.rows,
                                                              jax.default_backend()),
                                  admit_widths=parse_admit_widths(c.admit_widths,
                                                                  c.max_prompt_len))
  _log(f"[serve] loaded {c.model_dir} in {time.perf_counter() - t:.1f}s")
  _log(f"[serve] compiling {len(configs)} bucket(s) before listening ("
       + (f"kept in {cache}: a restart loads them" if cache else
          "no compilation cache: --config.compile_cache_dir keeps them for a restart")
       + ") ...")
  t = time.perf_counter()
  scheduler.warm_up(on_bucket=lambda i, bucket, seconds: _log(
      f"[serve] bucket {i + 1}/{len(configs)} {bucket.name} ready in {seconds:.1f}s"))
  _log(f"[serve] compiled {len(configs)} bucket(s) ("
       + ", ".join(b.name for b in scheduler.buckets)
       + f"), {c.rows} rows"
       + (f" (passes also over {', '.join(map(str, scheduler.row_counts))})"
          if scheduler.row_counts else "")
       + f", prompts up to {c.max_prompt_len} tokens"
       + (f" (prefilled also at {', '.join(map(str, scheduler.admit_widths))})"
          if scheduler.admit_widths else "")
       + ", in "
       f"{time.perf_counter() - t:.1f}s")
  return scheduler


def decode_configs(c: ml_collections.ConfigDict) -> list[DecodeConfig]:
  """The default decode config and one per `--config.buckets` entry."""
  try:
    default = DecodeConfig(**c.decode.to_dict())
  except (TypeError, ValueError) as e:
    raise ValueError(f"--config.decode: {e}") from None
  configs = sched_lib.parse_buckets(c.buckets, default)
  for dc in configs:
    dc.require_compiled("serve")
  return configs


def build(c: ml_collections.ConfigDict):
  """`(app, server)`: the model loaded, every bucket compiled, the engine not yet
  started (the app's lifespan starts it). With `--config.engine=process` the model
  lives in the engine process, started here; this process loads only the tokenizer
  (checked against the model's config first)."""
  c.model_dir = loading.resolve(c.model_dir)  # a shipped model's short name: its folder
  check_flags(c)
  decode_configs(c)  # flag errors before anything starts
  # A tokenizer that does not fit the model is reported before anything compiles
  # (the model's config is read without its weights).
  tokenizer = loading.load_tokenizer(c.model_dir, loading.read_model_config(c.model_dir),
                                     c.tokenizer_dir, required=False)
  metrics = app_lib.Metrics()
  if c.engine == "process":
    scheduler = engine_process.EngineProcess(c, make_scheduler=make_scheduler, metrics=metrics)
  else:
    scheduler = make_scheduler(c, metrics=metrics)
  if tokenizer is not None and tokenizer.chat_template:
    # OpenAI's completions send the prompt as it is; a chat-trained model wants its turns.
    _log("[serve] a chat model (its tokenizer has a chat template): ask /v1/chat/completions; "
         "/v1/completions sends prompts as they are, without the template")
  name = c.model_name or os.path.basename(os.path.normpath(c.model_dir))
  server = app_lib.Server(scheduler, tokenizer, name, request_timeout_s=c.request_timeout_s,
                          metrics=metrics, max_request_bytes=c.max_request_bytes)
  return app_lib.make_app(server), server
