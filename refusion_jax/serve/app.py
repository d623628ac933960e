"""The HTTP side: a Starlette app over a `Scheduler` (OpenAI's API shapes).

Handlers run on the event loop: they parse and tokenize the request, submit a
`Job`, and turn the engine's events into the response. With the engine in its
own process the loop reads its pipe and makes every delivery itself; an engine
thread hands them over with `call_soon_threadsafe`. A stream is written straight
to ASGI's `send`, the events that are ready together in one write, and sends
only the committed left-to-right prefix (`TextStream`), so nothing sent is ever
revised.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import os
import time
import uuid
from typing import Any

import numpy as np
import prometheus_client
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from refusion_jax.serve import protocol
from refusion_jax.serve.protocol import ApiError
from refusion_jax.serve.scheduler import (
  Bucket,
  Done,
  EngineDown,
  Job,
  QueueFull,
  Scheduler,
  bucket_of,
)
from refusion_jax.serve.text import TextStream

# A prompt text longer than this is encoded on a worker thread, off the event loop
# (shorter ones take at most about 2 ms where they are).
ENCODE_ON_LOOP_CHARS = 2048


class Metrics:
  """Prometheus metrics of one server (its own registry)."""

  def __init__(self):
    prometheus_client.disable_created_metrics()  # no *_created series beside each counter
    self.registry = r = prometheus_client.CollectorRegistry()
    self.requests = prometheus_client.Counter(
        "refusion_requests", "Requests answered, by endpoint and outcome.",
        ["endpoint", "outcome"], registry=r)
    self.prompt_tokens = prometheus_client.Counter(
        "refusion_prompt_tokens", "Prompt tokens of admitted requests.", registry=r)
    self.completion_tokens = prometheus_client.Counter(
        "refusion_completion_tokens", "Tokens generated and returned.", registry=r)
    self.forward_passes = prometheus_client.Counter(
        "refusion_engine_passes", "Forward passes run by the engine (all rows at once).",
        registry=r)
    self.cancelled_rows = prometheus_client.Counter(
        "refusion_cancelled_rows", "Rows freed mid-decode (disconnect, stop string, timeout).",
        registry=r)
    self.queue_depth = prometheus_client.Gauge(
        "refusion_queue_depth", "Requests waiting for a row.", registry=r)
    self.busy_rows = prometheus_client.Gauge(
        "refusion_busy_rows", "Rows decoding a request.", registry=r)
    buckets = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
    self.latency = prometheus_client.Histogram(
        "refusion_request_latency_seconds", "Request latency, arrival to last byte.",
        ["endpoint"], buckets=buckets, registry=r)
    self.ttft = prometheus_client.Histogram(
        "refusion_time_to_first_token_seconds", "Streams: arrival to the first text sent.",
        ["endpoint"], buckets=buckets, registry=r)


def _error(e: ApiError) -> JSONResponse:
  return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


class Server:
  """Endpoints over one model (see the module docstring)."""

  def __init__(self, scheduler: Scheduler, tokenizer, model_name: str, *,
               request_timeout_s: float, metrics: Metrics,
               max_request_bytes: int = 1 << 20):
    self.scheduler = scheduler
    self.max_request_bytes = max_request_bytes
    self.tokenizer = tokenizer
    self.model_name = model_name
    self.timeout = request_timeout_s
    self.metrics = metrics
    self.vocab_size = scheduler.model_config.vocab_size
    config = scheduler.model_config
    # The ids an answer ends at (EOS and the model's other stop ids: finish_reason "stop").
    self.stop_ids = frozenset(([] if config.eos_token_id is None else [config.eos_token_id])
                              + list(getattr(config, "stop_token_ids", ())))
    # No text longer than this fits the prompt width: refused without encoding it.
    self.text_limit = None if tokenizer is None else tokenizer.longest_text(scheduler.width)
    # A stream's update decodes a window of its tokens, not the whole prefix (TextStream).
    self.decode_incrementally = tokenizer is not None and tokenizer.decodes_incrementally
    self.unsettled_ids = frozenset() if tokenizer is None else tokenizer.unsettled_ids
    self.created = int(time.time())
    # Requests whose body is still coming in (their tasks), and whether the server
    # is shutting down (`close_reads`): those are answered at once, not drained.
    self._reading: set[asyncio.Task] = set()
    self.closing = False

  def close_reads(self) -> None:
    """The server is shutting down: requests still sending their body get a 503 now
    (nothing of theirs has reached the engine) instead of holding the drain open."""
    self.closing = True
    for task in list(self._reading):
      task.cancel()

  # --- helpers --------------------------------------------------------------------------

  def _decode(self, tokens) -> str:
    if self.tokenizer is None:
      return ""
    return self.tokenizer.decode(tokens, skip_special_tokens=True)

  async def _encode(self, req: protocol.Request) -> list[int]:
    if isinstance(req.prompt, list) and not req.chat:
      # Too many ids: refused for their number (by the caller) before each is looked at.
      bad = ([t for t in req.prompt if not 0 <= t < self.vocab_size]
             if len(req.prompt) <= self.scheduler.width else [])
      if bad:
        raise protocol.bad("prompt", f"token id {bad[0]} is outside the vocabulary "
                           f"[0, {self.vocab_size})")
      return list(req.prompt)
    if self.tokenizer is None:
      raise protocol.bad("prompt" if not req.chat else "messages",
                         "this model has no tokenizer: give the prompt as token ids")
    if not req.chat:
      text = req.prompt
    else:
      try:
        text = self.tokenizer.apply_chat_template(req.prompt, add_generation_prompt=True,
                                                  enable_thinking=req.enable_thinking)
      except ValueError as e:
        raise protocol.bad("messages", str(e)) from None
    if self.text_limit is not None and len(text) > self.text_limit:
      raise protocol.bad("messages" if req.chat else "prompt",
                         f"the prompt has {len(text)} characters, more than "
                         f"{self.scheduler.width} tokens can hold (--config.max_prompt_len)")
    if len(text) <= ENCODE_ON_LOOP_CHARS:
      return self.tokenizer.encode(text)
    # A long text is encoded on a worker thread, by the encoder that lets go of the GIL,
    # so that every stream and /health go on meanwhile (about 1 s a MB).
    return await asyncio.to_thread(self.tokenizer.encode, text, release_gil=True)

  def _bucket(self, req: protocol.Request) -> Bucket:
    default = bucket_of(self.scheduler.default_config)
    method = req.method or default.method
    found = [b for b in self.scheduler.buckets if b.method == method
             and (req.gen_length is None or b.gen_length == req.gen_length)
             and (b.method in ("ar", "bd3lm") or req.slot_size is None
                  or b.slot_size == req.slot_size)
             and (b.method == "ar" or req.block_size is None or b.block_size == req.block_size)
             and (req.max_tokens is None or b.gen_length >= req.max_tokens)]
    if not found:
      asked = {k: v for k, v in (("method", method), ("gen_length", req.gen_length),
                                 ("slot_size", req.slot_size), ("block_size", req.block_size),
                                 ("max_tokens", req.max_tokens)) if v is not None}
      names = ", ".join(b.name for b in self.scheduler.buckets)
      raise ApiError(400, f"no compiled decode shape fits {asked}; this server has "
                     f"(method:gen_length[:slot_size:block_size]): {names}", param="max_tokens"
                     if req.max_tokens else "method", code="unsupported_shape")
    return default if default in found else min(found, key=lambda b: b.gen_length)

  def _job(self, req: protocol.Request, ids: list[int], bucket: Bucket, deliver) -> Job:
    s, t, temp, ignore_eos = self.scheduler.default_knobs(bucket)
    temp = temp if req.temperature is None else req.temperature
    ignore_eos = ignore_eos if req.ignore_eos is None else req.ignore_eos
    if s is not None:  # the bucket's method has ReFusion's thresholds
      s = s if req.slot_threshold is None else float(req.slot_threshold)
      t = t if req.token_threshold is None else float(req.token_threshold)
    if req.seed is not None:
      seed = req.seed
    elif temp > 0:
      seed = int.from_bytes(os.urandom(4), "little")
    else:
      seed = 0
    # jax.random.key(seed)'s raw key for seed < 2**32 (threefry): [0, seed].
    rng2 = np.array([0, seed], np.uint32)
    max_tokens = bucket.gen_length if req.max_tokens is None else req.max_tokens
    return Job(prompt=ids, bucket=bucket, knobs=(s, t, float(temp), ignore_eos),
               rng2=rng2, max_tokens=max_tokens,
               watch=req.stream or bool(req.stops) or max_tokens < bucket.gen_length,
               slots=req.stream and req.stream_slots, deliver=deliver)

  async def _body(self, request: Request) -> bytes:
    """The request's body, refused (413) once it is longer than `max_request_bytes`:
    by its Content-Length before any of it is read, else while it streams in."""
    limit = self.max_request_bytes
    def too_large(size: str) -> ApiError:
      return ApiError(413, f"the request body is {size} bytes; this server takes at most "
                      f"{limit} (--config.max_request_bytes)", code="request_too_large")
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
      raise too_large(length)
    parts, size = [], 0
    task = asyncio.current_task()
    if self.closing:
      raise _shutting_down()
    self._reading.add(task)
    try:
      async for part in request.stream():
        size += len(part)
        if size > limit:
          raise too_large(f"more than {limit}")
        parts.append(part)
    except asyncio.CancelledError:
      if not self.closing:
        raise
      task.uncancel()  # cancelled by `close_reads`: answered, not torn down
      raise _shutting_down() from None
    finally:
      self._reading.discard(task)
    return b"".join(parts)

  # --- endpoints ------------------------------------------------------------------------

  async def health(self, request: Request) -> Response:
    del request
    if self.scheduler.error:
      return JSONResponse({"status": "error", "error": self.scheduler.error}, status_code=503)
    return JSONResponse({"status": "ok", "busy_rows": self.scheduler.busy_rows(),
                         "queue_depth": self.scheduler.queue_depth()})

  async def models(self, request: Request) -> Response:
    del request
    return JSONResponse({"object": "list", "data": [{
        "id": self.model_name, "object": "model", "created": self.created,
        "owned_by": "refusion_jax",
        "buckets": [b.describe() for b in self.scheduler.buckets]}]})

  async def metrics_text(self, request: Request) -> Response:
    del request
    return Response(prometheus_client.generate_latest(self.metrics.registry),
                    media_type=prometheus_client.CONTENT_TYPE_LATEST)

  async def completions(self, request: Request) -> Response:
    return await self._serve(request, chat=False)

  async def chat_completions(self, request: Request) -> Response:
    return await self._serve(request, chat=True)

  async def _serve(self, request: Request, chat: bool) -> Response:
    endpoint = "chat" if chat else "completions"
    start = time.perf_counter()
    try:
      try:
        async with asyncio.timeout(self.timeout):  # a body that never comes holds nothing
          raw = await self._body(request)
      except TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {self.timeout} s "
                       "(--config.request_timeout_s)", type_="timeout",
                       code="request_timeout") from None
      req = protocol.parse(protocol.loads(raw), chat)
      if req.model != self.model_name:
        raise ApiError(404, f"model: {req.model!r} does not exist; this server serves "
                       f"{self.model_name!r}", param="model", code="model_not_found")
      ids = await self._encode(req)
      if len(ids) > self.scheduler.width:
        raise protocol.bad("prompt" if not chat else "messages",
                           f"the prompt has {len(ids)} tokens; this server takes at most "
                           f"{self.scheduler.width} (--config.max_prompt_len)")
      if not ids:
        raise protocol.bad("prompt" if not chat else "messages", "the prompt has no tokens")
      bucket = self._bucket(req)
      reply = _Reply(self, req, ids, endpoint, start)
      reply.job = job = self._job(req, ids, bucket, reply.deliver)
      try:
        self.scheduler.submit(job)
      except QueueFull as e:
        reply.timer.cancel()
        raise ApiError(429, str(e), type_="rate_limit_error", code="queue_full",
                       headers={"Retry-After": "1"}) from None
      except EngineDown as e:
        reply.timer.cancel()
        raise ApiError(503, str(e), type_="server_error", code="engine_down") from None
    except ApiError as e:
      self.metrics.requests.labels(endpoint, str(e.status)).inc()
      return _error(e)
    self.metrics.prompt_tokens.inc(len(ids))
    if req.stream:
      return _Stream(reply)
    return await reply.whole(request)


class _Mailbox:
  """One request's engine events, on the event loop's thread: `put` never blocks, `get`
  waits for the next (a future per wait, no task)."""

  def __init__(self, loop: asyncio.AbstractEventLoop):
    self.loop = loop
    self.items: collections.deque = collections.deque()
    self.waiter: asyncio.Future | None = None

  def put(self, item) -> None:
    self.items.append(item)
    if self.waiter is not None and not self.waiter.done():
      self.waiter.set_result(None)

  def ready(self) -> bool:
    return bool(self.items)

  async def get(self):
    while not self.items:
      self.waiter = self.loop.create_future()
      try:
        await self.waiter
      finally:
        self.waiter = None
    return self.items.popleft()


class _Reply:
  """One request's answer, from the engine's events (its `_Mailbox`)."""

  def __init__(self, server: Server, req, ids, endpoint, start):
    self.s, self.req, self.ids = server, req, ids
    self.endpoint, self.start = endpoint, start
    self.loop = asyncio.get_running_loop()
    self.mail = _Mailbox(self.loop)
    self.job: Job | None = None
    self.committed: list[int] = []  # the committed prefix, from the progress reports
    self.text = TextStream(server._decode, req.stops,  # pylint: disable=protected-access
                           incremental=server.decode_incrementally,
                           unsettled=server.unsettled_ids)
    self.id = ("chatcmpl-" if req.chat else "cmpl-") + uuid.uuid4().hex
    self.created = int(time.time())
    self.forward_passes = 0
    self.finished = False
    # Deliveries come on this loop's thread (the engine process read by the loop), or
    # from an engine thread.
    self.in_loop = server.scheduler.delivers_in_loop
    # Past the deadline the request gets a "timeout" event (one timer, not one per wait).
    self.timer = self.loop.call_at(self.loop.time() + max(self._deadline_left(), 0.0),
                                   self.mail.put, ("timeout", None))

  def deliver(self, kind: str, payload) -> None:
    """The engine's delivery: on this loop's thread when the scheduler makes its
    deliveries there, else handed over to it."""
    if self.in_loop:
      self.mail.put((kind, payload))
    else:
      self.loop.call_soon_threadsafe(self.mail.put, (kind, payload))

  def _deadline_left(self) -> float:
    return self.s.timeout - (time.perf_counter() - self.start)

  def _finish_reason(self, tokens: list[int]) -> str:
    ignore_eos = self.job.knobs[3]
    if self.text.stopped or (tokens and tokens[-1] in self.s.stop_ids and not ignore_eos):
      return "stop"
    return "length"

  def _usage(self, tokens) -> dict:
    return {"prompt_tokens": len(self.ids), "completion_tokens": len(tokens),
            "total_tokens": len(self.ids) + len(tokens), "nfe": self.forward_passes}

  async def _next(self):
    """The next engine event, as (kind, payload). Progress reports already waiting
    behind it are merged into one (their new tokens joined, the last pass count)."""
    kind, payload = await self.mail.get()
    items = self.mail.items
    while kind == "progress" and items and items[0][0] == "progress":
      more, passes = items.popleft()[1]
      payload = (payload[0] + more, passes)
    return kind, payload

  def _close(self, outcome: str, tokens=None) -> None:
    self.finished = True
    self.timer.cancel()
    m = self.s.metrics
    m.requests.labels(self.endpoint, outcome).inc()
    if outcome == "ok":
      m.completion_tokens.inc(len(tokens))
      m.latency.labels(self.endpoint).observe(time.perf_counter() - self.start)

  def _cancel(self) -> None:
    """The request ends unfinished (its client left, or the server is stopping)."""
    if not self.finished:
      self.s.scheduler.cancel(self.job)
      self._close("cancelled")

  async def _watch_disconnect(self, receive) -> None:
    """Puts a "disconnect" event once the client has gone."""
    while (await receive())["type"] != "http.disconnect":
      pass
    self.mail.put(("disconnect", None))

  async def _events(self):
    """Engine events until the text is final, each as the list of what it gives:
    ("text", delta) and ("slots", runs), and at the end ("done", tokens),
    ("error", ApiError) or ("disconnect", None)."""
    while True:
      kind, payload = await self._next()
      out: list = []
      if kind == "progress":
        more, self.forward_passes = payload
        self.committed.extend(more)
        delta = self.text.update(self.committed)
        if delta:
          out.append(("text", delta))
        if self.text.stopped:
          self.s.scheduler.cancel(self.job)
          out.append(("done", self.text.tokens))
      elif kind == "slots":
        out.append(("slots", payload))
      elif kind == "done":
        done: Done = payload
        self.forward_passes = done.forward_passes
        delta = self.text.update(done.tokens, final=True)
        if delta:
          out.append(("text", delta))
        out.append(("done", self.text.tokens))
      elif kind == "timeout":
        self.s.scheduler.cancel(self.job)
        out.append(("error", ApiError(408, f"the request did not finish within "
                                      f"{self.s.timeout} s (--config.request_timeout_s)",
                                      type_="timeout", code="request_timeout")))
      elif kind == "disconnect":
        out.append(("disconnect", None))
      else:
        out.append(("error", ApiError(503, str(payload), type_="server_error",
                                      code="engine_error")))
      if out:
        yield out
      if out and out[-1][0] in ("done", "error", "disconnect"):
        return

  async def whole(self, request: Request) -> Response:
    watch = asyncio.ensure_future(self._watch_disconnect(request.receive))
    gen = self._events()
    try:
      text = ""
      async for batch in gen:
        for kind, payload in batch:
          if kind == "text":
            text += payload
          elif kind == "disconnect":
            self._cancel()
            return Response(status_code=499)
          elif kind == "error":
            self._close(str(payload.status))
            return _error(payload)
          elif kind == "done":
            return self._whole_body(text, payload)
      raise AssertionError("the event stream ended without a result")
    finally:
      watch.cancel()
      await gen.aclose()
      self._cancel()

  def _whole_body(self, text: str, tokens: list[int]) -> JSONResponse:
    choice: dict[str, Any] = {"index": 0, "finish_reason": self._finish_reason(tokens),
                              "logprobs": None, "token_ids": tokens}
    if self.req.chat:
      choice["message"] = {"role": "assistant", "content": text}
    else:
      choice["text"] = text
    self._close("ok", tokens)
    return JSONResponse({"id": self.id, "object": "chat.completion" if self.req.chat
                         else "text_completion", "created": self.created,
                         "model": self.s.model_name, "choices": [choice],
                         "usage": self._usage(tokens)})

  def _chunk(self, delta: str | None = None, *, finish=None, role=False, extra=None,
             usage=None) -> str:
    choices = []
    if usage is None:
      choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
      if self.req.chat:
        d: dict[str, Any] = {"role": "assistant"} if role else {}
        if delta is not None:
          d["content"] = delta
        choice["delta"] = d
      else:
        choice["text"] = delta or ""
      choice.update(extra or {})
      choices.append(choice)
    body = {"id": self.id, "object": "chat.completion.chunk" if self.req.chat
            else "text_completion", "created": self.created, "model": self.s.model_name,
            "choices": choices}
    if usage is not None:
      body["usage"] = usage
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

  async def stream(self, receive, send) -> None:
    """The server-sent event stream, written straight to ASGI's `send`: the events
    that are ready together go out in one write."""
    watch = asyncio.ensure_future(self._watch_disconnect(receive))
    gen = self._events()
    try:
      await send({"type": "http.response.start", "status": 200, "headers": [
          (b"content-type", b"text/event-stream; charset=utf-8"),
          (b"cache-control", b"no-cache")]})
      parts: list[str] = []
      if self.req.chat:
        await send({"type": "http.response.body", "body": self._chunk("", role=True).encode(),
                    "more_body": True})
      first = True
      async for batch in gen:
        for kind, payload in batch:
          if kind == "text":
            if first:
              first = False
              self.s.metrics.ttft.labels(self.endpoint).observe(time.perf_counter() - self.start)
            parts.append(self._chunk(payload))
          elif kind == "slots":
            decode = self.s._decode  # pylint: disable=protected-access
            runs = [{"position": p, "token_ids": t, "text": decode(t)} for p, t in payload]
            parts.append(self._chunk(None if self.req.chat else "",
                                     extra={"refusion_slots": runs}))
          elif kind == "disconnect":
            return
          else:
            if kind == "done":
              tokens = payload
              parts.append(self._chunk(None if self.req.chat else "",
                                       finish=self._finish_reason(tokens),
                                       extra={"token_ids": tokens}))
              if self.req.include_usage:
                parts.append(self._chunk(usage=self._usage(tokens)))
              self._close("ok", tokens)
            else:
              self._close(str(payload.status))
              parts.append(f"data: {json.dumps(payload.body())}\n\n")
            parts.append("data: [DONE]\n\n")
            await send({"type": "http.response.body", "body": "".join(parts).encode(),
                        "more_body": False})
            return
        if parts and not self.mail.ready():  # nothing more to add to this write
          await send({"type": "http.response.body", "body": "".join(parts).encode(),
                      "more_body": True})
          parts = []
    except OSError:  # a server on ASGI 2.4 raises it from `send` once the client is gone
      pass
    finally:
      watch.cancel()
      await gen.aclose()
      self._cancel()  # the client went away (or the server is stopping)


class _Stream:
  """The ASGI response of a streamed request (`_Reply.stream`)."""

  def __init__(self, reply: _Reply):
    self.reply = reply

  async def __call__(self, scope, receive, send) -> None:
    del scope
    await self.reply.stream(receive, send)


def _shutting_down() -> ApiError:
  return ApiError(503, "the server is shutting down; send the request again to another "
                  "server or later", type_="server_error", code="shutting_down",
                  headers={"Connection": "close", "Retry-After": "1"})


def make_app(server: Server) -> Starlette:
  """The ASGI app; its lifespan starts and stops the engine thread."""

  @contextlib.asynccontextmanager
  async def lifespan(app):
    del app
    server.scheduler.start()
    try:
      yield
    finally:
      server.scheduler.stop()

  async def http_error(request, exc: HTTPException):
    del request
    # Starlette's own headers travel with it (a 405's `Allow`, RFC 9110 15.5.6).
    return _error(ApiError(exc.status_code, str(exc.detail), code=str(exc.status_code),
                           headers=dict(exc.headers or {})))

  routes = [Route("/health", server.health, methods=["GET"]),
            Route("/metrics", server.metrics_text, methods=["GET"]),
            Route("/v1/models", server.models, methods=["GET"]),
            Route("/v1/completions", server.completions, methods=["POST"]),
            Route("/v1/chat/completions", server.chat_completions, methods=["POST"])]
  return Starlette(routes=routes, lifespan=lifespan,
                   exception_handlers={HTTPException: http_error})
