"""The lm-eval model `refusion_jax`: generate_until through the batched decode engine.

  python -m refusion_jax.lm_eval --model refusion_jax \\
      --model_args model_dir=DIR,method=refusion,slot_size=32,block_size=128 \\
      --tasks gsm8k_cot --apply_chat_template

(`refusion_jax.lm_eval` registers this model and our task folder, then runs
lm-eval's own command line; `import refusion_jax.lmeval.model` is enough to
register it in a Python session.)

Every request of a `generate_until` call is decoded by one continuous-batching
engine (`batch_size` rows; each prompt decodes exactly as it would alone, so
the answers do not depend on the batch size). The answer handling is the
release's (ALGORITHM.md, "Evaluation as the paper ran it"): the generated ids
are decoded with special tokens kept, cut at the first stop sequence,
re-tokenized and decoded without special tokens, and where a fenced block
starting "```python\\n" is present only its body is kept. Generation length,
temperature and the decoding method come from the model arguments (the
paper's Table 5 settings), not from a task's `max_gen_toks` / `temperature`.

Several JAX processes (a TPU slice, `jax.distributed`) split the requests:
process p decodes requests p, p + P, p + 2P, ... on its own devices, the
results are all-gathered, and every process returns the same answers, so
lm-eval (which sees one process) computes the same metrics everywhere.

Each decoded request leaves a `Record` (tokens up to EOS, forward passes,
the paper's TPF, seconds) in `records`, for the benchmark statistics.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import Any, Iterable, Sequence

import jax
import lm_eval.models  # noqa: F401  (lm-eval's own models first: it loads them only into an empty registry)
import numpy as np
import tqdm
from jax.experimental import multihost_utils
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

from refusion_jax import loading
from refusion_jax.decode import engine as engine_lib
from refusion_jax.decode import settings
from refusion_jax.lmeval import GenerativeOnlyError

FENCE_OPEN = "```python\n"
FENCE = "```"
# The model arguments besides the decode fields (every `settings.flat_fields()` name).
MODEL_ARGS = ("model_dir", "tokenizer_dir", "adapter_dir", "batch_size", "enable_thinking",
              "seed", "progress")
# The decode fields' defaults here where they differ from DecodeConfig's: the paper's
# Table 5 shape (512 tokens, slots of 32 in blocks of 128).
DECODE_DEFAULTS = dict(gen_length=512, slot_size=32, block_size=128)
_WHERE = "refusion_jax model arg"


def cut_at_stop(text: str, until: Iterable[str]) -> str:
  """`text` up to the earliest occurrence of any stop sequence."""
  end = len(text)
  for stop in until:
    if stop:
      at = text.find(stop)
      if 0 <= at < end:
        end = at
  return text[:end]


def fenced_body(text: str) -> str:
  """The body of the first "```python\\n" block (to its closing fence or the end)."""
  start = text.find(FENCE_OPEN)
  if start < 0:
    return text
  body = text[start + len(FENCE_OPEN):]
  close = body.find(FENCE)
  return body if close < 0 else body[:close]


def answer_text(tokenizer, token_ids: Sequence[int], until: Iterable[str]) -> str:
  """The release's answer handling of one generation (module docstring)."""
  with_special = tokenizer.decode(list(token_ids), skip_special_tokens=False)
  cut = cut_at_stop(with_special, until)
  plain = tokenizer.decode(tokenizer.encode(cut), skip_special_tokens=True)
  return fenced_body(plain)


def _until_of(gen_kwargs: Any) -> list[str]:
  if not isinstance(gen_kwargs, dict):
    raise ValueError(f"generate_until: expected a dict of generation kwargs, got {gen_kwargs!r}")
  until = gen_kwargs.get("until", [])
  if isinstance(until, str):
    until = [until]
  if not isinstance(until, (list, tuple)) or not all(isinstance(u, str) for u in until):
    raise ValueError(f"generate_until: 'until' must be a string or a list of strings, "
                     f"got {until!r}")
  return list(until)


@dataclasses.dataclass
class Record:
  """One decoded request."""

  task: str | None
  doc_id: int | None
  prompt: str
  prompt_tokens: int
  generation: str  # decoded with special tokens kept, before the stop cut
  answer: str  # after the answer handling (what lm-eval scores)
  tokens: int  # generated tokens up to and including EOS
  passes: int  # forward passes of this prompt (every kind counted)
  tpf_paper: float
  seconds: float  # from its admission to the end of the call that finished it
  truncated: int  # prompt tokens dropped from the left to fit the context


