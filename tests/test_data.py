"""Tests of refusion_jax.data: the TFDS builder, validation and the grain loader."""

import json
import os

import ml_collections
import numpy as np
import orbax.checkpoint as ocp
import pytest
import tensorflow_datasets as tfds

from refusion_jax import data, objective
from refusion_jax.tokenizer import Tokenizer

EXAMPLES = [
    {"query": f"copy {i} {i + 1}", "response": f"{i} {i + 1}"} for i in range(10)
] + [
    {"query": "sort 3 1 2", "response": "1 2 3", "extra": "ignored"},
    {"query": "héllo ∑", "response": "wörld"},
]


@pytest.fixture(scope="module")
def tok():
  return Tokenizer.tiny()


def _write_jsonl(path, rows):
  with open(path, "w", encoding="utf-8") as f:
    for row in rows:
      f.write((row if isinstance(row, str) else json.dumps(row, ensure_ascii=False)) + "\n")
  return str(path)


def _write_json_list(path, rows):
  # One element per line after the opening bracket: element i sits on line i + 2.
  with open(path, "w", encoding="utf-8") as f:
    f.write("[\n" + ",\n".join(json.dumps(r, ensure_ascii=False) for r in rows) + "\n]\n")
  return str(path)


def _pairs(source):
  out = []
  for i in range(len(source)):
    r = source[i]
    out.append((r["query"].decode(), r["response"].decode()))
  return sorted(out)


def _expected_row(tok, example, seq_len):
  """Plain-Python oracle of one padded row."""
  prompt = tok.encode_prompt(example["query"])
  response = tok.encode(example["response"]) + [tok.eos_id]
  tokens = prompt + response + [tok.pad_id] * (seq_len - len(prompt) - len(response))
  return tokens, len(prompt), len(response)


def _samples(batch):
  """(prompt, response) token tuples of every sample of a packed-format batch, in order."""
  out = []
  for r in range(batch["tokens"].shape[0]):
    seg, tokens = batch["segment_ids"][r], batch["tokens"][r]
    for s in sorted(set(seg[seg > 0].tolist()), key=lambda s: np.argmax(seg == s)):
      where = np.nonzero(seg == s)[0]
      p = int(batch["segment_prompt_len"][r, where[0]])
      out.append((tuple(tokens[where[:p]].tolist()), tuple(tokens[where[p:]].tolist())))
  return out


def _prompts(batch):
  return [prompt for prompt, _ in _samples(batch)]


def _length(tok, example):
  return len(tok.encode_prompt(example["query"])) + len(tok.encode(example["response"])) + 1


def _take(iterator, n):
  return [next(iterator) for _ in range(n)]


def _same_batches(a, b):
  return len(a) == len(b) and all(
      set(x) == set(y) and all(np.array_equal(x[k], y[k]) for k in x) for x, y in zip(a, b))


# ------------------------------------------------------------------ building

def test_prepare_from_jsonl_and_json_list_read_back(tmp_path):
  jsonl = _write_jsonl(tmp_path / "a.jsonl", EXAMPLES)
  jlist = _write_json_list(tmp_path / "b.json", EXAMPLES)
  want = sorted((e["query"], e["response"]) for e in EXAMPLES)
  for path in (jsonl, jlist):
    builder = data.prepare([path], str(tmp_path / "tfds"))
    source = builder.as_data_source("train")
    assert len(source) == len(EXAMPLES)
    assert _pairs(source) == want
    # The source feature points at the line each example came from.
    offset = 1 if path == jsonl else 2
    for i in range(len(source)):
      record = source[i]
      file, line = record["source"].decode().rsplit(":", 1)
      assert file == path
      assert EXAMPLES[int(line) - offset]["query"] == record["query"].decode()
  # Read back by name through tfds.data_source as well (no TensorFlow needed).
  named = tfds.data_source(f"{builder.name}/{builder.builder_config.name}:1.0.0",
                           split="train", data_dir=str(tmp_path / "tfds"))
  assert _pairs(named) == want


