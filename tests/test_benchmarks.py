"""The benchmark scripts run and report well-formed rows (their numbers are not checked)."""

import json
import os
import threading

import numpy as np
import pytest

from benchmarks import forward_cost


def test_forward_cost_reports_each_width(capsys):
  rows = forward_cost.main(["--widths=1,4", "--passes=2", "--repeats=1", "--context=8"])
  assert [r["width"] for r in rows] == [1, 4]
  assert all(r["ms_per_pass"] > 0 for r in rows)
  out = capsys.readouterr().out
  assert "| 1 |" in out and "| 4 |" in out and "1.00x" in out


def test_lossless_speed_decodes_ars_tokens_and_gives_each_windows_ceiling(capsys):
  from benchmarks import lossless_speed  # pylint: disable=import-outside-toplevel
  rows = lossless_speed.main(["--windows=4", "--per_task=1", "--gen_length=8", "--repeats=1"])
  ar, ll = rows
  assert ll["tokens"] == ar["tokens"] and ll["passes"] < ar["passes"]  # AR's answers
  assert ll["ceiling"] == pytest.approx(ll["tpf"] * ar["bare_ms"] / ll["bare_ms"])
  assert "| lossless, window 4 |" in capsys.readouterr().out
  with pytest.raises(SystemExit):
    lossless_speed.parse_args(["--windows=0"])


def test_planner_speed_keeps_every_answer_under_every_planner(tmp_path, capsys):
  """Every planner row (thresholds, the planner that knows the answer, the search)
  decodes the first row's answers; drafting every slot beats the leftmost alone."""
  from benchmarks import planner_speed  # pylint: disable=import-outside-toplevel
  weights = tmp_path / "plan_weights.json"
  weights.write_text(json.dumps({"features": [], "plan_weights": [0, 0, 0, 0, 0, -1.0]}))
  assert planner_speed.read_weights(str(weights)) == (0, 0, 0, 0, 0, -1.0)
  # (A policy row decodes through the engine as a threshold row does: tests/test_rl.py.)
  rep = planner_speed.main(["--per_task=1", "--thresholds=0,1", "--rows=8", "--search"])
  assert len(rep) == 4 and all(r["differ"] == 0 for r in rep.values())
  tpf = {name.split(" ")[0] + name.split(" ")[-1]: r["tpf"] for name, r in rep.items()}
  assert tpf["threshold0"] > tpf["threshold1"] and tpf["knowsanswer"] > 1
  assert tpf["search,deep"] >= tpf["threshold0"]  # never worse than the rule it rolls out
  assert "| knows the answer | 0 |" in capsys.readouterr().out
  weights.write_text("[1, 2]")
  with pytest.raises(ValueError, match="expected refusion_jax.rl's plan_weights.json"):
    planner_speed.read_weights(str(weights))


def test_forward_cost_runs_a_preset_shape(capsys):
  forward_cost.main(["--preset=release_tiny", "--widths=2", "--batch=2", "--passes=1",
                     "--repeats=1", "--context=4"])
  assert "2 layers, d=64, vocab 256; batch 2" in capsys.readouterr().out


@pytest.mark.parametrize("flag, needle", [("--widths=1,x", "comma-separated ints"),
                                          ("--widths=0,4", "must be positive"),
                                          ("--passes=0", "--passes must be >= 1"),
                                          ("--preset=nope", "invalid choice")])
def test_forward_cost_rejects_bad_flags(flag, needle, capsys):
  with pytest.raises(SystemExit):
    forward_cost.parse_args([flag])
  assert needle in capsys.readouterr().err


def test_forward_cost_takes_a_preset_or_a_model_not_both(capsys):
  with pytest.raises(SystemExit):
    forward_cost.parse_args(["--preset=release_tiny", "--model_dir=somewhere"])
  assert "exclude each other" in capsys.readouterr().err


def test_forward_cost_names_an_over_long_context():
  with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings"):
    forward_cost.main(["--widths=4", "--context=100000", "--passes=1", "--repeats=1"])


def test_decode_speed_compares_identical_work(capsys):
  from benchmarks import decode_speed  # pylint: disable=import-outside-toplevel
  rows = decode_speed.main(["--methods=refusion,ar", "--batch_sizes=1,2", "--prompt_len=8",
                            "--gen_length=8", "--slot_size=4", "--block_size=8",
                            "--repeats=1", "--engine_prompts=2"])
  by = {(r["method"], r["batch"]): r for r in rows}
  for method in ("refusion", "ar"):
    # The same two prompts one at a time and as one batch: a batch decodes each row
    # exactly as alone, so the token and pass counts agree.
    one, two = by[(method, 1)], by[(method, 2)]
    assert one["tokens"] == two["tokens"] > 0
    assert one["nfe_row"] == two["nfe_row"]
    assert one["tok_s"] > 0 and two["engine_pass_ratio"] > 0
  assert "refusion: batch 2 / batch 1 tokens/s" in capsys.readouterr().out


