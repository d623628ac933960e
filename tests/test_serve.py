"""The OpenAI-compatible server (refusion_jax/serve) through the real `openai` client.

One server (in-process, on 127.0.0.1, a free port) serves every test but the
SIGTERM one (a subprocess). The oracle is `refusion_jax.sample` run on the
same prompts with the same settings: greedy text and tokens must be equal.
"""

import asyncio
import collections
import concurrent.futures
import json
import multiprocessing
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import types

import httpx
import jax
import numpy as np
import openai
import pytest
from flax import nnx

from configs import sample as sample_config
from configs import serve as serve_config
from refusion_jax import checkpoint, loading, sample, serve
from refusion_jax import config as config_lib
from refusion_jax import tokenizer as tokenizer_lib
from refusion_jax.decode import compiled as compiled_lib
from refusion_jax.model import Transformer
from refusion_jax.serve import engine_process, protocol
from refusion_jax.serve import text as text_lib
from refusion_jax.serve.scheduler import Job, Scheduler
from refusion_jax.tokenizer import Tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GEN, SLOT, BLOCK, WIDTH, ROWS, QUEUE = 16, 4, 8, 32, 4, 16
SETTINGS = {"slot_threshold": 0.5, "token_threshold": 0.3}
TEXTS = ["sort 5 2 9", "hello world", "add 3 4", "reverse abc", "count to 3", "a b c d",
         "what is 2+3?", "copy xyz", "max 4 8 1", "the cat", "lookup k", "min 7 2",
         "repeat hi", "upper abc", "9 8 7", "go"]


def _save_model(path):
  mc = config_lib.tiny(num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1, head_dim=16,
                       mlp_dim=64, attention="causal", max_position_embeddings=256)
  model = Transformer(mc, rngs=nnx.Rngs(0))
  # Scaled weights, so that greedy texts vary and ReFusion commits slots out of order.
  nnx.update(model, jax.tree.map(lambda x: x * 4.0, nnx.state(model, nnx.Param)))
  checkpoint.save_model(path, mc, model)
  return path


def _oracle(model_dir, tmp, method, prompts, **decode):
  """refusion_jax.sample on `prompts` ([("ids", [int]) | ("query", str)]): its result dicts."""
  path = os.path.join(tmp, f"prompts_{method}_{len(prompts)}.jsonl")
  with open(path, "w", encoding="utf-8") as f:
    for kind, value in prompts:
      f.write(json.dumps({"prompt_ids": value} if kind == "ids" else {"query": value}) + "\n")
  c = sample_config.get_config()
  c.model_dir, c.prompts_file, c.output_json = model_dir, path, ""
  c.prompt_bucket, c.batch_size = WIDTH, 8
  c.decode.method, c.decode.gen_length = method, GEN
  c.decode.slot_size, c.decode.block_size = (GEN, GEN) if method == "ar" else (SLOT, BLOCK)
  for k, v in {**SETTINGS, **decode}.items():
    c.decode[k] = v
  return sample.run(c)


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
  """The model folder and `refusion_jax.sample`'s outputs on the test prompts."""
  tmp = str(tmp_path_factory.mktemp("serve"))
  model_dir = _save_model(os.path.join(tmp, "tiny"))
  tok = Tokenizer.tiny()
  completions = [("ids", tok.encode(t)) for t in TEXTS]
  chats = [("query", t) for t in TEXTS[:6]]
  out = {m: _oracle(model_dir, tmp, m, completions + chats) for m in ("refusion", "ar")}
  return {"tmp": tmp, "model_dir": model_dir, "tok": tok,
          "completion": {m: o[:len(TEXTS)] for m, o in out.items()},
          "chat": {m: o[len(TEXTS):] for m, o in out.items()}}


def _serving(oracle, engine_mode, row_counts="auto", rows=ROWS, buckets=f"ar:{GEN}", **fields):
  """A server on a free port (uvicorn on a thread of this process; under
  engine_mode "process" the engine runs in a child process); `fields`: more
  config fields."""
  import uvicorn  # pylint: disable=import-outside-toplevel
  c = serve_config.get_config()
  c.model_dir, c.model_name, c.rows, c.max_prompt_len = oracle["model_dir"], "tiny", rows, WIDTH
  c.max_queue, c.chunk_passes, c.buckets = QUEUE, 2, buckets
  c.engine, c.row_counts = engine_mode, row_counts
  for k, v in fields.items():
    c[k] = v
  c.decode.gen_length, c.decode.slot_size, c.decode.block_size = GEN, SLOT, BLOCK
  for k, v in SETTINGS.items():
    c.decode[k] = v
  asgi, server = serve.build(c)
  uv = uvicorn.Server(uvicorn.Config(asgi, host="127.0.0.1", port=0, log_level="error"))
  thread = threading.Thread(target=uv.run, daemon=True)
  thread.start()
  deadline = time.time() + 30
  while not uv.started:
    assert time.time() < deadline and thread.is_alive(), "the server did not start"
    time.sleep(0.02)
  port = uv.servers[0].sockets[0].getsockname()[1]
  return {**oracle, "url": f"http://127.0.0.1:{port}", "server": server,
          "compiled": compiled_lib.compiled_programs()}, lambda: _stop(uv, thread)


def _stop(uv, thread):
  uv.should_exit = True
  thread.join(30)


@pytest.fixture(scope="module")
def served(oracle):
  """The default server: the engine in its own process."""
  info, stop = _serving(oracle, "process")
  yield info
  stop()


@pytest.fixture(scope="module")
def served_thread(oracle):
  """The engine on a thread of the server's process (its state can be inspected), with
  passes over 1, 2 or 3 of its 4 rows on every platform ("auto" has them on a CPU)."""
  start_log, say = [], serve._log  # pylint: disable=protected-access
  serve._log = start_log.append  # pylint: disable=protected-access
  try:
    info, stop = _serving(oracle, "thread", row_counts="1,2,3")
  finally:
    serve._log = say  # pylint: disable=protected-access
  yield dict(info, start_log="\n".join(start_log))
  stop()


def _client(served):
  return openai.OpenAI(base_url=served["url"] + "/v1", api_key="none", max_retries=0,
                       timeout=60)


def _finish(tokens):
  return "stop" if tokens and tokens[-1] == 1 else "length"  # config.tiny(): EOS id 1


def _complete(cl, i, method, stream, **kw):
  """(text, token_ids, finish_reason, usage) of completion prompt i."""
  args = dict(model="tiny", prompt=TEXTS[i], max_tokens=GEN, extra_body={"method": method, **kw})
  if not stream:
    r = cl.completions.create(**args)
    return r.choices[0].text, r.choices[0].token_ids, r.choices[0].finish_reason, r.usage
  text, ids, finish, usage = "", None, None, None
  for chunk in cl.completions.create(stream=True, stream_options={"include_usage": True}, **args):
    if chunk.usage is not None:
      usage = chunk.usage
    for ch in chunk.choices:
      text += ch.text
      if ch.finish_reason is not None:
        finish, ids = ch.finish_reason, ch.token_ids
  return text, ids, finish, usage


def _chat(cl, i, method, stream):
  args = dict(model="tiny", messages=[{"role": "user", "content": TEXTS[i]}],
              extra_body={"method": method})
  if not stream:
    r = cl.chat.completions.create(**args)
    return r.choices[0].message.content, r.choices[0].token_ids, r.choices[0].finish_reason
  text, ids, finish = "", None, None
  for chunk in cl.chat.completions.create(stream=True, **args):
    for ch in chunk.choices:
      text += ch.delta.content or ""
      if ch.finish_reason is not None:
        finish, ids = ch.finish_reason, ch.token_ids
  return text, ids, finish


def _metric(served, name):
  text = httpx.get(served["url"] + "/metrics").text
  m = re.search(rf"^{name} ([0-9.e+]+)$", text, re.M)
  return float(m.group(1))


@pytest.mark.parametrize("method", ["refusion", "ar"])
def test_greedy_equals_sample(served, method):
  cl = _client(served)
  for i in range(4):
    want = served["completion"][method][i]
    for stream in (False, True):
      text, ids, finish, usage = _complete(cl, i, method, stream)
      assert (text, ids) == (want["text"], want["tokens"]), (method, i, stream)
      assert finish == _finish(want["tokens"])
      assert usage.completion_tokens == len(want["tokens"])
      assert usage.prompt_tokens == len(served["tok"].encode(TEXTS[i]))
      assert usage.model_extra["nfe"] == want["nfe"]
  for i in range(3):
    want = served["chat"][method][i]
    for stream in (False, True):
      text, ids, finish = _chat(cl, i, method, stream)
      assert (text, ids, finish) == (want["text"], want["tokens"], _finish(want["tokens"]))