def test_record_order_does_not_depend_on_where_the_files_are(tmp_path):
  """Two copies of the same files (two checkouts) give the same records in the same order."""
  examples = [{"query": f"q{i}", "response": f"r{i}"} for i in range(40)]
  orders = []
  for where in ("checkout_a", "another/checkout_b"):
    (tmp_path / where).mkdir(parents=True)
    paths = [_write_jsonl(tmp_path / where / "x.jsonl", examples[:25]),
             _write_jsonl(tmp_path / where / "y.jsonl", examples[25:])]
    source = data.prepare(paths, str(tmp_path / where / "tfds")).as_data_source("train")
    orders.append([source[i]["query"].decode() for i in range(len(source))])
  assert orders[0] == orders[1]
  assert sorted(orders[0]) == sorted(e["query"] for e in examples)


def test_prepare_reuses_unchanged_files_and_rebuilds_changed(tmp_path):
  path = _write_jsonl(tmp_path / "a.jsonl", EXAMPLES[:3])
  first = data.prepare([path], str(tmp_path / "tfds"))
  again = data.prepare([path], str(tmp_path / "tfds"))
  assert first.data_dir == again.data_dir
  _write_jsonl(tmp_path / "a.jsonl", EXAMPLES[:4])
  changed = data.prepare([path], str(tmp_path / "tfds"))
  assert changed.data_dir != first.data_dir
  assert len(changed.as_data_source("train")) == 4
  # Several files and named splits.
  other = _write_jsonl(tmp_path / "b.jsonl", EXAMPLES[4:6])
  multi = data.prepare({"train": [path, other], "eval": [other]}, str(tmp_path / "tfds"))
  assert len(multi.as_data_source("train")) == 6
  assert len(multi.as_data_source("eval")) == 2


BAD_JSONL = [
    ('{"query": "a", "response": "b"}', None),
    ('{"query": "a", "response": ', "malformed JSON"),
    ('{"query": "a"}', "missing field 'response'"),
    ('{"response": "b"}', "missing field 'query'"),
    ('{"query": 3, "response": "b"}', "field 'query' must be a string, got int"),
    ('{"query": ' + "[" * 100_000 + "]" * 100_000 + ', "response": "b"}',
     "malformed JSON (nested too deeply)"),
    ('{"query": ' + "1" * 5000 + ', "response": "b"}', "malformed JSON (Exceeds the limit"),
    ('{"query": "a", "response": "b\\udc00"}',
     "field 'response' is not valid Unicode: a lone surrogate at character 1"),
    ('{"query": "a", "response": "  "}', "empty response"),
    ('["a", "b"]', "expected a JSON object"),
    ('', None),  # blank lines are allowed
    ('{"query": "a", "response": "b"}', None),
]


def test_every_bad_line_reported_with_file_and_line(tmp_path):
  path = _write_jsonl(tmp_path / "bad.jsonl", [row for row, _ in BAD_JSONL])
  out = tmp_path / "tfds"
  with pytest.raises(ValueError) as info:
    data.prepare([path], str(out))
  message = str(info.value)
  expected = [(i + 1, reason) for i, (_, reason) in enumerate(BAD_JSONL) if reason]
  assert f"{len(expected)} problem(s)" in message
  for line, reason in expected:
    assert f"{os.path.abspath(path)}:{line}: {reason}" in message
  # Nothing was written.
  assert not out.exists()


@pytest.mark.parametrize("text,line,reason", [
    ('[\n{"query": "a", "response": "b"},\n{"query": "a" "response": "b"}\n]', 3,
     "malformed JSON"),
    ('[\n{"query": "a", "response": "b"},\n{"query": "a"}\n]', 3, "missing field 'response'"),
    ('[\n{"query": "a",\n "response": ""}\n]', 2, "empty response"),
    ('[\n{"query": "a", "response": "b"}\n', 3, "not closed"),
    ('[]', 1, "no examples"),
    ('[\n{"query": "a", "response": "b"},\n' + "[" * 100_000 + "]" * 100_000 + "\n]", 3,
     "nested too deeply"),
])
def test_json_list_errors_name_the_line(tmp_path, text, line, reason):
  path = tmp_path / "bad.json"
  path.write_text(text)
  with pytest.raises(ValueError, match=rf"bad\.json:{line}: .*{reason}"):
    data.prepare([str(path)], str(tmp_path / "tfds"))
  assert not (tmp_path / "tfds").exists()


