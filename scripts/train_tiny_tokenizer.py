"""Trains the bundled 512-token byte-level BPE tokenizer (Tokenizer.tiny()).

  /work/venv/bin/python scripts/train_tiny_tokenizer.py               # retrain
  /work/venv/bin/python scripts/train_tiny_tokenizer.py --check       # outputs up to date?
  /work/venv/bin/python scripts/train_tiny_tokenizer.py --write_corpus  # regenerate synthetic lines

Inputs and outputs live in refusion_jax/assets/tiny_tokenizer/:
  corpus.txt             hand-written English sentences, then (after MARKER)
                         lines of the bundled task suite (refusion_jax.tasks) written
                         by --write_corpus from a fixed seed;
  tokenizer.json         the trained tokenizer;
  tokenizer_config.json  ChatML template, eos/pad names, added_tokens_decoder.

Layout (total exactly 512, matching config.tiny()):
  0 <|endoftext|> (pad), 1 <|im_end|> (eos), 2 <|beginoftext|> (bos),
  3 <|mask|>, 4 <|im_start|>, then the 256 byte symbols, then 251 merges.
Qwen's pre-tokenizer regex splits every number into single digits, so
"12+45=57" is 8 tokens and arithmetic tasks see one token per digit.

Chat template: ChatML like Qwen3, but to keep prompts short nothing follows
`<|im_start|>assistant\\n` when enable_thinking is False (Qwen3 writes an empty
think block there); enable_thinking=True opens a `<think>\\n` block.

Training is deterministic: the same corpus gives the same tokenizer.json
(tests/test_tokenizer.py retrains and compares with the committed file).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import tokenizers
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ASSET_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                         "refusion_jax", "assets", "tiny_tokenizer")
VOCAB_SIZE = 512
# Order fixes the ids: pad, eos, bos, mask, im_start (see config.tiny()).
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_end|>", "<|beginoftext|>", "<|mask|>", "<|im_start|>")
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
MARKER = "### synthetic lines below: scripts/train_tiny_tokenizer.py --write_corpus ###"
SYNTHETIC_SEED = 100  # not a data-split seed (scripts/make_tiny_data.py uses 0 and 1)
SYNTHETIC_LINES_PER_KIND = 60

# Qwen2/Qwen3's split: English contractions, letter runs with one leading
# non-letter, single digits, punctuation runs, newlines, then whitespace.
SPLIT_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

CHAT_TEMPLATE = (
    "{%- for message in messages %}\n"
    "{%- if message.role not in ['system', 'user', 'assistant'] %}\n"
    "{{- raise_exception('unknown role ' + message.role) }}\n"
    "{%- endif %}\n"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "{{- '<|im_start|>assistant\\n' }}\n"
    "{%- if enable_thinking is defined and enable_thinking %}\n"
    "{{- '<think>\\n' }}\n"
    "{%- endif %}\n"
    "{%- endif %}\n")


def synthetic_lines(seed: int = SYNTHETIC_SEED, per_kind: int = SYNTHETIC_LINES_PER_KIND):
  """Lines shaped like the bundled task suite ("<query> -> <response>"), from a fixed seed.

  They come from refusion_jax.tasks (a seed the data splits do not use), so the
  task names and template words become single tokens and prompts stay short.
  """
  from refusion_jax import tasks  # pylint: disable=import-outside-toplevel
  examples = tasks.generate(None, per_kind * len(tasks.TASKS), seed=seed)
  lines = [f"{ex['query']} -> {ex['response']}" for ex in examples]
  # Chat-template headers, so that "user" and "assistant" become single tokens.
  lines += ["<|im_start|>user", "<|im_start|>assistant"] * per_kind
  return lines


def read_corpus(path: str) -> list[str]:
  """Non-empty corpus lines, the marker line left out."""
  if not os.path.isfile(path):
    raise FileNotFoundError(f"no corpus at {path!r}")
  with open(path, encoding="utf-8") as f:
    lines = [line.rstrip("\n") for line in f]
  return [line for line in lines if line and line != MARKER]


def write_corpus(path: str) -> None:
  """Keeps the hand-written part of `path` and rewrites the synthetic part."""
  with open(path, encoding="utf-8") as f:
    text = f.read()
  written = text.split(MARKER)[0].rstrip("\n")
  with open(path, "w", encoding="utf-8") as f:
    f.write(written + "\n" + MARKER + "\n" + "\n".join(synthetic_lines()) + "\n")


def train(lines: list[str]) -> tokenizers.Tokenizer:
  """A byte-level BPE with Qwen's normalizer/pre-tokenizer, trained on `lines`."""
  tok = tokenizers.Tokenizer(models.BPE())
  tok.normalizer = normalizers.NFC()
  tok.pre_tokenizer = pre_tokenizers.Sequence([
      pre_tokenizers.Split(tokenizers.Regex(SPLIT_PATTERN), behavior="isolated"),
      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
  ])
  tok.decoder = decoders.ByteLevel()
  tok.post_processor = processors.ByteLevel(trim_offsets=False)
  trainer = trainers.BpeTrainer(
      vocab_size=VOCAB_SIZE, min_frequency=2, show_progress=False,
      special_tokens=[tokenizers.AddedToken(t, special=True, normalized=False)
                      for t in SPECIAL_TOKENS],
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(lines, trainer=trainer, length=len(lines))
  size = tok.get_vocab_size(with_added_tokens=True)
  if size != VOCAB_SIZE:
    raise ValueError(f"trained vocabulary has {size} tokens, expected {VOCAB_SIZE}; "
                     "the corpus has too few distinct pairs")
  for want_id, name in enumerate(SPECIAL_TOKENS):
    if tok.token_to_id(name) != want_id:
      raise ValueError(f"special token {name!r} got id {tok.token_to_id(name)}, expected {want_id}")
  return tok


def tokenizer_config() -> dict:
  """The HF tokenizer_config.json beside tokenizer.json."""
  return {
      "added_tokens_decoder": {
          str(i): {"content": name, "lstrip": False, "normalized": False, "rstrip": False,
                   "single_word": False, "special": True}
          for i, name in enumerate(SPECIAL_TOKENS)},
      "bos_token": None,
      "eos_token": EOS_TOKEN,
      "pad_token": PAD_TOKEN,
      "unk_token": None,
      "chat_template": CHAT_TEMPLATE,
      "add_bos_token": False,
      "add_prefix_space": False,
      "clean_up_tokenization_spaces": False,
      "split_special_tokens": False,
      "errors": "replace",
      "model_max_length": 1024,
      "tokenizer_class": "PreTrainedTokenizerFast",
  }


def build_files(corpus_path: str) -> dict[str, str]:
  """File name -> exact text of the two tokenizer files."""
  tok = train(read_corpus(corpus_path))
  tok_text = json.dumps(json.loads(tok.to_str()), ensure_ascii=False, indent=2) + "\n"
  cfg_text = json.dumps(tokenizer_config(), ensure_ascii=False, indent=2) + "\n"
  return {"tokenizer.json": tok_text, "tokenizer_config.json": cfg_text}


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--corpus", default=os.path.join(ASSET_DIR, "corpus.txt"))
  parser.add_argument("--out_dir", default=ASSET_DIR)
  parser.add_argument("--write_corpus", action="store_true",
                      help="regenerate the synthetic part of the corpus first")
  parser.add_argument("--check", action="store_true",
                      help="only compare with the files in --out_dir; exit 1 if they differ")
  args = parser.parse_args(argv)
  if args.write_corpus:
    write_corpus(args.corpus)
  files = build_files(args.corpus)
  stale = []
  for name, text in files.items():
    path = os.path.join(args.out_dir, name)
    if args.check:
      current = open(path, encoding="utf-8").read() if os.path.isfile(path) else None
      if current != text:
        stale.append(path)
    else:
      os.makedirs(args.out_dir, exist_ok=True)
      with open(path, "w", encoding="utf-8") as f:
        f.write(text)
      print(f"wrote {path}")
  if stale:
    print("out of date: " + ", ".join(stale), file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