@pytest.mark.parametrize("method", ["refusion", "ar"])
def test_ignore_eos_equals_sample(served, method):
  """vLLM's `ignore_eos` extra field: every answer is max_tokens long, as sample's
  decode.ignore_eos gives it, with "length" as its finish reason. AR: on prompts whose
  answer ends at EOS otherwise. (This random model's ReFusion decodes seldom meet EOS:
  tests/test_decode_refusion.py checks ReFusion's ignore_eos on a model whose do.)"""
  cl = _client(served)
  prompts = [served["tok"].encode(t) for t in TEXTS[:2]]
  if method == "ar":
    rs = np.random.RandomState(3)
    prompts = []  # prompts (token ids) whose answer ends at EOS
    for _ in range(100):
      ids = [int(x) for x in rs.randint(4, 256, size=rs.randint(2, 12))]
      r = cl.completions.create(model="tiny", prompt=ids, max_tokens=GEN,
                                extra_body={"method": method})
      if r.choices[0].finish_reason == "stop" and len(r.choices[0].token_ids) < GEN:
        prompts.append(ids)
        if len(prompts) == 2:
          break
    assert prompts, "no prompt ends at EOS: nothing to ignore"
  want = _oracle(served["model_dir"], served["tmp"], method, [("ids", ids) for ids in prompts],
                 ignore_eos=True)
  for ids, w in zip(prompts, want):
    assert len(w["tokens"]) == GEN
    for stream in (False, True):
      args = dict(model="tiny", prompt=ids, max_tokens=GEN,
                  extra_body={"method": method, "ignore_eos": True})
      if stream:
        got, finish = None, None
        for chunk in cl.completions.create(stream=True, **args):
          for ch in chunk.choices:
            if ch.finish_reason is not None:
              got, finish = ch.token_ids, ch.finish_reason
      else:
        r = cl.completions.create(**args)
        got, finish = r.choices[0].token_ids, r.choices[0].finish_reason
        assert r.usage.completion_tokens == GEN
        assert r.usage.model_extra["nfe"] == w["nfe"]
      assert (got, finish) == (w["tokens"], "length"), (method, ids, stream)


def test_enable_thinking_changes_the_prompt(served):
  cl = _client(served)
  body = dict(model="tiny", messages=[{"role": "user", "content": TEXTS[0]}], max_tokens=GEN)
  off = cl.chat.completions.create(**body)
  on = cl.chat.completions.create(**body, extra_body={"chat_template_kwargs": {
      "enable_thinking": True}})
  tok = served["tok"]
  n_on = len(tok.encode(tok.apply_chat_template([{"role": "user", "content": TEXTS[0]}],
                                                enable_thinking=True)))
  assert on.usage.prompt_tokens == n_on == off.usage.prompt_tokens + len(tok.encode("<think>\n"))


def _sixteen_concurrent_streams(served):
  """16 streams at once (refusion and ar mixed): each equals its single-request output;
  returns [((prompt, method), text)]."""
  cl = _client(served)
  jobs = [(i, "refusion" if i % 3 else "ar") for i in range(16)]
  with concurrent.futures.ThreadPoolExecutor(16) as pool:
    got = list(pool.map(lambda job: _complete(cl, job[0], job[1], True), jobs))
  for (i, method), (text, ids, _, _) in zip(jobs, got):
    want = served["completion"][method][i]
    assert (text, ids) == (want["text"], want["tokens"]), (i, method)
  return [(job, text) for job, (text, _, _, _) in zip(jobs, got)]


def test_sixteen_concurrent_streams(served):
  cl = _client(served)
  for (i, method), text in _sixteen_concurrent_streams(served):
    assert text == _complete(cl, i, method, False)[0]


def _sse(served, path, body):
  """The data objects of a raw SSE stream, in order (checks the [DONE] terminator)."""
  out = []
  with httpx.stream("POST", served["url"] + path, json=body, timeout=60) as r:
    assert r.status_code == 200
    for line in r.iter_lines():
      if line.startswith("data: "):
        out.append(line[6:])
  assert out[-1] == "[DONE]"
  return [json.loads(x) for x in out[:-1]]


def test_stream_is_never_revised_while_slots_commit_out_of_order(served):
  tok = served["tok"]
  out_of_order_seen = 0
  for i in range(len(TEXTS)):
    want = served["completion"]["refusion"][i]
    events = _sse(served, "/v1/completions", {"model": "tiny", "prompt": TEXTS[i],
                                              "stream": True, "stream_slots": True})
    committed, sent = {}, ""
    for ev in events:
      ch = ev["choices"][0]
      for run in ch.get("refusion_slots", []):
        prefix = len(committed)
        while prefix in committed:
          prefix += 1
        out_of_order_seen += run["position"] > prefix
        for j, t in enumerate(run["token_ids"]):
          assert committed.setdefault(run["position"] + j, t) == t  # a slot is sent once
          assert want["tokens"][run["position"] + j] == t
      sent += ch["text"]
      prefix = 0
      while prefix in committed:
        prefix += 1
      # Everything sent is final text, and no more than the committed prefix holds.
      assert want["text"].startswith(sent)
      assert tok.decode(want["tokens"][:prefix], skip_special_tokens=True).startswith(sent)
    assert sent == want["text"]
  assert out_of_order_seen > 0  # some decodes committed a slot past a gap


def test_stop_sequences_and_max_tokens(served):
  cl = _client(served)
  tok = served["tok"]
  tried = 0
  for i, want in enumerate(served["completion"]["refusion"]):
    m = re.search(r"[a-z]{2}", want["text"][1:])
    if not m:
      continue
    stop = m.group(0)
    cut = want["text"].find(stop)
    n = next(n for n in range(1, len(want["tokens"]) + 1)
             if stop in tok.decode(want["tokens"][:n], skip_special_tokens=True))
    for stream in (False, True):
      text, ids, finish, usage = _complete(cl, i, "refusion", stream, stop=[stop, "\x00\x01"])
      assert (text, ids, finish) == (want["text"][:cut], want["tokens"][:n], "stop")
      assert usage.completion_tokens == n
    tried += 1
    if tried == 3:
      break
  assert tried
  for i in range(3):
    want = served["completion"]["ar"][i]
    r = cl.completions.create(model="tiny", prompt=TEXTS[i], max_tokens=5,
                              extra_body={"method": "ar"})
    assert r.choices[0].token_ids == want["tokens"][:5]
    assert r.choices[0].text == tok.decode(want["tokens"][:5], skip_special_tokens=True)


def test_text_stream_holds_back_partial_stops_and_characters():
  pieces = {1: "ab", 2: "c", 3: "\xe9", 4: "STO", 5: "P", 6: "x"}
  decode = lambda ids: "".join(pieces[i] for i in ids)  # noqa: E731
  ts = text_lib.TextStream(decode, ["STOP"])
  assert ts.update([1, 2]) == "abc"
  assert ts.update([1, 2, 4]) == ""  # "STO" may begin "STOP"
  assert ts.update([1, 2, 4, 5, 6]) == "" and ts.stopped and ts.tokens == [1, 2, 4, 5]
  ts = text_lib.TextStream(lambda ids: "ab\ufffd" if len(ids) == 1 else "ab\xe9")
  assert ts.update([1]) == "ab" and ts.update([1, 2], final=True) == "\xe9"


def _stream_alike(tok, ids, stops, rng):
  """Streams `ids` through a windowed TextStream and one that decodes the whole prefix
  at every update (same random update sizes): same deltas, stops and tokens at every
  update, and the windowed one decodes O(n) tokens. Returns the windowed stream."""
  decoded = [0, 0]  # tokens decoded by each stream

  def counting(k):
    def decode(t):
      decoded[k] += len(t)
      return tok.decode(t, skip_special_tokens=True)
    return decode
  full = text_lib.TextStream(counting(0), stops, unsettled=tok.unsettled_ids)
  fast = text_lib.TextStream(counting(1), stops, incremental=True, unsettled=tok.unsettled_ids)
  sent = ""
  n = 0
  while n < len(ids):
    n = min(len(ids), n + int(rng.integers(1, 4)))
    final = n == len(ids)
    delta = fast.update(ids[:n], final)
    assert delta == full.update(ids[:n], final), (stops, n)
    assert (fast.stopped, fast.tokens) == (full.stopped, full.tokens)
    sent += delta
    if full.stopped:
      break
  assert sent == fast.sent == full.sent
  assert fast.sent == tok.decode(fast.tokens, skip_special_tokens=True)[:len(fast.sent)]
  if not stops:
    assert fast.sent == tok.decode(ids, skip_special_tokens=True)  # never revised
    assert decoded[1] <= 6 * len(ids) < len(ids) ** 2 / 8 < decoded[0], decoded  # O(n), not O(n^2)
  return fast


@pytest.mark.parametrize("seed", range(4))
def test_text_stream_decoding_a_window_sends_the_same(seed):
  # The tiny tokenizer is byte-level: accented letters, CJK and emoji take several
  # tokens, so updates cut characters; stop strings span updates.
  tok = Tokenizer.tiny()
  assert tok.decodes_incrementally and not tok.unsettled_ids
  rng = np.random.default_rng(seed)
  words = ["caf\xe9", "\u4e2d\u6587", "\U0001f600", "STOP", "ST", "OP", "a", " ", "\n", "12"]
  text = "".join(words[i] for i in rng.integers(len(words), size=300))
  ids = tok.encode(text)
  ids[5:5] = [tok.eos_id, tok.pad_id]  # special tokens, skipped when decoded
  for stops in ([], ["STOP"], ["\u6587\U0001f600", "x"]):
    stream = _stream_alike(tok, ids, stops, rng)
    assert stream.stopped or stops != ["STOP"]


