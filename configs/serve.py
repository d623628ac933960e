"""Serving a model over HTTP: `python -m refusion_jax.serve --config=configs/serve.py
--config.model_dir=DIR`.

An OpenAI-compatible server (/v1/completions, /v1/chat/completions,
/v1/models, /health, /metrics). `decode` is the default decode shape and
settings, as in configs/sample.py; `buckets` adds more compiled shapes that a
request can pick (by max_tokens, method, gen_length, slot_size, block_size).
Every shape is compiled at start-up; nothing compiles per request.
"""

import ml_collections

from configs import sample


def get_config():
  c = ml_collections.ConfigDict()
  c.model_dir = ""  # HF folder (config.json + safetensors) or a refusion_jax model folder
  c.adapter_dir = ""  # a PEFT LoRA folder (a D2F adapter) merged into model_dir's weights
  c.scan_layers = ml_collections.config_dict.placeholder(bool)  # layer layout: None = as saved
  c.tokenizer_dir = ""  # "" = model_dir if it has tokenizer.json, else the bundled tiny one when it fits
  c.model_name = ""  # the id clients name in "model" ("" = the model folder's name)
  c.host = "127.0.0.1"  # address to listen on
  c.port = 8000  # TCP port (0 = any free port, printed at start-up)
  c.engine = "process"  # the engine loop in its own process ("thread": in the server's)
  # Compiled programs kept here and loaded by the next start of the same shapes: "auto"
  # ($JAX_COMPILATION_CACHE_DIR, else ~/.cache/refusion_jax/jax), a folder, or "" (none)
  c.compile_cache_dir = "auto"
  c.rows = 16  # engine rows per lane: requests decoded at once
  c.max_prompt_len = 256  # prompt width of every compiled program (longer prompts get a 400)
  c.buckets = ""  # more compiled shapes, "method:gen_length:slot_size:block_size,..." (ar: "ar:G")
  c.max_request_bytes = 1 << 20  # a longer request body gets a 413 (read no further); a body
  #   is parsed on the event loop, about 0.2 s a MiB at worst (a list of many messages)
  c.max_queue = 256  # requests waiting for a row at most (more get 429 with Retry-After)
  c.max_lanes = 4  # row sets alive at once (one per shape and knob values in use)
  c.chunk_passes = 4  # passes between returns to the host while streaming / lanes take turns
  #   (and between a stream's progress reports; while a row is free it returns every pass)
  c.row_counts = "auto"  # also passes over fewer rows when fewer are busy: "auto", "" or "4,8,12"
  c.admit_widths = "auto"  # narrower prefills for short prompts: "auto", "" or widths "32,64"
  c.request_timeout_s = 600.0  # a request still running (or its body still coming) after this
  #   is cancelled (408)
  c.drain_timeout_s = 30.0  # on SIGTERM: in-flight requests get this long, then are cancelled
  c.log_level = "warning"  # uvicorn's log level
  c.decode = sample.get_config().decode  # default decode shape and settings (configs/sample.py)
  return c
