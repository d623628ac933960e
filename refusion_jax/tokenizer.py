"""Tokenizer loading, ReFusion's special tokens and the chat template.

A checkpoint directory holds the HF `tokenizers` file `tokenizer.json` and a
`tokenizer_config.json` with the chat template (Jinja2), the eos/pad token
names and `added_tokens_decoder`. ReFusion appends two special tokens to the
backbone's vocabulary, `<|beginoftext|>` then `<|mask|>`; for Qwen3 they land
right after the last added token, at ids 151669 and 151670.

Prompts are `encode_prompt(query)` (a single user turn rendered by the chat
template with the generation prompt); callers encode responses as
`encode(response) + [eos_id]`.

The bundled tiny tokenizer (`Tokenizer.tiny()`, built by
scripts/train_tiny_tokenizer.py) is a 512-token byte-level BPE with Qwen's
pre-tokenizer (single-digit numbers) and a ChatML template. To keep prompts
short its template adds nothing after `<|im_start|>assistant\\n` when
`enable_thinking=False`, and opens a `<think>\\n` block when it is True
(Qwen3's template instead writes an empty think block when thinking is off).
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, Iterable, Mapping, Sequence

import jinja2
import jinja2.sandbox
import tokenizers

from refusion_jax import fileio

BOS_TOKEN = "<|beginoftext|>"
MASK_TOKEN = "<|mask|>"
# Mask tokens found by name in a folder that does not name its own: Dream's and ReFusion's,
# LLaDA's.
_KNOWN_MASKS = (MASK_TOKEN, "<|mdm_mask|>")
TINY_TOKENIZER_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets",
                                  "tiny_tokenizer")


# Decoder steps a stream may run over a window of its tokens (Tokenizer.decodes_incrementally).
_WINDOWED_DECODERS = frozenset({"ByteLevel", "ByteFallback", "Metaspace", "WordPiece",
                                "BPEDecoder", "Replace", "Fuse", "Strip"})
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")  # a byte-fallback token's vocabulary entry


def _token_name(value: Any, field: str, where: str) -> str | None:
  # transformers writes special tokens either as a string or as a serialized AddedToken dict.
  if value is None:
    return None
  if isinstance(value, Mapping):
    value = value.get("content")
  if not isinstance(value, str) or not value:
    raise ValueError(f"{where}: {field} must be a token string, got {value!r}")
  return value


def _raise_from_template(message: str):
  raise ValueError(f"chat template: {message}")


def _to_json(value: Any, indent: int | None = None) -> str:
  # Non-ASCII text must survive as-is inside prompts, hence ensure_ascii=False.
  return json.dumps(value, ensure_ascii=False, indent=indent)


def _parts(spec: Mapping[str, Any] | None, key: str) -> list[Mapping[str, Any]]:
  """A tokenizer.json normalizer, pre-tokenizer or decoder as its list of steps (a
  Sequence's `key`, one step, or none)."""
  if not spec:
    return []
  if spec.get("type") == "Sequence":
    return list(spec.get(key) or [])
  return [spec]


def _compile_template(source: str, where: str) -> jinja2.Template:
  # A template comes with downloaded checkpoints, so it runs sandboxed.
  env = jinja2.sandbox.ImmutableSandboxedEnvironment(
      trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
  env.filters["tojson"] = _to_json
  env.globals["raise_exception"] = _raise_from_template
  try:
    return env.from_string(source)
  except jinja2.TemplateSyntaxError as e:
    raise ValueError(f"{where}: chat_template is not valid Jinja2 ({e})") from None


class Tokenizer:
  """A HF `tokenizers` tokenizer plus ReFusion's special tokens and chat template."""

  def __init__(self, hf_tokenizer: tokenizers.Tokenizer, *, eos_token: str, pad_token: str,
               chat_template: str | None, source: str = "<memory>",
               bos_token: str | None = None, mask_token: str | None = None):
    """Wraps `hf_tokenizer`; a backbone without its own begin token (Qwen3, Qwen2.5)
    gains ReFusion's `<|beginoftext|>` and `<|mask|>` where missing.

    Args:
      hf_tokenizer: the backbone's tokenizer; it is modified in place.
      eos_token: name of the end-of-response token (Qwen3: `<|im_end|>`).
      pad_token: name of the padding token (Qwen3: `<|endoftext|>`).
      chat_template: Jinja2 source of the chat template, or None (then
        `apply_chat_template` raises).
      source: where the tokenizer came from, for error messages.
      bos_token: the folder's own begin token (Llama-3: `<|begin_of_text|>`, LLaDA:
        `<|startoftext|>`, Dream: `<|beginoftext|>`), or None: ReFusion's.
      mask_token: the folder's own mask token, or None: `<|mask|>` (Dream, ReFusion) or
        `<|mdm_mask|>` (LLaDA) where the vocabulary has one; else ReFusion's `<|mask|>` is
        added to a folder without its own begin token, and a folder with one (an AR
        model's, Llama-3's) has no mask (`mask_id` None).
    """
    self._tok = hf_tokenizer
    self.source = source
    if mask_token is None:
      mask_token = next((n for n in _KNOWN_MASKS if self._tok.token_to_id(n) is not None), None)
    if bos_token is None or bos_token == BOS_TOKEN:
      bos_token = BOS_TOKEN
      # The order matters: bos then mask, as the ReFusion release appends them.
      for name in (BOS_TOKEN, mask_token or MASK_TOKEN):
        if self._tok.token_to_id(name) is None:
          self._tok.add_special_tokens(
              [tokenizers.AddedToken(name, special=True, normalized=False)])
      mask_token = mask_token or MASK_TOKEN
    self.bos_token = bos_token
    self.bos_id = self._require_id(bos_token, "bos_token")
    self.mask_token = mask_token
    self.mask_id = None if mask_token is None else self._require_id(mask_token, "mask_token")
    self.eos_token = eos_token
    self.pad_token = pad_token
    self.eos_id = self._require_id(eos_token, "eos_token")
    self.pad_id = self._require_id(pad_token, "pad_token")
    self.chat_template = chat_template
    self._template = (None if chat_template is None
                      else _compile_template(chat_template, source))
    # Ids need not be contiguous, so the model needs max id + 1 embedding rows.
    self.id_limit = max(self._tok.get_vocab(with_added_tokens=True).values()) + 1
    self._chars_per_token: int | None = None  # longest_text's bound, worked out on first use
    self._unsettled: frozenset[int] | None = None  # unsettled_ids, worked out on first use
    self._spec_cache: Mapping[str, Any] | None = None

  def _require_id(self, name: str, field: str) -> int:
    token_id = self._tok.token_to_id(name)
    if token_id is None:
      raise ValueError(f"{self.source}: {field} {name!r} is not in the vocabulary")
    return token_id

  # ---------------------------------------------------------------- loading

  @classmethod
  def from_dir(cls, path: str | os.PathLike) -> "Tokenizer":
    """Loads `tokenizer.json` and `tokenizer_config.json` from a checkpoint directory.

    The chat template is `tokenizer_config.json`'s `chat_template`, or the
    file `chat_template.jinja` beside it (newer transformers save it there).
    """
    path = os.fspath(path)
    if not os.path.exists(path):
      raise FileNotFoundError(f"tokenizer directory {path!r} does not exist")
    if not os.path.isdir(path):
      raise NotADirectoryError(f"tokenizer path {path!r} is not a directory")
    tok_path = os.path.join(path, "tokenizer.json")
    cfg_path = os.path.join(path, "tokenizer_config.json")
    for required in (tok_path, cfg_path):
      if not os.path.isfile(required):
        raise FileNotFoundError(f"no {os.path.basename(required)} in {path!r}")
    with open(tok_path, encoding="utf-8") as f:
      tok_text = f.read()
    try:
      hf_tokenizer = tokenizers.Tokenizer.from_str(tok_text)
    except Exception as e:  # tokenizers raises a bare Exception for any bad file.
      try:
        json.loads(tok_text)
      except (ValueError, RecursionError) as json_error:
        raise ValueError(f"{tok_path}: not valid JSON ({json_error})") from None
      raise ValueError(f"{tok_path}: not a valid `tokenizers` file ({e})") from None
    cfg = fileio.read_json(cfg_path)
    if not isinstance(cfg, Mapping):
      raise ValueError(f"{cfg_path}: expected a JSON object, got {type(cfg).__name__}")

    _check_added_tokens(hf_tokenizer, cfg.get("added_tokens_decoder") or {}, cfg_path)

    eos = _token_name(cfg.get("eos_token"), "eos_token", cfg_path)
    if eos is None:
      raise ValueError(f"{cfg_path}: eos_token is missing")
    # Checkpoints without a pad token pad with eos; padding is always masked out.
    pad = _token_name(cfg.get("pad_token"), "pad_token", cfg_path) or eos

    template = cfg.get("chat_template")
    jinja_path = os.path.join(path, "chat_template.jinja")
    if template is None and os.path.isfile(jinja_path):
      with open(jinja_path, encoding="utf-8") as f:
        template = f.read()
    if isinstance(template, list):
      # Multi-template layout: [{"name": "default", "template": ...}, ...].
      named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
      if "default" not in named:
        raise ValueError(f"{cfg_path}: chat_template list has no 'default' entry "
                         f"(names: {sorted(map(str, named))})")
      template = named["default"]
    if template is not None and not isinstance(template, str):
      raise ValueError(f"{cfg_path}: chat_template must be a string, got {type(template).__name__}")
    return cls(hf_tokenizer, eos_token=eos, pad_token=pad, chat_template=template, source=path,
               bos_token=_token_name(cfg.get("bos_token"), "bos_token", cfg_path),
               mask_token=_token_name(cfg.get("mask_token"), "mask_token", cfg_path))

  @classmethod
  def tiny(cls) -> "Tokenizer":
    """The bundled 512-token tokenizer matching `config.tiny()`."""
    return cls.from_dir(TINY_TOKENIZER_DIR)

  # ------------------------------------------------------------- vocabulary

  @property
  def vocab_size(self) -> int:
    """Number of tokens, added tokens included."""
    return self._tok.get_vocab_size(with_added_tokens=True)

  def token_to_id(self, token: str) -> int | None:
    """The id of a vocabulary entry (byte-level form, e.g. 'Ġworld'), or None."""
    if not isinstance(token, str):
      raise TypeError(f"token_to_id: token must be a str, got {type(token).__name__}")
    return self._tok.token_to_id(token)

  def id_to_token(self, token_id: int) -> str | None:
    return self._tok.id_to_token(int(token_id))

  # -------------------------------------------------------- encode / decode

  def encode(self, text: str, *, release_gil: bool = False) -> list[int]:
    """Token ids of `text`; no special tokens are added (special names in the text match).

    With `release_gil`, through the batch encoder, which lets go of Python's lock while
    it works (the single-text one holds it: about 1 s a MB), so that other threads run
    meanwhile (a server's event loop, with the encoding on a worker thread). Same ids.
    """
    if not isinstance(text, str):
      raise TypeError(f"encode: text must be a str, got {type(text).__name__}")
    try:
      if release_gil:
        return list(self._tok.encode_batch([text], add_special_tokens=False)[0].ids)
      return list(self._tok.encode(text, add_special_tokens=False).ids)
    except TypeError:
      found = fileio.not_unicode(text)
      if found:
        raise ValueError(f"encode: the text is not valid Unicode: a lone surrogate at "
                         f"character {found[1]}") from None
      raise

  def longest_text(self, tokens: int) -> int | None:
    """The most characters a text of at most `tokens` tokens can have, or None where this
    tokenizer's pipeline gives no such bound.

    For a byte-level BPE after at most NFC (Qwen3's and the bundled tiny one): a token
    covers at most as many characters as its vocabulary entry has (one per byte; an
    added token its own text), and NFC turns at most 4 code points into one (Greek
    letters with three marks), so a longer text cannot fit. Lets a server refuse a huge
    prompt without encoding it (encoding holds the GIL: about 1 s a MB).
    """
    if self._chars_per_token is None:
      spec = self._spec()
      normalizers = _parts(spec.get("normalizer"), "normalizers")
      pre = _parts(spec.get("pre_tokenizer"), "pretokenizers")
      ok = ((spec.get("model") or {}).get("type") == "BPE"
            and all(n.get("type") == "NFC" for n in normalizers)
            and any(p.get("type") == "ByteLevel" for p in pre))
      self._chars_per_token = (4 * max(map(len, self._tok.get_vocab(with_added_tokens=True)))
                               if ok else 0)
    return tokens * self._chars_per_token if self._chars_per_token else None

  @property
  def decodes_incrementally(self) -> bool:
    """Whether a stream may decode a window of its tokens instead of the whole prefix
    (`serve.text.TextStream`): every step of the decoder maps each token to its text,
    with effects only at the first token it decodes (a SentencePiece piece's leading
    space, a WordPiece word's), at the last (a BPE end-of-word suffix) or where bytes
    are joined into characters (byte-level BPE: Qwen3's and the tiny one; byte
    fallback, whose tokens `unsettled_ids` names).
    A decoder of another kind (CTC's merging of repeats, a custom one) is decoded
    whole at every update."""
    return self._decoder_types() <= _WINDOWED_DECODERS

  @property
  def unsettled_ids(self) -> frozenset[int]:
    """Tokens whose text may change with the tokens after them: with a ByteFallback
    decoder, a run of byte tokens (`<0xE4>`) becomes characters when it is valid UTF-8
    and one U+FFFD per token otherwise, so a byte token's text is known only once a
    token of another kind follows it. A stream holds their text back until then."""
    if self._unsettled is None:
      self._unsettled = frozenset(
          i for t, i in self._tok.get_vocab(with_added_tokens=False).items()
          if _BYTE_TOKEN.fullmatch(t)) if "ByteFallback" in self._decoder_types() else frozenset()
    return self._unsettled

  def _decoder_types(self) -> set[str | None]:
    """The types of tokenizer.json's decoder steps (none: no decoder)."""
    return {d.get("type") for d in _parts(self._spec().get("decoder"), "decoders")}

  def _spec(self) -> Mapping[str, Any]:
    """tokenizer.json as a dict (parsed once; 0.4 s for Qwen3's)."""
    if self._spec_cache is None:
      self._spec_cache = json.loads(self._tok.to_str())
    return self._spec_cache

  def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
    """Text of `ids` (a list, numpy or jax array of ints)."""
    ids = _as_id_list(ids, self.id_limit)
    return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

  # ---------------------------------------------------------- chat template

  def apply_chat_template(self, messages: Sequence[Mapping[str, Any]],
                          add_generation_prompt: bool = True,
                          enable_thinking: bool = False) -> str:
    """Renders `messages` ([{"role": ..., "content": ...}, ...]) with the chat template."""
    if self._template is None:
      raise ValueError(f"{self.source}: the tokenizer has no chat_template")
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
      raise ValueError(f"apply_chat_template: messages must be a non-empty list of dicts, "
                       f"got {messages!r}")
    for i, message in enumerate(messages):
      if not isinstance(message, Mapping):
        raise ValueError(f"apply_chat_template: messages[{i}] must be a dict, got {message!r}")
      for key in ("role", "content"):
        if not isinstance(message.get(key), str):
          raise ValueError(f"apply_chat_template: messages[{i}][{key!r}] must be a str, "
                           f"got {message.get(key)!r}")
    return self._template.render(
        messages=[dict(m) for m in messages],
        add_generation_prompt=bool(add_generation_prompt),
        enable_thinking=bool(enable_thinking),
        bos_token=self.bos_token, eos_token=self.eos_token, pad_token=self.pad_token)

  def encode_prompt(self, query: str, enable_thinking: bool = False) -> list[int]:
    """Ids of a single user turn plus the assistant generation prompt."""
    if not isinstance(query, str):
      raise TypeError(f"encode_prompt: query must be a str, got {type(query).__name__}")
    text = self.apply_chat_template([{"role": "user", "content": query}],
                                    add_generation_prompt=True,
                                    enable_thinking=enable_thinking)
    return self.encode(text)

  # ------------------------------------------------------------ validation

  def __getstate__(self):
    # A compiled Jinja2 template does not pickle (grain workers pickle their
    # transforms); it is rebuilt from its source on the other side.
    state = dict(self.__dict__)
    state.pop("_template")
    return state

  def __setstate__(self, state):
    self.__dict__.update(state)
    self._template = (None if self.chat_template is None
                      else _compile_template(self.chat_template, self.source))

  def check_compatible(self, model_config: Any) -> None:
    """Raises ValueError when the model cannot use this tokenizer.

    The model's embedding must cover every token id, and the special-token
    ids the decoders use (mask, eos), where the model config sets them, must
    be the tokenizer's. bos is not compared: a base Qwen3 config.json names
    <|endoftext|> (151643) as bos, while ReFusion's <|beginoftext|> is 151669,
    and no part of training or decoding reads it.
    """
    problems = []
    vocab_size = getattr(model_config, "vocab_size", None)
    if not isinstance(vocab_size, int):
      raise ValueError(f"check_compatible: model_config.vocab_size must be an int, "
                       f"got {vocab_size!r}")
    if self.id_limit > vocab_size:
      problems.append(f"the tokenizer needs {self.id_limit} embedding rows (highest id + 1) "
                      f"but the model's vocab_size is {vocab_size}")
    for field, ours in (("mask_token_id", self.mask_id), ("eos_token_id", self.eos_id)):
      theirs = getattr(model_config, field, None)
      if theirs is not None and ours is None:
        problems.append(f"model config {field}={theirs} but the tokenizer has no such token")
      elif theirs is not None and theirs != ours:
        problems.append(f"model config {field}={theirs} but the tokenizer's is {ours}")
    if problems:
      raise ValueError(f"tokenizer {self.source!r} does not match the model config: "
                       + "; ".join(problems))

  def __repr__(self) -> str:
    return (f"Tokenizer(source={self.source!r}, vocab_size={self.vocab_size}, "
            f"bos_id={self.bos_id}, mask_id={self.mask_id}, eos_id={self.eos_id}, "
            f"pad_id={self.pad_id})")


def _check_added_tokens(hf_tokenizer: tokenizers.Tokenizer, decoder: Mapping[str, Any],
                        where: str) -> None:
  """Makes the tokenizer agree with `added_tokens_decoder` ({"id": {"content": ...}})."""
  if not isinstance(decoder, Mapping):
    raise ValueError(f"{where}: added_tokens_decoder must be an object, got {decoder!r}")
  entries = []
  for key, spec in decoder.items():
    try:
      token_id = int(key)
    except ValueError:
      raise ValueError(f"{where}: added_tokens_decoder key {key!r} is not an id") from None
    if not isinstance(spec, Mapping) or not isinstance(spec.get("content"), str):
      raise ValueError(f"{where}: added_tokens_decoder[{key!r}] needs a 'content' string")
    entries.append((token_id, spec))
  for token_id, spec in sorted(entries, key=lambda e: e[0]):
    content = spec["content"]
    found = hf_tokenizer.token_to_id(content)
    if found is None:
      special = bool(spec.get("special", False))
      token = tokenizers.AddedToken(
          content, special=special, normalized=bool(spec.get("normalized", False)),
          lstrip=bool(spec.get("lstrip", False)), rstrip=bool(spec.get("rstrip", False)),
          single_word=bool(spec.get("single_word", False)))
      if special:
        hf_tokenizer.add_special_tokens([token])
      else:
        hf_tokenizer.add_tokens([token])
      found = hf_tokenizer.token_to_id(content)
    if found != token_id:
      raise ValueError(f"{where}: added_tokens_decoder puts {content!r} at id {token_id} "
                       f"but tokenizer.json gives it id {found}")


def _as_id_list(ids: Iterable[int], id_limit: int) -> list[int]:
  if isinstance(ids, (str, bytes)):
    raise TypeError(f"decode: ids must be integers, got a {type(ids).__name__}")
  if hasattr(ids, "tolist"):  # numpy / jax arrays
    ids = ids.tolist()
  out = []
  for i, value in enumerate(ids):
    if isinstance(value, bool) or not isinstance(value, int):
      raise TypeError(f"decode: ids[{i}]={value!r} is not an int")
    if not 0 <= value < id_limit:
      raise ValueError(f"decode: ids[{i}]={value} is outside the vocabulary [0, {id_limit})")
    out.append(value)
  return out