# Pieces for tokenizers of other families: SentencePiece pieces (leading "\u2581"),
# WordPiece continuations, BPE end-of-word suffixes, byte tokens (valid and invalid
# UTF-8 runs), byte-level letters, punctuation that WordPiece's cleanup joins.
_PIECES = (["\u2581the", "\u2581", "\u2581\u2581", "a", "b", "\u2581c", "##ing", "##s", "x", ".",
            ",", "\u2581.", "'s", "e</w>", "ab</w>", "\u0120hi", "\u010a", "\xe9", "STOP", "ST",
            "OP"] + [f"<0x{b:02X}>" for b in range(256)])


def _other_tokenizer(decoder):
  import tokenizers  # pylint: disable=import-outside-toplevel
  vocab = {p: i for i, p in enumerate(_PIECES + ["<eos>", "<pad>"])}
  raw = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="a"))
  raw.add_special_tokens(["<eos>", "<pad>"])
  if decoder is not None:
    raw.decoder = decoder
  return Tokenizer(raw, eos_token="<eos>", pad_token="<pad>", chat_template=None, source="test")


def _other_decoders():
  from tokenizers import decoders  # pylint: disable=import-outside-toplevel
  return {
      # Llama 2 / Mistral / Gemma: SentencePiece with byte fallback.
      "sentencepiece_byte_fallback": decoders.Sequence([
          decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
          decoders.Strip(" ", 1, 0)]),
      "metaspace": decoders.Metaspace(),
      "metaspace_never": decoders.Metaspace(prepend_scheme="never"),
      "wordpiece": decoders.WordPiece(),
      "bpe_suffix": decoders.BPEDecoder(),
      "byte_level": decoders.ByteLevel(),
      "none": None,  # tokens joined with spaces
  }


@pytest.mark.parametrize("family", sorted(_other_decoders()))
def test_text_stream_window_equals_whole_prefix_for_other_tokenizer_families(family):
  tok = _other_tokenizer(_other_decoders()[family])
  assert tok.decodes_incrementally
  assert bool(tok.unsettled_ids) == (family == "sentencepiece_byte_fallback")
  rng = np.random.default_rng(0)
  for trial in range(40):
    # Byte tokens in runs: UTF-8 of accented, CJK and emoji characters, and stray bytes.
    ids = []
    while len(ids) < 120:
      if rng.random() < 0.25:
        ids += [tok.token_to_id(f"<0x{b:02X}>")
                for b in rng.choice(["\xe9", "\u4e2d", "\U0001f600", " "]).encode()]
      elif rng.random() < 0.05:
        ids.append(tok.token_to_id(f"<0x{int(rng.integers(128, 256)):02X}>"))
      else:
        ids.append(int(rng.integers(len(_PIECES) - 256)))
    ids[3:3] = [tok.eos_id]
    _stream_alike(tok, ids, [] if trial % 2 else ["STOP", "\u4e2d"], rng)


def test_text_stream_holds_back_byte_tokens_until_their_run_ends():
  # With byte fallback a byte run's text depends on the bytes after it: " " alone,
  # but one U+FFFD per token once an invalid byte follows.
  tok = _other_tokenizer(_other_decoders()["sentencepiece_byte_fallback"])
  a, space, bad = (tok.token_to_id(t) for t in ("\u2581the", "<0x20>", "<0xA9>"))
  assert tok.decode([a, space]) == "the " and tok.decode([a, space, bad]) == "the\ufffd\ufffd"
  for incremental in (False, True):
    ts = text_lib.TextStream(tok.decode, incremental=incremental, unsettled=tok.unsettled_ids)
    assert ts.update([a, space]) == "the"
    assert ts.update([a, space, bad], final=True) == "\ufffd\ufffd"
    assert ts.sent == tok.decode([a, space, bad])


def test_decoders_of_other_kinds_are_decoded_whole():
  from tokenizers import decoders  # pylint: disable=import-outside-toplevel
  tok = _other_tokenizer(decoders.CTC())  # merges repeats across the window's edge
  assert not tok.decodes_incrementally and not tok.unsettled_ids


def _reply(timeout=60.0, **body):
  """A `_Reply` over a stand-in server (letters for tokens), and its cancelled jobs."""
  from refusion_jax.serve import app as app_lib  # pylint: disable=import-outside-toplevel
  cancelled = []
  server = types.SimpleNamespace(
      _decode=lambda ids: "".join(chr(ord("a") + i) for i in ids), timeout=timeout,
      decode_incrementally=True, unsettled_ids=frozenset(),
      scheduler=types.SimpleNamespace(cancel=cancelled.append, delivers_in_loop=True),
      metrics=app_lib.Metrics(), model_name="m", stop_ids=frozenset({99}))
  req = protocol.parse({"model": "m", "prompt": "x", "stream": True, **body}, chat=False)
  reply = app_lib._Reply(server, req, [1, 2], "completions", time.perf_counter())  # pylint: disable=protected-access
  reply.job = types.SimpleNamespace(knobs=(0.5, 0.1, 0.0, False))
  return reply, cancelled


def _bodies(sent):
  """The SSE texts of each body write, and whether more was to come after it."""
  return [(m["body"].decode(), m["more_body"]) for m in sent if m["type"] == "http.response.body"]


def _texts(body: str) -> list:
  events = [json.loads(x[6:]) for x in body.split("\n\n") if x.startswith("data: {")]
  return [e["choices"][0]["text"] for e in events if e.get("choices")]


def test_stream_merges_waiting_progress_and_writes_what_is_ready_at_once():
  import asyncio  # pylint: disable=import-outside-toplevel

  from refusion_jax.serve.scheduler import Done  # pylint: disable=import-outside-toplevel

  async def never():
    await asyncio.Event().wait()

  async def main():
    reply, cancelled = _reply()
    sent = []

    async def send(m):
      sent.append(m)

    # Three progress reports and the end, all waiting: one text chunk for the three,
    # the last piece, the finish, [DONE], in one write.
    for n in (1, 2, 3):
      reply.deliver("progress", ([n - 1], n))  # the tokens committed since the last
    reply.deliver("done", Done(tokens=[0, 1, 2, 3], forward_passes=4, truncated=False))
    await reply.stream(never, send)
    assert sent[0]["type"] == "http.response.start"
    (body, more), = _bodies(sent)
    assert not more and body.endswith("data: [DONE]\n\n")
    assert _texts(body) == ["abc", "d", ""] and not cancelled and reply.finished

    # Events that come apart go out apart.
    reply, cancelled = _reply()
    sent = []
    task = asyncio.ensure_future(reply.stream(never, send))
    reply.deliver("progress", ([0], 1))
    for _ in range(5):
      await asyncio.sleep(0)
    assert _bodies(sent) == [(_bodies(sent)[0][0], True)] and _texts(_bodies(sent)[0][0]) == ["a"]
    reply.deliver("done", Done(tokens=[0, 1], forward_passes=2, truncated=False))
    await task
    assert [_texts(b) for b, _ in _bodies(sent)] == [["a"], ["b", ""]]

    # Past the deadline: a 408 error event, the job cancelled.
    reply, cancelled = _reply(timeout=0.05)
    sent = []
    await asyncio.wait_for(reply.stream(never, send), 10)
    (body, more), = _bodies(sent)
    assert '"code": "request_timeout"' in body and not more and cancelled == [reply.job]

    # The client leaves: no more writes, the job cancelled.
    reply, cancelled = _reply()
    sent = []

    async def gone():
      return {"type": "http.disconnect"}

    reply.deliver("progress", ([0], 1))
    await asyncio.wait_for(reply.stream(gone, send), 10)
    assert cancelled == [reply.job] and all(more for _, more in _bodies(sent))

    # A server that raises OSError from `send` once the client is gone (ASGI 2.4).
    reply, cancelled = _reply()

    async def broken(m):
      if m["type"] == "http.response.body":
        raise OSError("the connection is closed")

    reply.deliver("progress", ([0], 1))
    await asyncio.wait_for(reply.stream(never, broken), 10)
    assert cancelled == [reply.job] and reply.finished

  asyncio.run(main())


def test_seeded_sampling_equals_sample(served):
  cl = _client(served)
  tok = served["tok"]
  prompts = [("ids", tok.encode(t)) for t in TEXTS[:8]]
  want = _oracle(served["model_dir"], served["tmp"], "refusion", prompts, temperature=0.8,
                 )[0]  # prompt 0 draws from fold_in(key(seed=0), 0), as a request with seed 0
  r = cl.completions.create(model="tiny", prompt=TEXTS[0], max_tokens=GEN, temperature=0.8,
                            seed=0)
  assert r.choices[0].token_ids == want["tokens"]