def test_decode_options_runs_each_option_side_by_side(capsys):
  from benchmarks import decode_options  # pylint: disable=import-outside-toplevel
  rows = decode_options.main(["--options=release,verify+remask", "--prompts=3", "--rows=2",
                              "--repeats=1", "--prompt_len=8", "--gen_length=8",
                              "--slot_size=4", "--block_size=8", "--slot_threshold=0.0"])
  by = {r["name"]: r for r in rows}
  assert list(by) == ["release", "verify+remask"]
  assert by["release"]["corrected"] == by["release"]["remasked"] == 0
  assert by["release"]["kinds"]["recheck_b"] == 0
  for r in rows:
    assert r["acc"] is None and r["tpf"] > 0 and r["ms_pass"] > 0 and r["tpse"] > 0
  out = capsys.readouterr().out
  assert "| release | n/a |" in out and "(1.00x)" in out
  with pytest.raises(SystemExit):
    decode_options.parse_args(["--options=fast"])
  assert "unknown 'fast'" in capsys.readouterr().err


def test_mdm_cache_compares_the_caches_with_no_cache(capsys):
  from benchmarks import mdm_cache  # pylint: disable=import-outside-toplevel
  rows = mdm_cache.main(["--caches=dual", "--refresh=1", "--prompts=2", "--rows=2",
                         "--repeats=1", "--prompt_len=8", "--gen_length=8", "--block_size=4"])
  by = {r["name"]: r for r in rows}
  assert list(by) == ["none", "dual", "dual/refresh 1"]
  # Refreshed every step, the dual cache is the decoder without one.
  assert by["none"]["same"] == by["dual/refresh 1"]["same"] == 100.0
  assert by["none"]["fulls"] == 0 and by["dual"]["fulls"] == 2  # a full pass per block
  assert by["dual/refresh 1"]["fulls"] == by["dual/refresh 1"]["nfe"]
  assert "| dual | n/a |" in capsys.readouterr().out
  with pytest.raises(SystemExit):
    mdm_cache.parse_args(["--caches=triple"])
  assert "unknown 'triple'" in capsys.readouterr().err


def test_decode_speed_needs_batch_sizes_that_divide_the_largest(capsys):
  from benchmarks import decode_speed  # pylint: disable=import-outside-toplevel
  with pytest.raises(SystemExit):
    decode_speed.main(["--batch_sizes=2,3"])
  assert "must divide the largest" in capsys.readouterr().err


def test_decode_speed_memory_only_compiles_from_shapes(capsys):
  from benchmarks import decode_speed  # pylint: disable=import-outside-toplevel
  rows = decode_speed.main(["--memory_only", "--methods=refusion,ar", "--batch_sizes=1,2",
                            "--prompt_len=8", "--gen_length=8", "--slot_size=4",
                            "--block_size=8"])
  by = {(r["method"], r["batch"]): r for r in rows}
  assert set(by) == {("refusion", 1), ("ar", 1), ("refusion", 2), ("ar", 2)}
  for r in rows:
    assert r["program_mb"] > r["temp_mb"] >= 0
  # Twice the rows: twice the KV cache and prompts, the same parameters.
  assert by[("ar", 2)]["program_mb"] > by[("ar", 1)]["program_mb"]
  out = capsys.readouterr().out
  assert "compiled from shapes only" in out and "1.00x" in out


@pytest.mark.parametrize("script, flag, needle", [
    ("serve_load", "--clients=1,x", "comma-separated ints"),
    ("serve_load", "--clients=0", "must be positive"),
    ("serve_load", "--repeats=0", "must be >= 1"),
    ("serve_load", "--requests_per_client=0", "must be >= 1"),
    ("serve_load", "--prompts=-1", "--prompts >= 0"),
    ("serve_load", "--loop_stagger=-1", "--loop_stagger must be >= 0"),
    ("serve_load", "--methods=beam", "choose from refusion, ar, mdm")])
