"""How much of a training row is real tokens: padded, the release's layout, packed.

For the data a training config names (`--config.data.train_files`, tokenized
with its tokenizer exactly as the trainer does, through the trainer's own
loader), or for a synthetic SFT length distribution (`--synthetic=N`), one
shuffled epoch is laid out in rows of `data.seq_len` tokens four ways:

* padded: one sample per row, padded to seq_len (refusion_jax without packing);
* pad_to_longest_4: micro-batches of 4 samples in the same shuffled order, each
  padded to its longest sample (the public PyTorch release: `pad_sequence` per
  micro-batch of 4 per device);
* first_fit / best_fit: grain's packers as the loader runs them (the config's
  `data.packing_bins`); "packed" is the config's `data.packing` (first_fit
  when it packs nothing).

  python benchmarks/packing.py --config=configs/qwen3_8b_refusion.py --synthetic=20000
  python benchmarks/packing.py --config=configs/tiny_refusion.py --config.data.seq_len=64

With `--train_steps=N` it also trains the config's model on the same data
both ways, one sample per row and packed (the config's packing, first_fit
when none), the same rows per step, steps of the two alternating in one
process: samples per second of each (data loading included) against the
ratio of their real-token shares (TARGETS.md: packed / padded samples per
second >= 0.8 x that ratio).

  python benchmarks/packing.py --config=configs/tiny_refusion.py \
      --config.data.seq_len=64 --train_steps=200

The synthetic distribution is log-normal in tokens per sample (prompt with its
chat template + answer + EOS; median 370, sigma 0.68: mean ~466, p90 ~880,
capped at seq_len), like query/response SFT data tokenized with Qwen3's chat
template (mean ~460, median ~370, p90 ~920); the samples are text made to
tokenize to those lengths with the config's tokenizer, and the table states
the lengths reached. The last line is one JSON object: `samples`, and for
`padded`, `pad_to_longest_4`, `packed` (and `first_fit`, `best_fit`):
`rows` and `real_token_fraction`.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402
from absl import flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from refusion_jax import entry_flags  # noqa: E402

PROGRAM = "benchmarks/packing.py"
MICRO_BATCH = 4  # the release's per-device micro-batch
MEDIAN, SIGMA = 370.0, 0.68  # the synthetic log-normal's median and sigma (tokens)
_CONFIG = config_flags.DEFINE_config_file("config", None, "Training config (its data.*, "
                                          "tokenizer_dir / init_from_hf).", lock_config=True)
_SYNTHETIC = flags.DEFINE_integer("synthetic", 0, "Lay out this many samples of the synthetic "
                                  "SFT length distribution instead of config.data.train_files.")
_MAX_SAMPLES = flags.DEFINE_integer("max_samples", 0, "Lay out this many records of the data "
                                    "drawn at random (0 = all of them).")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the synthetic lengths.")
_TRAIN_STEPS = flags.DEFINE_integer("train_steps", 0, "Also time this many train steps of "
                                    "each layout, alternating (0 = no training).")
_WARMUP = flags.DEFINE_integer("warmup", 3, "Untimed steps of each layout first (compiles).")


def _filler(tokenizer) -> str:
  """A word that tokenizes to one token per repetition (after a space) in any number."""
  for word in ("a", "the", "x", "z", "7", "1", "is", "of"):
    if all(len(tokenizer.encode(" ".join([word] * m))) == m for m in (1, 2, 3, 7, 50, 300)):
      return word
  raise ValueError("no filler word tokenizes to one token per repetition with this tokenizer")


def synthetic_examples(tokenizer, n: int, seq_len: int, seed: int) -> list[dict]:
  """`n` query/response pairs whose samples tokenize to log-normal lengths."""
  rng = np.random.default_rng(seed)
  word = _filler(tokenizer)
  overhead = len(tokenizer.encode_prompt(""))
  totals = np.minimum(np.round(rng.lognormal(np.log(MEDIAN), SIGMA, n)), seq_len).astype(int)
  examples = []
  for total in totals:
    total = max(int(total), overhead + 2)
    prompt = max(overhead, int(round(total * rng.uniform(0.1, 0.5))))
    answer = max(1, total - prompt - 1)  # the EOS ends the response
    examples.append({"query": " ".join([word] * (prompt - overhead)),
                     "response": " ".join([word] * answer)})
  return examples


def _source(config, tokenizer):
  """The training source (built as the trainer builds it) or a synthetic one; with
  --max_samples, a random subset of that many of its records (seeded)."""
  from refusion_jax import data  # pylint: disable=import-outside-toplevel
  seq_len = int(config.data.seq_len)
  if _SYNTHETIC.value:
    source = synthetic_examples(tokenizer, _SYNTHETIC.value, seq_len, _SEED.value)
    what = "synthetic"
  else:
    files = list(config.data.train_files)
    data.validate_files(files)
    tfds_dir = config.data.tfds_dir or os.path.join(tempfile.gettempdir(), "refusion_jax_tfds")
    source = data.source_of(data.prepare(files, tfds_dir), "train")
    what = ", ".join(files)
  if _MAX_SAMPLES.value and _MAX_SAMPLES.value < len(source):
    keep = np.random.default_rng(_SEED.value).permutation(len(source))[:_MAX_SAMPLES.value]
    source = [source[int(i)] for i in sorted(keep)]
    what += f" ({len(source)} of its records, drawn at random)"
  return source, what


def pad_to_longest(lengths: list[int], micro_batch: int) -> tuple[int, int]:
  """(row tokens, rows) of `lengths` in micro-batches each padded to its longest."""
  tokens = 0
  for i in range(0, len(lengths), micro_batch):
    group = lengths[i:i + micro_batch]
    tokens += max(group) * len(group)
  return tokens, len(lengths)


def measure(config) -> dict:
  from refusion_jax import data  # pylint: disable=import-outside-toplevel
  from refusion_jax.training import settings  # pylint: disable=import-outside-toplevel
  tokenizer = settings.load_tokenizer(config)
  source, what = _source(config, tokenizer)
  seq_len = int(config.data.seq_len)
  kwargs = dict(seq_len=seq_len, batch_size=max(1, int(config.global_batch_size)),
                seed=int(config.data.shuffle_seed), drop_overlong=bool(config.data.drop_overlong),
                packing_bins=int(config.data.get("packing_bins", 0)),
                eos_pad_response_to=settings.eos_pad_response_to(config))
  report = {"data": what, "seq_len": seq_len}
  # One sample per row, in the shuffled order every layout reads.
  lengths = data.sample_lengths(source, tokenizer, seq_len=seq_len, seed=kwargs["seed"],
                                drop_overlong=kwargs["drop_overlong"],
                                eos_pad_response_to=kwargs["eos_pad_response_to"])
  report["samples"] = len(lengths)
  report["length_mean"] = float(np.mean(lengths))
  report["length_median"] = float(np.median(lengths))
  report["length_p90"] = float(np.percentile(lengths, 90))
  report["length_max"] = int(np.max(lengths))
  report["padded"] = {"rows": len(lengths),
                      "real_token_fraction": sum(lengths) / (len(lengths) * seq_len)}
  tokens, rows = pad_to_longest(lengths, MICRO_BATCH)
  report["pad_to_longest_4"] = {"rows": rows, "real_token_fraction": sum(lengths) / tokens}
  for packing in ("first_fit", "best_fit"):
    start = time.perf_counter()
    layout = data.measure_layout(source, tokenizer, packing=packing, **kwargs)
    if layout.samples != len(lengths):
      raise AssertionError(f"{packing} laid out {layout.samples} samples, not {len(lengths)}")
    report[packing] = {"rows": layout.rows, "real_token_fraction": layout.real_token_fraction,
                       "samples_per_row": layout.samples_per_row,
                       "seconds": time.perf_counter() - start}
  chosen = "first_fit" if settings.packing(config) == "none" else settings.packing(config)
  report["packed"] = dict(report[chosen], packing=chosen)
  report["packing_bins"] = data.packing_bins_for(kwargs["batch_size"], kwargs["packing_bins"])
  return report


def train_throughput(config, source, tokenizer, steps: int, warmup: int) -> dict:
  """Samples / s of train steps on padded and on packed rows of the same data."""
  import jax  # pylint: disable=import-outside-toplevel
  from refusion_jax import data, sharding  # pylint: disable=import-outside-toplevel
  from refusion_jax.training import settings  # pylint: disable=import-outside-toplevel
  from refusion_jax.training import trainer as trainer_lib  # pylint: disable=C0415
  resolved = settings.resolve(config)
  mesh = sharding.make_mesh(devices=resolved.devices, **resolved.mesh_shape)
  trainer = trainer_lib.Trainer(config, resolved.model_config, mesh=mesh,
                                pad_id=tokenizer.pad_id, total_steps=warmup + steps + 1)
  params = trainer.init_params()
  opt_state = trainer.init_opt_state(params)
  packing = "first_fit" if settings.packing(config) == "none" else settings.packing(config)
  rows = int(config.global_batch_size)
  layouts = {name: iter(data.make_loader(
      source, tokenizer, seq_len=int(config.data.seq_len), batch_size=rows,
      seed=int(config.data.shuffle_seed), packing=mode,
      packing_bins=int(config.data.get("packing_bins", 0)),
      eos_pad_response_to=settings.eos_pad_response_to(config)))
      for name, mode in (("padded", "none"), (packing, packing))}
  totals = {name: {"seconds": 0.0, "samples": 0.0, "real_tokens": 0.0} for name in layouts}
  step = 0
  for i in range(warmup + steps):
    for name, batches in layouts.items():  # alternating: both see the same machine load
      start = time.perf_counter()
      batch = trainer.shard_batch(next(batches))
      params, opt_state, metrics = trainer.train_step(params, opt_state, batch, step)
      metrics = jax.device_get(metrics)
      seconds = time.perf_counter() - start
      step += 1
      if i >= warmup:
        t = totals[name]
        t["seconds"] += seconds
        t["samples"] += float(metrics["samples"])
        t["real_tokens"] += float(metrics["real_tokens"])
  row_tokens = steps * rows * int(config.data.seq_len)
  out = {"objective": config.objective, "rows": rows, "steps": steps, "packing": packing}
  for name, t in totals.items():
    out[name] = {"samples_per_s": t["samples"] / t["seconds"],
                 "samples_per_step": t["samples"] / steps,
                 "real_token_fraction": t["real_tokens"] / row_tokens,
                 "step_ms": 1e3 * t["seconds"] / steps}
  padded, packed = out["padded"], out[packing]
  out["samples_per_s_ratio"] = packed["samples_per_s"] / padded["samples_per_s"]
  out["real_share_ratio"] = packed["real_token_fraction"] / padded["real_token_fraction"]
  out["of_share_ratio"] = out["samples_per_s_ratio"] / out["real_share_ratio"]
  return out


def render_throughput(t: dict) -> str:
  lines = ["", f"training ({t['objective']}, {t['rows']} rows per step, {t['steps']} timed steps "
           "of each layout, alternating; data loading included):", "",
           "| layout | samples / step | real tokens | step (ms) | samples / s |",
           "|---|---|---|---|---|"]
  for name in ("padded", t["packing"]):
    r = t[name]
    lines.append(f"| {name} | {r['samples_per_step']:.1f} | "
                 f"{100 * r['real_token_fraction']:.1f}% | {r['step_ms']:.1f} | "
                 f"{r['samples_per_s']:.3g} |")
  lines.append(f"\npacked / padded samples per second: {t['samples_per_s_ratio']:.2f}x; ratio of "
               f"real-token shares {t['real_share_ratio']:.2f}x; so {t['of_share_ratio']:.2f} of "
               "it (target >= 0.8)")
  return "\n".join(lines)


def render(r: dict) -> str:
  lines = [f"data: {r['data']}; {r['samples']} samples of {r['length_mean']:.0f} tokens on "
           f"average (median {r['length_median']:.0f}, p90 {r['length_p90']:.0f}, max "
           f"{r['length_max']}), rows of {r['seq_len']}; packers: {r['packing_bins']} bins",
           "", "| layout | rows | samples / row | real tokens |", "|---|---|---|---|"]
  for name in ("padded", "pad_to_longest_4", "first_fit", "best_fit"):
    row = r[name]
    tag = " (the config's)" if name == r["packed"]["packing"] else ""
    lines.append(f"| {name}{tag} | {row['rows']} | {r['samples'] / row['rows']:.2f} | "
                 f"{100 * row['real_token_fraction']:.1f}% |")
  return "\n".join(lines)


def main(argv):
  config = entry_flags.config_value(argv, _CONFIG, "a training config")
  if _SYNTHETIC.value < 0 or _MAX_SAMPLES.value < 0:
    raise entry_flags.InputError("--synthetic and --max_samples must be >= 0")
  if _TRAIN_STEPS.value < 0 or _WARMUP.value < 0:
    raise entry_flags.InputError("--train_steps and --warmup must be >= 0")
  report = measure(config)
  text = render(report)
  if _TRAIN_STEPS.value:
    from refusion_jax.training import settings  # pylint: disable=import-outside-toplevel
    tokenizer = settings.load_tokenizer(config)
    source, _ = _source(config, tokenizer)
    report["training"] = train_throughput(config, source, tokenizer, _TRAIN_STEPS.value,
                                          _WARMUP.value)
    text += "\n" + render_throughput(report["training"])
  print(text)
  print(json.dumps(report))


if __name__ == "__main__":
  entry_flags.run_program(main, PROGRAM, (ValueError, FileNotFoundError))
