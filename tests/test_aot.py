"""`python -m refusion_jax.aot`: programs compiled for a TPU slice without a TPU.

The tiny configs' train step and every decode method go through the command
line (libtpu from the test setup describes a v5litepod-4); its numbers are
checked against counts made here by hand: the train step's arguments hold
the float32 parameters and both AdamW moments split over four chips, the flop
hand count agrees with XLA's own count where XLA's is right (unrolled
layers), a decode pass reads at least every weight and the whole KV cache
(the floor) and not several times more. An oversized program is reported as
not fitting (exit 3); bad flags exit 2 on one line. AR decode with scanned
layers on a tensor-parallel mesh compiles (libtpu 0.0.42 aborted on it).
"""

import json
import math
import os
import re
import subprocess
import sys

import pytest

from refusion_jax import tpu
from refusion_jax.aot import estimates
from refusion_jax.aot import train as aot_train
from refusion_jax import config as config_lib
from refusion_jax.decode import settings

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOPOLOGY = "v5litepod-4"
# One layer, wide enough that the matrix products outweigh the elementwise work (the hand
# count of flops leaves it out); its config.json is all aot reads.
SMALL = dict(num_layers=1, hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64,
             mlp_dim=1024, max_position_embeddings=256, tie_embeddings=False)
DECODE = ["--config=configs/sample.py", "--config.decode.gen_length=16",
          "--config.decode.slot_size=4", "--config.decode.block_size=8", "--batch=4",
          "--prompt_len=16", "--mesh=4,1,1"]


def _aot(*args, timeout=300):
  env = dict(os.environ, JAX_PLATFORMS="cpu", ALLOW_MULTIPLE_LIBTPU_LOAD="1")
  done = subprocess.run([sys.executable, "-m", "refusion_jax.aot", *args], cwd=REPO,
                        capture_output=True, text=True, timeout=timeout, env=env)
  lines = done.stdout.strip().splitlines()
  report = json.loads(lines[-1]) if lines and lines[-1].startswith("{") else None
  return done, report


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
  folder = tmp_path_factory.mktemp("small")
  with open(folder / "config.json", "w") as f:
    json.dump(config_lib.to_hf_config(config_lib.tiny(**SMALL)), f)
  return str(folder)


@pytest.fixture(scope="module")
def train_run():
  return _aot("--program=train", f"--topology={TOPOLOGY}", "--config=configs/tiny_refusion.py",
              "--config.model.num_layers=2", "--config.data.seq_len=64",
              "--config.global_batch_size=8", "--config.data.packing=best_fit",
              "--sample_tokens=20")


@pytest.fixture(scope="module")
def decode_runs(small_model):
  """Each method's programs; refusion compiles all three and the per-pass table."""
  runs = {}
  for method, extra in (("refusion", ["--pass_widths=1,2"]),
                        ("ar", ["--decode_programs=generate", "--pass_widths="]),
                        ("mdm", ["--decode_programs=generate,run"]),
                        ("mdm-dual", ["--decode_programs=run", "--config.decode.mdm_cache=dual",
                                      "--config.decode.mdm_threshold=0.9"]),
                        ("d2f", ["--decode_programs=run", "--config.decode.d2f_window=2"])):
    runs[method] = _aot("--program=decode", f"--topology={TOPOLOGY}", f"--model={small_model}",
                        *DECODE, f"--config.decode.method={method.split('-')[0]}", *extra)
  return runs


# --- topology names ------------------------------------------------------------------------


@pytest.mark.parametrize("name,topology,chips", [
    ("v4-8", "v4:2x2x1", 4), ("v4-16", "v4:2x2x2", 8), ("v4-32", "v4:2x2x4", 16),
    ("v4-64", "v4:2x4x4", 32), ("v4-128", "v4:4x4x4", 64), ("v4-256", "v4:4x4x8", 128),
    ("v4-512", "v4:4x8x8", 256), ("v5p-8", "v5p:2x2x1", 4), ("v5p-128", "v5p:4x4x4", 64),
    ("v5p-1024", "v5p:8x8x8", 512), ("v5litepod-1", "v5e:1x1", 1),
    ("v5litepod-4", "v5e:2x2", 4), ("v5litepod-8", "v5e:2x4", 8),
    ("v5litepod-16", "v5e:4x4", 16), ("v5litepod-32", "v5e:4x8", 32),
    ("v5litepod-256", "v5e:16x16", 256), ("v5e-256", "v5e:16x16", 256),
    ("v6e-8", "v6e:2x4", 8), ("v6e-256", "v6e:16x16", 256),
    ("v5p:4x4x12", "v5p:4x4x12", 192), ("v5e:2x2", "v5e:2x2", 4),
])
def test_gcloud_names_map_to_libtpu_topologies(name, topology, chips):
  s = tpu.parse_slice(name)
  assert (s.topology, s.chips, s.num_slices) == (topology, chips, 1)
  assert tpu.parse_slice(name, num_slices=4).chips == 4 * chips