def test_cancelled_stream_frees_its_row(served):
  sched = served["server"].scheduler
  before = _metric(served, "refusion_cancelled_rows_total")
  sched.hold(True)  # admitted, but no pass runs: the row is busy mid-decode
  try:
    with httpx.stream("POST", served["url"] + "/v1/chat/completions", timeout=60, json={
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True}) as r:
      assert r.status_code == 200
      lines = r.iter_lines()  # kept open: dropping the iterator closes the stream
      assert next(lines).startswith("data: ")  # the role chunk: the request is in
      deadline = time.time() + 10
      while sched.busy_rows() != 1:
        assert time.time() < deadline, "the request was not admitted"
        time.sleep(0.02)
      # The HTTP side answers while the engine holds a request mid-decode.
      assert httpx.get(served["url"] + "/health", timeout=5).json()["busy_rows"] == 1
    # The client has gone; the row is freed without decoding further.
    deadline = time.time() + 10
    while sched.busy_rows() != 0:
      assert time.time() < deadline, "the cancelled request kept its row"
      time.sleep(0.02)
  finally:
    sched.hold(False)
  assert _metric(served, "refusion_cancelled_rows_total") == before + 1
  assert _metric(served, 'refusion_requests_total{endpoint="chat",outcome="cancelled"}') >= 1
  assert _complete(_client(served), 0, "ar", False)[1] == served["completion"]["ar"][0]["tokens"]


@pytest.mark.parametrize("fixture", ["served", "served_thread"])
def test_a_burst_is_admitted_up_to_rows_and_queue_and_the_rest_get_429(request, fixture):
  # A burst of concurrent requests against a held engine: every row and every queue
  # place is taken, whether or not the engine has picked the requests up yet, and only
  # the requests beyond rows + max_queue are refused; the rest are served.
  served = request.getfixturevalue(fixture)
  sched = served["server"].scheduler
  n = ROWS + QUEUE + 3
  sched.hold(True)
  results = []
  try:
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
      futures = [pool.submit(httpx.post, served["url"] + "/v1/completions", timeout=60,
                             json={"model": "tiny", "prompt": TEXTS[i % 4], "method": "ar"})
                 for i in range(n)]
      deadline = time.time() + 20
      while sum(f.done() for f in futures) < n - ROWS - QUEUE:
        assert time.time() < deadline
        time.sleep(0.02)
      sched.hold(False)
      results = [(i, f.result()) for i, f in enumerate(futures)]
  finally:
    sched.hold(False)
  rejected = [r for _, r in results if r.status_code == 429]
  assert len(rejected) == 3, [r.status_code for _, r in results]
  for r in rejected:
    assert r.headers["Retry-After"] == "1"
    assert r.json()["error"]["code"] == "queue_full"
  for i, r in results:
    if r.status_code != 429:
      assert r.status_code == 200
      assert r.json()["choices"][0]["token_ids"] == served["completion"]["ar"][i % 4]["tokens"]


def _raw_reply(sock) -> bytes:
  """What the server answers on a raw socket: read until a JSON body has ended (or the
  connection closes)."""
  reply = b""
  while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
    part = sock.recv(65536)
    if not part:
      break
    reply += part
  return reply


def test_request_timeout(served):
  srv = served["server"]
  srv.timeout, old = 0.3, srv.timeout
  srv.scheduler.hold(True)
  try:
    r = httpx.post(served["url"] + "/v1/completions", timeout=30,
                   json={"model": "tiny", "prompt": "go"})
  finally:
    srv.timeout = old
    srv.scheduler.hold(False)
  assert r.status_code == 408 and r.json()["error"]["code"] == "request_timeout"
  deadline = time.time() + 10
  while srv.scheduler.busy_rows():
    assert time.time() < deadline
    time.sleep(0.02)
  # A body that stops coming: its request times out the same way, and frees nothing else.
  host, port = served["url"][len("http://"):].split(":")
  srv.timeout = 0.5
  try:
    with socket.create_connection((host, int(port)), timeout=30) as sock:
      sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                   b"application/json\r\nContent-Length: 100\r\n\r\n{\"model\": ")
      reply = _raw_reply(sock)
  finally:
    srv.timeout = old
  assert reply.startswith(b"HTTP/1.1 408"), reply
  assert b'"request_timeout"' in reply and b"body did not arrive" in reply, reply
  assert _complete(_client(served), 1, "refusion", False)[1] == (
      served["completion"]["refusion"][1]["tokens"])


BAD = [
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", b'{"model": "tiny", "prompt": "x\\ud800"}', 400, "prompt"),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": '
     b'"\\udfff"}]}', 400, "messages[0].content"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "x", "stop": ["a", "\\ud83d"]}', 400,
     "stop[1]"),
    ("/v1/completions", b"[1, 2]", 400, None),
    ("/v1/completions", b"[" * 100_000 + b"]" * 100_000, 400, None),  # nested too deeply
    ("/v1/completions", b'{"model": "tiny", "prompt": [' + b"1" * 5000 + b"]}", 400, None),
    ("/v1/completions", b'{"model": "tiny", "prompt": ' + b"[" * 500 + b'"\\ud800"'
     + b"]" * 500 + b"}", 400, "prompt" + "[0]" * 500),  # deep, walked without recursion
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": "8"}, 400, "max_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": 5}, 400, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "temperature": "hot"}, 400,
     "temperature"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {"model": "gpt-4", "prompt": "hi"}, 404, "model"),
    ("/v1/completions", {"prompt": "hi"}, 400, "model"),
    ("/v1/completions", {"model": "tiny", "prompt": "word " * 40}, 400, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": [1, 2, 99999]}, 400, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": ["a", "b"]}, 400, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "top_p": 0.5}, 400, "top_p"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "n": 2}, 400, "n"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "logprobs": 2}, 400, "logprobs"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "frobnicate": 1}, 400, "frobnicate"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 64}, 400, "max_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "method": "mdm"}, 400, "method"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "method": "bogus"}, 400, "method"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "slot_size": 8}, 400, "method"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "slot_threshold": 2}, 400,
     "slot_threshold"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "seed": -1}, 400, "seed"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "ignore_eos": "yes"}, 400,
     "ignore_eos"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "stop": [1]}, 400, "stop"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "stop": ["x" * 257]}, 400, "stop"),
    ("/v1/chat/completions", {"model": "tiny", "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "robot", "content": "x"}]},
     400, "messages[0].role"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": 3}]},
     400, "messages[0].content"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                              "chat_template_kwargs": {"tools": 1}}, 400,
     "chat_template_kwargs"),
]


