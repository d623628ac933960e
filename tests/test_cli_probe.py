"""A probe of bad inputs across the four entry points (train, sample, evaluate, convert).

Each case runs the real command line in a subprocess, as a user would, and must
end with exit status 2 and one `refusion_jax.<program>: error: ...` line naming
the bad field, file, line or value; no traceback; before anything is compiled
(JAX logs every compile here); and nothing created or changed in the case's own
folder, where every output path of the command points. The subprocesses run two
at a time.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import os
import subprocess
import sys
import time

import pytest

from tests.conftest import save_tiny_random_model

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN_CONFIG = os.path.join(REPO, "configs", "tiny_refusion.py")
SAMPLE_CONFIG = os.path.join(REPO, "configs", "sample.py")
EVAL_CONFIG = os.path.join(REPO, "configs", "eval", "synthetic.py")
GOOD = {"query": "sort 321", "response": "123"}
LONG = {"query": "copy " + "7" * 60, "response": "7" * 60}  # > 64 tokens
# Each command gets this long (a loaded machine; they take seconds); past it, it counts as a
# hang or as work that started although the input is bad.
TIMEOUT_SECONDS = 90


@dataclasses.dataclass(frozen=True)
class Case:
  name: str
  program: str  # train | sample | evaluate | convert
  args: tuple[str, ...]  # {case} = the case's folder, {inputs} = shared inputs, {model} = a model
  needle: str  # must appear in the error line


def _train(*args):
  return ("--config=" + TRAIN_CONFIG, "--workdir={case}/w", "--config.data.tfds_dir={case}/tfds",
          "--config.mesh.num_devices=1") + args


def _sample(*args):
  return ("--config=" + SAMPLE_CONFIG, "--config.output_json={case}/out.json") + args


def _evaluate(*args):
  return ("--config=" + EVAL_CONFIG, "--config.output_dir={case}/out") + args


CASES = [
    # --- train: flags and config fields.
    Case("unknown field, suggested", "train", _train("--config.optimzer.learning_rate=1"),
         "config has no field 'optimzer' (did you mean 'optimizer'?)"),
    Case("unknown nested field", "train", _train("--config.optimizer.learnin_rate=1"),
         "config.optimizer has no field 'learnin_rate' (did you mean 'learning_rate'?)"),
    Case("unknown leaf of a value", "train", _train("--config.seed.x=1"),
         "config.seed is a value"),
    Case("value of the wrong type", "train", _train("--config.seed=abc"), "--config.seed=abc"),
    Case("unknown flag", "train", _train("--wrokdir=x"), "Unknown command line flag 'wrokdir'"),
    Case("missing workdir", "train", ("--config=" + TRAIN_CONFIG,), "--workdir"),
    Case("missing config file", "train", ("--config={case}/nope.py", "--workdir={case}/w"),
         "nope.py: no such config file"),
    Case("positional argument", "train", _train("extra"), "unexpected arguments: ['extra']"),
    Case("seq_len too small", "train", _train("--config.data.seq_len=1"),
         "config.data.seq_len must be an int >= 2, got 1"),
    Case("unknown objective", "train", _train("--config.objective=bert"),
         "config.objective must be one of"),
    Case("zero batch", "train", _train("--config.global_batch_size=0"),
         "config.global_batch_size must be a positive int, got 0"),
    Case("too many devices", "train", _train("--config.mesh.num_devices=99"),
         "config.mesh.num_devices=99"),
    Case("no steps", "train", _train("--config.num_train_steps=0", "--config.num_epochs=0"),
         "set one of them to a positive value"),
    Case("unknown packing", "train", _train("--config.data.packing=greedy"),
         "config.data.packing must be one of ('none', 'first_fit', 'best_fit'), got 'greedy'"),
    Case("negative packing bins", "train", _train("--config.data.packing_bins=-4"),
         "config.data.packing_bins must be an int >= 0"),
    # --- train: paths.
    Case("workdir is a file", "train", _train("--workdir={inputs}/a_file"),
         "exists and is not a folder"),
    Case("export into a file", "train", _train("--config.export_hf_dir={inputs}/a_file"),
         "config.export_hf_dir"),
    Case("export into the workdir", "train", _train("--config.export_hf_dir={case}/w"),
         "is the workdir"),
    Case("tfds_dir is a file", "train", _train("--config.data.tfds_dir={inputs}/a_file"),
         "config.data.tfds_dir="),
    # --- train: data.
    Case("missing train file", "train", _train("--config.data.train_files={case}/none.jsonl"),
         "none.jsonl"),
    Case("malformed train line", "train",
         _train("--config.data.train_files={inputs}/malformed.jsonl"),
         "malformed.jsonl:2: malformed JSON"),
    Case("missing field", "train", _train("--config.data.train_files={inputs}/no_response.jsonl"),
         "no_response.jsonl:1: missing field 'response'"),
    Case("every example over-long", "train",
         _train("--config.data.train_files={inputs}/long.jsonl", "--config.data.seq_len=64"),
         "only 0 of 3 example(s) fit in config.data.seq_len=64"),
    Case("over-long example kept", "train",
         _train("--config.data.train_files={inputs}/mixed.jsonl", "--config.data.seq_len=64",
                "--config.data.drop_overlong=false"),
         "mixed.jsonl:2 has"),
    Case("malformed eval line", "train", _train("--config.data.eval_files={inputs}/malformed.jsonl"),
         "malformed.jsonl:2: malformed JSON"),
    Case("eval smaller than a batch", "train",
         _train("--config.data.eval_files={inputs}/two.jsonl", "--config.eval_every_steps=5"),
         "config.data.eval_files: only 2 of 2 example(s)"),
    # --- sample.
    Case("sample: missing model", "sample", _sample("--config.model_dir={case}/none",
                                                    "--config.prompt=hi"),
         "--config.model_dir="),
    Case("sample: no prompt", "sample", _sample("--config.model_dir={model}"), "set exactly one"),
    Case("sample: two prompts", "sample", _sample("--config.model_dir={model}",
                                                  "--config.prompt=hi", "--config.prompt_ids=1"),
         "set exactly one"),
    Case("sample: unknown decode field", "sample",
         _sample("--config.model_dir={model}", "--config.prompt=hi", "--config.decode.slot_siz=4"),
         "config.decode has no field 'slot_siz' (did you mean 'slot_size'?)"),
    Case("sample: unknown verify mode", "sample",
         _sample("--config.model_dir={model}", "--config.prompt=hi",
                 "--config.decode.verify=always"),
         "decode.verify must be one of ('off', 'correct', 'exact', 'lossless'), got 'always'"),
    Case("sample: re-masking with no slots", "sample",
         _sample("--config.model_dir={model}", "--config.prompt=hi", "--config.decode.method=ar",
                 "--config.decode.remask=true", "--config.decode.remask_threshold=0.3"),
         "decode.remask=True checks ReFusion's slots; it needs decode.method='refusion' "
         "(decode.method='ar' has none)"),
    Case("sample: zero batch", "sample", _sample("--config.model_dir={model}", "--config.prompt=hi",
                                                 "--config.batch_size=0"),
         "--config.batch_size must be a positive int"),
    Case("sample: output folder missing", "sample",
         ("--config=" + SAMPLE_CONFIG, "--config.output_json={case}/no/out.json",
          "--config.model_dir={model}", "--config.prompt=hi"), "its folder does not exist"),
    Case("sample: malformed prompts file", "sample",
         _sample("--config.model_dir={model}", "--config.prompts_file={inputs}/malformed.jsonl"),
         "malformed.jsonl:2: not valid JSON"),
    Case("sample: bad prompt ids", "sample", _sample("--config.model_dir={model}",
                                                     "--config.prompt_ids=1,x"),
         "expected comma-separated token ids"),
    Case("sample: token outside the vocabulary", "sample",
         _sample("--config.model_dir={model}", "--config.prompt_ids=1,99999"),
         "token id 99999 is outside the vocabulary"),
    # --- evaluate.
    Case("evaluate: output_dir is a file", "evaluate",
         ("--config=" + EVAL_CONFIG, "--config.output_dir={inputs}/a_file",
          "--config.model_dir={model}"), "--config.output_dir="),
    Case("evaluate: missing model", "evaluate", _evaluate("--config.model_dir={case}/none"),
         "--config.model_dir="),
    Case("evaluate: missing data", "evaluate",
         _evaluate("--config.model_dir={model}", "--config.data={case}/none.jsonl"),
         "--config.data="),
    Case("evaluate: malformed problems", "evaluate",
         _evaluate("--config.model_dir={model}", "--config.data={inputs}/malformed.jsonl"),
         "malformed.jsonl:2: not valid JSON"),
    Case("evaluate: unknown field", "evaluate",
         _evaluate("--config.model_dir={model}", "--config.decod.method=ar"),
         "config has no field 'decod' (did you mean 'decode'?)"),
    Case("evaluate: no config", "evaluate", (), "--config=configs/eval/<benchmark>.py is required"),
    # --- convert.
    Case("convert: missing source", "convert", ("--hf_dir={case}/none", "--out_dir={case}/out"),
         "is not a folder (nor a shipped model: base_tiny, refusion_tiny)"),
    Case("convert: destination exists", "convert",
         ("--out_dir={model}", "--to_hf", "--hf_dir={inputs}"),
         "already exists (pass --overwrite"),
    Case("convert: same folder", "convert", ("--hf_dir={model}", "--out_dir={model}"),
         "are the same folder"),
    Case("convert: dtype with --to_hf", "convert",
         ("--to_hf", "--out_dir={model}", "--hf_dir={case}/hf", "--dtype=bfloat16"),
         "--dtype applies to HF -> ours only"),
    Case("convert: bad integer flag", "convert",
         ("--hf_dir={case}/none", "--out_dir={case}/out", "--max_shard_bytes=lots"),
         "--max_shard_bytes"),
    Case("convert: missing flag", "convert", ("--hf_dir={case}/none",), "--out_dir"),
]


def _snapshot(folder: str) -> dict[str, str]:
  """Every path under `folder` with its file contents' hash (folders: "dir")."""
  seen = {}
  for root, dirs, files in os.walk(folder):
    for d in dirs:
      seen[os.path.relpath(os.path.join(root, d), folder)] = "dir"
    for f in files:
      with open(os.path.join(root, f), "rb") as fh:
        seen[os.path.relpath(os.path.join(root, f), folder)] = hashlib.sha256(
            fh.read()).hexdigest()
  return seen