def test_serving_benchmarks_reject_bad_flags(script, flag, needle, capsys):
  import importlib  # pylint: disable=import-outside-toplevel
  with pytest.raises(SystemExit):
    importlib.import_module(f"benchmarks.{script}").parse_args([flag])
  assert needle in capsys.readouterr().err


def test_serve_load_counts_cpu_of_a_process_and_finds_its_child():
  import subprocess  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel
  import time  # pylint: disable=import-outside-toplevel

  from benchmarks import serve_load  # pylint: disable=import-outside-toplevel
  # A parent that spins its child for a while: the child is found and its CPU counted.
  code = ("import subprocess, sys; subprocess.run([sys.executable, '-c', "
          "'import time\\nt = time.time()\\nwhile time.time() - t < 3: pass'])")
  proc = subprocess.Popen([sys.executable, "-c", code])
  try:
    deadline = time.time() + 10
    child = None
    while child is None:
      assert time.time() < deadline
      time.sleep(0.05)
      child = serve_load.server_pids(proc)[1]
    a = serve_load.cpu_seconds(child)
    time.sleep(1.0)
    used = serve_load.cpu_seconds(child) - a
    assert 0.2 < used < 1.5, used  # one busy core for about a second
    assert serve_load.cpu_seconds(proc.pid) < 0.5 * serve_load.cpu_seconds(child) + 0.5
  finally:
    proc.wait(timeout=30)
  assert serve_load.cpu_seconds() > 0


