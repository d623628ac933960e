"""What `aot` prints: a check's report finished with the slice's figures, rendered."""

from __future__ import annotations

from refusion_jax import tpu
from refusion_jax.aot.estimates import (
  GIB,
  PAPER_EPOCHS,
  PAPER_SAMPLES,
  DoesNotFit,
  Memory,
)


def program_entry(name: str, memory: Memory, seconds: float) -> dict:
  return {"name": name, "argument": memory.argument, "output": memory.output,
          "alias": memory.alias, "temp": memory.temp, "code": memory.code,
          "total": memory.total, "compile_s": seconds}


def finish(report: dict, tpu_slice: tpu.Slice) -> dict:
  """Adds the fit verdict and the slice's figures to a check's report."""
  hbm = tpu_slice.chip.hbm_gib
  per_chip = max(p["total"] for p in report["programs"]) / GIB
  return {"program": report.pop("kind"), "topology": tpu_slice.name,
          "libtpu_topology": tpu_slice.topology, "num_slices": tpu_slice.num_slices,
          "chip": tpu_slice.chip.name, "chips": tpu_slice.chips, "hbm_gib": hbm,
          "per_chip_gib": per_chip, "fits": per_chip <= hbm,
          "compile_s": sum(p["compile_s"] for p in report["programs"]), **report}


def _gib(n: float) -> str:
  return f"{n / GIB:.2f} GiB"


