"""refusion_jax.evaluate: problem reading, scoring and counting against hand-built oracles."""

import json
import os
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from refusion_jax import checkpoint, evaluate
from refusion_jax import config as config_lib
from refusion_jax.decode import autoregressive, engine
from refusion_jax.decode.counters import DecodeCounters, DecodeOutput
from refusion_jax.decode.settings import DecodeConfig
from refusion_jax.model import Transformer
from refusion_jax.tokenizer import Tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

ROWS = [
    {"query": "sort 539", "response": "359"},
    {"query": "copy 12", "response": "12"},
    {"query": "sort 21", "response": "12"},
    {"query": "sort 780", "response": "078"},
    {"query": "copy 4", "response": "4"},
    {"query": "lookup a=1 b=2 ? b", "response": "2"},
]


@pytest.fixture(scope="module")
def tok():
  return Tokenizer.tiny()


def _write(path, rows):
  with open(path, "w") as f:
    for row in rows:
      f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
  return str(path)


def test_read_problems_keeps_file_order_and_limits_per_task(tmp_path, tok):
  path = _write(tmp_path / "p.jsonl", ROWS)
  problems = evaluate.read_problems(path, tok, per_task=2)
  assert [p.query for p in problems] == ["sort 539", "copy 12", "sort 21", "copy 4",
                                         "lookup a=1 b=2 ? b"]
  assert [p.task for p in problems] == ["sort", "copy", "sort", "copy", "lookup"]
  assert problems[0].prompt_ids == tuple(tok.encode_prompt("sort 539"))
  only = evaluate.read_problems(path, tok, task_names=["copy"])
  assert [p.query for p in only] == ["copy 12", "copy 4"]


@pytest.mark.parametrize("line, needle", [
    ("{not json", "p.jsonl:2: not valid JSON"),
    ('{"response": "1"}', "p.jsonl:2: expected an object with a non-empty string 'query'"),
    ('{"query": "divide 4 2"}', "p.jsonl:2: query 'divide 4 2' starts with 'divide'"),
])
def test_read_problems_names_the_bad_line(tmp_path, tok, line, needle):
  path = _write(tmp_path / "p.jsonl", [ROWS[0], line])
  with pytest.raises(ValueError, match="p.jsonl:2"):
    evaluate.read_problems(path, tok)
  try:
    evaluate.read_problems(path, tok)
  except ValueError as e:
    assert needle in str(e)


def test_read_problems_rejects_bad_arguments(tmp_path, tok):
  path = _write(tmp_path / "p.jsonl", ROWS)
  with pytest.raises(ValueError, match="per_task must be an int >= 0"):
    evaluate.read_problems(path, tok, per_task=-1)
  with pytest.raises(ValueError, match="unknown task name"):
    evaluate.read_problems(path, tok, task_names=["divide"])
  with pytest.raises(FileNotFoundError, match="does not exist"):
    evaluate.read_problems(str(tmp_path / "missing.jsonl"), tok)


def test_prompt_width_rounds_up_within_the_position_limit(tok):
  problems = [evaluate.Problem("copy 1", "copy", tuple(range(21))),
              evaluate.Problem("copy 2", "copy", tuple(range(9)))]
  config = config_lib.tiny(max_position_embeddings=64)
  assert evaluate.prompt_width(problems, config, gen_length=16, multiple=16) == 32
  assert evaluate.prompt_width(problems, config, gen_length=40, multiple=16) == 24  # 64 - 40
  with pytest.raises(ValueError, match="exceeds max_position_embeddings=64"):
    evaluate.prompt_width(problems, config, gen_length=50, multiple=16)


class _Oracle:
  """A fake decoder: answers each known prompt with a fixed text, counting passes.

  It records every call's shape, so the harness's batching can be checked.
  """

  def __init__(self, tok, answers, nfe_per_row):
    self.tok = tok
    self.answers = answers  # prompt ids tuple -> response text
    self.nfe_per_row = nfe_per_row
    self.shapes = []

  def __call__(self, model, ids_bp, lens_b, decode_config, rng=None):
    del model, rng
    ids_bp, lens_b = np.asarray(ids_bp), np.asarray(lens_b)
    self.shapes.append(ids_bp.shape)
    b, g = ids_bp.shape[0], decode_config.gen_length
    tokens_bg = np.zeros((b, g), np.int32)
    length_b = np.zeros((b,), np.int32)
    for r in range(b):
      ids = self.tok.encode(self.answers[tuple(ids_bp[r, :lens_b[r]])]) + [self.tok.eos_id]
      tokens_bg[r, :len(ids)] = ids
      length_b[r] = len(ids)
    counters = DecodeCounters.zeros(b).replace(
        verify_b=jnp.full((b,), self.nfe_per_row, jnp.int32),
        tokens_b=jnp.asarray(length_b))
    return DecodeOutput(tokens_bg=jnp.asarray(tokens_bg), length_b=jnp.asarray(length_b),
                        counters=counters, commit_step_bg=jnp.zeros((b, g), jnp.int32))