def test_bad_input_gets_its_4xx_and_the_server_keeps_serving(served):
  for path, body, status, param in BAD:
    if isinstance(body, bytes):
      r = httpx.post(served["url"] + path, content=body, timeout=30,
                     headers={"Content-Type": "application/json"})
    else:
      r = httpx.post(served["url"] + path, json=body, timeout=30)
    assert r.status_code == status, (body, r.text)
    err = r.json()["error"]
    assert err["message"] and err["type"], body
    assert err["param"] == param, (body, err)
  r = httpx.post(served["url"] + "/v1/completions", json={"model": "tiny", "prompt": "hi",
                                                          "max_tokens": 64}, timeout=30)
  assert "refusion:16:4:8" in r.json()["error"]["message"]  # names what is compiled
  assert "ar:16" in r.json()["error"]["message"]
  # A prompt too long for any WIDTH tokens is refused for its length, without encoding it.
  limit = served["server"].text_limit
  assert limit == Tokenizer.tiny().longest_text(WIDTH)
  for path, body in (("/v1/completions", {"model": "tiny", "prompt": "ab " * limit}),
                     ("/v1/chat/completions", {"model": "tiny", "messages": [
                         {"role": "user", "content": "ab " * limit}]})):
    r = httpx.post(served["url"] + path, json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert f"characters, more than {WIDTH} tokens can hold" in r.json()["error"]["message"]
  r = httpx.post(served["url"] + "/v1/completions", timeout=30,
                 json={"model": "tiny", "prompt": [99999] * (WIDTH + 1)})
  assert f"the prompt has {WIDTH + 1} tokens" in r.json()["error"]["message"]
  with pytest.raises(openai.NotFoundError):
    _client(served).completions.create(model="nope", prompt="hi")
  r = httpx.post(served["url"] + "/v1/completions", timeout=30,
                 json={"model": "tiny", "prompt": "hi", "method": "bogus"})
  assert "must be one of refusion, ar, mdm, bd3lm, d2f, got 'bogus'" in r.json()["error"]["message"]
  # A method the path does not take: 405 naming the ones it does (RFC 9110's Allow).
  r = httpx.get(served["url"] + "/v1/completions", timeout=30)
  assert r.status_code == 405 and r.headers["allow"] == "POST" and r.json()["error"]["message"]
  r = httpx.post(served["url"] + "/health", timeout=30)
  assert r.status_code == 405 and "GET" in r.headers["allow"]
  assert httpx.get(served["url"] + "/health").json()["status"] == "ok"
  assert _complete(_client(served), 1, "refusion", False)[1] == (
      served["completion"]["refusion"][1]["tokens"])


def test_a_long_prompt_text_is_encoded_off_the_event_loop(served, monkeypatch):
  # Encoding holds the GIL (about 1 s a MB); a long text is encoded on a worker thread
  # by the encoder that lets it go, so streams and /health go on meanwhile.
  from refusion_jax.serve import app as app_lib  # pylint: disable=import-outside-toplevel
  server, tok = served["server"], served["server"].tokenizer
  calls = []
  def encode(text, release_gil=False):
    try:
      on_loop = asyncio.get_running_loop() is not None
    except RuntimeError:  # a worker thread runs no event loop
      on_loop = False
    calls.append((len(text), release_gil, on_loop))
    return Tokenizer.encode(tok, text, release_gil=release_gil)
  monkeypatch.setattr(tok, "encode", encode)
  monkeypatch.setattr(server, "text_limit", None)  # as for a tokenizer with no bound
  url = served["url"] + "/v1/completions"
  long_text = "ab " * app_lib.ENCODE_ON_LOOP_CHARS
  r = httpx.post(url, json={"model": "tiny", "prompt": long_text}, timeout=60)
  assert r.status_code == 400 and "tokens; this server takes at most" in r.text, r.text
  r = httpx.post(url, json={"model": "tiny", "prompt": TEXTS[0], "max_tokens": 4}, timeout=60)
  assert r.status_code == 200, r.text
  assert calls == [(len(long_text), True, False), (len(TEXTS[0]), False, True)]


def test_a_body_over_max_request_bytes_gets_413_and_the_server_keeps_serving(served):
  server, limit = served["server"], 1000
  body = json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 4})
  at_limit = body[:-1] + " " * (limit - len(body)) + "}"
  over = at_limit[:-1] + " }"
  saved, server.max_request_bytes = server.max_request_bytes, limit
  try:
    url = served["url"] + "/v1/completions"
    headers = {"Content-Type": "application/json"}
    r = httpx.post(url, content=over.encode(), headers=headers, timeout=30)  # Content-Length
    assert r.status_code == 413, r.text
    err = r.json()["error"]
    assert err["code"] == "request_too_large" and err["type"] == "invalid_request_error"
    assert f"{limit + 1} bytes" in err["message"], err
    assert "--config.max_request_bytes" in err["message"]
    def chunked():  # no Content-Length: refused once what came in passes the limit
      for i in range(0, len(over), 300):
        yield over[i:i + 300].encode()
    r = httpx.post(url, content=chunked(), headers=headers, timeout=30)
    assert r.status_code == 413, r.text
    assert f"more than {limit} bytes" in r.json()["error"]["message"]
    r = httpx.post(url, content=at_limit.encode(), headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1
  finally:
    server.max_request_bytes = saved
  assert httpx.get(served["url"] + "/health").json()["status"] == "ok"
  assert _complete(_client(served), 1, "refusion", False)[1] == (
      served["completion"]["refusion"][1]["tokens"])


def test_models_health_metrics(served):
  models = _client(served).models.list().data
  assert [m.id for m in models] == ["tiny"]
  assert {(b["method"], b["gen_length"]) for b in models[0].model_extra["buckets"]} == {
      ("refusion", GEN), ("ar", GEN)}
  # A histogram shows its buckets once it has an observation: one stream for the first token.
  _complete(_client(served), 0, "refusion", True)
  text = httpx.get(served["url"] + "/metrics").text
  for name in ("refusion_requests_total", "refusion_prompt_tokens_total",
               "refusion_completion_tokens_total", "refusion_engine_passes_total",
               "refusion_queue_depth", "refusion_busy_rows",
               "refusion_request_latency_seconds_bucket",
               "refusion_time_to_first_token_seconds_bucket"):
    assert name in text, name
  passes = _metric(served, "refusion_engine_passes_total")
  _complete(_client(served), 2, "ar", False)
  assert _metric(served, "refusion_engine_passes_total") > passes


@pytest.mark.parametrize("raw, param", [
    (b'{"prompt": "x\\ud800"}', "prompt"),  # an escape
    (b'{"m": [{"c": ["a", "\\uDFFF"]}]}', "m[0].c[1]"),
    ('{"prompt": "\ud800"}'.encode("utf-8", "surrogatepass"), "prompt"),  # UTF-8 bytes
    ('{"prompt": "\ud800"}'.encode("utf-16", "surrogatepass"), "prompt"),  # a UTF-16 body
    (b'{"prompt": "\\ud83d\\ude00 \\u00e9 \xed\x9f\xbf"}', None),  # a pair, U+D7FF: fine
])
def test_protocol_loads_names_a_lone_surrogate_wherever_the_bytes_put_it(raw, param):
  if param is None:
    assert protocol.loads(raw) == {"prompt": "\U0001f600 \xe9 \ud7ff"}
    return
  with pytest.raises(protocol.ApiError, match="not valid Unicode: a lone surrogate") as e:
    protocol.loads(raw)
  assert e.value.status == 400 and e.value.param == param


def test_protocol_bounds_stop_strings():
  body = {"model": "m", "prompt": "x", "stop": ["a", "b" * protocol.MAX_STOP_CHARS]}
  assert protocol.parse(body, chat=False).stops == body["stop"]
  body["stop"][1] += "b"
  with pytest.raises(protocol.ApiError, match=f"at most {protocol.MAX_STOP_CHARS} characters"):
    protocol.parse(body, chat=False)


def test_protocol_refuses_stream_options_without_stream():
  with pytest.raises(protocol.ApiError, match="stream_options"):
    protocol.parse({"model": "m", "prompt": "x", "stream_options": {"include_usage": True}},
                   chat=False)


# Values every field of a random request is drawn from: each type JSON has, edge numbers,
# text that is not Unicode, nested shapes the fields take.
_ODD = [None, True, False, 0, 1, 2, -1, 16, 2**40, -2**70, 0.5, 1.5, 1e308, -0.0, "", "x",
        "x\ud800", "refusion", "ar", [], [1], [[5, 6]], ["a", "b"], [1, True], {}, {"a": 1},
        [{"type": "text", "text": "hi"}], [{"role": "user", "content": "hi"}],
        {"include_usage": True}, {"enable_thinking": True}, {"enable_thinking": "no"}]


def _random_bodies(seed: int, n: int):
  """(chat, body) pairs: a valid request with up to four fields set to `_ODD` values."""
  rng = np.random.default_rng(seed)
  # The fields a request's text, shape and sampling come from, four times as likely.
  core = ["prompt", "messages", "stop", "max_tokens", "temperature", "seed", "stream",
          "method", "gen_length"] * 3
  names = sorted(protocol.CHAT_FIELDS | protocol.COMPLETION_FIELDS) + ["frobnicate"] + core
  for _ in range(n):
    chat = bool(rng.integers(2))
    body = {"model": "tiny", **({"messages": [{"role": "user", "content": "ab"}]} if chat
                                else {"prompt": "ab"})}
    for _ in range(int(rng.integers(5))):
      body[names[rng.integers(len(names))]] = _ODD[rng.integers(len(_ODD))]
    yield chat, body


def test_protocol_answers_random_requests_with_a_request_or_a_4xx():
  parsed = refused = 0
  for chat, body in _random_bodies(0, 3000):
    try:
      protocol.parse(body, chat)
      parsed += 1
    except protocol.ApiError as e:
      assert 400 <= e.status < 500 and e.message, body
      json.dumps(e.body(), ensure_ascii=False).encode("utf-8")  # sendable as it is
      refused += 1
  assert parsed > 300 and refused > 300, (parsed, refused)


def test_random_requests_get_an_answer_or_a_4xx_and_the_server_keeps_serving(served):
  statuses = collections.Counter()
  for chat, body in _random_bodies(1, 150):
    path = "/v1/chat/completions" if chat else "/v1/completions"
    # json.dumps escapes a lone surrogate (\ud800) as JSON allows; the server must cope.
    r = httpx.post(served["url"] + path, content=json.dumps(body).encode(), timeout=60,
                   headers={"Content-Type": "application/json"})
    statuses[r.status_code] += 1
    assert r.status_code == 200 or 400 <= r.status_code < 500, (body, r.status_code, r.text)
    if r.status_code != 200:
      assert r.json()["error"]["message"], body
    elif body.get("stream") is True:
      assert r.text.rstrip().endswith("data: [DONE]"), (body, r.text)
    else:
      assert r.json()["usage"]["completion_tokens"] >= 1, body
  assert statuses[200] > 10 and sum(statuses.values()) - statuses[200] > 10, statuses
  assert httpx.get(served["url"] + "/health").json()["status"] == "ok"
  assert _complete(_client(served), 1, "refusion", False)[1] == (
      served["completion"]["refusion"][1]["tokens"])


def test_row_counts():
  assert serve.parse_row_counts("auto", 16, "cpu") == (1, 2, 4, 8, 12)
  assert serve.parse_row_counts("auto", 4, "cpu") == (1, 2, 3)
  assert serve.parse_row_counts("auto", 8, "cpu") == (1, 2, 4, 6)
  assert serve.parse_row_counts("auto", 64, "cpu") == (1, 2, 4, 8, 16, 32, 48)
  assert serve.parse_row_counts("auto", 1, "cpu") == ()
  assert serve.parse_row_counts("auto", 16, "gpu") == ()
  assert serve.parse_row_counts("", 16, "cpu") == ()
  assert serve.parse_row_counts(" 12, 4,8,4 ", 16, "tpu") == (4, 8, 12)
  for bad in ("16", "0", "4,x", "auto,4"):
    with pytest.raises(ValueError, match="--config.row_counts: .* is not a row count from 1 "
                                         "to 15"):
      serve.parse_row_counts(bad, 16, "cpu")
  with pytest.raises(ValueError, match="must be a string"):
    serve.parse_row_counts(8, 16, "cpu")


def test_admit_widths():
  assert serve.parse_admit_widths("auto", 256) == (16, 32, 64, 128)
  assert serve.parse_admit_widths("auto", 48) == (16, 32)
  assert serve.parse_admit_widths("auto", 16) == ()
  assert serve.parse_admit_widths("auto", 4096) == (256, 512, 1024, 2048)
  assert serve.parse_admit_widths("", 256) == ()
  assert serve.parse_admit_widths(" 64, 32,32 ", 256) == (32, 64)
  for bad in ("256", "0", "32,x", "auto,32"):
    with pytest.raises(ValueError, match="--config.admit_widths: .* is not a prompt width "
                                         "from 1 to 255"):
      serve.parse_admit_widths(bad, 256)
  with pytest.raises(ValueError, match="must be a string"):
    serve.parse_admit_widths(32, 256)


def _serves_the_same(served):
  """Prompts 0 and 1 of both methods, streamed and not, equal `sample`'s text, tokens
  and passes; so do 16 concurrent streams."""
  cl = _client(served)
  for method in ("refusion", "ar"):
    for i in range(2):
      want = served["completion"][method][i]
      for stream in (False, True):
        text, ids, _, usage = _complete(cl, i, method, stream)
        assert (text, ids) == (want["text"], want["tokens"]), (method, i, stream)
        assert usage.model_extra["nfe"] == want["nfe"]
  _sixteen_concurrent_streams(served)


def test_thread_engine_serves_the_same(served_thread):
  # --config.engine=thread: the same scheduler on a thread of the server's process.
  _serves_the_same(served_thread)


def test_a_hugging_face_folder_serves_what_its_model_folder_does(oracle, tmp_path):
  # The released checkpoints come as HF folders (config.json + safetensors): served from
  # one (here an export of the test model), greedy answers equal the model folder's.
  from refusion_jax import hf  # pylint: disable=import-outside-toplevel
  config, model = loading.load_model(oracle["model_dir"])
  hf_dir = str(tmp_path / "hf")
  hf.save(config, model, hf_dir)
  info, stop = _serving({**oracle, "model_dir": hf_dir}, "thread")
  try:
    cl = _client(info)
    for method in ("refusion", "ar"):
      for i, stream in ((0, False), (3, True)):
        got = _complete(cl, i, method, stream)
        want = oracle["completion"][method][i]
        assert got[1] == want["tokens"], (method, i, stream)
        assert got[3].model_extra["nfe"] == want["nfe"], (method, i)
  finally:
    stop()


def _scheduler_config(served_thread):
  """The served_thread's settings (one bucket, row counts 1-3) for a scheduler built
  in this process: it reuses the served_thread's programs, so nothing new compiles."""
  c = serve_config.get_config()
  c.model_dir, c.rows, c.max_prompt_len = served_thread["model_dir"], ROWS, WIDTH
  c.max_queue, c.chunk_passes, c.buckets, c.row_counts = QUEUE, 2, "", "1,2,3"
  c.decode.gen_length, c.decode.slot_size, c.decode.block_size = GEN, SLOT, BLOCK
  for k, v in SETTINGS.items():
    c.decode[k] = v
  return c


def _before_programs(monkeypatch, names, before):
  """Patches the engine programs `names` so that `before(name)` runs ahead of each call
  (on the thread that makes it; it may raise); they keep their compile counts
  (`compiled_lib.compiled_programs`)."""
  for name in names:
    real = getattr(compiled_lib, name)

    def wrapped(*args, _real=real, _name=name, **kwargs):
      before(_name)
      return _real(*args, **kwargs)
    wrapped._cache_size = real._cache_size  # pylint: disable=protected-access
    monkeypatch.setattr(compiled_lib, name, wrapped)


def _submit_text(sched, served_thread, i, deliver):
  """Submits completion prompt i (greedy, the bucket's default knobs) to `sched`."""
  bucket = sched.buckets[0]
  sched.submit(Job(prompt=served_thread["tok"].encode(TEXTS[i]), bucket=bucket,
                   knobs=sched.default_knobs(bucket), rng2=np.zeros((2,), np.uint32),
                   max_tokens=GEN, watch=False, slots=False, deliver=deliver))


def test_a_decoder_failure_fails_the_requests_in_flight_and_the_engine_serves_on(
    served_thread, monkeypatch):
  # A run that raises on the engine thread: the requests in flight get the error,
  # the scheduler keeps it (what /health answers with, 503), and later requests are
  # decoded on fresh rows, as `refusion_jax.sample` decodes them.
  want = served_thread["completion"]["refusion"]
  c = _scheduler_config(served_thread)
  sched = serve.make_scheduler(c)  # the served_thread's programs: nothing new compiles
  failures = []

  def fail_first(_):
    if not failures:
      failures.append(threading.current_thread().name)
      raise RuntimeError("the device went away")
  # The first run fails, whatever its rows.
  _before_programs(monkeypatch, ("live_run", "live_run_rows"), fail_first)
  results, done = {}, threading.Event()

  def deliver_to(i, n):
    def deliver(kind, payload):
      if kind in ("done", "error"):
        results[i] = payload.tokens if kind == "done" else ("error", payload)
        if len(results) == n:
          done.set()
    return deliver
  try:
    sched.start()
    for i in range(2):
      _submit_text(sched, served_thread, i, deliver_to(i, 2))
    assert done.wait(60), results
    assert failures and failures[0].startswith("refusion-engine"), failures
    for i in range(2):
      assert results[i] == ("error", "the decoder failed: RuntimeError: the device went away"), i
    assert sched.error == "RuntimeError: the device went away"
    results.clear()
    done.clear()
    for i in range(2, 5):
      _submit_text(sched, served_thread, i, deliver_to(i, 3))
    assert done.wait(60), results
  finally:
    sched.stop()
  for i in range(2, 5):
    assert results[i] == want[i]["tokens"], i


def test_the_wait_for_a_returning_client_ends_on_a_request_or_the_pass():
  class Pending:
    def __init__(self):
      self.event = threading.Event()

    @property
    def done(self):
      return self.event.is_set()

    @done.setter
    def done(self, value):
      if value:
        self.event.set()
      else:
        self.event.clear()

    def ready(self):
      return self.event.is_set()

    def wait(self):
      self.event.wait()

  fake = types.SimpleNamespace(_inbox=[], _stop=False, _hold=threading.Event(),
                               _wake=threading.Event(), _return_poll_s=0.01,
                               _watch_q=queue.SimpleQueue())
  pending = Pending()

  def waited():
    t = time.perf_counter()
    Scheduler._await_return(fake, pending)  # pylint: disable=protected-access
    return time.perf_counter() - t

  def arrive():
    fake._inbox.append(object())  # pylint: disable=protected-access
    fake._wake.set()  # pylint: disable=protected-access

  threading.Timer(0.2, arrive).start()  # a request comes in
  assert 0.15 < waited() < 10
  fake._inbox.clear()  # pylint: disable=protected-access
  threading.Timer(0.2, lambda: setattr(pending, "done", True)).start()  # the pass has run
  assert 0.15 < waited() < 10
  assert waited() < 0.1  # already run: no wait
  pending.done = False
  arrive()
  assert waited() < 0.1  # a request already in: no wait
  # The watcher wakes the wait once the pass has run: no need to look again.
  fake._inbox.clear()  # pylint: disable=protected-access
  fake._return_poll_s = 60.0  # pylint: disable=protected-access
  fake._watch_q = queue.SimpleQueue()  # pylint: disable=protected-access
  watch = Scheduler._watch  # pylint: disable=protected-access
  watcher = threading.Thread(target=watch, args=(fake,), daemon=True)
  watcher.start()
  pending = Pending()
  threading.Timer(0.2, lambda: setattr(pending, "done", True)).start()
  assert 0.15 < waited() < 10
  fake._watch_q.put(None)  # pylint: disable=protected-access
  watcher.join(10)
  assert not watcher.is_alive()


def test_progress_goes_out_every_chunk_passes_while_a_row_is_free(served_thread):
  # One AR stream on 4 rows: the lane returns after every pass (a row is free), but
  # the stream's progress goes out with its first text, then every chunk_passes (2)
  # passes at most; the tokens are the same.
  c = _scheduler_config(served_thread)
  c.buckets = f"ar:{GEN}"  # the served_thread's programs: nothing new compiles
  sched = serve.make_scheduler(c)
  sched.start()
  bucket = [b for b in sched.buckets if b.method == "ar"][0]
  try:
    for i in range(2):
      events, done = [], threading.Event()

      def deliver(kind, payload, events=events, done=done):
        events.append((kind, payload))
        if kind in ("done", "error"):
          done.set()
      sched.submit(Job(prompt=served_thread["tok"].encode(TEXTS[i]), bucket=bucket,
                       knobs=sched.default_knobs(bucket), rng2=np.zeros((2,), np.uint32),
                       max_tokens=GEN, watch=True, slots=False, deliver=deliver))
      assert done.wait(60), events
      want = served_thread["completion"]["ar"][i]
      assert events[-1][0] == "done" and events[-1][1].tokens == want["tokens"]
      progress = [p for k, p in events if k == "progress"]
      assert progress and progress[0][1] <= 2  # the first text at the first read
      nfe = [n for _, n in progress]
      assert all(b - a >= c.chunk_passes for a, b in zip(nfe, nfe[1:])), nfe
      got = sum((t for t, _ in progress), [])  # each report: the tokens since the last
      assert got == want["tokens"][:len(got)] and all(t for t, _ in progress)
      assert len(progress) <= 1 + want["nfe"] // c.chunk_passes, (len(progress), want["nfe"])
  finally:
    sched.stop()


def test_waiting_for_returning_clients_changes_no_token(served_thread):
  # Run ahead (a CPU's order), a turn whose deliveries freed rows waits for a returning
  # client: four closed-loop clients, each sending its next prompt a moment after its
  # response (a round trip), on four rows; every answer is sample's.
  c = _scheduler_config(served_thread)
  sched = serve.make_scheduler(c)  # the served_thread's programs: nothing new compiles
  assert not sched.read_first
  waits = []
  real_wait = sched._await_return  # pylint: disable=protected-access

  def counted_wait(pending):
    waits.append(1)
    real_wait(pending)

  sched._await_return = counted_wait  # pylint: disable=protected-access
  sched.start()
  results, done = {}, threading.Event()

  def submit(i):
    def deliver(kind, payload):
      results[i] = payload.tokens if kind == "done" else payload
      if i + ROWS < len(TEXTS):
        threading.Timer(0.002, submit, (i + ROWS,)).start()
      if len(results) == len(TEXTS):
        done.set()
    _submit_text(sched, served_thread, i, deliver)

  try:
    for i in range(ROWS):
      submit(i)
    assert done.wait(60), sorted(results)
  finally:
    sched.stop()
  for i in range(len(TEXTS)):
    assert results[i] == served_thread["completion"]["refusion"][i]["tokens"], i
  assert waits, "no turn waited for a returning client"


def _closed_loop_passes(served_thread, read_first: bool, queues) -> tuple[int, dict]:
  """Closed-loop clients on a scheduler that reads first or runs ahead: client k
  sends the prompts of `queues[k]`, (prompt, max_tokens) pairs, one after the other,
  each from within the delivery of the last one's response (a client that takes no
  time; it watches progress when max_tokens is below GEN, as the server's requests do).
  (The lane's passes, {prompt: (tokens, the request's own passes)})."""
  c = _scheduler_config(served_thread)
  sched = serve.make_scheduler(c)  # the served_thread's programs: nothing new compiles
  assert not sched.read_first  # a CPU's order; a GPU's is set here
  sched.read_first = read_first
  compiled = compiled_lib.compiled_programs()
  bucket = sched.buckets[0]
  lane = next(iter(sched._lanes.values()))  # pylint: disable=protected-access
  before = lane.batch.read().passes
  results, done = {}, threading.Event()
  total = sum(len(q) for q in queues)

  def submit(todo):
    i, max_tokens = todo.pop(0)

    def deliver(kind, payload):
      if kind == "progress":
        return
      results[i] = (payload.tokens, payload.forward_passes) if kind == "done" else payload
      if todo:
        submit(todo)
      if len(results) == total:
        done.set()
    sched.submit(Job(prompt=served_thread["tok"].encode(TEXTS[i]), bucket=bucket,
                     knobs=sched.default_knobs(bucket), rng2=np.zeros((2,), np.uint32),
                     max_tokens=max_tokens, watch=max_tokens < GEN, slots=False,
                     deliver=deliver))

  try:
    sched.hold(True)  # every client's first prompt admitted before the first pass
    for q in queues:
      submit(list(q))
    sched.start()
    sched.hold(False)
    assert done.wait(60), sorted(results)
  finally:
    sched.stop()
  assert compiled_lib.compiled_programs() == compiled  # either order: the same programs
  return lane.batch.read().passes - before, results


def test_reading_first_a_client_that_comes_back_at_once_joins_the_next_pass(
    served_thread):
  # Reading first (a GPU's order, whose dispatch returns only once its passes have
  # run): a response goes out before the next pass is dispatched, so a
  # client that sends its next prompt at once joins that pass and its row never sits
  # out. Two such clients on 4 rows, one sending short requests (max_tokens 3) that
  # finish while the other's run on, then take exactly as many passes as the longer of
  # their requests' own passes added up. Run ahead (the order elsewhere), a freed row
  # sits out the pass dispatched before its read while the other row decodes.
  want = served_thread["completion"]["refusion"]
  queues = [[(i, 3) for i in range(8)], [(8, GEN), (9, GEN)]]
  passes, results = _closed_loop_passes(served_thread, True, queues)
  longer = max(sum(results[i][1] for i, _ in q) for q in queues)
  assert passes == longer
  ahead_passes, ahead_results = _closed_loop_passes(served_thread, False, queues)
  assert ahead_passes > longer
  assert ahead_results == results  # the same tokens and passes for every request
  for q in queues:
    for i, max_tokens in q:
      assert results[i][0] == want[i]["tokens"][:max_tokens], i


@pytest.mark.parametrize("field,value,needle", [
    ("rows", 0, "--config.rows must be a positive int"),
    ("chunk_passes", 0, "--config.chunk_passes must be a positive int"),
    ("admit_widths", "256", "--config.admit_widths: '256' is not a prompt width from 1 to 255"),
    ("port", 70000, "--config.port must be in [0, 65536)"),
    ("engine", "fork", "--config.engine must be"),
    ("request_timeout_s", 0.0, "--config.request_timeout_s must be a positive number"),
    ("max_request_bytes", 0, "--config.max_request_bytes must be a positive int"),
    ("compile_cache_dir", __file__, "is a file, not a folder"),
    ("compile_cache_dir", os.path.join(__file__, "cache"),
     f"cannot be made: {__file__!r} is not a folder this process may write to"),
])
def test_bad_server_flags_are_named_before_loading(oracle, field, value, needle):
  c = serve_config.get_config()
  c.model_dir, c.rows = oracle["model_dir"], ROWS
  c[field] = value
  with pytest.raises(ValueError, match=re.escape(needle)):
    serve.check_flags(c)


def test_the_server_says_what_it_compiles_and_which_endpoint_a_chat_model_wants(
    served_thread):
  """Between "loaded" and "listening": a line before the buckets compile and one as each is
  ready; a chat model (its tokenizer has a chat template) names the endpoint it wants."""
  lines = served_thread["start_log"].splitlines()
  names = [f"refusion:{GEN}:{SLOT}:{BLOCK}", f"ar:{GEN}"]
  assert lines[0].startswith("[serve] loaded ") and lines[1].startswith(
      "[serve] compiling 2 bucket(s) before listening"), lines
  assert [line.split(" ready in ")[0] for line in lines[2:4]] == [
      f"[serve] bucket {i + 1}/2 {name}" for i, name in enumerate(names)], lines
  assert lines[4].startswith("[serve] compiled 2 bucket(s)"), lines
  assert lines[5].startswith("[serve] a chat model (its tokenizer has a chat template): ask "
                             "/v1/chat/completions"), lines


def test_served_passes_ran_over_fewer_rows(served_thread):
  # The server (4 rows, row_counts "1,2,3") ran single requests over 1 row and the
  # 16 concurrent ones over all 4: the smaller programs are in use.
  sched = served_thread["server"].scheduler
  assert sched.row_counts == (1, 2, 3)
  _complete(_client(served_thread), 5, "refusion", False)
  _sixteen_concurrent_streams(served_thread)  # whichever tests ran on this server before
  used = sum((lane.batch.runs_by_rows for lane in sched._lanes.values()),  # pylint: disable=protected-access
             collections.Counter())
  assert used[1] > 0 and used[ROWS] > 0, used


def test_served_admissions_prefilled_at_the_narrower_width(served_thread):
  # Prompts up to 32 tokens, "auto" admit widths: a short prompt is prefilled at 16.
  sched = served_thread["server"].scheduler
  assert sched.admit_widths == (16,)
  _complete(_client(served_thread), 1, "refusion", False)
  used = sum((lane.batch.admits_by_width for lane in sched._lanes.values()),  # pylint: disable=protected-access
             collections.Counter())
  assert used[16] > 0, used


def test_nothing_compiled_while_serving(served_thread):
  # Every request above (shapes, knobs, seeds, admissions of any size) reused the
  # programs compiled at start-up (and the oracle's, compiled before).
  assert compiled_lib.compiled_programs() == served_thread["compiled"]


def test_engine_process_start_up_error_is_raised(oracle, tmp_path):
  bad = tmp_path / "bad"
  bad.mkdir()  # the model's config without its weights: only loading the model fails
  shutil.copy(os.path.join(oracle["model_dir"], "model_config.json"), bad)
  c = serve_config.get_config()
  c.model_dir, c.rows, c.max_prompt_len = str(bad), 2, WIDTH
  # Raised in the engine process, raised again here with its type (the entry point
  # reports it as a user error), and the engine process is gone.
  before = set(multiprocessing.active_children())
  with pytest.raises(FileNotFoundError, match=f"{bad}/params"):
    serve.build(c)
  assert set(multiprocessing.active_children()) <= before


@pytest.mark.parametrize("engine_mode", ["process", "thread"])
def test_a_tokenizer_that_does_not_fit_is_refused_before_the_engine_starts(
    oracle, tmp_path, monkeypatch, engine_mode):
  other = tmp_path / "other"  # a model folder with its own tokenizer, whose eos differs
  shutil.copytree(oracle["model_dir"], other)
  for name in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(os.path.join(tokenizer_lib.TINY_TOKENIZER_DIR, name), other)
  with open(other / "model_config.json", encoding="utf-8") as f:
    fields = json.load(f)
  fields["eos_token_id"] += 1
  (other / "model_config.json").write_text(json.dumps(fields))

  def never(*args, **kwargs):
    raise AssertionError("the engine started before the tokenizer was checked")

  monkeypatch.setattr(engine_process, "EngineProcess", never)
  monkeypatch.setattr(serve, "make_scheduler", never)
  c = serve_config.get_config()
  c.model_dir, c.rows, c.max_prompt_len, c.engine = str(other), 2, WIDTH, engine_mode
  with pytest.raises(ValueError, match="does not match the model config: model config "
                     f"eos_token_id={fields['eos_token_id']}"):
    serve.build(c)


def test_engine_process_keeps_its_programs_in_the_compile_cache(oracle, tmp_path):
  """The engine process keeps the programs it compiles in --config.compile_cache_dir
  (made if missing), each of them, however quickly it compiled."""
  cache = tmp_path / "cache" / "serve"
  info, stop = _serving(oracle, "process", row_counts="", rows=1, buckets="",
                        compile_cache_dir=str(cache))
  try:
    kept = os.listdir(cache)
    for name in ("admit", "live_run", "live_read"):
      assert any(f.startswith(f"jit_{name}-") for f in kept), (name, kept)
    for i in range(2):
      _, ids, _, _ = _complete(_client(info), i, "refusion", False)
      assert ids == oracle["completion"]["refusion"][i]["tokens"], i
  finally:
    stop()


def test_engine_process_death_fails_requests_and_health(oracle):
  info, stop = _serving(oracle, "process", row_counts="", rows=1, buckets="")  # a small one
  try:
    sched = info["server"].scheduler
    # The event loop reads the engine's events itself (no reader thread), also at its end.
    assert sched.delivers_in_loop and sched._reader is None  # pylint: disable=protected-access
    sched.hold(True)
    with httpx.stream("POST", info["url"] + "/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": "hi", "stream": True}) as r:
      deadline = time.time() + 10
      while sched.busy_rows() != 1:
        assert time.time() < deadline, "the request was not admitted"
        time.sleep(0.02)
      sched._proc.kill()  # pylint: disable=protected-access
      events = [json.loads(line[6:]) for line in r.iter_lines()
                if line.startswith("data: {")]
    assert events[-1]["error"]["code"] == "engine_error"
    assert "engine process exited" in events[-1]["error"]["message"]
    h = httpx.get(info["url"] + "/health", timeout=5)
    assert h.status_code == 503 and "engine process exited" in h.json()["error"]
    r = httpx.post(info["url"] + "/v1/completions", timeout=10,
                   json={"model": "tiny", "prompt": "hi"})
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_down"
  finally:
    stop()