def test_serve_load_reads_the_servers_passes_from_metrics():
  import http.server  # pylint: disable=import-outside-toplevel

  from benchmarks import serve_load  # pylint: disable=import-outside-toplevel

  class Metrics(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # pylint: disable=invalid-name
      body = (b"# TYPE refusion_engine_passes_total counter\n"
              b"refusion_engine_passes_total 1234.0\nrefusion_requests_total 7.0\n")
      self.send_response(200 if self.path == "/metrics" else 404)
      self.send_header("Content-Length", str(len(body)))
      self.end_headers()
      self.wfile.write(body)

    def log_message(self, *args):
      pass

  server = http.server.HTTPServer(("127.0.0.1", 0), Metrics)
  thread = threading.Thread(target=server.serve_forever, daemon=True)
  thread.start()
  try:
    assert serve_load.server_passes(f"http://127.0.0.1:{server.server_port}") == 1234.0
  finally:
    server.shutdown()
    server.server_close()


def test_benchmarks_need_no_test_only_package():
  """`bash launch/setup_env.sh` without --test must be enough to run every benchmark."""
  import ast  # pylint: disable=import-outside-toplevel
  import pathlib  # pylint: disable=import-outside-toplevel
  import re  # pylint: disable=import-outside-toplevel
  root = pathlib.Path(__file__).resolve().parents[1]
  test_only = set()
  for line in (root / "requirements-test.txt").read_text().splitlines():
    name = re.match(r"\s*([A-Za-z0-9_.-]+)", line.split("#")[0])
    if name:
      test_only.add(name.group(1).lower().replace("-", "_").split("_")[0])
  assert {"pytest", "openai", "httpx"} <= test_only
  for path in sorted((root / "benchmarks").glob("*.py")):
    for node in ast.walk(ast.parse(path.read_text())):
      names = ([a.name for a in node.names] if isinstance(node, ast.Import)
               else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
      for name in names:
        assert name.split(".")[0].lower() not in test_only, f"{path.name} imports {name}"


def test_serve_load_server_config_takes_the_benchmark_flags_and_server_flags():
  from benchmarks import serve_load  # pylint: disable=import-outside-toplevel
  args = serve_load.parse_args(["--rows=4", "--clients=2,8", "--gen_length=8", "--ignore_eos",
                                "--server_flags=--config.chunk_passes=2 "
                                "--config.decode.slot_threshold=0.7 --config.engine=thread"])
  c = serve_load.serve_config("some/model", "ar", args, 32)
  assert (c.model_dir, c.rows, c.max_prompt_len, c.max_queue) == ("some/model", 4, 32, 16)
  assert c.chunk_passes == 2 and c.engine == "thread"
  assert c.decode.slot_threshold == 0.7 and c.decode.method == "ar"
  assert c.decode.slot_size == c.decode.block_size == c.decode.gen_length == 8  # AR: one slot
  assert c.decode.ignore_eos is True
  # The server's command line sets the same fields (the server flags last: they win).
  cmd = serve_load.server_command("some/model", "ar", args, 32)
  assert "--config.decode.slot_size=8" in cmd and "--config.max_prompt_len=32" in cmd
  assert "--config.decode.ignore_eos=True" in cmd
  assert cmd[-3:] == ["--config.chunk_passes=2", "--config.decode.slot_threshold=0.7",
                      "--config.engine=thread"]
  fields = serve_load.server_fields("some/model", "ar", args, 32)
  assert all(c[k] == v for k, v in fields.items()
             if k != "chunk_passes" and k != "decode.slot_threshold")
  assert c.decode.matmul_precision is None  # per platform on both sides
  precise = serve_load.parse_args(["--matmul_precision=default"])
  assert serve_load.serve_config("m", "refusion", precise, 32).decode.matmul_precision == "default"
  assert "--config.decode.matmul_precision=default" in serve_load.server_command(
      "m", "refusion", precise, 32)
  for value, want in (("false", False), ("True", True)):
    wait = serve_load.parse_args([f"--server_flags=--config.decode.ignore_eos={value}"])
    assert serve_load.serve_config("m", "ar", wait, 32).decode.ignore_eos is want  # a bool
  bad = serve_load.parse_args(["--server_flags=--rows=3"])
  with pytest.raises(ValueError, match="not --config.FIELD=VALUE"):
    serve_load.serve_config("m", "refusion", bad, 32)


def test_serve_load_counts_the_responses_that_differ_and_where():
  from benchmarks import serve_load  # pylint: disable=import-outside-toplevel
  want = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]
  assert serve_load.mismatch(want, want) == (0, None)
  # One differs at token 2, one is cut short after token 1: two differ, from token 1.
  assert serve_load.mismatch([[5, 6, 0, 8], [9], [11, 12, 13]], want) == (2, 1)
  assert serve_load.mismatch([[5, 6, 7, 8, 1], [9, 10], [4, 12, 13]], want) == (2, 0)
  with pytest.raises(ValueError, match="2 responses against 3"):
    serve_load.mismatch(want[:2], want)
  text = serve_load._mismatch_text  # pylint: disable=protected-access
  assert text((0, None), (0, None), 3) == "yes"
  assert text((2, 1), (0, None), 3) == "NO: server 2 of 3 (from token 1), loop 0 of 3"
  assert text((0, None), (1, 0), 3) == "NO: server 0 of 3, loop 1 of 3 (from token 0)"


def test_serve_load_goes_through_a_short_prompt_file_again_in_order(tmp_path):
  from benchmarks import serve_load  # pylint: disable=import-outside-toplevel

  class Ids:
    def encode_prompt(self, query):
      return [int(query)]

  path = tmp_path / "prompts.jsonl"
  path.write_text("".join(json.dumps({"query": str(i)}) + "\n\n" for i in range(3)))
  assert serve_load.load_prompts(str(path), 2, Ids()) == [[0], [1]]
  assert serve_load.load_prompts(str(path), 8, Ids()) == [[0], [1], [2], [0], [1], [2], [0],
                                                         [1]]
  (tmp_path / "empty.jsonl").write_text("\n")
  with pytest.raises(ValueError, match="no prompts"):
    serve_load.load_prompts(str(tmp_path / "empty.jsonl"), 4, Ids())


def test_serve_load_summary_gives_the_servers_overhead_over_its_loop():
  from benchmarks import serve_load  # pylint: disable=import-outside-toplevel
  row = {"clients": 16, "method": "refusion", "server_loop_ratio": 0.93}
  lines = serve_load.summary([dict(row, clients=1, server_loop_ratio=0.97), row,
                              dict(row, method="ar", server_loop_ratio=0.88)])
  assert lines[1] == ("server / its engine loop without HTTP (target >= 0.90x): refusion 1 "
                      "clients 0.97x, refusion 16 clients 0.93x, ar 16 clients 0.88x; lowest "
                      "0.88x (ar, 16 clients)")
  assert serve_load.summary([]) == []


def test_serve_load_shares_a_compilation_cache_with_its_server_and_cleans_up(tmp_path,
                                                                          monkeypatch):
  """'auto' makes a temporary folder, which the server's config names, and removes it
  afterwards (or takes the folder JAX already uses); a folder given is kept; '' sets
  nothing. The settings are restored."""
  import jax  # pylint: disable=import-outside-toplevel

  from benchmarks import serve_load  # pylint: disable=import-outside-toplevel
  monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
  suite_cache = jax.config.jax_compilation_cache_dir  # the suite's own, if any
  jax.config.update("jax_compilation_cache_dir", None)

  def servers_folder(folder):
    args = serve_load.parse_args([])
    assert "compile_cache_dir" not in serve_load.server_fields("m", "ar", args, 32)
    args.cache_dir = folder
    assert f"--config.compile_cache_dir={folder}" in serve_load.server_command("m", "ar", args,
                                                                                  32)
    return serve_load.serve_config("m", "ar", args, 32).compile_cache_dir

  try:
    before = jax.config.jax_persistent_cache_min_compile_time_secs
    with serve_load.compile_cache("auto") as folder:
      assert os.path.isdir(folder) and servers_folder(folder) == folder
      assert jax.config.jax_compilation_cache_dir == folder
      assert jax.config.jax_persistent_cache_min_compile_time_secs == 0
    assert not os.path.exists(folder) and "JAX_COMPILATION_CACHE_DIR" not in os.environ
    assert jax.config.jax_compilation_cache_dir is None
    assert jax.config.jax_persistent_cache_min_compile_time_secs == before
    with serve_load.compile_cache(str(tmp_path / "cache")) as folder:
      assert os.path.isdir(folder)  # made
    assert os.path.isdir(tmp_path / "cache")
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "theirs"))
    with serve_load.compile_cache("auto") as folder:
      assert folder == str(tmp_path / "theirs")
    assert os.environ["JAX_COMPILATION_CACHE_DIR"] == str(tmp_path / "theirs")
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR")
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "configured"))
    with serve_load.compile_cache("auto") as folder:
      assert folder == str(tmp_path / "configured")
      assert servers_folder(folder) == folder  # the server's too
    assert "JAX_COMPILATION_CACHE_DIR" not in os.environ
  finally:
    jax.config.update("jax_compilation_cache_dir", suite_cache)
  with serve_load.compile_cache("") as folder:
    assert folder is None