def test_non_utf8_line_is_reported(tmp_path):
  path = tmp_path / "latin.jsonl"
  path.write_bytes(b'{"query": "a", "response": "b"}\n{"query": "caf\xe9", "response": "b"}\n')
  with pytest.raises(ValueError, match=r"latin\.jsonl:2: not UTF-8 text"):
    data.prepare([str(path)], str(tmp_path / "tfds"))


def test_a_utf8_byte_order_mark_is_skipped(tmp_path):
  # Some editors write one first; the server's JSON bodies accept it, so training does.
  lines = b'{"query": "a", "response": "b"}\n{"query": "c", "response": "d"}\n'
  jsonl = tmp_path / "bom.jsonl"
  jsonl.write_bytes(b"\xef\xbb\xbf" + lines)
  listed = tmp_path / "bom.json"
  listed.write_bytes(b"\xef\xbb\xbf" + b'  [{"query": "a", "response": "b"},\n'
                     b' {"query": "c", "response": "d"}]')
  for path in (jsonl, listed):
    assert data.validate_files([str(path)]) == 2
    got = [(e["query"], e["response"]) for e in data.iter_examples([str(path)])]
    assert got == [("a", "b"), ("c", "d")]
  # Only a leading one: a BOM inside a line is the line's own (malformed) text.
  inner = tmp_path / "inner.jsonl"
  inner.write_bytes(lines + b"\xef\xbb\xbf" + lines)
  with pytest.raises(ValueError, match=r"inner\.jsonl:3: "):
    data.validate_files([str(inner)])


def test_problems_of_all_splits_in_one_error_and_bad_split_arguments(tmp_path):
  good = _write_jsonl(tmp_path / "good.jsonl", EXAMPLES[:2])
  bad_a = _write_jsonl(tmp_path / "bad_a.jsonl", ['{"query": "a"}'])
  bad_b = _write_jsonl(tmp_path / "bad_b.jsonl", ['{"query": "a", "response": ""}'])
  # Splits are checked in name order: eval, then train.
  with pytest.raises(ValueError, match=r"(?s)2 problem\(s\).*bad_a\.jsonl:1: missing field "
                                       r"'response'.*bad_b\.jsonl:1: empty response"):
    data.prepare({"train": [good, bad_b], "eval": [bad_a]}, str(tmp_path / "tfds"))
  with pytest.raises(ValueError, match="must be a non-empty list of paths"):
    data.prepare({"train": good}, str(tmp_path / "tfds"))
  # pathlib paths are accepted.
  assert len(data.prepare([tmp_path / "good.jsonl"], str(tmp_path / "tfds"))
             .as_data_source("train")) == 2


def test_missing_file_is_an_error(tmp_path):
  with pytest.raises(ValueError, match="does not exist"):
    data.prepare([str(tmp_path / "nope.jsonl")], str(tmp_path / "tfds"))


# -------------------------------------------------------------------- loading

def test_batches_hold_prompt_response_eos_and_padding(tmp_path, tok):
  seq_len = 40
  builder = data.prepare([_write_jsonl(tmp_path / "a.jsonl", EXAMPLES)], str(tmp_path / "tfds"))
  source = builder.as_data_source("train")
  loader = data.make_loader(source, tok, seq_len=seq_len, batch_size=4, seed=None,
                            shuffle=False, num_epochs=1)
  batches = list(loader)
  assert len(batches) == len(EXAMPLES) // 4
  by_query = {e["query"]: e for e in EXAMPLES}
  # Without shuffling the rows follow the source's order.
  for b, batch in enumerate(batches):
    assert sorted(batch) == sorted(objective.PACKED_KEYS)
    for value in batch.values():
      assert value.shape == (4, seq_len) and value.dtype == np.int32
    objective.check_batch(batch)
    for r in range(4):
      example = by_query[source[4 * b + r]["query"].decode()]
      tokens, prompt_len, response_len = _expected_row(tok, example, seq_len)
      n = prompt_len + response_len
      assert batch["tokens"][r].tolist() == tokens
      assert batch["segment_ids"][r].tolist() == [1] * n + [0] * (seq_len - n)
      assert batch["positions"][r].tolist() == list(range(n)) + [0] * (seq_len - n)
      assert (batch["segment_prompt_len"][r, :n] == prompt_len).all()
      assert (batch["segment_response_len"][r, :n] == response_len).all()
      assert batch["tokens"][r, n - 1] == tok.eos_id


