"""The code sandbox: correct programs pass, hostile ones fail and change nothing.

Every program here really runs in the sandbox (root, namespaces, a uid of its
own); the limits are small so that the hostile ones end within seconds.
"""

import os
import re
import secrets
import socket
import tempfile
import textwrap
import threading
import time

import pytest

from refusion_jax.lmeval import sandbox

SMALL = sandbox.Limits(wall_seconds=3.0, cpu_seconds=2, memory_bytes=1 << 30, processes=16,
                       file_bytes=1 << 20, scratch_bytes=8 << 20)


# Prepended to a program: it prints the uid it runs as, for `_processes_of`.
SHOW_UID = "import os as _os\nprint('uid', _os.getuid(), flush=True)\n"


def _uid_of(outcome: sandbox.Outcome) -> int:
  match = re.search(r"^uid (\d+)$", outcome.detail, re.MULTILINE)
  assert match, f"the program did not print its uid: {outcome.detail[-300:]!r}"
  return int(match.group(1))


def _processes_of(uid: int) -> list[int]:
  """Processes on this machine running as `uid` (a finished sample's: none may be left)."""
  pids = []
  for entry in os.listdir("/proc"):
    if entry.isdigit():
      try:
        if os.stat(f"/proc/{entry}").st_uid == uid:
          pids.append(int(entry))
      except FileNotFoundError:
        continue
  return pids


def _program(text: str) -> str:
  return textwrap.dedent(text).lstrip()


def test_correct_wrong_and_broken_programs():
  correct = "def add(a, b):\n  return a + b\n\nassert add(2, 3) == 5\nprint('fine')\n"
  wrong = "def add(a, b):\n  return a * b\n\nassert add(2, 3) == 5, 'add is wrong'\n"
  syntax = "def add(a, b)\n  return a + b\n"
  ok, bad, broken = sandbox.run_programs([correct, wrong, syntax], SMALL)
  assert (ok.passed, ok.status) == (True, "passed") and "fine" in ok.detail
  assert (bad.passed, bad.status) == (False, "failed")
  assert "AssertionError: add is wrong" in bad.detail
  assert (broken.passed, broken.status) == (False, "failed") and "SyntaxError" in broken.detail
  assert all(0 < o.seconds < SMALL.wall_seconds for o in (ok, bad, broken))


def test_hostile_programs_fail_and_change_nothing(tmp_path, monkeypatch):
  canary = tmp_path / "canary.txt"
  canary.write_text("intact")
  outside = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                         f"sandbox-escape-{secrets.token_hex(4)}.txt")
  marker = f"refusion-sandbox-marker-{secrets.token_hex(4)}"
  token = secrets.token_hex(16)
  monkeypatch.setenv("REFUSION_SECRET", token)

  listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
  listener.bind(("127.0.0.1", 0))
  listener.listen(8)
  listener.settimeout(0.2)
  port = listener.getsockname()[1]
  connections, stop = [], threading.Event()

  def listen():
    while not stop.is_set():
      try:
        conn, address = listener.accept()
      except socket.timeout:
        continue
      connections.append(address)
      conn.close()

  thread = threading.Thread(target=listen, daemon=True)
  thread.start()

  hostile = {
      "infinite loop": "while True:\n  pass\n",
      "fork bomb": _program("""
          import os
          while True:
            try:
              os.fork()
            except OSError:
              pass
          """),
      "10 GB allocation": "block = bytearray(10 * 2**30)\nassert len(block) > 0\n",
      "delete the canary": _program(f"""
          import os
          path = {str(canary)!r}
          try:
            with open(path, 'w') as f:
              f.write('overwritten')
          finally:
            os.remove(path)
          """),
      "write outside its folder": f"open({outside!r}, 'w').write('escaped')\n",
      "write to HOME, /tmp and /dev/shm": _program(f"""
          import os
          home = os.path.expanduser('~')
          print('home:', home)
          for folder in (home, '/tmp', '/dev/shm'):
            with open(os.path.join(folder, {marker!r}), 'w') as f:
              f.write('left behind')
          assert home == {os.path.expanduser('~')!r}, 'HOME is not the evaluator HOME'
          """),
      "read an environment secret": _program(f"""
          import os
          found = os.environ.get('REFUSION_SECRET') == {token!r}
          for pid in filter(str.isdigit, os.listdir('/proc')):
            try:
              with open(f'/proc/{{pid}}/environ', 'rb') as f:
                found = found or {token!r}.encode() in f.read()
            except OSError:
              pass
          assert found, 'no secret visible'
          """),
      "connect to a local listener": _program(f"""
          import socket
          with socket.create_connection(('127.0.0.1', {port}), timeout=2) as s:
            s.sendall(b'exfiltrated')
          """),
  }
  start = time.monotonic()
  try:
    sources = [SHOW_UID + source for source in hostile.values()]
    outcomes = dict(zip(hostile, sandbox.run_programs(sources, SMALL, workers=2)))
  finally:
    time.sleep(0.3)  # one more accept round after the last program
    stop.set()
    thread.join()
    listener.close()
  elapsed = time.monotonic() - start

  for name, outcome in outcomes.items():
    assert not outcome.passed, f"{name}: {outcome}"
  assert outcomes["infinite loop"].status == "timeout"
  assert outcomes["fork bomb"].status in ("timeout", "killed")
  assert "MemoryError" in outcomes["10 GB allocation"].detail
  assert "Network is unreachable" in outcomes["connect to a local listener"].detail
  assert "no secret visible" in outcomes["read an environment secret"].detail
  assert canary.read_text() == "intact"
  assert not os.path.exists(outside)
  assert connections == []
  detail = outcomes["write to HOME, /tmp and /dev/shm"].detail
  assert "HOME is not the evaluator HOME" in detail
  home = detail.split("home: ", 1)[1].split("\n", 1)[0]
  assert home.startswith(tempfile.gettempdir()) and not os.path.exists(home)
  for folder in (os.path.expanduser("~"), "/tmp", "/dev/shm"):
    assert not os.path.exists(os.path.join(folder, marker))
  uids = [_uid_of(outcome) for outcome in outcomes.values()]
  assert len(set(uids)) == len(uids) and all(uid >= sandbox.UID_BASE for uid in uids)
  assert [pid for uid in uids for pid in _processes_of(uid)] == []
  # Two workers, two programs at the time limit (the loop on CPU, the bomb on wall).
  assert elapsed < 4 * SMALL.wall_seconds