class _FakeDecoder:
  """Stands in for `engine.Decoder`: its engine decodes `rows` prompts per oracle call."""

  oracle = None

  def __init__(self, model, decode_config):
    self.model, self.config = model, decode_config

  def generate(self, ids_bp, lens_b, rng=None):
    return self.oracle(self.model, ids_bp, lens_b, self.config, rng)

  def engine(self, rows, width):
    decoder = self

    class _Engine:

      def warm_up(self):
        pass

      def run(self, prompts, rng=None, progress=None):
        del rng
        results = []
        for start in range(0, len(prompts), rows):
          chunk = prompts[start:start + rows]
          ids = np.zeros((rows, width), np.int32)
          lens = np.ones((rows,), np.int32)
          for r in range(rows):  # missing rows repeat the first prompt
            p = chunk[r] if r < len(chunk) else chunk[0]
            ids[r, :len(p)], lens[r] = p, len(p)
          out = jax.device_get(decoder.generate(ids, lens))
          counters = {k: np.asarray(v) for k, v in out.counters.as_dict().items()}
          for r in range(len(chunk)):
            n = int(out.length_b[r])
            results.append(engine.PromptResult(
                index=start + r, tokens=[int(t) for t in out.tokens_bg[r, :n]],
                counters={k: float(v[r]) for k, v in counters.items()},
                commit_steps=[0] * n, seconds=0.0))
          if progress is not None:
            progress.update(len(chunk))
        return engine.EngineRun(results=results, passes=0, seconds=1.0, admissions=0)

    return _Engine()


def test_evaluate_scores_and_counts_like_a_hand_tally(tmp_path, tok, monkeypatch):
  path = _write(tmp_path / "p.jsonl", ROWS)
  problems = evaluate.read_problems(path, tok)
  # Right answers for "sort 539", "sort 780", "copy 4", "lookup"; wrong for the others.
  texts = {"sort 539": "359", "copy 12": "13", "sort 21": "21", "sort 780": "078",
           "copy 4": "4", "lookup a=1 b=2 ? b": "2"}
  oracle = _Oracle(tok, {p.prompt_ids: texts[p.query] for p in problems}, nfe_per_row=2)
  monkeypatch.setattr(_FakeDecoder, "oracle", staticmethod(oracle))
  monkeypatch.setattr(engine, "Decoder", _FakeDecoder)
  fake_model = types.SimpleNamespace(config=config_lib.tiny())  # the oracle never runs it
  result = evaluate.evaluate(fake_model, tok, problems,
                             DecodeConfig(method="ar", gen_length=16, slot_size=16,
                                          block_size=16),
                             batch_size=2, speed_per_task=1, speed_repeats=3, width=32,
                             progress=False)
  per_task = result["per_task"]
  assert per_task["sort"]["n"] == 3 and per_task["sort"]["correct"] == 2
  assert per_task["sort"]["accuracy"] == pytest.approx(200 / 3)
  assert per_task["copy"]["correct"] == 1 and per_task["lookup"]["accuracy"] == 100.0
  # Tokens are the answer's tokens plus EOS; two passes per row.
  sort_tokens = sum(len(tok.encode(texts[q])) + 1 for q in ("sort 539", "sort 21",
                                                             "sort 780"))
  assert per_task["sort"]["tokens"] == sort_tokens
  assert per_task["sort"]["tokens_per_forward"] == pytest.approx(sort_tokens / 6)
  # Speed: the first sort problem alone, at batch 1.
  assert per_task["sort"]["speed_n"] == 1
  assert per_task["sort"]["speed_tokens"] == len(tok.encode("359")) + 1
  assert per_task["sort"]["tokens_per_sec"] > 0
  assert result["average"]["accuracy"] == pytest.approx((200 / 3 + 50 + 100) / 3)
  # The engine runs batch_size rows, every timed call is one row, and all prompts
  # share one width: one program per decode config.
  assert set(oracle.shapes) == {(2, 32), (1, 32)}
  # Per task: one untimed warm-up, then the timed problem decoded speed_repeats times.
  assert oracle.shapes.count((1, 32)) == 3 * (1 + 3)
  assert per_task["sort"]["speed_repeats"] == 3
  assert [s["correct"] for s in result["samples"] if s["task"] == "sort"] == [True, False, True]
  json.dumps(result)  # JSON-able