@pytest.mark.parametrize("name,message", [
    ("v3-8", "unknown TPU accelerator type 'v3-8'"),
    ("v5p", "unknown TPU accelerator type 'v5p'"),
    ("tpu-v5p-128", "unknown TPU accelerator type"),
    ("v4-9", "count TensorCores, two per chip; 9 is odd"),
    ("v5p-24", "12 chips is not a power of two"),
    ("v5litepod-2", "2 chips is not a v5e/v6e slice size"),
    ("v5e:2x2x2", "a v5e slice has 2 dimensions"),
])
def test_unknown_slices_are_refused_by_name(name, message):
  with pytest.raises(ValueError, match=re.escape(message)):
    tpu.parse_slice(name)
  with pytest.raises(ValueError, match="--num_slices must be a positive int"):
    tpu.parse_slice("v5p-8", num_slices=0)


@pytest.mark.parametrize("name,num_slices,chips,kind", [
    ("v4-8", 1, 4, "TPU v4"), ("v5p-16", 1, 8, "TPU v5"), ("v5litepod-4", 2, 8, "TPU v5 lite"),
    ("v5litepod-1", 1, 1, "TPU v5 lite"), ("v6e-4", 1, 4, "TPU v6 lite"),
])
def test_libtpu_describes_one_device_per_chip(name, num_slices, chips, kind):
  devices = tpu.slice_devices(tpu.parse_slice(name, num_slices))
  assert len(devices) == chips
  assert {d.device_kind for d in devices} == {kind}
  if num_slices > 1:
    assert sorted({d.slice_index for d in devices}) == list(range(num_slices))


def test_default_3d_shapes_grow_the_smallest_side():
  for chips in (4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048):
    shape = tpu.default_shape(chips, 3)
    assert math.prod(shape) == chips and max(shape) <= 2 * min(shape), shape


# --- the train step ------------------------------------------------------------------------


def test_tiny_train_step_compiles_and_fits(train_run):
  done, r = train_run
  assert done.returncode == 0, done.stderr[-2000:]
  assert "compiling train step for v5litepod-4" in done.stderr  # progress
  assert r["program"] == "train" and r["topology"] == TOPOLOGY and r["chips"] == 4
  assert r["fits"] is True and "fits" in done.stdout
  assert (r["global_batch"], r["seq_len"], r["mesh"]) == (8, 64, {"data": 1, "fsdp": 4,
                                                                    "tensor": 1})
  mc = config_lib.tiny(num_layers=2)
  # Arguments: float32 parameters and AdamW's two moments, split 4 ways (FSDP), plus the
  # batch; donated, so the updated state is aliased to them. TPU tiles (8 x 128) pad the
  # tiny model's narrow minor dimensions (e.g. 2 kv heads x 32), hence the upper bound.
  state = 3 * 4 * mc.num_params() / 4
  (step,) = r["programs"]
  assert state <= step["argument"] <= 2 * state, (step, state)
  assert step["alias"] >= 0.95 * state
  total = step["argument"] + step["output"] - step["alias"] + step["temp"] + step["code"]
  assert step["total"] == total and r["per_chip_gib"] == pytest.approx(total / 2**30)
  assert r["compile_s"] > 0 and r["bytes"] > state  # the step reads at least its state
  # The hand count against XLA's (right for unrolled layers): within the elementwise work.
  assert r["scan_layers"] is False
  assert 0.8 * r["xla_flops"] <= r["flops"] <= 1.05 * r["xla_flops"], r
  chip = tpu.CHIPS["v5e"]
  want = max(r["flops"] / (chip.bf16_tflops * 1e12), r["bytes"] / (chip.hbm_gbps * 1e9))
  assert r["estimated_s"] == pytest.approx(want)
  assert r["estimated_mfu"] == pytest.approx(
      r["model_flops"] / r["estimated_s"] / (chip.bf16_tflops * 1e12))
  assert 0 < r["estimated_mfu"] <= 1
  assert "estimated step time" in done.stdout and "estimated MFU" in done.stdout
  # Packed rows of samples averaging 20 tokens (the 2% over 64 dropped): ~3 per 64-token
  # row; the paper's run is 4 epochs over 3.7M samples at the estimated step time, packed
  # and one per row.
  assert r["packing"] == "best_fit" and "mean 20 tokens" in r["lengths_from"]
  assert 8 * 2.5 < r["samples_per_step"] < 8 * 3.5
  assert 0.8 < r["real_token_fraction"] <= 1
  assert r["real_tokens_per_step"] == pytest.approx(8 * 64 * r["real_token_fraction"])
  passes = 4 * 3_700_000
  assert r["paper_run_steps"] == math.ceil(passes / r["samples_per_step"])
  assert r["paper_run_hours"] == pytest.approx(r["paper_run_steps"] * r["estimated_s"] / 3600)
  assert r["paper_run_hours_padded"] == pytest.approx(
      math.ceil(passes / 8) * r["estimated_s"] / 3600)
  assert r["paper_run_chip_hours"] == pytest.approx(4 * r["paper_run_hours"])
  assert r["paper_run_hours_padded"] > 2.5 * r["paper_run_hours"]
  assert "the paper's run, 4 epochs over 3.7M samples" in done.stdout