def test_children_that_outlive_the_program_are_killed():
  program = SHOW_UID + _program("""
      import os, time
      if os.fork() == 0:
        os.setsid()  # leaves the process group: only the PID namespace catches it
        time.sleep(60)
        os._exit(0)
      print('parent exits')
      """)
  outcome = sandbox.run_program(program, SMALL)
  assert outcome.passed and "parent exits" in outcome.detail
  assert outcome.seconds < SMALL.wall_seconds
  assert _processes_of(_uid_of(outcome)) == []


def test_output_is_kept_to_its_tail():
  outcome = sandbox.run_program("for i in range(5000):\n  print('line', i)\nraise SystemExit(3)\n",
                                SMALL)
  assert (outcome.passed, outcome.status) == (False, "failed")
  assert len(outcome.detail) <= sandbox.DETAIL_CHARS
  assert "line 4999" in outcome.detail and "line 0\n" not in outcome.detail
  assert "exit status 3" in outcome.detail


def test_run_programs_keeps_input_order():
  # Earlier programs sleep longer, so they finish after later ones.
  sources = [f"import time\ntime.sleep({0.1 * (5 - i):.1f})\nprint('program {i}')\n"
             f"raise SystemExit({i % 2})\n" for i in range(6)]
  outcomes = sandbox.run_programs(sources, SMALL, workers=3)
  assert [o.passed for o in outcomes] == [i % 2 == 0 for i in range(6)]
  assert [f"program {i}" in o.detail for i, o in enumerate(outcomes)] == [True] * 6


@pytest.mark.parametrize("field, value, message", [
    ("wall_seconds", 0, "must be positive"),
    ("cpu_seconds", -1, "must be positive"),
    ("cpu_seconds", 1.5, "must be an integer"),
    ("memory_bytes", True, "must be an integer"),
    ("processes", "32", "must be an integer"),
    ("wall_seconds", float("nan"), "must be positive"),
])
def test_limits_are_validated(field, value, message):
  with pytest.raises(ValueError, match=f"Limits.{field}=.*{message}"):
    sandbox.Limits(**{field: value})


def test_refused_network_namespace_names_the_opt_out(monkeypatch):
  # A platform that refuses network namespaces, as far as the probe can tell.
  monkeypatch.setattr(sandbox, "NETWORK_PROBE", ("false",))
  with pytest.raises(sandbox.SandboxError, match="cannot create a network namespace") as info:
    sandbox.run_program("pass\n", SMALL)
  assert "allow_network=True" in str(info.value)
  assert "--config.sandbox_allow_network=true" in str(info.value)
  with pytest.raises(sandbox.SandboxError, match="allow_network=True"):
    sandbox.run_programs(["pass\n"], SMALL)
  outcome = sandbox.run_program("assert 1 + 1 == 2\n", SMALL, allow_network=True)
  assert outcome.passed


def test_without_root_the_sandbox_refuses_clearly(monkeypatch):
  monkeypatch.setattr(os, "geteuid", lambda: 1000)
  with pytest.raises(sandbox.SandboxError, match="needs root"):
    sandbox.run_program("pass\n", SMALL)


def test_configure_sets_the_settings_filters_read():
  before = sandbox.settings()
  try:
    chosen = sandbox.configure(SMALL, allow_network=True, workers=3, progress=True)
    assert sandbox.settings() == chosen == sandbox.Settings(SMALL, True, 3, True)
    with pytest.raises(ValueError, match="workers=0"):
      sandbox.configure(SMALL, workers=0)
  finally:
    sandbox.configure(before.limits, allow_network=before.allow_network,
                      workers=before.workers, progress=before.progress)