def test_overlong_examples_are_dropped_and_counted(tok):
  examples = [{"query": "q", "response": " ".join("7" * n)} for n in (1, 3, 6, 10, 2, 12, 4)]
  # An example of exactly seq_len tokens fits (it fills the row, no padding).
  seq_len = _length(tok, examples[2])
  overlong = sum(_length(tok, e) > seq_len for e in examples)
  assert overlong == 2  # the responses of 10 and 12 numbers
  loader = data.make_loader(examples, tok, seq_len=seq_len, batch_size=1, seed=None,
                            shuffle=False, num_epochs=1)
  rows = [batch["segment_response_len"][0, 0] for batch in loader]
  kept = [e for e in examples if _length(tok, e) <= seq_len]
  assert rows == [len(tok.encode(e["response"])) + 1 for e in kept]
  assert len(kept) == 5
  assert loader.dropped.count == overlong
  assert data.count_overlong(examples, tok, seq_len) == overlong


def test_overlong_example_raises_when_not_dropping(tok):
  examples = [{"query": "q", "response": "1 2", "source": "x.jsonl:1"},
              {"query": "q", "response": " ".join("9" * 30), "source": "x.jsonl:2"}]
  loader = data.make_loader(examples, tok, seq_len=24, batch_size=1, seed=None, shuffle=False,
                            num_epochs=1, drop_overlong=False)
  with pytest.raises(ValueError, match=r"x\.jsonl:2 has \d+ tokens .*> seq_len=24"):
    list(loader)


def test_same_seed_same_batches_and_each_epoch_a_permutation(tok):
  examples = [{"query": f"copy {i}", "response": f"{i}"} for i in range(12)]
  # One over-long example: dropping it must not disturb determinism.
  examples.append({"query": "q", "response": " ".join("5" * 40)})
  kwargs = dict(seq_len=24, batch_size=3)
  a = _take(iter(data.make_loader(examples, tok, seed=5, **kwargs)), 8)
  b = _take(iter(data.make_loader(examples, tok, seed=5, **kwargs)), 8)
  c = _take(iter(data.make_loader(examples, tok, seed=6, **kwargs)), 8)
  assert _same_batches(a, b)
  assert not _same_batches(a, c)
  one_epoch = list(data.make_loader(examples, tok, seed=5, num_epochs=1, **kwargs))
  prompts = [p for batch in one_epoch for p in _prompts(batch)]
  want = sorted(tuple(tok.encode_prompt(e["query"])) for e in examples[:12])
  assert sorted(prompts) == want
  assert prompts != [tuple(tok.encode_prompt(e["query"])) for e in examples[:12]]


def test_iterator_state_resumes_at_the_next_batch(tmp_path, tok):
  examples = [{"query": f"reverse {i} 1", "response": f"1 {i}"} for i in range(10)]
  kwargs = dict(seq_len=24, batch_size=4, seed=3)
  it = iter(data.make_loader(examples, tok, **kwargs))
  _take(it, 3)
  state = it.get_state()
  reference = _take(it, 4)  # crosses an epoch boundary (10 examples, batches of 4)
  resumed = iter(data.make_loader(examples, tok, **kwargs))
  resumed.set_state(state)
  assert _same_batches(_take(resumed, 4), reference)
  # The same through grain's orbax handler, as the trainer saves it.
  it = iter(data.make_loader(examples, tok, **kwargs))
  _take(it, 3)
  with ocp.Checkpointer(data.ITERATOR_HANDLER()) as ckptr:
    ckptr.save(tmp_path / "ckpt", args=data.IteratorSave(it))
    restored = iter(data.make_loader(examples, tok, **kwargs))
    ckptr.restore(tmp_path / "ckpt", args=data.IteratorRestore(restored))
  assert _same_batches(_take(restored, 4), reference)