def test_the_rl_policy_step_compiles_fits_and_counts_its_flops():
  done, r = _aot("--program=rl", f"--topology={TOPOLOGY}", "--config=configs/rl_tiny.py",
                 "--config.train.model.num_layers=2", "--config.micro_batch=8")
  assert done.returncode == 0, done.stderr[-2000:]
  assert r["program"] == "rl" and r["fits"] is True and r["reference"] is True
  assert (r["rollouts"], r["layout_width"], r["layout_tokens"]) == (8, 128, 32)
  mc = config_lib.tiny(num_layers=2)
  # Arguments: the policy's float32 parameters and AdamW's moments, the reference's
  # parameters, split 4 ways, and the rollouts' layouts (their masks 8 x 128 x 128 bool).
  state = 4 * 4 * mc.num_params() / 4
  (step,) = r["programs"]
  assert state <= step["argument"] <= 2 * state + 8 * 128 * 128, (step, state)
  # The hand count (the replay's forward and backward, the reference's forward) against
  # XLA's, right for unrolled layers.
  assert 0.8 * r["xla_flops"] <= r["flops"] <= 1.05 * r["xla_flops"], r
  assert r["estimated_s_per_group"] == pytest.approx(r["estimated_s"] * 8 / 8)
  assert "estimated policy step" in done.stdout
  bad, _ = _aot("--program=rl", f"--topology={TOPOLOGY}", "--config=configs/tiny_refusion.py")
  assert bad.returncode == 2 and "--program=rl takes an RL config" in bad.stderr


def test_a_qwen2_train_step_compiles_with_its_biases():
  done, r = _aot("--program=train", f"--topology={TOPOLOGY}", "--config=configs/tiny_refusion.py",
                 "--config.model.num_layers=2", "--config.data.seq_len=64",
                 "--config.global_batch_size=8", "--config.model.model_type=qwen2",
                 "--sample_tokens=20")
  assert done.returncode == 0 and r["fits"], done.stderr[-2000:]
  mc = config_lib.tiny(num_layers=2, model_type="qwen2")
  # The biases (4 + 2 + 2 heads of 32 per layer) in, the q/k norms (2 x 32) out.
  assert r["params"] == mc.num_params() == config_lib.tiny(num_layers=2).num_params() + 2 * (
      8 * 32 - 2 * 32)