@register_model("refusion_jax")
class RefusionLM(LM):
  """A refusion_jax model (ReFusion, AR or MDM decoding) as an lm-eval generative LM."""

  def __init__(self, model_dir: str | None = None, *, model=None, tokenizer=None,
               tokenizer_dir: str = "", adapter_dir: str = "", batch_size: int | str = 1,
               enable_thinking: bool = True, seed: int = 0, progress: bool = True,
               max_batch_size: Any = None, device: Any = None, **decode_args):
    super().__init__()
    del max_batch_size, device  # lm-eval passes them to every model; the engine has rows
    unknown = sorted(set(decode_args) - set(settings.flat_fields()))
    if unknown:
      raise ValueError(f"refusion_jax: unknown model arg(s) {unknown}; known: "
                       f"{', '.join(MODEL_ARGS + tuple(settings.flat_fields()))}")
    if isinstance(batch_size, str) and batch_size.startswith("auto"):
      raise ValueError("refusion_jax: batch_size='auto' is not supported; give the number of "
                       "engine rows (e.g. --batch_size 16)")
    self.rows = settings.parse_value("batch_size", batch_size, _WHERE, int)
    if self.rows < 1:
      raise ValueError(f"refusion_jax: batch_size must be >= 1, got {batch_size!r}")
    self.decode_config = settings.from_args({**DECODE_DEFAULTS, **decode_args}, _WHERE)
    self.enable_thinking = settings.parse_value("enable_thinking", enable_thinking, _WHERE, bool)
    self.progress = settings.parse_value("progress", progress, _WHERE, bool)
    self.seed = settings.parse_value("seed", seed, _WHERE, int)
    if model is None:
      if not model_dir:
        raise ValueError("refusion_jax: model_dir=... is required (a refusion_jax model folder, "
                         "a HF Qwen3 checkpoint folder or a shipped model's name)")
      _, model = loading.load_model(str(model_dir), adapter_dir=str(adapter_dir or ""),
                                    flag="refusion_jax: model_dir")
    self.model = model
    self.model_dir = model_dir
    if tokenizer is None:
      tokenizer = loading.load_tokenizer(str(model_dir or ""), model.config,
                                         str(tokenizer_dir or ""), flag="refusion_jax: model_dir",
                                         tokenizer_flag="tokenizer_dir=...")
    self.tokenizer = tokenizer
    self.decoder = engine_lib.decoder_for(model, self.decode_config)
    self.records: list[Record] = []
    self.decode_seconds = 0.0  # wall time of the engine runs (compiles excluded)
    self.passes = 0  # engine passes (every row advanced by each)

  # --------------------------------------------------------------- lm-eval API

  @property
  def tokenizer_name(self) -> str:
    return f"refusion_jax:{self.tokenizer.source}"

  def chat_template(self, chat_template: bool | str = False) -> str | None:
    return self.tokenizer.chat_template if chat_template else None

  def apply_chat_template(self, chat_history: list[dict[str, str]],
                          add_generation_prompt: bool = True) -> str:
    """The chat template with `enable_thinking`; a trailing assistant message (a task's
    `gen_prefix`) is continued, not closed."""
    history = [dict(m) for m in chat_history]
    if not add_generation_prompt and history and history[-1].get("role") == "assistant":
      prefix = history.pop()["content"]
      return self.tokenizer.apply_chat_template(
          history, add_generation_prompt=True, enable_thinking=self.enable_thinking) + prefix
    return self.tokenizer.apply_chat_template(history, add_generation_prompt=add_generation_prompt,
                                              enable_thinking=self.enable_thinking)

  def loglikelihood(self, requests, disable_tqdm: bool = False):
    raise GenerativeOnlyError(
        "refusion_jax is generative only: this task asks for log-likelihoods "
        f"({len(requests)} requests); use a generate_until task (the paper's seven "
        "benchmarks are all generative, e.g. arc_challenge_chat instead of arc_challenge)")

  def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
    raise GenerativeOnlyError(
        "refusion_jax is generative only: this task asks for rolling log-likelihoods "
        "(perplexity); use a generate_until task")

  def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
    if not requests:
      return []
    contexts, untils, keys = [], [], []
    for req in requests:
      context, gen_kwargs = req.args[0], req.args[1]
      if not isinstance(context, str):
        raise ValueError(f"generate_until: the context must be a string, got {type(context)}")
      contexts.append(context)
      untils.append(_until_of(gen_kwargs))
      keys.append((getattr(req, "task_name", None), getattr(req, "doc_id", None)))
    prompts, dropped = self._encode(contexts)
    outs = self.decode(prompts, progress=self.progress and not disable_tqdm)
    answers = []
    for (task, doc_id), context, ids, cut, until, out in zip(keys, contexts, prompts, dropped,
                                                              untils, outs):
      tokens, passes, tpf_paper, seconds = out
      answer = answer_text(self.tokenizer, tokens, until)
      self.records.append(Record(
          task=task, doc_id=doc_id, prompt=context, prompt_tokens=len(ids),
          generation=self.tokenizer.decode(tokens, skip_special_tokens=False), answer=answer,
          tokens=len(tokens), passes=passes, tpf_paper=tpf_paper, seconds=seconds,
          truncated=cut))
      answers.append(answer)
    return answers

  # ------------------------------------------------------------------ decoding

  def _encode(self, contexts: Sequence[str]) -> tuple[list[list[int]], list[int]]:
    """Token ids of each context, cut from the left to fit the model's context."""
    limit = self.model.config.max_position_embeddings - self.decode_config.gen_length
    if limit < 1:
      raise ValueError(f"gen_length={self.decode_config.gen_length} leaves no room for a prompt "
                       f"within max_position_embeddings="
                       f"{self.model.config.max_position_embeddings}")
    prompts, dropped = [], []
    for context in contexts:
      ids = self.tokenizer.encode(context)
      if not ids:
        raise ValueError("generate_until: an empty prompt cannot be decoded")
      cut = max(0, len(ids) - limit)
      prompts.append(ids[cut:])
      dropped.append(cut)
    if any(dropped):
      print(f"refusion_jax: {sum(1 for d in dropped if d)} prompt(s) longer than "
            f"{limit} tokens were cut from the left", file=sys.stderr)
    return prompts, dropped

  def decode(self, prompts: Sequence[Sequence[int]], progress: bool = False
             ) -> list[tuple[list[int], int, float, float]]:
    """(tokens, passes, tpf_paper, seconds) per prompt, in order; split over processes."""
    world, rank = jax.process_count(), jax.process_index()
    mine = list(range(rank, len(prompts), world))
    engine = self.decoder.engine(self.rows)
    engine.warm_up([len(prompts[i]) for i in mine])  # compiles are not decode time
    bar = None
    if progress and mine:
      bar = tqdm.tqdm(total=len(mine), desc=f"refusion_jax {self.decode_config.method}",
                      unit="req", file=sys.stderr)
    t0 = time.perf_counter()
    run = engine.run([prompts[i] for i in mine], jax.random.key(self.seed), progress=bar)
    wall = time.perf_counter() - t0
    if bar is not None:
      bar.close()
    local = [(r.tokens, int(r.counters["nfe_b"]), float(r.counters["tpf_paper_b"]), r.seconds)
             for r in run.results]
    if world == 1:
      self.decode_seconds += wall
      self.passes += run.passes
      return local
    gathered, wall_max, passes = _all_gather(local, len(prompts), world,
                                             self.decode_config.gen_length, wall, run.passes)
    self.decode_seconds += wall_max
    self.passes += passes
    return gathered