def test_sigterm_drains_and_exits_zero(served, tmp_path):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  long_gen = 192
  cmd = [sys.executable, "-m", "refusion_jax.serve", "--config=configs/serve.py",
         f"--config.model_dir={served['model_dir']}", "--config.port=0", "--config.rows=2",
         "--config.max_prompt_len=16", "--config.decode.method=ar",
         f"--config.decode.gen_length={long_gen}", f"--config.decode.slot_size={long_gen}",
         f"--config.decode.block_size={long_gen}", "--config.chunk_passes=1",
         "--config.drain_timeout_s=20", "--config.model_name=tiny"]
  proc = subprocess.Popen(cmd, cwd=REPO, env=env, stderr=subprocess.PIPE, text=True)
  try:
    url = None
    deadline = time.time() + 120
    while url is None:
      assert time.time() < deadline and proc.poll() is None, "the server did not start"
      line = proc.stderr.readline()
      m = re.search(r"listening on (http://\S+)", line)
      url = m.group(1) if m else None
    # A stream in flight when SIGTERM arrives is finished, then the process exits 0. A
    # client that has sent its headers and part of its body is answered at once (a JSON
    # 503), not held until the drain ends, and nothing is logged as a traceback.
    host, port = url[len("http://"):].split(":")
    partial = socket.create_connection((host, int(port)), timeout=30)
    body = json.dumps({"model": "tiny", "prompt": "hi"}).encode()
    partial.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                    b"application/json\r\nContent-Length: " + str(len(body)).encode()
                    + b"\r\n\r\n" + body[:5])
    chunks, finish = [], None
    with httpx.stream("POST", url + "/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": [5, 6, 7], "stream": True}) as r:
      lines = r.iter_lines()
      for line in lines:
        if line.startswith("data: {"):
          chunks.append(json.loads(line[6:]))
          break
      proc.send_signal(signal.SIGTERM)
      sent = time.perf_counter()
      answer = _raw_reply(partial)
      answered_s = time.perf_counter() - sent
      head, _, payload = answer.partition(b"\r\n\r\n")
      assert head.startswith(b"HTTP/1.1 503"), answer
      assert b"application/json" in head.lower(), head
      assert json.loads(payload)["error"]["code"] == "shutting_down"
      assert answered_s < 3, answered_s
      partial.close()
      for line in lines:
        if line.startswith("data: {"):
          chunks.append(json.loads(line[6:]))
          finish = chunks[-1]["choices"][0]["finish_reason"] or finish
    assert sum(bool(c["choices"][0]["text"]) for c in chunks[1:]) >= 2  # text came after it
    assert finish in ("stop", "length")
    tokens = chunks[-1]["choices"][0]["token_ids"]
    assert len(tokens) == long_gen or tokens[-1] == 1
    assert proc.wait(timeout=60) == 0
    log = proc.stderr.read()
    assert "Traceback" not in log and "CancelledError" not in log, log
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()