def test_sample_lengths_come_from_a_data_file_or_a_mean():
  from configs import tiny_refusion  # pylint: disable=import-outside-toplevel
  from refusion_jax.tokenizer import Tokenizer  # pylint: disable=import-outside-toplevel
  config = tiny_refusion.get_config()
  path = tiny_refusion.common.TINY_TEST
  lengths, source = aot_train.sample_lengths(config, 20, path)
  tok = Tokenizer.tiny()
  with open(path) as f:
    examples = [json.loads(line) for line in f]
  want = [len(tok.encode_prompt(e["query"])) + len(tok.encode(e["response"])) + 1
          for e in examples]
  assert sorted(lengths) == sorted(want)  # every sample, in the loader's shuffled order
  assert source.startswith(f"{path} ({len(want)} samples, mean ")
  lengths, source = aot_train.sample_lengths(config, 20, None)
  assert len(lengths) > 0.99 * aot_train.LENGTH_DRAWS and abs(sum(lengths) / len(lengths) - 20) < 0.5
  assert max(lengths) <= config.data.seq_len and "mean 20 tokens" in source
  # Samples longer than a row are dropped, as the trainer drops them.
  lengths, source = aot_train.sample_lengths(config, 330, None)
  assert max(lengths) <= 128 and 0.05 * aot_train.LENGTH_DRAWS < len(lengths) < 0.4 * aot_train.LENGTH_DRAWS
  assert f"{aot_train.LENGTH_DRAWS - len(lengths)} over seq_len dropped" in source
  with pytest.raises(ValueError, match="no sample of that length distribution fits"):
    aot_train.sample_lengths(config, 100_000, None)


def test_train_flops_count_recomputation():
  mc = config_lib.qwen3_8b()
  model, executed = estimates.train_flops(mc, 512, 4096, 0)
  assert model == executed  # no remat, full logits
  tokens = 512 * 4096
  # 6 N T for Qwen3-8B's 7.57B matmul weights (layers + LM head; not the embedding lookup).
  assert 6 * 7.56e9 * tokens < model - 3 * 512 * estimates.attention_flops(mc, 4096, 4096) < \
      6 * 7.58e9 * tokens
  _, full = estimates.train_flops(mc.replace(remat="full"), 512, 4096, 512)
  layers = estimates.layer_matmul_params(mc)
  assert full - model == (2 * layers * tokens + 512 * estimates.attention_flops(mc, 4096, 4096)
                          + 2 * estimates.head_params(mc) * tokens)
  # BD3-LM: the layers run both halves (8192 tokens a row, attention over their square),
  # the LM head the noised half only.
  bd3, _ = estimates.train_flops(mc, 512, 4096, 0, two_halves=True)
  assert bd3 == (6 * layers * 2 * tokens + 6 * estimates.head_params(mc) * tokens
                 + 3 * 512 * 4 * 36 * 32 * 128 * 8192 * 8192)


# --- decoding ------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["refusion", "ar", "mdm", "mdm-dual", "d2f"])
def test_every_decode_method_compiles_and_fits(decode_runs, method):
  done, r = decode_runs[method]
  assert done.returncode == 0, done.stderr[-2000:]
  assert r["program"] == "decode" and r["method"] == method.split("-")[0] and r["fits"] is True
  names = {"refusion": ["generate", "admit", "run"], "ar": ["generate"],
           "mdm": ["generate", "run"], "mdm-dual": ["run"], "d2f": ["run"]}[method]
  assert [p["name"] for p in r["programs"]] == names
  # decode.kv_chunk unset: the TPU's default (MDM passes have no cache but Fast-dLLM's).
  assert r["kv_chunk"] == (0 if method == "mdm" else settings.KV_CHUNK_AUTO["tpu"])
  assert r["decode"].get("mdm_cache") == ("dual" if method == "mdm-dual" else None)
  assert all(p["total"] > 0 and p["compile_s"] > 0 for p in r["programs"])
  assert r["per_chip_gib"] == pytest.approx(max(p["total"] for p in r["programs"]) / 2**30)
  mc = config_lib.tiny(**SMALL)
  f32 = 4
  # --mesh=4,1,1: every chip holds every weight and the whole cache.
  weights = (mc.num_params() - mc.vocab_size * mc.hidden_size) * f32  # less the input embedding
  cache = 2 * mc.num_layers * 4 * mc.num_kv_heads * (16 + 16) * mc.head_dim * f32
  # Fast-dLLM's dual cache: the full canvas pass, then the block (8) over the cache.
  # D2F: up to its window of two blocks in flight.
  widths = {"refusion": [1, 2, 8], "ar": [1], "mdm": [16 + 16], "mdm-dual": [16 + 16, 8],
            "d2f": [1, 2, 4, 8, 16]}[method]
  assert [p["width"] for p in r["per_pass"]] == widths
  for p in r["per_pass"]:
    floor = weights if p["width"] == 16 + 16 and method.startswith("mdm") else weights + cache
    assert p["bytes_floor"] == floor
    # A pass reads every weight and (cached methods) the whole buffer, and little more.
    assert floor <= p["bytes"] <= 3 * floor, p
    # The hand count against XLA's (one unrolled layer: right).
    assert 0.85 * p["xla_flops"] <= p["flops"] <= 1.05 * p["xla_flops"], p
  assert r["pass_width"] == widths[-1] and r["bytes"] == r["per_pass"][-1]["bytes"]
  assert r["estimated_s"] > 0 and "estimate per pass" in done.stdout