def test_resume_refuses_changed_data(tmp_path, tok):
  path = _write_jsonl(tmp_path / "a.jsonl", EXAMPLES)
  kwargs = dict(seq_len=40, batch_size=2, seed=0)
  source = data.source_of(data.prepare([path], str(tmp_path / "tfds")), "train")
  it = iter(data.make_loader(source, tok, **kwargs))
  _take(it, 2)
  state = it.get_state()
  same = data.source_of(data.prepare([path], str(tmp_path / "tfds")), "train")
  resumed = iter(data.make_loader(same, tok, **kwargs))
  resumed.set_state(state)  # unchanged files: accepted
  _write_jsonl(tmp_path / "a.jsonl", EXAMPLES[::-1])
  changed = data.source_of(data.prepare([path], str(tmp_path / "tfds")), "train")
  with pytest.raises(ValueError, match=r"saved data position belongs to other data .*source: "
                                       r"saved .*files_.*now .*files_"):
    iter(data.make_loader(changed, tok, **kwargs)).set_state(state)
  with pytest.raises(ValueError, match="split 'eval' is not in the build"):
    data.source_of(data.prepare([path], str(tmp_path / "tfds")), "eval")


def test_two_processes_read_disjoint_halves(tok):
  examples = [{"query": f"copy {i} {i}", "response": f"{i} {i}"} for i in range(16)]
  by_prompt = {tuple(tok.encode_prompt(e["query"])): e["query"] for e in examples}
  seen = []
  for process_index in range(2):
    loader = data.make_loader(examples, tok, seq_len=24, batch_size=4, seed=1, num_epochs=1,
                              process_index=process_index, process_count=2)
    batches = list(loader)
    assert all(batch["tokens"].shape == (2, 24) for batch in batches)
    seen.append({by_prompt[p] for batch in batches for p in _prompts(batch)})
    assert len(seen[-1]) == 8
  assert not seen[0] & seen[1]
  assert seen[0] | seen[1] == {e["query"] for e in examples}


@pytest.mark.parametrize("kwargs,match", [
    (dict(batch_size=3, process_count=2), "not divisible"),
    (dict(process_index=2, process_count=2), "process_index"),
    (dict(seq_len=0), "seq_len"),
    (dict(seed=None), "seed"),
    (dict(seed=-1), "seed"),
    (dict(num_epochs=0), "num_epochs"),
])
def test_make_loader_rejects_bad_arguments(tok, kwargs, match):
  args = dict(seq_len=24, batch_size=4, seed=0) | kwargs
  with pytest.raises(ValueError, match=match):
    data.make_loader(EXAMPLES, tok, **args)


def test_loader_from_config(tmp_path, tok):
  config = ml_collections.ConfigDict(dict(
      train_files=[_write_jsonl(tmp_path / "train.jsonl", EXAMPLES)],
      eval_files=[_write_json_list(tmp_path / "eval.json", EXAMPLES[:5])],
      seq_len=40, tfds_dir=str(tmp_path / "tfds"), drop_overlong=True, shuffle_seed=0))
  train = data.loader_from_config(config, tok, batch_size=4, split="train",
                                  process_index=1, process_count=2)
  batch = next(iter(train))
  assert batch["tokens"].shape == (2, 40)
  evaluation = data.loader_from_config(config, tok, batch_size=2, split="eval")
  batches = list(evaluation)
  # One pass over every eval example, the last batch partial.
  assert [b["tokens"].shape[0] for b in batches] == [2, 2, 1]
  prompts = sorted(p for b in batches for p in _prompts(b))
  assert prompts == sorted(tuple(tok.encode_prompt(e["query"])) for e in EXAMPLES[:5])
  del config.eval_files
  with pytest.raises(ValueError, match="config.data.eval_files"):
    data.loader_from_config(config, tok, batch_size=2, split="eval")


def test_worker_process_gives_the_same_batches(tok):
  """A grain worker process (the tokenizer pickled into it) yields identical batches."""
  from absl import flags
  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()  # grain reads its flags when it starts workers
  examples = [{"query": f"copy {i} 9", "response": f"{i} 9"} for i in range(12)]
  kwargs = dict(seq_len=24, batch_size=3, seed=2)
  with_worker = iter(data.make_loader(examples, tok, worker_count=1, **kwargs))
  got = _take(with_worker, 6)
  del with_worker  # stops the worker process
  assert _same_batches(got, _take(iter(data.make_loader(examples, tok, **kwargs)), 6))


