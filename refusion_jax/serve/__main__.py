"""`python -m refusion_jax.serve --config=configs/serve.py --config.model_dir=DIR`.

Serves until SIGTERM or Ctrl-C: then it stops accepting connections, answers
a request still sending its body a 503 at once, lets requests in the engine
finish for up to `drain_timeout_s`, cancels the rest and exits 0.
"""

from __future__ import annotations

import asyncio
import signal
import sys

import uvicorn
from ml_collections import config_flags

from refusion_jax import entry_flags, serve

# uvloop where installed (as uvicorn's own "auto" loop picks): fewer microseconds per
# event, so responses reach clients sooner while the decoder keeps the cores busy.
try:
  import uvloop
except ImportError:  # optional: asyncio's own loop then
  uvloop = None


def main(argv, config_flag):
  c = entry_flags.config_value(argv, config_flag, "configs/serve.py")
  asgi, app_server = serve.build(c)
  config = uvicorn.Config(asgi, host=c.host, port=c.port, log_level=c.log_level,
                          timeout_graceful_shutdown=c.drain_timeout_s, access_log=False)
  server = uvicorn.Server(config)
  # uvicorn re-raises the signal that stopped it once it has shut down; a handler
  # that does nothing turns that into a normal return (exit status 0).
  for sig in (signal.SIGTERM, signal.SIGINT):
    signal.signal(sig, lambda *_: None)

  async def started():
    while not server.started:
      await asyncio.sleep(0.05)
    for s in server.servers:
      for sock in s.sockets:
        host, port = sock.getsockname()[:2]
        print(f"[serve] listening on http://{host}:{port}", file=sys.stderr, flush=True)

  async def closing():
    # uvicorn's signal handler sets should_exit; bodies still coming in are then
    # answered at once (they would otherwise hold the drain open until its timeout).
    while not server.should_exit:
      await asyncio.sleep(0.05)
    app_server.close_reads()

  async def run():
    tasks = [asyncio.ensure_future(started()), asyncio.ensure_future(closing())]
    await server.serve()
    for task in tasks:
      task.cancel()

  loop_factory = None if uvloop is None else uvloop.new_event_loop
  with asyncio.Runner(loop_factory=loop_factory) as runner:
    runner.run(run())


if __name__ == "__main__":
  _config_flag = config_flags.DEFINE_config_file(
      "config", None, "Serving config file (configs/serve.py).", lock_config=True)
  entry_flags.run_program(lambda argv: main(argv, _config_flag), "refusion_jax.serve",
                          user_errors=(ValueError, FileNotFoundError, TypeError))