_LOOP_MODEL = "refusion_jax/assets/base_tiny"
_LOOP_FLAGS = ["--rows=4", "--clients=3", "--gen_length=8", "--slot_size=4", "--block_size=8",
               "--row_counts="]


def _loop_prompts_and_offline(seed: int):
  """Seven short random prompts and the offline engine's run of them (4 rows, width 16,
  the settings of `_LOOP_FLAGS`) on the bundled base."""
  from benchmarks import serve_load  # pylint: disable=import-outside-toplevel
  from refusion_jax import loading  # pylint: disable=import-outside-toplevel
  from refusion_jax.decode.settings import DecodeConfig  # pylint: disable=import-outside-toplevel
  _, model = loading.load_model(_LOOP_MODEL)
  rs = np.random.RandomState(seed)
  prompts = [[int(t) for t in rs.randint(4, 60, size=rs.randint(2, 9))] for _ in range(7)]
  dc = DecodeConfig(gen_length=8, slot_size=4, block_size=8, slot_threshold=0.5,
                    token_threshold=0.1)
  return prompts, serve_load.offline(serve_load.offline_engine(model, dc, prompts, 4, 16),
                                     prompts)


def test_serve_load_closed_loop_gives_each_prompt_its_offline_tokens():
  """The in-process closed loop, its clients started turns apart and together: every
  prompt answered once, with the offline engine's tokens, its passes counted, the
  warm-up requests not among them."""
  from benchmarks import serve_load  # pylint: disable=import-outside-toplevel
  from refusion_jax import serve  # pylint: disable=import-outside-toplevel
  flags = _LOOP_FLAGS
  prompts, offline = _loop_prompts_and_offline(seed=0)
  sched = serve.make_scheduler(serve_load.serve_config(
      _LOOP_MODEL, "refusion", serve_load.parse_args(flags), 16))
  turns = []
  sched.after_turn = lambda: sched.busy_rows() and turns.append(sched.busy_rows())
  sched.start()
  try:
    # Clients started two turns apart (the default: one), then all at once.
    wall, tokens, passes = serve_load.closed_loop(
        sched, prompts, 3, serve_load.parse_args(flags + ["--loop_stagger=2"]))
    assert tokens == offline[1]
    # Every request's own passes ran, at most 3 rows at a time (3 clients).
    assert wall > 0 and 3 * passes >= round(offline[3] * len(prompts)) > 0
    # The warm-up's first two turns decoded one client's request alone: the others waited.
    assert turns[:2] == [1, 1] and max(turns) == 3
    assert sched.after_turn.__name__ == "<lambda>"  # the loop's hook is taken off again
    turns.clear()
    wall, tokens, passes = serve_load.closed_loop(
        sched, prompts, 3, serve_load.parse_args(flags + ["--loop_stagger=0"]))
    assert tokens == offline[1] and turns[0] == 3
  finally:
    sched.stop()