# -------------------------------------------------------------------- packing


def _tiny_examples(n, seed=0):
  rng = np.random.default_rng(seed)
  return [{"query": f"copy {i} " + " ".join("1" * int(rng.integers(0, 6))),
           "response": " ".join("2" * int(rng.integers(1, 12)))} for i in range(n)]


def _expected_samples(tok, examples):
  return sorted((tuple(tok.encode_prompt(e["query"])),
                 tuple(tok.encode(e["response"]) + [tok.eos_id])) for e in examples)


@pytest.mark.parametrize("packing", ["first_fit", "best_fit"])
def test_packed_rows_hold_every_sample_once_whole_and_in_its_own_segment(tok, packing):
  examples = _tiny_examples(60)  # 14 to 42 tokens, 29 on average
  seq_len = 96
  loader = data.make_loader(examples, tok, seq_len=seq_len, batch_size=4, seed=3, num_epochs=1,
                            packing=packing, packing_bins=8, drop_remainder=False)
  batches = list(loader)
  got = []
  for batch in batches:
    objective.check_batch(batch)  # positions 0.. per sample, one (P, R) each, P + R tokens
    seg = batch["segment_ids"]
    # Padding only after a row's last sample; segment ids 1, 2, ... in row order.
    for row in seg:
      live = row[row > 0]
      assert (row[:len(live)] > 0).all()
      assert sorted(set(live.tolist())) == list(range(1, live.max() + 1))
      assert (np.diff(live) >= 0).all()
    assert ((batch["tokens"] == tok.pad_id) | (seg > 0)).all()
    got += _samples(batch)
  assert sorted(got) == _expected_samples(tok, examples)
  padded = sum(len(b["tokens"]) for b in data.make_loader(
      examples, tok, seq_len=seq_len, batch_size=4, seed=3, num_epochs=1, drop_remainder=False))
  rows = sum(len(b["tokens"]) for b in batches)
  assert padded == 60 and rows * 2 < padded  # samples share rows


def test_packed_loader_resumes_at_the_next_batch_across_epochs(tmp_path, tok):
  examples = _tiny_examples(30, seed=1)
  kwargs = dict(seq_len=64, batch_size=3, seed=4, packing="first_fit", packing_bins=4)
  reference = iter(data.make_loader(examples, tok, **kwargs))
  _take(reference, 2)
  state = reference.get_state()
  want = _take(reference, 16)  # several epochs of 30 samples in rows of ~2
  assert sum(len(_samples(b)) for b in want) > 60
  resumed = iter(data.make_loader(examples, tok, **kwargs))
  resumed.set_state(state)
  assert _same_batches(_take(resumed, 16), want)
  # Every epoch is each sample once, in a new order.
  one = list(data.make_loader(examples, tok, num_epochs=1, drop_remainder=False, **kwargs))
  two = list(data.make_loader(examples, tok, num_epochs=2, drop_remainder=False, **kwargs))
  first = [s for b in one for s in _samples(b)]
  both = [s for b in two for s in _samples(b)]
  assert sorted(first) == _expected_samples(tok, examples)
  assert sorted(both) == sorted(first + first)
  assert [s for s in both[:len(first)] if s not in first] == []  # no epoch leaks ahead
  # A position saved with other packing settings is refused, naming the setting.
  with pytest.raises(ValueError, match="packing: saved 'first_fit', now 'best_fit'"):
    iter(data.make_loader(examples, tok, **dict(kwargs, packing="best_fit"))).set_state(state)
  with pytest.raises(ValueError, match="not one this loader wrote"):
    iter(data.make_loader(examples, tok, **kwargs)).set_state(b'{"sampler": 3}')


def test_packed_loader_shards_over_processes(tok):
  examples = _tiny_examples(40, seed=2)
  seen = []
  for process_index in range(2):
    batches = list(data.make_loader(examples, tok, seq_len=64, batch_size=4, seed=1,
                                    num_epochs=1, process_index=process_index, process_count=2,
                                    packing="best_fit", drop_remainder=False))
    assert all(b["tokens"].shape[1] == 64 and b["tokens"].shape[0] <= 2 for b in batches)
    seen.append([s for b in batches for s in _samples(b)])
  assert len(seen[0]) == len(seen[1]) == 20
  assert sorted(seen[0] + seen[1]) == _expected_samples(tok, examples)