def _write(path, rows):
  with open(path, "w") as f:
    f.writelines(r if isinstance(r, str) else json.dumps(r) + "\n" for r in rows)


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
  """Runs every case (two at a time); {name: (returncode, stderr, seconds, changed paths)}."""
  inputs = str(tmp_path_factory.mktemp("inputs"))
  model = save_tiny_random_model(os.path.join(inputs, "model"), seed=0)
  _write(os.path.join(inputs, "a_file"), ["not a folder\n"])
  _write(os.path.join(inputs, "malformed.jsonl"), [GOOD, '{"query": "sort 21", "response":\n'])
  _write(os.path.join(inputs, "no_response.jsonl"), [{"query": "sort 1"}])
  _write(os.path.join(inputs, "long.jsonl"), [LONG] * 3)
  _write(os.path.join(inputs, "mixed.jsonl"), [GOOD, LONG, GOOD])
  _write(os.path.join(inputs, "two.jsonl"), [GOOD] * 2)
  before_inputs = _snapshot(inputs)
  env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_LOG_COMPILES="1",
             PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
  env.pop("XLA_FLAGS", None)  # one device is enough: no command gets to run anything

  def run(case: Case):
    folder = str(tmp_path_factory.mktemp("case"))
    args = [a.format(case=folder, inputs=inputs, model=model) for a in case.args]
    before = _snapshot(folder)
    start = time.monotonic()
    try:
      done = subprocess.run([sys.executable, "-m", f"refusion_jax.{case.program}", *args],
                            cwd=folder, env=env, capture_output=True, text=True,
                            timeout=TIMEOUT_SECONDS)
      returncode, stderr = done.returncode, done.stderr
    except subprocess.TimeoutExpired as e:  # a hang, or work that should not have started
      returncode = None
      stderr = (e.stderr or b"").decode(errors="replace") if isinstance(e.stderr, bytes) else (
          e.stderr or "")
    seconds = time.monotonic() - start
    after = _snapshot(folder)
    changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
    return case.name, (returncode, stderr, seconds, changed)

  with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
    results = dict(pool.map(run, CASES))
  assert _snapshot(inputs) == before_inputs  # no command touched the shared inputs
  return results