def test_results_contents_links_every_section_once():
  """docs/RESULTS.md's Contents list links each `## ` section once, by GitHub's anchor."""
  import re  # pylint: disable=import-outside-toplevel
  path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                      "docs", "RESULTS.md")
  with open(path, encoding="utf-8") as f:
    text = f.read()
  heads = [line[3:] for line in text.splitlines()
           if line.startswith("## ") and line != "## Contents"]
  contents = text.split("## Contents", 1)[1].split("\n## ", 1)[0]
  links = re.findall(r"\[(.+)\]\(#([^)]+)\)", contents)
  slug = lambda h: re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-")
  assert sorted(h for h, _ in links) == sorted(heads)
  assert all(anchor == slug(h) for h, anchor in links)
  assert len({slug(h) for h in heads}) == len(heads)  # no anchor needs a -1 suffix


def test_decode_commits_compares_two_trees_on_the_same_outputs(capsys):
  from benchmarks import decode_commits  # pylint: disable=import-outside-toplevel
  # HEAD exported with git archive against the work tree reading its buffer two
  # entries at a time: one worker process each, the same tokens, both APIs.
  rows = decode_commits.main(["--variants=HEAD,.:kv_chunk=2", "--apis=generate,engine",
                              "--rows=1,2", "--gen_lengths=8", "--prompts=2",
                              "--prompt_len=8", "--repeats=1"])
  assert [(r["api"], r["rows"]) for r in rows] == [
      ("generate", 1)] * 2 + [("generate", 2)] * 2 + [("engine", 1)] * 2 + [("engine", 2)] * 2
  assert all(r["tok_s"] > 0 for r in rows)
  assert [r["ratio"] for r in rows[::2]] == [1.0] * 4  # the base against itself
  out = capsys.readouterr().out
  assert "kv_chunk=2" in out and "identical across variants" in out


@pytest.mark.parametrize("argv, needle", [
    (["--variants=HEAD"], "at least two"),
    (["--prompts=3"], "multiple of every --rows"),
    (["--gen_lengths=40"], "not a multiple of 32"),
    (["--apis=live"], "generate and/or engine")])
def test_decode_commits_rejects_bad_flags(argv, needle, capsys):
  from benchmarks import decode_commits  # pylint: disable=import-outside-toplevel
  with pytest.raises(SystemExit):
    decode_commits.parse_args(argv)
  assert needle in capsys.readouterr().err


def test_decode_commits_reads_a_variants_decode_fields():
  from benchmarks import decode_commits  # pylint: disable=import-outside-toplevel
  assert decode_commits.parse_variant("e57c5b9") == ("e57c5b9", {})
  assert decode_commits.parse_variant(".:kv_chunk=0; ignore_eos=True") == (
      ".", {"kv_chunk": 0, "ignore_eos": True})
  with pytest.raises(ValueError, match="not FIELD=VALUE"):
    decode_commits.parse_variant(".:kv_chunk")


def test_order_oracle_scores_every_order_of_each_problem(tmp_path, capsys):
  from flax import nnx  # pylint: disable=import-outside-toplevel

  from benchmarks import order_oracle as bench  # pylint: disable=import-outside-toplevel
  from refusion_jax import checkpoint  # pylint: disable=import-outside-toplevel
  from refusion_jax import config as config_lib
  from refusion_jax.model import Transformer  # pylint: disable=import-outside-toplevel
  cfg = config_lib.tiny(num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1, head_dim=16,
                        mlp_dim=64)
  checkpoint.save_model(str(tmp_path / "m"), cfg, Transformer(cfg, rngs=nnx.Rngs(0)))
  rows = bench.main(["--model_dir", str(tmp_path / "m"), "--task_prompts", os.path.join(
      os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "refusion_jax", "assets",
      "data", "tiny_test.jsonl"), "--per_task", "1", "--gen_length", "8", "--slot_size", "4"])
  assert rows["all"]["problems"] == 7
  for r in rows.values():  # the best order is at least any order, the worst at most
    assert r["worst"] <= r["mean"] <= r["best"] and r["worst"] <= r["ltr"] <= r["best"]
    assert 1 <= r["distinct"] <= 2
  assert "| all | 7 |" in capsys.readouterr().out
  with pytest.raises(SystemExit):
    bench.parse_args(["--model_dir", str(tmp_path / "m"), "--task_prompts", __file__,
                      "--gen_length", "24", "--slot_size", "2"])