def test_eos_padding_of_responses(tok):
  examples = [{"query": "q", "response": "1 2"}, {"query": "q", "response": " ".join("3" * 12)}]
  p = len(tok.encode_prompt("q"))
  lengths = [len(tok.encode(e["response"])) + 1 for e in examples]
  seq_len = p + lengths[1] + 2
  for pad_to, want in ((6, [6, lengths[1]]), (0, [seq_len - p] * 2),
                       (40, [seq_len - p] * 2), (None, lengths)):
    batches = list(data.make_loader(examples, tok, seq_len=seq_len, batch_size=1, seed=None,
                                    shuffle=False, num_epochs=1, eos_pad_response_to=pad_to))
    for batch, n, answer in zip(batches, want, lengths):
      r = batch["segment_response_len"][0, 0]
      assert r == n
      response = batch["tokens"][0, p:p + r]
      assert (response[answer:] == tok.eos_id).all() and response[answer - 1] == tok.eos_id


def test_layout_counts(tok):
  examples = _tiny_examples(50, seed=5)
  lengths = [len(tok.encode_prompt(e["query"])) + len(tok.encode(e["response"])) + 1
             for e in examples]
  padded = data.measure_layout(examples, tok, seq_len=96, packing="none", batch_size=4, seed=0)
  assert (padded.rows, padded.samples, padded.real_tokens) == (50, 50, sum(lengths))
  assert padded.real_token_fraction == pytest.approx(sum(lengths) / (50 * 96))
  packed = data.measure_layout(examples, tok, seq_len=96, packing="first_fit", batch_size=4,
                               seed=0)
  assert (packed.samples, packed.real_tokens) == (50, sum(lengths))
  assert packed.rows <= 25 and packed.real_token_fraction > 2 * padded.real_token_fraction
  assert packed.samples_per_row == pytest.approx(50 / packed.rows)
  first = data.measure_layout(examples, tok, seq_len=96, packing="first_fit", batch_size=4,
                              seed=0, max_samples=10)
  assert 10 <= first.samples < 50


@pytest.mark.parametrize("kwargs,match", [
    (dict(packing="greedy"), "packing must be one of"),
    (dict(packing="first_fit", packing_bins=-1), "packing_bins must be an int >= 0"),
    (dict(eos_pad_response_to=-2), "eos_pad_response_to"),
])
def test_bad_packing_arguments(tok, kwargs, match):
  with pytest.raises(ValueError, match=match):
    data.make_loader(EXAMPLES, tok, seq_len=24, batch_size=4, seed=0, **kwargs)


def _first_fit_by_hand(lengths, seq_len, bins):
  """grain's online first fit, by hand: up to `bins` open rows; a sample goes to the first
  with room; when none has room every open row is emitted and the sample opens a new set."""
  rows, open_rows = 0, []
  for n in lengths:
    for i, used in enumerate(open_rows):
      if used + n <= seq_len:
        open_rows[i] += n
        break
    else:
      if len(open_rows) < bins:
        open_rows.append(n)
      else:
        rows += len(open_rows)
        open_rows = [n]
  return rows + len(open_rows)


def test_pack_lengths_matches_first_fit_by_hand():
  rng = np.random.default_rng(3)
  lengths = np.clip(np.round(rng.lognormal(np.log(40), 0.7, 3000)), 1, 128).astype(int)
  for bins in (1, 4, 16):
    layout = data.pack_lengths(lengths.tolist(), seq_len=128, packing="first_fit",
                               packing_bins=bins)
    assert layout.rows == _first_fit_by_hand(lengths.tolist(), 128, bins)
    assert (layout.samples, layout.real_tokens) == (3000, int(lengths.sum()))
  best = data.pack_lengths(lengths.tolist(), seq_len=128, packing="best_fit", packing_bins=16)
  assert best.samples == 3000 and best.rows <= _first_fit_by_hand(lengths.tolist(), 128, 16)
  none = data.pack_lengths(lengths.tolist(), seq_len=128, packing="none")
  assert (none.rows, none.real_token_fraction) == (3000, lengths.sum() / (3000 * 128))