def test_the_probe_covers_the_four_entry_points():
  assert len(CASES) >= 30 and len({c.name for c in CASES}) == len(CASES)
  assert {c.program for c in CASES} == {"train", "sample", "evaluate", "convert"}


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input_gets_one_clear_error_line(outcomes, case):
  returncode, stderr, seconds, changed = outcomes[case.name]
  errors = [line for line in stderr.splitlines() if "error:" in line.lower()]
  assert returncode == 2, stderr[-3000:]
  assert "Traceback" not in stderr, stderr[-3000:]
  assert len(errors) == 1 and errors[0].startswith(f"refusion_jax.{case.program}: error: "), \
      stderr[-3000:]
  assert case.needle in errors[0], errors[0]
  # Found before any compile: JAX_LOG_COMPILES logs each one.
  assert "Finished XLA compilation" not in stderr and "Compiling " not in stderr, stderr[-3000:]
  assert seconds < TIMEOUT_SECONDS, seconds
  assert changed == [], changed  # nothing created or changed where the outputs would go


@pytest.mark.parametrize("override, message", [
    ("--config.optimzer.learning_rate=1",
     "--config.optimzer.learning_rate: config has no field 'optimzer' (did you mean "
     "'optimizer'?)"),
    ("--config.data.seq_ln=8",
     "--config.data.seq_ln: config.data has no field 'seq_ln' (did you mean 'seq_len'?)"),
    ("--config.zzzz=1", "--config.zzzz: config has no field 'zzzz'"),
    # A field of a nested group named at the top: that group's field is suggested.
    ("--config.seq_len=8",
     "--config.seq_len: config has no field 'seq_len' (did you mean 'data.seq_len'?)"),
    ("--config.seed.x=1", "--config.seed.x: config.seed is a value (int), not a group of fields"),
])
def test_unknown_config_fields_are_named_with_the_nearest_one(override, message):
  from absl import flags  # pylint: disable=import-outside-toplevel
  from ml_collections import config_flags  # pylint: disable=import-outside-toplevel
  from refusion_jax import entry_flags  # pylint: disable=import-outside-toplevel

  argv = ["train", "--config=" + TRAIN_CONFIG, override]
  fv = flags.FlagValues()
  config_flags.DEFINE_config_file("config", None, "", flag_values=fv, lock_config=True,
                                  sys_argv=argv)
  with pytest.raises(entry_flags.InputError) as info:
    entry_flags.parse_flags(argv, fv)
  assert str(info.value) == message


def test_bad_input_exits_2_and_internal_errors_keep_their_traceback(capsys):
  from refusion_jax import entry_flags  # pylint: disable=import-outside-toplevel

  with pytest.raises(SystemExit) as info:
    with entry_flags.errors_reported("refusion_jax.train"):
      raise entry_flags.InputError("config.seed must be an int, got 'x'")
  assert info.value.code == 2
  assert capsys.readouterr().err == "refusion_jax.train: error: config.seed must be an int, got 'x'\n"
  # A ValueError is a user's error only where the entry point says so (sample, convert ...).
  with pytest.raises(SystemExit):
    with entry_flags.errors_reported("refusion_jax.sample", (ValueError,)):
      raise ValueError("--config.batch_size must be a positive int")
  # Anything else is a bug: it propagates with its traceback.
  for error in (RuntimeError("bug"), ValueError("bug inside training"), KeyError("k")):
    with pytest.raises(type(error)):
      with entry_flags.errors_reported("refusion_jax.train"):
        raise error
