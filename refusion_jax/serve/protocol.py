"""OpenAI request fields: parsing, checks and the error shape.

Every problem is an `ApiError` with the HTTP status and OpenAI's error body
`{"error": {"message", "type", "param", "code"}}`; the message names the field
and the value.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from typing import Any

from refusion_jax import fileio
from refusion_jax.decode.settings import method_names


class ApiError(Exception):

  def __init__(self, status: int, message: str, *, param: str | None = None,
               type_: str = "invalid_request_error", code: str | None = None,
               headers: dict[str, str] | None = None):
    super().__init__(message)
    self.status, self.message, self.param = status, message, param
    self.type, self.code, self.headers = type_, code, headers or {}

  def body(self) -> dict:
    return {"error": {"message": self.message, "type": self.type, "param": self.param,
                      "code": self.code}}


def bad(param: str, message: str) -> ApiError:
  return ApiError(400, f"{param}: {message}", param=param)


# Fields that are accepted only at the value that means "off" (OpenAI's default).
_OFF = {"echo": (False,), "logprobs": (None, False), "top_logprobs": (None, 0),
        "best_of": (None, 1), "frequency_penalty": (None, 0, 0.0),
        "presence_penalty": (None, 0, 0.0), "logit_bias": (None, {}), "suffix": (None,),
        "top_p": (None, 1, 1.0), "n": (None, 1), "response_format": (None, {"type": "text"}),
        "tools": (None, []), "tool_choice": (None, "none"), "parallel_tool_calls": (None,),
        "service_tier": (None, "auto", "default"), "store": (None, False),
        "metadata": (None,), "modalities": (None, ["text"]), "stream_options": (None,)}
_IGNORED = {"user"}
_REFUSION = {"method", "gen_length", "slot_size", "block_size", "slot_threshold",
             "token_threshold", "stream_slots", "ignore_eos"}
COMPLETION_FIELDS = {"model", "prompt", "max_tokens", "temperature", "stop", "seed", "stream",
                     "stream_options"} | set(_OFF) | _IGNORED | _REFUSION
CHAT_FIELDS = ((COMPLETION_FIELDS - {"prompt", "echo", "suffix", "best_of"})
               | {"messages", "max_completion_tokens", "chat_template_kwargs"})
_WHY_OFF = {"top_p": "only top_p=1 (no nucleus truncation) is supported",
            "n": "only n=1 is supported"}


@dataclasses.dataclass
class Request:
  """A checked request (chat or completion)."""

  chat: bool
  model: str
  prompt: Any  # completions: str or list[int]; chat: list of {"role", "content"} dicts
  enable_thinking: bool
  max_tokens: int | None
  temperature: float | None
  stops: list[str]
  seed: int | None
  stream: bool
  include_usage: bool
  method: str | None
  gen_length: int | None
  slot_size: int | None
  block_size: int | None
  slot_threshold: float | None
  token_threshold: float | None
  stream_slots: bool
  ignore_eos: bool | None  # vLLM's extra field: EOS ends nothing (None: the server's default)


def _is_int(x) -> bool:
  return isinstance(x, int) and not isinstance(x, bool)


def _number(body, name, lo, hi):
  x = body.get(name)
  if x is None:
    return None
  if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
    raise bad(name, f"must be a number, got {x!r}")
  if not lo <= x <= hi:
    raise bad(name, f"must lie in [{lo}, {hi}], got {x!r}")
  return float(x)


def _positive_int(body, name):
  x = body.get(name)
  if x is None:
    return None
  if not _is_int(x) or x < 1:
    raise bad(name, f"must be a positive integer, got {x!r}")
  return x


def _bool(body, name, default=False):
  x = body.get(name, default)
  if x is None:
    return default
  if not isinstance(x, bool):
    raise bad(name, f"must be a boolean, got {x!r}")
  return x


def _content(message, i) -> str:
  content = message.get("content")
  if isinstance(content, str):
    return content
  if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
    parts = []
    for j, part in enumerate(content):
      if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(
          part.get("text"), str):
        raise bad(f"messages[{i}].content[{j}]", 'only text parts {"type": "text", "text": str} '
                  f"are supported, got {part!r}")
      parts.append(part["text"])
    return "".join(parts)
  raise bad(f"messages[{i}].content", f"must be a string or a list of text parts, got "
            f"{content!r}")


MAX_STOP_CHARS = 256

# Where a decoded body can hold a lone surrogate: a \uD800-\uDFFF escape, or one encoded
# as UTF-8 bytes (json.loads decodes bytes with "surrogatepass").
_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")


def loads(raw: bytes) -> Any:
  """A request body's JSON value; ApiError (400) when it is not JSON or holds a string
  that UTF-8 cannot encode (naming its field). The value is walked for such strings
  only where the bytes can hold one (a walk costs 1.4 ms over 4,096 token ids)."""
  try:
    body = json.loads(raw)
  except ValueError as e:  # also a number too long for Python to convert (> 4,300 digits)
    raise ApiError(400, f"the request body is not valid JSON ({e})") from None
  except RecursionError:
    raise ApiError(400, "the request body is nested too deeply to decode") from None
  if json.detect_encoding(raw) != "utf-8" or (
      (b"\\u" in raw or b"\xed" in raw) and _SURROGATE.search(raw)):
    found = fileio.not_unicode(body)
    if found:
      raise bad(found[0], f"is not valid Unicode: a lone surrogate at character {found[1]}")
  return body


def parse(body: Any, chat: bool) -> Request:
  """Checks a decoded JSON body; raises ApiError naming the first problem."""
  if not isinstance(body, dict):
    raise ApiError(400, f"the request body must be a JSON object, got {type(body).__name__}")
  allowed = CHAT_FIELDS if chat else COMPLETION_FIELDS
  unknown = sorted(set(body) - allowed)
  if unknown:
    raise bad(unknown[0], f"unsupported field (this server takes: {', '.join(sorted(allowed))})")
  for name, ok in _OFF.items():
    if name in body and name != "stream_options" and body[name] not in ok:
      why = _WHY_OFF.get(name, f"{name} is not supported (accepted only as {ok[-1]!r})")
      raise bad(name, f"{why}; got {body[name]!r}")
  if not isinstance(body.get("model"), str):
    raise bad("model", f"is required and must be a string, got {body.get('model')!r}")
  enable_thinking = False
  if chat:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
      raise bad("messages", f"must be a non-empty list of messages, got {messages!r}")
    prompt = []
    for i, m in enumerate(messages):
      if not isinstance(m, dict):
        raise bad(f"messages[{i}]", f"must be an object, got {m!r}")
      if m.get("role") not in ("system", "user", "assistant"):
        raise bad(f"messages[{i}].role", f"must be 'system', 'user' or 'assistant', got "
                  f"{m.get('role')!r}")
      prompt.append({"role": m["role"], "content": _content(m, i)})
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict) or set(kwargs) - {"enable_thinking"}:
      raise bad("chat_template_kwargs", f"only {{\"enable_thinking\": bool}} is supported, got "
                f"{kwargs!r}")
    enable_thinking = _bool(kwargs, "enable_thinking")
    if body.get("max_tokens") is not None and body.get("max_completion_tokens") is not None:
      raise bad("max_completion_tokens", "give max_tokens or max_completion_tokens, not both")
    max_tokens = _positive_int(body, "max_tokens") or _positive_int(body,
                                                                    "max_completion_tokens")
  else:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
      prompt = prompt[0]  # a batch of one prompt
    if isinstance(prompt, list):
      if not prompt or not all(_is_int(t) for t in prompt):
        raise bad("prompt", "must be a string or a non-empty list of token ids (one prompt: "
                  "several prompts per request are not supported)")
    elif not isinstance(prompt, str) or not prompt:
      raise bad("prompt", f"must be a non-empty string or a list of token ids, got {prompt!r}")
    max_tokens = _positive_int(body, "max_tokens")
  stop = body.get("stop")
  if stop is None:
    stops = []
  elif isinstance(stop, str):
    stops = [stop]
  elif isinstance(stop, list) and len(stop) <= 4 and all(isinstance(s, str) for s in stop):
    stops = list(stop)
  else:
    raise bad("stop", f"must be a string or a list of at most 4 strings, got {stop!r}")
  if any(not s for s in stops):
    raise bad("stop", "stop strings must not be empty")
  if any(len(s) > MAX_STOP_CHARS for s in stops):
    # A stream holds back a suffix that may begin a stop string, found in time that
    # grows with the square of its length, at every report.
    raise bad("stop", f"a stop string has at most {MAX_STOP_CHARS} characters, got one of "
              f"{max(map(len, stops))}")
  seed = body.get("seed")
  if seed is not None and (not _is_int(seed) or not 0 <= seed < 2**32):
    raise bad("seed", f"must be an integer in [0, 2**32), got {seed!r}")
  stream = _bool(body, "stream")
  options = body.get("stream_options")
  include_usage = False
  if options is not None:
    if not stream:
      raise bad("stream_options", "is only allowed with stream=true")
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
      raise bad("stream_options", f"only {{\"include_usage\": bool}} is supported, got "
                f"{options!r}")
    include_usage = _bool(options, "include_usage")
  method = body.get("method")
  if method is not None and not isinstance(method, str):
    raise bad("method", f"must be a string, got {method!r}")
  if method is not None and method not in method_names():
    raise bad("method", f"must be one of {', '.join(method_names())}, got {method!r}")
  return Request(
      chat=chat, model=body["model"], prompt=prompt, enable_thinking=enable_thinking, max_tokens=max_tokens,
      temperature=_number(body, "temperature", 0.0, 2.0), stops=stops, seed=seed, stream=stream,
      include_usage=include_usage, method=method, gen_length=_positive_int(body, "gen_length"),
      slot_size=_positive_int(body, "slot_size"), block_size=_positive_int(body, "block_size"),
      slot_threshold=_number(body, "slot_threshold", 0.0, 1.0),
      token_threshold=_number(body, "token_threshold", 0.0, 1.0),
      stream_slots=_bool(body, "stream_slots"),
      ignore_eos=None if body.get("ignore_eos") is None else _bool(body, "ignore_eos"))