def test_the_shipped_base_is_served_by_its_short_name(tmp_path, monkeypatch):
  # --config.model_dir=base_tiny (no folder of that name here): the base shipped in the
  # package, as `refusion_jax.sample` takes it; the engine gets its folder.
  from refusion_jax import packaged  # pylint: disable=import-outside-toplevel
  monkeypatch.chdir(tmp_path)
  seen = []

  class Started(Exception):
    pass

  def record(c, **kwargs):
    del kwargs
    seen.append(c.model_dir)
    raise Started
  monkeypatch.setattr(engine_process, "EngineProcess", record)
  c = serve_config.get_config()
  c.model_dir = "base_tiny"
  with pytest.raises(Started):
    serve.build(c)
  assert seen == [packaged.BASE_TINY_DIR]


def test_the_server_process_starts_no_jax_backend():
  """Under --config.engine=process the server process reads the model's config and its
  tokenizer but starts no JAX backend (on an accelerator, one process holds it: the
  engine's), from build through an answered request."""
  code = """
import jax
from starlette.testclient import TestClient
from configs import serve as serve_config
from refusion_jax import serve
jax.config.update("jax_platforms", "no_such_platform")  # a backend started here fails
c = serve_config.get_config()
c.model_dir, c.rows, c.max_prompt_len = "base_tiny", 1, 32
c.row_counts, c.admit_widths = "", ""
c.decode.method, c.decode.gen_length = "ar", 8
asgi, _ = serve.build(c)  # the engine process starts, with the environment's platform
with TestClient(asgi) as client:
  reply = client.post("/v1/completions",
                      json={"model": "base_tiny", "prompt": "copy 42", "max_tokens": 8})
print(reply.status_code, reply.json()["choices"][0]["finish_reason"])
"""
  done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                        text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  assert done.stdout.split()[-2:] in (["200", "stop"], ["200", "length"]), done.stdout
