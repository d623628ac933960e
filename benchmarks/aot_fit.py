"""Will it fit? Training configs x Cloud TPU slices, compiled here without a TPU.

Each row runs `python -m refusion_jax.aot` in its own process (libtpu from
requirements-tpu.txt) and reads the JSON of its last line; the markdown table
gives per chip: the compiled program's HBM (GiB, and the share of the chip's),
whether it fits, compile seconds on this machine, and the estimated step
time and MFU (roofline estimates: see refusion_jax/aot/estimates.py), each row with the
command that produced it.

  python benchmarks/aot_fit.py --rows=tiny-v5litepod-4      # a minute on 2 CPU cores
  python benchmarks/aot_fit.py                              # every row (8B: minutes each)
  python benchmarks/aot_fit.py --list

The Qwen3-8B rows compile the paper's recipe (configs/qwen3_8b_refusion.py,
64 packed rows x 4096 tokens) as the config says; where a slice has more
chips than rows, a row states the mesh override it uses. Each row also gives
the samples per step and the estimated hours of the paper's 4 epochs over
3.7M samples, packed and one sample per row (aot's estimate).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_8B = ["--program=train", "--config=configs/qwen3_8b_refusion.py"]
_BD3LM = ["--config.objective=bd3lm", "--config.model.attention_impl=xla"]
# name -> aot arguments
ROWS = {
    "8b-v5p-128": [*_8B, "--topology=v5p-128"],
    # 64 packed rows split over at most 64 chips of fsdp: the tensor axis takes the rest.
    "8b-v4-256": [*_8B, "--topology=v4-256", "--config.mesh.tensor=2"],
    "8b-v5litepod-256": [*_8B, "--topology=v5litepod-256", "--config.mesh.tensor=4"],
    # The recipe before packing: 512 rows of one sample each.
    "8b-v5p-128-padded": [*_8B, "--topology=v5p-128", "--config.data.packing=none",
                          "--config.global_batch_size=512"],
    "0.6b-v5p-32": ["--program=train", "--config=configs/qwen3_0_6b_refusion.py",
                    "--topology=v5p-32"],
    "0.6b-v5litepod-16": ["--program=train", "--config=configs/qwen3_0_6b_refusion.py",
                          "--topology=v5litepod-16"],
    "8b-decode-v5litepod-8": [
        "--program=decode", "--topology=v5litepod-8", "--model=qwen3_8b",
        "--config=configs/sample.py", "--config.decode.method=refusion",
        "--config.decode.gen_length=512", "--config.decode.slot_size=32",
        "--config.decode.block_size=128", "--batch=16", "--prompt_len=1024", "--scan_layers"],
    # BD3-LM (the paper's Table 2 baseline) on the same recipe: its two-half rows need the
    # einsum attention (attention_impl='xla').
    "8b-bd3lm-v5p-128": [*_8B, "--topology=v5p-128", *_BD3LM],
    "8b-bd3lm-v4-256": [*_8B, "--topology=v4-256", "--config.mesh.tensor=2", *_BD3LM],
    "8b-bd3lm-v5litepod-256": [*_8B, "--topology=v5litepod-256", "--config.mesh.tensor=4",
                               *_BD3LM],
    "8b-decode-bd3lm-v5litepod-8": [
        "--program=decode", "--topology=v5litepod-8", "--model=qwen3_8b",
        "--config=configs/sample.py", "--config.decode.method=bd3lm",
        "--config.decode.gen_length=512", "--config.decode.block_size=8",
        "--config.decode.slot_size=8", "--batch=16", "--prompt_len=1024", "--scan_layers"],
    # Table 1's systems (docs/RESULTS.md "Table 1's systems"): Llama-3-8B left to right,
    # LLaDA-8B with Fast-dLLM's dual cache, LLaDA-8B with D2F (4 blocks of 32 in flight).
    "8b-decode-llama3-ar-v5litepod-8": [
        "--program=decode", "--topology=v5litepod-8", "--model=llama3_8b",
        "--config=configs/sample.py", "--config.decode.method=ar",
        "--config.decode.gen_length=256", "--batch=16", "--prompt_len=1024",
        "--decode_programs=generate", "--pass_widths="],
    "8b-decode-llada-dual-v5litepod-8": [
        "--program=decode", "--topology=v5litepod-8", "--model=llada_8b",
        "--config=configs/sample.py", "--config.decode.method=mdm",
        "--config.decode.gen_length=256", "--config.decode.block_size=32",
        "--config.decode.slot_size=32", "--config.decode.mdm_threshold=0.9",
        "--config.decode.mdm_cache=dual", "--batch=16", "--prompt_len=1024",
        "--decode_programs=run"],
    "8b-decode-llada-d2f-v5litepod-8": [
        "--program=decode", "--topology=v5litepod-8", "--model=llada_8b",
        "--config=configs/sample.py", "--config.decode.method=d2f",
        "--config.decode.gen_length=256", "--config.decode.block_size=32",
        "--config.decode.slot_size=1", "--config.decode.d2f_window=4", "--batch=16",
        "--prompt_len=1024", "--decode_programs=run", "--pass_widths="],
    "tiny-v5litepod-4": ["--program=train", "--config=configs/tiny_refusion.py",
                         "--topology=v5litepod-4"],
    # RL (docs/RESULTS.md "RL and planning"): the 8B policy step with the reference's
    # log-probabilities, 64 rollouts of 3,072-entry layouts.
    "8b-rl-v5p-128": ["--program=rl", "--config=configs/qwen3_8b_refusion_rl.py",
                      "--topology=v5p-128"],
}


def run_row(name: str, timeout: float) -> dict:
  args = ROWS[name]
  env = dict(os.environ, JAX_PLATFORMS="cpu", ALLOW_MULTIPLE_LIBTPU_LOAD="1")
  command = ["python", "-m", "refusion_jax.aot", *args]
  print(f"[aot_fit] {name}: {shlex.join(command)}", file=sys.stderr, flush=True)
  t = time.perf_counter()
  try:
    done = subprocess.run([sys.executable, "-m", "refusion_jax.aot", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)
  except subprocess.TimeoutExpired:
    return {"name": name, "command": command, "error": f"not done in {timeout:.0f}s"}
  lines = done.stdout.strip().splitlines()
  if done.returncode not in (0, 3) or not lines or not lines[-1].startswith("{"):
    tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
    return {"name": name, "command": command, "error": f"exit {done.returncode}: {tail}"}
  report = json.loads(lines[-1])
  print(f"[aot_fit] {name}: done in {time.perf_counter() - t:.0f}s", file=sys.stderr, flush=True)
  return {"name": name, "command": command, "report": report}


def _cell(value, fmt: str) -> str:
  return "-" if value is None else format(value, fmt)


def table(results: list[dict]) -> str:
  lines = ["| row | slice | per chip GiB | fits | compile s | est. step (pass) s | est. MFU | "
           "samples / step | est. paper run h (one per row) | command |",
           "|---|---|---|---|---|---|---|---|---|---|"]
  for r in results:
    command = f"`{shlex.join(r['command'])}`"
    if "error" in r:
      lines.append(f"| {r['name']} | - | - | - | - | - | - | - | - | {command} ({r['error']}) |")
      continue
    p = r["report"]
    gib = p["per_chip_gib"]
    share = f"{gib:.1f} / {p['hbm_gib']:g} ({100 * gib / p['hbm_gib']:.0f}%)" if gib else "-"
    mfu = p.get("estimated_mfu")
    step = _cell(p["estimated_s"], ".3g")
    if p["program"] == "decode" and p["estimated_s"] is not None:
      step += f" (pass of {p['pass_width']})"
    if p["program"] == "rl" and p["estimated_s"] is not None:
      step += f" ({p['estimated_s_per_group']:.3g} a group of {p['group_size']})"
    samples = _cell(p.get("samples_per_step"), ",.0f")
    hours = "-"
    if p.get("paper_run_hours") is not None:
      hours = f"{p['paper_run_hours']:.1f} ({p['paper_run_hours_padded']:.1f})"
    lines.append(f"| {r['name']} | {p['topology']} ({p['chips']} chips) | {share} | "
                 f"{'yes' if p['fits'] else 'no'} | {_cell(p['compile_s'], '.0f')} | {step} | "
                 f"{'-' if mfu is None else f'{100 * mfu:.0f}%'} | {samples} | {hours} | "
                 f"{command} |")
  return "\n".join(lines)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--rows", default=",".join(ROWS), help="comma-separated row names")
  parser.add_argument("--list", action="store_true", help="print the rows and their commands")
  parser.add_argument("--timeout", type=float, default=3600, help="seconds per row")
  args = parser.parse_args(argv)
  names = [n.strip() for n in args.rows.split(",") if n.strip()]
  unknown = [n for n in names if n not in ROWS]
  if unknown or not names:
    parser.error(f"--rows: unknown {unknown or 'none'}; choose from {sorted(ROWS)}")
  if args.list:
    for n in names:
      print(f"{n}: {shlex.join(['python', '-m', 'refusion_jax.aot', *ROWS[n]])}")
    return
  results = [run_row(n, args.timeout) for n in names]
  print(table(results))
  print("\nEstimates: roofline max(flops / peak, HBM bytes / bandwidth) per chip (flops by hand, "
        "bytes from the compiled program); collectives are not modelled. compile s: this "
        "machine.")


if __name__ == "__main__":
  main()