def test_evaluate_rejects_bad_settings_before_decoding(tmp_path, tok):
  problems = evaluate.read_problems(_write(tmp_path / "p.jsonl", ROWS), tok)
  model = Transformer(config_lib.tiny(num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1,
                                head_dim=16, mlp_dim=32, max_position_embeddings=48),
                rngs=nnx.Rngs(0))
  ar = DecodeConfig(method="ar", gen_length=32, slot_size=32, block_size=32)
  with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings=48"):
    evaluate.evaluate(model, tok, problems, ar, width=32, progress=False)
  with pytest.raises(ValueError, match="no decode config for task"):
    evaluate.evaluate(model, tok, problems, {"sort": ar}, progress=False)
  with pytest.raises(ValueError, match="batch_size must be a positive int"):
    evaluate.evaluate(model, tok, problems, ar, batch_size=0, progress=False)
  with pytest.raises(ValueError, match="speed_repeats must be an int >= 1"):
    evaluate.evaluate(model, tok, problems, ar, speed_repeats=0, progress=False)


def test_batched_accuracy_decodes_like_single_prompts(tmp_path, tok):
  """Padding rows and a shared width change nothing: batch results = batch-1 decodes."""
  config = config_lib.tiny(num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1,
                           head_dim=16, mlp_dim=64)
  model = Transformer(config, rngs=nnx.Rngs(3))
  problems = evaluate.read_problems(_write(tmp_path / "p.jsonl", ROWS[:3]), tok)
  ar = DecodeConfig(method="ar", gen_length=8, slot_size=8, block_size=8)
  result = evaluate.evaluate(model, tok, problems, ar, batch_size=4, speed_per_task=0,
                             progress=False)
  by_query = {s["query"]: s for s in result["samples"]}
  for p in problems:
    ids = np.asarray([p.prompt_ids], np.int32)
    out = autoregressive.generate(model, ids, np.asarray([len(p.prompt_ids)], np.int32), ar)
    n = int(out.length_b[0])
    assert by_query[p.query]["text"] == tok.decode(np.asarray(out.tokens_bg[0, :n]),
                                                   skip_special_tokens=True)
    assert by_query[p.query]["nfe"] == int(out.counters.nfe_b()[0])
  assert result["per_task"]["sort"]["tokens_per_sec"] is None  # nothing was timed


def test_command_line_writes_a_json_result(tmp_path, tok):
  config = config_lib.tiny(num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1,
                           head_dim=16, mlp_dim=64)
  model_dir = str(tmp_path / "model")
  checkpoint.save_model(model_dir, config, Transformer(config, rngs=nnx.Rngs(0)))
  data = _write(tmp_path / "p.jsonl", ROWS[:2])
  out_dir = tmp_path / "out"
  synthetic = os.path.join(REPO, "configs", "eval", "synthetic.py")
  evaluate.main(["evaluate", f"--config={synthetic}", f"--config.model_dir={model_dir}",
                 f"--config.data={data}", "--config.decode.method=ar",
                 "--config.decode.gen_length=8", "--config.decode.slot_size=8",
                 "--config.decode.block_size=8", "--config.speed_per_task=1",
                 "--config.batch_size=2", f"--config.output_dir={out_dir}"])
  with open(out_dir / "results.json") as f:
    result = json.load(f)
  assert set(result["per_task"]) == {"sort", "copy"}
  assert result["decode"]["sort"]["method"] == "ar"
  assert all(m["speed_n"] == 1 and m["tokens_per_sec"] > 0 for m in result["per_task"].values())
  assert not [n for n in os.listdir(out_dir) if ".tmp" in n]  # nothing half-written left
  # Beside it, one record per problem; the summary carries what evaluate_table reads, and
  # the files get the mode any new file gets (not mkstemp's 0600).
  assert (result["benchmark"], result["model"], result["method"], result["samples"]) == (
      "synthetic", model_dir, "ar", 2)
  with open(out_dir / "samples.jsonl") as f:
    records = [json.loads(line) for line in f]
  assert sorted(r["query"] for r in records) == sorted(r["query"] for r in ROWS[:2])
  mask = os.umask(0)
  os.umask(mask)
  assert all(os.stat(out_dir / n).st_mode & 0o777 == 0o666 & ~mask
             for n in ("results.json", "samples.jsonl"))
  from refusion_jax import evaluate_table  # pylint: disable=import-outside-toplevel
  table = evaluate_table.bundled_markdown(evaluate_table.load_results([str(out_dir)]))
  acc = {t: m["accuracy"] for t, m in result["per_task"].items()}
  tasks = list(result["per_task"])
  assert f"| Model | {tasks[0]} | {tasks[1]} | Avg | Tok/fwd |" in table
  assert f"| {model_dir} (ar) | {acc[tasks[0]]:.2f} / " in table
  with pytest.raises(ValueError, match="--config.decode: decode.block_size=8 must be a multiple"):
    evaluate.main(["evaluate", f"--config={synthetic}", f"--config.model_dir={model_dir}",
                   f"--config.data={data}", "--config.decode.slot_size=3",
                   "--config.decode.block_size=8", "--config.decode.gen_length=8"])
  with pytest.raises(ValueError, match="--config=configs/eval/<benchmark>.py is required"):
    evaluate.main(["evaluate"])
