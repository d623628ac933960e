"""Decode tokens/s of two (or more) git revisions side by side, same model, prompts and outputs.

Each variant is a source tree of `refusion_jax` (a revision exported with
`git archive` into a temporary folder, or the work tree itself) and optional
DecodeConfig overrides. Every variant runs in a worker process of its own with
only its tree on PYTHONPATH; the workers build the same random model from the
same seed, compile every case, and decode the same prompts. The timed repeats
then alternate between the workers (A B A B ..., one at a time, so they never
compete for the cores), and each case's token ids (and lengths and passes) must
be equal across the variants or the run fails.

A case is (api, rows, gen_length): the same `--prompts` prompts decoded `rows`
at a time, by `Decoder.generate` (one call per group of rows, each waited for)
or by the offline `Engine` with `rows` rows (one `run` over all of them, as
sample.py decodes). ReFusion, greedy, slots of 8, blocks of 32. tokens/s counts
the generated tokens (up to and including EOS) of all the prompts over the
time of one repeat; the table shows the median over the repeats and its ratio
to the first variant's (the base), and the median of the per-repeat ratios
(the variants' runs of a repeat are back to back, their order alternated).

  python benchmarks/decode_commits.py                      # e57c5b9 vs the work tree
  python benchmarks/decode_commits.py --variants e57c5b9,HEAD,.:kv_chunk=0
  python benchmarks/decode_commits.py --apis generate --rows 1 --gen_lengths 64 --repeats 21

A variant is `REV[:FIELD=VALUE;...]`: REV a git revision, or `.` for the work
tree (HEAD with any uncommitted changes); the fields are DecodeConfig fields
set in that variant only (a field its revision lacks is an error). The
workload uses only APIs that exist at e57c5b9 and after: `config.tiny`,
`model.Transformer`, `decode.engine.Decoder` (`generate`, `engine`) and `Engine`
(`warm_up`, `run`).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The release's tiny test model (benchmarks/decode_speed.py's release_tiny).
MODEL = dict(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
             mlp_dim=128, vocab_size=256, tie_embeddings=False)


# --- worker: runs with one revision's tree on PYTHONPATH ---------------------------------


def _prompts(mc, n: int, width: int, seed: int):
  # decode_speed.make_prompts' random prompts, written again: importing that module
  # would put this checkout's refusion_jax on the path ahead of the revision's.
  import numpy as np  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(seed)
  specials = {mc.mask_token_id, mc.eos_token_id, mc.bos_token_id, mc.pad_token_id}
  ordinary = np.array([t for t in range(mc.vocab_size) if t not in specials])
  lens_b = rng.integers(max(1, width // 2), width + 1, size=n).astype(np.int32)
  ids_bp = np.zeros((n, width), np.int32)
  for b in range(n):
    ids_bp[b, :lens_b[b]] = rng.choice(ordinary, size=lens_b[b])
  return ids_bp, lens_b


def worker(cfg: dict) -> None:
  """Builds the model, compiles and checks every case, then answers `run CASE` lines on
  stdin with that case's timed pass over every prompt (one JSON line each)."""
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from flax import nnx  # pylint: disable=import-outside-toplevel

  # The worker imports the revision it measures, so it reads that revision's names: a
  # revision before the decode options moved (decode/settings.py) and the model class was
  # renamed (Transformer) has them under their older names.
  from refusion_jax import config as config_lib  # pylint: disable=import-outside-toplevel
  from refusion_jax import model as model_lib  # pylint: disable=import-outside-toplevel
  from refusion_jax.decode import engine  # pylint: disable=import-outside-toplevel
  try:
    from refusion_jax.decode.settings import DecodeConfig  # pylint: disable=import-outside-toplevel
  except ImportError:
    DecodeConfig = config_lib.DecodeConfig
  Transformer = getattr(model_lib, "Transformer", None) or getattr(model_lib, "Qwen3")

  mc = config_lib.tiny(**MODEL)
  model = Transformer(mc, rngs=nnx.Rngs(cfg["seed"]))
  ids_np, lens_np = _prompts(mc, cfg["prompts"], cfg["prompt_len"], cfg["seed"])
  width = max(cfg["width"], cfg["prompt_len"])  # generate's padded prompts, the Engine's width
  ids_np = np.pad(ids_np, ((0, 0), (0, width - ids_np.shape[1])))
  rng = jax.random.PRNGKey(cfg["seed"])
  prompts = [ids_np[i, :lens_np[i]].tolist() for i in range(len(ids_np))]
  cases, info = [], []
  for api, rows, gen in cfg["cases"]:
    dc = DecodeConfig(method="refusion", gen_length=gen, slot_size=8,
                      block_size=min(32, gen), temperature=0.0)
    dc = dc.replace(**cfg["overrides"])
    decoder = engine.Decoder(model, dc)
    t = time.perf_counter()
    if api == "engine":  # the offline engine (sample.py's path): rows rows, one width
      eng = decoder.engine(rows, width=width)
      eng.warm_up()
      eng.run(prompts, rng)  # first-call costs untimed

      def call(eng=eng):
        return eng.run(prompts, rng)
    else:  # one Decoder.generate call per group of rows
      groups = [(ids_np[i:i + rows], lens_np[i:i + rows]) for i in range(0, len(ids_np), rows)]
      jax.block_until_ready(decoder.generate(*groups[0], rng))

      def call(decoder=decoder, groups=groups):
        return [jax.block_until_ready(decoder.generate(ids, lens, rng, with_state=True))
                for ids, lens in groups]
    compile_s = time.perf_counter() - t
    if api == "engine":
      run = call()
      tokens = [r.tokens for r in run.results]
      passes = run.passes
      nfe = int(sum(r.counters["nfe_b"] for r in run.results))
    else:
      tokens, passes, nfe = [], 0, 0
      for out, state in call():
        length_b = np.asarray(out.length_b)
        tokens_bg = np.asarray(out.tokens_bg)
        tokens += [tokens_bg[b, :length_b[b]].tolist() for b in range(len(length_b))]
        passes += int(state.passes)
        nfe += int(np.asarray(out.counters.nfe_b()).sum())
    cases.append(call)
    info.append({"api": api, "rows": rows, "gen": gen, "compile_s": compile_s,
                 "tokens": tokens, "generated": int(sum(len(x) for x in tokens)),
                 "passes": passes, "nfe": nfe})
  print(json.dumps({"ready": True, "cases": info}), flush=True)
  for line in sys.stdin:
    words = line.split()
    if not words or words[0] == "quit":
      break
    call = cases[int(words[1])]
    t = time.perf_counter()
    call()
    seconds = time.perf_counter() - t
    print(json.dumps({"seconds": seconds}), flush=True)