@pytest.mark.parametrize("method", ["refusion", "ar"])
def test_a_pass_reading_the_cache_in_chunks_compiles_and_counts_a_full_buffer(
    small_model, method):
  # decode.kv_chunk=8 over a 16 + 16 entry cache: attention's loop over the live prefix
  # (a traced trip count) compiles for the TPU, and the traffic estimate counts it at
  # every chunk of a full buffer, so a pass still reads every weight and the cache.
  # ReFusion's row program compiles here with the "Past the paper" options on (verified
  # infill and re-masking: the KV buffer's entries moved within it).
  options = (["--config.decode.verify=correct", "--config.decode.remask=true"]
             if method == "refusion" else [])
  done, r = _aot("--program=decode", f"--topology={TOPOLOGY}", f"--model={small_model}",
                 *DECODE, f"--config.decode.method={method}", "--config.decode.kv_chunk=8",
                 "--decode_programs=run" if method == "refusion" else "--decode_programs=generate",
                 "--pass_widths=2", *options)
  assert done.returncode == 0, done.stderr[-2000:]
  assert r["kv_chunk"] == 8 and r["fits"] is True
  assert (r["decode"].get("verify", "off"), r["decode"].get("remask", False)) == (
      ("correct", True) if options else ("off", False))
  mc = config_lib.tiny(**SMALL)
  weights = (mc.num_params() - mc.vocab_size * mc.hidden_size) * 4
  cache = 2 * mc.num_layers * 4 * mc.num_kv_heads * (16 + 16) * mc.head_dim * 4
  assert r["per_pass"]
  for p in r["per_pass"]:
    assert p["bytes_floor"] == weights + cache
    assert weights + cache <= p["bytes"] <= 3 * (weights + cache), p
  assert "read 8 entries at a time, counted over a full buffer" in done.stdout


def test_bd3lm_decode_programs_compile_and_its_widest_pass_holds_two_blocks(small_model):
  # BD3-LM's engine programs lower for the TPU; its widest pass is a finished block's
  # clean tokens and the next block's masks (2 x block_size = 16 here).
  done, r = _aot("--program=decode", f"--topology={TOPOLOGY}", f"--model={small_model}",
                 *DECODE, "--config.decode.method=bd3lm", "--config.decode.slot_size=3",
                 "--decode_programs=admit,run", "--pass_widths=")
  assert done.returncode == 0, done.stderr[-2000:]
  assert r["method"] == "bd3lm" and r["fits"] is True
  assert [p["name"] for p in r["programs"]] == ["admit", "run"]
  assert r["kv_chunk"] == settings.KV_CHUNK_AUTO["tpu"]
  assert [p["width"] for p in r["per_pass"]] == [16] and r["pass_width"] == 16


def test_ar_decode_compiles_with_scanned_layers_on_a_tensor_mesh(tmp_path):
  # Grouped-query heads split over the chips and layers in a scan that writes the K/V
  # into the stacked cache: libtpu 0.0.42 used to abort compiling the AR program
  # ("A cycle is detected", a fatal check: hence the subprocess) unless the chunk's K/V
  # pass a barrier before the write (model.py, _scan_layers).
  mc = config_lib.tiny(num_layers=1, hidden_size=256, num_heads=8, num_kv_heads=4,
                       head_dim=64, mlp_dim=256)
  with open(tmp_path / "config.json", "w") as f:
    json.dump(config_lib.to_hf_config(mc), f)
  done, r = _aot("--program=decode", f"--topology={TOPOLOGY}", f"--model={tmp_path}",
                 "--config=configs/sample.py", "--config.decode.method=ar",
                 "--config.decode.gen_length=8", "--config.decode.slot_size=8",
                 "--config.decode.block_size=8", "--batch=2", "--prompt_len=8", "--mesh=1,1,4",
                 "--scan_layers", "--decode_programs=generate", "--pass_widths=")
  assert done.returncode == 0, done.stderr[-2000:]
  assert r["scan_layers"] is True and r["mesh"] == {"data": 1, "fsdp": 1, "tensor": 4}
  assert [p["name"] for p in r["programs"]] == ["generate"] and r["fits"] is True