def _all_gather(local, total: int, world: int, gen_length: int, wall: float, passes: int):
  """Every process's results, back in request order, on every process."""
  per = -(-total // world)
  tokens = np.zeros((per, gen_length), np.int32)
  lengths = np.full((per,), -1, np.int32)
  stats = np.zeros((per, 3), np.float64)  # passes, tpf_paper, seconds
  for j, (toks, nfe, tpf, sec) in enumerate(local):
    tokens[j, :len(toks)] = toks
    lengths[j] = len(toks)
    stats[j] = (nfe, tpf, sec)
  extra = np.asarray([wall, passes], np.float64)
  g_tokens, g_lengths, g_stats, g_extra = multihost_utils.process_allgather(
      (tokens, lengths, stats, extra))
  out: list[Any] = [None] * total
  for p in range(world):
    for j, i in enumerate(range(p, total, world)):
      n = int(g_lengths[p, j])
      if n < 0:
        raise RuntimeError(f"process {p} returned no result for request {i}")
      out[i] = ([int(t) for t in g_tokens[p, j, :n]], int(g_stats[p, j, 0]),
                float(g_stats[p, j, 1]), float(g_stats[p, j, 2]))
  return out, float(np.max(g_extra[:, 0])), int(np.sum(g_extra[:, 1]))