# --- driver --------------------------------------------------------------------------------


def _git(*args) -> str:
  return subprocess.run(["git", "-C", REPO, *args], check=True, capture_output=True,
                        text=True).stdout.strip()


def parse_variant(text: str) -> tuple[str, dict]:
  rev, _, rest = text.partition(":")
  overrides = {}
  for item in filter(None, (s.strip() for s in rest.split(";"))):
    key, eq, value = item.partition("=")
    if not eq:
      raise ValueError(f"variant {text!r}: {item!r} is not FIELD=VALUE")
    try:
      overrides[key.strip()] = ast.literal_eval(value.strip())
    except (ValueError, SyntaxError):
      overrides[key.strip()] = value.strip()
  return rev.strip() or ".", overrides


class Variant:
  """One worker process: a source tree and its DecodeConfig overrides."""

  def __init__(self, text: str, tmp: str, cfg: dict):
    self.rev, self.overrides = parse_variant(text)
    if self.rev == ".":
      head = _git("rev-parse", "--short", "HEAD")
      dirty = _git("status", "--porcelain", "--", "refusion_jax")
      self.name = f"{head}+work tree" if dirty else head
      self.tree = REPO
    else:
      self.name = _git("rev-parse", "--short", self.rev)
      self.tree = os.path.join(tmp, f"{len(os.listdir(tmp))}_{self.name}")
      os.makedirs(self.tree)
      archive = subprocess.run(["git", "-C", REPO, "archive", self.rev, "refusion_jax"],
                               check=True, capture_output=True).stdout
      subprocess.run(["tar", "-x", "-C", self.tree], input=archive, check=True)
    if self.overrides:
      self.name += " " + ",".join(f"{k}={v}" for k, v in self.overrides.items())
    env = dict(os.environ, PYTHONPATH=self.tree, PYTHONDONTWRITEBYTECODE="1")
    worker_cfg = dict(cfg, overrides=self.overrides)
    self.proc = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(worker_cfg)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=tmp)
    self.info = None

  def ready(self) -> list[dict]:
    line = self.proc.stdout.readline()
    if not line:
      raise RuntimeError(f"worker for {self.name} exited ({self.proc.wait()})")
    self.info = json.loads(line)["cases"]
    return self.info

  def run(self, case: int) -> float:
    self.proc.stdin.write(f"run {case}\n")
    self.proc.stdin.flush()
    line = self.proc.stdout.readline()
    if not line:
      raise RuntimeError(f"worker for {self.name} exited ({self.proc.wait()})")
    return json.loads(line)["seconds"]

  def close(self):
    if self.proc.poll() is None:
      try:
        self.proc.stdin.write("quit\n")
        self.proc.stdin.close()
      except OSError:
        pass
      self.proc.wait()


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--variants", default="e57c5b9,.",
                      help="comma-separated REV[:FIELD=VALUE;...]; the first is the base "
                           "('.': the work tree)")
  parser.add_argument("--apis", default="generate,engine",
                      help="comma-separated: generate (Decoder.generate, one call per group of "
                           "rows) and/or engine (the offline Engine with that many rows)")
  parser.add_argument("--rows", default="1,16", help="rows per call, comma-separated")
  parser.add_argument("--gen_lengths", default="32,64", help="comma-separated")
  parser.add_argument("--prompts", type=int, default=16,
                      help="prompts decoded per case (a multiple of every --rows)")
  parser.add_argument("--prompt_len", type=int, default=32,
                      help="padded prompt width (lengths drawn in [len/2, len])")
  parser.add_argument("--width", type=int, default=0,
                      help="prompt width of a call (generate's padded prompts, the Engine's "
                           "width; KV buffer = width + gen_length); default --prompt_len")
  parser.add_argument("--repeats", type=int, default=7,
                      help="timed passes over the prompts per case and variant, alternated")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--worker", default="", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  args.variants = [v for v in args.variants.split(",") if v.strip()]
  args.apis = [a.strip() for a in args.apis.split(",") if a.strip()]
  if not args.apis or set(args.apis) - {"generate", "engine"}:
    parser.error(f"--apis: generate and/or engine, got {args.apis}")
  args.rows = [int(r) for r in args.rows.split(",") if r.strip()]
  args.gen_lengths = [int(g) for g in args.gen_lengths.split(",") if g.strip()]
  if len(args.variants) < 2 and not args.worker:
    parser.error("--variants needs at least two")
  if any(r <= 0 or args.prompts % r for r in args.rows):
    parser.error(f"--prompts={args.prompts} must be a multiple of every --rows {args.rows}")
  for g in args.gen_lengths:
    if g <= 0 or (g > 32 and g % 32) or (g < 32 and g % 8):
      parser.error(f"--gen_lengths: {g} is not a multiple of 32 (or of 8 below 32)")
  if args.repeats <= 0:
    parser.error("--repeats must be > 0")
  if args.width and args.width < args.prompt_len:
    parser.error(f"--width={args.width} must be at least --prompt_len={args.prompt_len}")
  return args