def test_an_oversized_program_does_not_fit(small_model):
  # 8192 rows of a 512 + 512 cache: the prefill's temporaries exceed a v5e chip's 16 GiB.
  done, r = _aot("--program=decode", f"--topology={TOPOLOGY}", "--model=tiny",
                 "--config=configs/sample.py", "--config.decode.gen_length=512", "--batch=8192",
                 "--prompt_len=512", "--decode_programs=admit")
  assert done.returncode == 3, done.stderr[-2000:]
  assert "Traceback" not in done.stderr
  assert "does not fit by" in done.stdout
  assert r["fits"] is False and r["per_chip_gib"] > r["hbm_gib"] == 16
  assert "RESOURCE_EXHAUSTED" in r["compiler_error"]


def test_out_of_memory_messages_are_read():
  class Lowered:
    def __init__(self, message):
      self.message = message

    def compile(self):
      raise RuntimeError(self.message)

  for message, used, limit in (
      ("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
       "temporaries (35.35G) exceeds available HBM (15.75G).", 35.35, 15.75),
      ("RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory "
       "space hbm. Used 101.5G of 95.74G hbm. Exceeded hbm capacity by 5.8G.", 101.5, 95.74)):
    with pytest.raises(estimates.DoesNotFit) as e:
      estimates.compile_program(Lowered(message), "x")
    assert e.value.used == pytest.approx(used * 2**30)
    assert e.value.limit == pytest.approx(limit * 2**30)
  with pytest.raises(RuntimeError, match="something else"):
    estimates.compile_program(Lowered("something else"), "x")


@pytest.mark.parametrize("args,message", [
    (["--program=train", "--topology=v9-8", "--config=configs/tiny_refusion.py"],
     "error: unknown TPU accelerator type 'v9-8'"),
    (["--program=train", "--topology=v5e-4"], "error: --config is required"),
    (["--program=serve", "--topology=v5e-4"], "error: flag --program=serve"),
    (["--program=train", "--topology=v5e-4", "--config=configs/tiny_refusion.py",
      "--config.nope=1"], "error: --config.nope: config has no field 'nope'"),
    (["--program=decode", "--topology=v5e-4", "--config=configs/sample.py"],
     "error: --model is required"),
    (["--program=train", "--topology=v5e-4", "--config=configs/tiny_refusion.py",
      "--config.global_batch_size=6"], "error: config.global_batch_size=6 is not divisible"),
    (["--program=train", "--topology=v5e-4", "--config=configs/tiny_refusion.py",
      "--sample_tokens=0"], "error: --sample_tokens must be >= 1, got 0"),
    # A host-side planner has no program: refused at the config, before any model.
    (["--program=decode", "--topology=v5e-4", "--config=configs/sample.py", "--model=tiny",
      "--config.decode.planner=mcts"],
     "error: decode.planner='mcts' is a host-driven search; aot runs compiled decoders only"),
])
def test_bad_flags_exit_2_on_one_line(args, message):
  done, report = _aot(*args)
  assert done.returncode == 2, (done.stdout, done.stderr[-2000:])
  assert report is None and done.stdout == ""
  ours = [line for line in done.stderr.splitlines() if line.startswith("refusion_jax.aot: error:")]
  assert len(ours) == 1 and ours[0].startswith("refusion_jax.aot: " + message), done.stderr[-2000:]
  assert "Traceback" not in done.stderr


def test_the_fit_table_shows_each_row_with_its_command(train_run):
  from benchmarks import aot_fit  # pylint: disable=import-outside-toplevel
  _, r = train_run
  command = ["python", "-m", "refusion_jax.aot", "--program=train"]
  out = aot_fit.table([{"name": "tiny", "command": command, "report": r},
                       {"name": "broken", "command": command, "error": "exit 2: error: x"}])
  tiny, broken = out.splitlines()[2:]
  assert tiny.startswith("| tiny | v5litepod-4 (4 chips) | 0.0 / 16 (0%) | yes | ")
  assert f"{100 * r['estimated_mfu']:.0f}%" in tiny and "`python -m refusion_jax.aot" in tiny
  assert (f"| {r['samples_per_step']:,.0f} | {r['paper_run_hours']:.1f} "
          f"({r['paper_run_hours_padded']:.1f}) |") in tiny
  assert broken.startswith("| broken | - |") and "(exit 2: error: x)" in broken