def render(r: dict) -> str:
  chip = tpu.CHIPS[r["chip"]]
  lines = [f"{r['program']} on {r['topology']} ({r['libtpu_topology']} x {r['num_slices']} "
           f"slice(s), {r['chips']} {r['chip']} chips of {r['hbm_gib']:g} GiB HBM, "
           f"{chip.bf16_tflops:g} TFLOP/s bf16, {chip.hbm_gbps:g} GB/s)",
           ]
  if "model" in r:
    lines.append(f"model: {r['model']}, {r['params'] / 1e9:.3f}B parameters, mesh {r['mesh']}")
  if r["programs"]:
    lines.append(f"{'program':12s}{'argument':>12s}{'output':>12s}{'aliased':>12s}"
                 f"{'temporary':>12s}{'code':>10s}{'total':>12s}{'compile':>9s}")
  for p in r["programs"]:
    lines.append(f"{p['name']:12s}{_gib(p['argument']):>12s}{_gib(p['output']):>12s}"
                 f"{_gib(p['alias']):>12s}{_gib(p['temp']):>12s}{_gib(p['code']):>10s}"
                 f"{_gib(p['total']):>12s}{p['compile_s']:>8.1f}s")
  if r["per_chip_gib"] is None:
    lines.append(f"per chip: more than {r['hbm_gib']:g} GiB: does not fit")
  else:
    verdict = ("fits" if r["fits"] else
               f"does not fit by {r['per_chip_gib'] - r['hbm_gib']:.2f} GiB")
    lines.append(f"per chip: {r['per_chip_gib']:.2f} of {r['hbm_gib']:g} GiB "
                 f"({100 * r['per_chip_gib'] / r['hbm_gib']:.0f}%): {verdict}")
  if r.get("compiler_error"):
    lines.append(f"the compiler: {r['compiler_error']}")
    if r.get("compiler_limit_gib"):
      lines.append(f"(the compiler's usable HBM per chip: {r['compiler_limit_gib']:.2f} GiB)")
  if r["flops"] is None:
    return "\n".join(lines)
  if r["program"] == "train":
    lines.append(
        f"estimate per chip per step ({r['global_batch']} x {r['seq_len']} tokens, remat "
        f"{r['remat']}): {r['flops'] / 1e12:.1f} TFLOP executed ({r['model_flops'] / 1e12:.1f} "
        f"model; {r['flops_source']}), {r['bytes'] / 1e9:.1f} GB HBM traffic (hlo_traffic)")
    lines.append(f"estimated step time {r['estimated_s']:.2f}s, "
                 f"{r['estimated_tokens_per_s_per_chip']:,.0f} tokens/s per chip, "
                 f"estimated MFU {100 * r['estimated_mfu']:.1f}% (roofline: "
                 "max(flops / peak, bytes / bandwidth), a bound: collectives, overlap and "
                 "kernel efficiency are not modelled)")
    if "samples_per_step" in r:
      lines.append(
          f"rows: data.packing={r['packing']!r}, {r['samples_per_step']:,.0f} samples and "
          f"{r['real_tokens_per_step']:,.0f} real tokens per step "
          f"({100 * r['real_token_fraction']:.1f}% "
          f"of row tokens), for {r['lengths_from']}")
      lines.append(
          f"the paper's run, {PAPER_EPOCHS} epochs over {PAPER_SAMPLES / 1e6:g}M samples "
          f"(estimates at the step time above): {r['paper_run_steps']:,} steps, "
          f"{r['paper_run_hours']:.1f} hours, {r['paper_run_chip_hours']:,.0f} chip-hours; one "
          f"sample per row: {r['paper_run_hours_padded']:.1f} hours, "
          f"{r['paper_run_chip_hours_padded']:,.0f} chip-hours")
  elif r["program"] == "rl":
    lines.append(
        f"estimate per chip per policy step ({r['rollouts']} rollouts, layouts of "
        f"{r['layout_width']} entries / {r['layout_tokens']} scored tokens, reference "
        f"{'on' if r['reference'] else 'off'}, remat {r['remat']}): {r['flops'] / 1e12:.1f} "
        f"TFLOP executed ({r['flops_source']}), {r['bytes'] / 1e9:.1f} GB HBM traffic "
        "(hlo_traffic)")
    lines.append(f"estimated policy step {r['estimated_s']:.2f}s, "
                 f"{r['estimated_s_per_group']:.3f}s per group of {r['group_size']} rollouts "
                 "(roofline: max(flops / peak, bytes / bandwidth); the rollouts' decode is "
                 "--program=decode's)")
  else:
    # (MDM's spec holds kv_chunk 0: its passes have no cache.)
    chunked = (f"; the cache read {r['kv_chunk']} entries at a time, counted over a full "
               "buffer" if 0 < r["kv_chunk"] < r["prompt_len"] + r["gen_length"] else "")
    lines.append(f"estimate per pass and chip ({r['batch']} rows, {r['flops_source']}; HBM "
                 f"bytes from hlo_traffic{chunked}; floor = weights a pass reads + KV cache "
                 "per chip):")
    lines.append(f"{'width':>7s}{'HBM GB':>10s}{'floor GB':>10s}{'x floor':>9s}{'GFLOP':>10s}"
                 f"{'est. ms':>10s}{'bound':>8s}")
    for p in r["per_pass"]:
      compute = p["flops"] / (chip.bf16_tflops * 1e12)
      lines.append(f"{p['width']:>7d}{p['bytes'] / 1e9:>10.3f}{p['bytes_floor'] / 1e9:>10.3f}"
                   f"{p['bytes'] / p['bytes_floor']:>8.2f}x{p['flops'] / 1e9:>10.1f}"
                   f"{1e3 * p['estimated_s']:>10.3f}"
                   f"{'flops' if compute >= p['estimated_s'] else 'HBM':>8s}")
  return "\n".join(lines)


def not_fitting_report(kind: str, tpu_slice: tpu.Slice, error: DoesNotFit, partial: dict) -> dict:
  """The report of a program the compiler refused for lack of HBM."""
  return {"program": kind, "topology": tpu_slice.name, "libtpu_topology": tpu_slice.topology,
          "num_slices": tpu_slice.num_slices, "chip": tpu_slice.chip.name,
          "chips": tpu_slice.chips, "hbm_gib": tpu_slice.chip.hbm_gib,
          "per_chip_gib": None if error.used is None else error.used / GIB,
          "fits": False, "compile_s": None,
          "compiler_error": str(error),
          "compiler_limit_gib": None if error.limit is None else error.limit / GIB,
          "flops": None, "bytes": None, "estimated_s": None,
          "programs": [], **partial}