def main(argv=None) -> list[dict]:
  args = parse_args(argv)
  if args.worker:
    worker(json.loads(args.worker))
    return []
  cases = [(a, r, g) for a in args.apis for r in args.rows for g in args.gen_lengths]
  cfg = {"seed": args.seed, "prompts": args.prompts, "prompt_len": args.prompt_len,
         "width": args.width, "cases": cases}
  with tempfile.TemporaryDirectory(prefix="decode_commits_") as tmp:
    variants = []
    try:
      for text in args.variants:  # one at a time: compiles would share the cores
        v = Variant(text, tmp, cfg)
        variants.append(v)
        v.ready()
        print(f"  {v.name}: compiled "
              + ", ".join(f"{c['api']} {c['rows']}x{c['gen']} {c['compile_s']:.1f}s"
                          for c in v.info),
              file=sys.stderr, flush=True)
      base = variants[0]
      for i, c in enumerate(base.info):
        for v in variants[1:]:
          o = v.info[i]
          if (o["tokens"], o["passes"], o["nfe"]) != (c["tokens"], c["passes"], c["nfe"]):
            raise SystemExit(f"{c['api']} rows {c['rows']} gen {c['gen']}: {v.name}'s outputs "
                             f"differ from {base.name}'s (passes {o['passes']} vs "
                             f"{c['passes']})")
      times = {(vi, ci): [] for vi in range(len(variants)) for ci in range(len(cases))}
      for rep in range(args.repeats):
        for ci in range(len(cases)):
          order = range(len(variants)) if rep % 2 == 0 else reversed(range(len(variants)))
          for vi in order:
            times[vi, ci].append(variants[vi].run(ci))
        print(f"  repeat {rep + 1}/{args.repeats}", file=sys.stderr, flush=True)
    finally:
      for v in variants:
        v.close()
  results = []
  print(f"ReFusion greedy, random model {MODEL['num_layers']} layers d={MODEL['hidden_size']} "
        f"vocab {MODEL['vocab_size']} (seed {args.seed}); {args.prompts} prompts of "
        f"{args.prompt_len // 2}-{args.prompt_len} tokens per case, width "
        f"{max(args.width, args.prompt_len)}; median of {args.repeats} "
        f"alternated repeats; outputs (token ids, passes, NFE) identical across variants")
  header = (f"{'revision':34s}{'api':>9s}{'rows':>5s}{'gen':>5s}{'tokens':>8s}{'passes':>8s}"
            f"{'tok/s':>10s}{'ms/pass':>9s}{'ratio':>8s}{'paired':>8s}")
  print(header)
  print("-" * len(header))
  for ci, (api, rows, gen) in enumerate(cases):
    base_t = times[0, ci]
    for vi, v in enumerate(variants):
      c = v.info[ci]
      t = times[vi, ci]
      med = statistics.median(t)
      tok_s = c["generated"] / med
      ratio = statistics.median(base_t) / med
      paired = statistics.median(b / x for b, x in zip(base_t, t))
      results.append({"variant": v.name, "api": api, "rows": rows, "gen": gen, "tok_s": tok_s,
                      "ratio": ratio, "paired": paired, "seconds": t})
      print(f"{v.name:34s}{api:>9s}{rows:>5d}{gen:>5d}{c['generated']:>8d}{c['passes']:>8d}"
            f"{tok_s:>10.1f}{1e3 * med / max(c['passes'], 1):>9.3f}"
            f"{ratio:>7.3f}x{paired:>7.3f}x")
  print("\nratio: median tokens/s over the base's (first row of each case); paired: the median "
        "of the per-repeat ratios (the variants' runs of a repeat are back to back). passes: "
        "loop passes of all the calls of one repeat.")
  return results


if __name__ == "__main__":
  main()
