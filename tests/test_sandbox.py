"""The code sandbox: correct programs pass, hostile ones fail and change nothing.

Every program here really runs in the sandbox, the same programs with the
same expected outcomes for each evaluator: root (namespaces, a uid of its
own per program) and an ordinary user (user namespaces, through bubblewrap
and through `unshare`). As root, the tests make that user (`useradd`), drop
to it (`runuser`) and have it run a copy of the sandbox module with Debian's
/usr/bin/python3, since the project's Python may be out of its reach; run
as an ordinary user, they run the sandbox in this process instead. The
limits are small so that the hostile programs end within seconds.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import re
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import pytest

from refusion_jax.lmeval import sandbox

SMALL = sandbox.Limits(wall_seconds=3.0, cpu_seconds=2, memory_bytes=1 << 30, processes=16,
                       file_bytes=1 << 20, scratch_bytes=8 << 20)
SYSTEM_PYTHON = "/usr/bin/python3"
HERE = os.path.dirname(os.path.abspath(__file__))

# Prepended to a program: it prints its uid and PID namespace, for `_left_behind`.
SHOW_IDS = ("import os as _os\n"
            "print('ids', _os.getuid(), _os.readlink('/proc/self/ns/pid'), flush=True)\n")

# Run by the ordinary user: the sandbox copy beside it, a request on stdin, the
# outcomes (or the SandboxError) as JSON on stdout.
DRIVER = """
import dataclasses, json, os, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sandbox
request = json.load(sys.stdin)
for name, value in request["attrs"].items():
  setattr(sandbox, name, value)
try:
  plan = sandbox.check_platform(False, request["allow_no_namespaces"])
  outcomes = sandbox.run_programs(request["sources"], sandbox.Limits(**request["limits"]),
                                  workers=request["workers"],
                                  allow_no_namespaces=request["allow_no_namespaces"])
  print(json.dumps({"mode": plan.mode, "outcomes": [dataclasses.asdict(o) for o in outcomes]}))
except sandbox.SandboxError as e:
  print(json.dumps({"error": str(e)}))
"""

# Runs a command in a user namespace that maps every id to itself (so root
# stays root and the user stays the user) and where no further user namespace
# may be made: the platform of a machine with user.max_user_namespaces=0.
NO_USER_NAMESPACES = """
import ctypes, os, sys
ready, go = os.pipe(), os.pipe()
pid = os.fork()
if pid == 0:
  if ctypes.CDLL(None, use_errno=True).unshare(0x10000000) != 0:  # CLONE_NEWUSER
    os._exit(90)
  os.write(ready[1], b"x")
  os.read(go[0], 1)
  with open("/proc/sys/user/max_user_namespaces", "w") as f:
    f.write("0")
  os.execvp(sys.argv[1], sys.argv[1:])
os.read(ready[0], 1)
for name in ("uid_map", "gid_map"):
  with open(f"/proc/{pid}/{name}", "w") as f:
    f.write("0 0 4294967295")
os.write(go[1], b"x")
sys.exit(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
"""


@dataclasses.dataclass
class Evaluator:
  """Who runs the sandbox, and folders of its own that its programs must not touch."""

  mode: str  # the sandbox mode it must get: root, bwrap or unshare
  uid: int
  home: str  # its HOME, with a private file
  work: str  # a folder it may write
  user: str | None = None  # run as this user through runuser (None: in this process)
  lib: str | None = None  # the sandbox copy and the driver, for `user`

  def run(self, sources: list[str], limits: sandbox.Limits = SMALL, *, workers: int = 2,
          env: dict[str, str] | None = None, allow_no_namespaces: bool = False,
          attrs: dict | None = None, prefix: tuple[str, ...] = ()) -> list[sandbox.Outcome]:
    """The sandbox's outcomes for `sources`, run by this evaluator with `env`
    added to its environment and the sandbox module's attributes `attrs` set;
    raises SandboxError as the sandbox does."""
    attrs = {**({} if self.mode == "root" else {"UNPRIVILEGED_TOOLS": [self.mode]}),
             **(attrs or {})}
    if self.user is None:
      return self._run_here(sources, limits, workers, {"HOME": self.home, **(env or {})},
                            allow_no_namespaces, attrs)
    request = {"sources": sources, "limits": dataclasses.asdict(limits), "workers": workers,
               "allow_no_namespaces": allow_no_namespaces, "attrs": attrs}
    environment = [f"{k}={v}" for k, v in {
        "PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": self.home, "TMPDIR": "/tmp",
        "LANG": "C.UTF-8", **(env or {})}.items()]
    done = subprocess.run(
        [*prefix, "runuser", "-u", self.user, "--", "env", "-i", *environment, SYSTEM_PYTHON,
         "-I", os.path.join(self.lib, "driver.py")],
        input=json.dumps(request), capture_output=True, text=True, timeout=300, cwd="/")
    assert done.returncode == 0, f"the driver failed: {done.stdout}{done.stderr}"
    self.stderr = done.stderr
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    if "error" in answer:
      raise sandbox.SandboxError(answer["error"])
    self.last_mode = answer["mode"]
    return [sandbox.Outcome(**o) for o in answer["outcomes"]]

  def _run_here(self, sources, limits, workers, env, allow_no_namespaces, attrs):
    saved_env = {k: os.environ.get(k) for k in env}
    saved_attrs = {k: getattr(sandbox, k) for k in attrs}
    os.environ.update(env)
    for name, value in attrs.items():
      setattr(sandbox, name, tuple(value) if isinstance(value, list) else value)
    try:
      self.last_mode = sandbox.check_platform(False, allow_no_namespaces).mode
      return sandbox.run_programs(sources, limits, workers=workers,
                                  allow_no_namespaces=allow_no_namespaces)
    finally:
      for name, value in saved_attrs.items():
        setattr(sandbox, name, value)
      for name, value in saved_env.items():
        if value is None:
          os.environ.pop(name, None)
        else:
          os.environ[name] = value


def _make_folder(path: str, uid: int, mode: int) -> str:
  os.makedirs(path)
  os.chown(path, uid, -1)
  os.chmod(path, mode)
  return path


@pytest.fixture(scope="module")
def world():
  """The folders (and, as root, the ordinary user) the evaluators use; removed after."""
  if os.geteuid() != 0:
    # Already an ordinary user: the sandbox runs in this process.
    base = tempfile.mkdtemp(prefix=".sandbox-test-", dir=HERE)
    uid = os.geteuid()
    yield {"base": base, "user": None, "uid": uid,
           "home": _make_folder(os.path.join(base, "home"), uid, 0o700),
           "work": _make_folder(os.path.join(base, "work"), uid, 0o755)}
    shutil.rmtree(base, ignore_errors=True)
    return
  # Outside the folders the sandbox replaces (/tmp, /var/tmp, /dev/shm), so that
  # what a program does there would last.
  base = tempfile.mkdtemp(prefix="refusion-sandbox-test-", dir="/var/lib")
  os.chmod(base, 0o755)
  user = f"rfsbx{secrets.token_hex(4)}"
  home = os.path.join(base, "home")
  subprocess.run(["useradd", "--system", "--no-create-home", "--home-dir", home, "--shell",
                  "/usr/sbin/nologin", user], check=True, capture_output=True)
  try:
    import pwd  # pylint: disable=import-outside-toplevel
    uid = pwd.getpwnam(user).pw_uid
    lib = _make_folder(os.path.join(base, "lib"), 0, 0o755)
    shutil.copy(sandbox.__file__, os.path.join(lib, "sandbox.py"))
    for name, text in (("driver.py", DRIVER), ("no_user_namespaces.py", NO_USER_NAMESPACES)):
      with open(os.path.join(lib, name), "w") as f:
        f.write(text)
    for name in os.listdir(lib):
      os.chmod(os.path.join(lib, name), 0o644)
    yield {"base": base, "user": user, "uid": uid, "lib": lib,
           "home": _make_folder(home, uid, 0o700),
           "work": _make_folder(os.path.join(base, "work"), uid, 0o755),
           "root_home": _make_folder(os.path.join(base, "root-home"), 0, 0o700),
           "root_work": _make_folder(os.path.join(base, "root-work"), 0, 0o755)}
  finally:
    subprocess.run(["userdel", user], capture_output=True)
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(params=["root", "bwrap", "unshare"])
def evaluator(request, world) -> Evaluator:
  """Each way the sandbox runs: as root, and as an ordinary user through each tool."""
  return _evaluator(request.param, world)


def _evaluator(mode: str, world) -> Evaluator:
  if mode == "root":
    if os.geteuid() != 0:
      pytest.skip("the sandbox's root mode needs root (the ordinary-user modes run here)")
    return Evaluator("root", 0, world["root_home"], world["root_work"])
  if shutil.which(mode) is None:
    pytest.skip(f"{mode} is not installed (launch/setup_env.sh --test installs bubblewrap)")
  if world["user"] is None:
    return Evaluator(mode, world["uid"], world["home"], world["work"])
  if not os.path.exists(SYSTEM_PYTHON):
    pytest.fail(f"{SYSTEM_PYTHON} is missing: the ordinary user's evaluator needs it")
  return Evaluator(mode, world["uid"], world["home"], world["work"], world["user"],
                   world["lib"])


def _ids(outcome: sandbox.Outcome) -> tuple[int, str]:
  match = re.search(r"^ids (\d+) (pid:\[\d+\])$", outcome.detail, re.MULTILINE)
  assert match, f"the program did not print its ids: {outcome.detail[-300:]!r}"
  return int(match.group(1)), match.group(2)


def _left_behind(namespace: str) -> list[int]:
  """Processes still running in a finished sample's PID namespace (none may be)."""
  pids = []
  for entry in os.listdir("/proc"):
    if entry.isdigit():
      try:
        if os.readlink(f"/proc/{entry}/ns/pid") == namespace:
          pids.append(int(entry))
      except OSError:
        continue
  return pids


def _check_identities(evaluator: Evaluator, outcomes: list[sandbox.Outcome]) -> None:
  """Each program ran in a PID namespace other than ours that is now empty
  (the kernel reuses a freed namespace's number), as a uid of its own (root)
  or the mapped evaluating user (bwrap: itself, unshare: 0)."""
  ids = [_ids(outcome) for outcome in outcomes]
  namespaces = [namespace for _, namespace in ids]
  assert os.readlink("/proc/self/ns/pid") not in namespaces
  assert [pid for namespace in namespaces for pid in _left_behind(namespace)] == []
  uids = [uid for uid, _ in ids]
  if evaluator.mode == "root":
    assert len(set(uids)) == len(uids) and all(uid >= sandbox.UID_BASE for uid in uids)
  else:
    assert set(uids) == {evaluator.uid if evaluator.mode == "bwrap" else 0}


def _program(text: str) -> str:
  return textwrap.dedent(text).lstrip()


def test_correct_wrong_and_broken_programs(evaluator):
  correct = "def add(a, b):\n  return a + b\n\nassert add(2, 3) == 5\nprint('fine')\n"
  wrong = "def add(a, b):\n  return a * b\n\nassert add(2, 3) == 5, 'add is wrong'\n"
  syntax = "def add(a, b)\n  return a + b\n"
  ok, bad, broken = evaluator.run([correct, wrong, syntax])
  assert evaluator.last_mode == evaluator.mode
  assert (ok.passed, ok.status) == (True, "passed") and "fine" in ok.detail
  assert (bad.passed, bad.status) == (False, "failed")
  assert "AssertionError: add is wrong" in bad.detail
  assert (broken.passed, broken.status) == (False, "failed") and "SyntaxError" in broken.detail
  assert all(0 < o.seconds < SMALL.wall_seconds for o in (ok, bad, broken))


def _chown(path: str, uid: int) -> None:
  if os.geteuid() == 0:
    os.chown(path, uid, -1)


def test_hostile_programs_fail_and_change_nothing(evaluator):
  canary = os.path.join(evaluator.work, f"canary-{secrets.token_hex(4)}.txt")
  with open(canary, "w") as f:
    f.write("intact")
  _chown(canary, evaluator.uid)  # the evaluator itself could delete it
  outside = os.path.join(evaluator.work, f"sandbox-escape-{secrets.token_hex(4)}.txt")
  private = os.path.join(evaluator.home, f"private-{secrets.token_hex(4)}.txt")
  private_text = secrets.token_hex(16)
  with open(private, "w") as f:
    f.write(private_text)
  os.chmod(private, 0o600)
  _chown(private, evaluator.uid)
  marker = f"refusion-sandbox-marker-{secrets.token_hex(4)}"
  token = secrets.token_hex(16)

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
          path = {canary!r}
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
          for folder in (home, {evaluator.home!r}, '/tmp', '/dev/shm'):
            try:
              with open(os.path.join(folder, {marker!r}), 'w') as f:
                f.write('left behind')
            except OSError as e:
              print(folder, e)
          assert home == {evaluator.home!r}, 'HOME is not the evaluator HOME'
          """),
      "read the evaluator's private file": _program(f"""
          try:
            text = open({private!r}).read()
          except OSError as e:
            text = str(e)
          assert text == {private_text!r}, 'private file not readable: ' + text
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
      # Mounts read-write again, directly or from a user namespace of its own.
      "regain write access": _program(f"""
          import ctypes, os
          libc = ctypes.CDLL(None, use_errno=True)
          remount = 32 | 4096  # MS_REMOUNT | MS_BIND, without MS_RDONLY
          print('remount', libc.mount(None, b'/', None, remount, None), ctypes.get_errno())
          uid = os.getuid()
          nested = libc.unshare(0x10000000 | 0x20000)  # CLONE_NEWUSER | CLONE_NEWNS
          print('nested user namespace', nested, ctypes.get_errno())
          if nested == 0:
            open('/proc/self/setgroups', 'w').write('deny')
            open('/proc/self/uid_map', 'w').write(f'0 {{uid}} 1')
            print('nested remount', libc.mount(None, b'/', None, remount, None),
                  ctypes.get_errno())
          open({outside + ".2"!r}, 'w').write('escaped')
          """),
  }
  start = time.monotonic()
  try:
    outcomes = dict(zip(hostile, evaluator.run([SHOW_IDS + s for s in hostile.values()],
                                               env={"REFUSION_SECRET": token})))
  finally:
    time.sleep(0.3)  # one more accept round after the last program
    stop.set()
    thread.join()
    listener.close()
  elapsed = time.monotonic() - start
  assert evaluator.last_mode == evaluator.mode

  for name, outcome in outcomes.items():
    assert not outcome.passed, f"{name}: {outcome}"
  assert outcomes["infinite loop"].status == "timeout"
  assert outcomes["fork bomb"].status in ("timeout", "killed")
  assert "MemoryError" in outcomes["10 GB allocation"].detail
  # No route at all (unshare: loopback down), or a loopback of its own (bwrap brings one
  # up) where nothing listens: the host's listener is not reached either way.
  assert re.search(r"Network is unreachable|Connection refused",
                   outcomes["connect to a local listener"].detail)
  assert "no secret visible" in outcomes["read an environment secret"].detail
  assert "private file not readable" in outcomes["read the evaluator's private file"].detail
  assert re.search(r"^remount -1 1$", outcomes["regain write access"].detail, re.MULTILINE)
  if evaluator.mode != "root":  # as root a sample's nested namespace has locked mounts
    assert re.search(r"^nested user namespace -1 ", outcomes["regain write access"].detail,
                     re.MULTILINE)
  with open(canary) as f:
    assert f.read() == "intact"
  assert not os.path.exists(outside) and not os.path.exists(outside + ".2")
  assert connections == []
  detail = outcomes["write to HOME, /tmp and /dev/shm"].detail
  assert "HOME is not the evaluator HOME" in detail
  home = detail.split("home: ", 1)[1].split("\n", 1)[0]
  assert home.startswith("/tmp/refusion-sandbox-") and not os.path.exists(home)
  for folder in (evaluator.home, "/tmp", "/dev/shm"):
    assert not os.path.exists(os.path.join(folder, marker))
  _check_identities(evaluator, list(outcomes.values()))
  # Two workers, two programs at the time limit (the loop on CPU, the bomb on wall).
  assert elapsed < 4 * SMALL.wall_seconds + 5


def test_children_that_outlive_the_program_are_killed(evaluator):
  program = SHOW_IDS + _program("""
      import os, time
      if os.fork() == 0:
        os.setsid()  # leaves the process group: only the PID namespace catches it
        time.sleep(60)
        os._exit(0)
      print('parent exits')
      """)
  [outcome] = evaluator.run([program])
  assert outcome.passed and "parent exits" in outcome.detail
  assert outcome.seconds < SMALL.wall_seconds
  _check_identities(evaluator, [outcome])


def test_process_limit_counts_the_sample_alone(evaluator):
  # The sample's own thread and processes - 1 more, whoever else runs as its uid
  # (an ordinary user's evaluator and launcher do).
  program = _program("""
      import threading, time
      started = 0
      try:
        while True:
          threading.Thread(target=time.sleep, args=(3,), daemon=True).start()
          started += 1
      except RuntimeError:
        print('started', started)
      """)
  limits = dataclasses.replace(SMALL, processes=6)
  [outcome] = evaluator.run([program], limits)
  assert outcome.passed and "started 5\n" in outcome.detail, outcome


def test_canonical_humaneval_solutions_pass(world):
  """As an ordinary user, through the tool such a user's evaluation uses here
  (tests/test_code_eval.py scores them as root)."""
  preferred = next(tool for tool in sandbox.UNPRIVILEGED_TOOLS if shutil.which(tool))
  evaluator = _evaluator(preferred, world)
  from refusion_jax.lmeval import code  # pylint: disable=import-outside-toplevel
  problems = code.humaneval_problems()
  programs = [code.humaneval_program(p, p["canonical_solution"]) for p in problems]
  outcomes = evaluator.run(programs, sandbox.Limits(wall_seconds=10.0, cpu_seconds=10))
  assert len(outcomes) == 164
  assert [p["task_id"] for p, o in zip(problems, outcomes) if not o.passed] == []


def _ordinary_user_evaluator(world) -> Evaluator:
  if world["user"] is None:
    pytest.skip("needs root, to make a user namespace in which no further one may be made")
  return Evaluator("unshare", world["uid"], world["home"], world["work"], world["user"],
                   world["lib"])


def test_disabled_user_namespaces_name_the_setting_and_the_opt_out(world):
  evaluator = _ordinary_user_evaluator(world)
  prefix = (SYSTEM_PYTHON, os.path.join(world["lib"], "no_user_namespaces.py"))
  tools = {"UNPRIVILEGED_TOOLS": ["bwrap", "unshare"]}
  with pytest.raises(sandbox.SandboxError) as info:
    evaluator.run(["pass\n"], attrs=tools, prefix=prefix)
  message = str(info.value)
  assert f"cannot create user namespaces as uid {world['uid']}" in message
  assert "user.max_user_namespaces is 0: `sysctl -w user.max_user_namespaces=" in message
  assert "--config.sandbox_allow_no_namespaces=true" in message

  # The opt-out runs programs with resource limits only: what one writes stays.
  escape = os.path.join(world["work"], f"no-namespaces-{secrets.token_hex(4)}.txt")
  fork_bomb = "import os\nwhile True:\n  try:\n    os.fork()\n  except OSError:\n    pass\n"
  outcomes = evaluator.run(["print('fine')\n", "while True:\n  pass\n",
                            f"open({escape!r}, 'w').write('written')\n",
                            "block = bytearray(10 * 2**30)\n", fork_bomb],
                           attrs=tools, prefix=prefix, allow_no_namespaces=True)
  assert evaluator.last_mode == "none"
  assert [o.status for o in outcomes[:4]] == ["passed", "timeout", "passed", "failed"]
  assert outcomes[4].status in ("timeout", "killed")
  assert "MemoryError" in outcomes[3].detail
  assert os.path.exists(escape)
  assert evaluator.stderr.count("WARNING: the code sandbox runs programs WITHOUT namespaces") == 1


def test_disabled_user_namespaces_are_diagnosed(monkeypatch, tmp_path):
  # As an ordinary user on a platform whose tools fail, with these sysctl values.
  monkeypatch.setattr(os, "geteuid", lambda: 1000)
  monkeypatch.setattr(sandbox, "TOOL_PATHS", {"bwrap": "/bin/false", "unshare": "/bin/false"})
  files = [str(tmp_path / f"sysctl{i}") for i in range(len(sandbox.USERNS_SYSCTLS))]
  monkeypatch.setattr(sandbox, "USERNS_SYSCTLS", tuple(
      (path, disabling, enabling)
      for path, (_, disabling, enabling) in zip(files, sandbox.USERNS_SYSCTLS)))
  # Nothing disabled: the sysctls to check are named.
  for path in files:
    with open(path, "w") as f:
      f.write("15000\n")
  with pytest.raises(sandbox.SandboxError, match="check the sysctls kernel.unprivileged_userns_"
                     "clone, user.max_user_namespaces, kernel.apparmor_restrict_unprivileged_"
                     "userns") as info:
    sandbox.run_program("pass\n", SMALL)
  assert "bwrap: " in str(info.value) and "unshare: " in str(info.value)
  # Ubuntu's AppArmor restriction: its setting is named.
  with open(files[2], "w") as f:
    f.write("1\n")
  with pytest.raises(sandbox.SandboxError,
                     match="kernel.apparmor_restrict_unprivileged_userns is 1: `sysctl -w kernel."
                     "apparmor_restrict_unprivileged_userns=0`"):
    sandbox.run_programs(["pass\n"], SMALL)
  # Too old a kernel for the per-namespace process count.
  monkeypatch.setattr(platform, "release", lambda: "5.10.0-28-amd64")
  with pytest.raises(sandbox.SandboxError, match="5.10.0-28-amd64 is older than 5.14"):
    sandbox.check_platform()


def test_output_is_kept_to_its_tail():
  outcome = sandbox.run_program("for i in range(5000):\n  print('line', i)\nraise SystemExit(3)\n",
                                SMALL)
  assert (outcome.passed, outcome.status) == (False, "failed")
  assert len(outcome.detail) <= sandbox.DETAIL_CHARS
  assert "line 4999" in outcome.detail and "line 0\n" not in outcome.detail
  assert "exit status 3" in outcome.detail


# Runs the launcher as PID 1 of a PID namespace on a program that ends at
# once, with a wait4 that returns late: the wall-clock alarm comes after the
# sample has been reaped, when nothing is left in the namespace to kill.
_LATE_ALARM_DRIVER = textwrap.dedent("""
    import json, os, sys, tempfile, time
    sys.path.insert(0, sys.argv[1])
    import sandbox
    assert os.getpid() == 1, os.getpid()
    folder = tempfile.mkdtemp()
    program = os.path.join(folder, "given.py")
    with open(program, "w") as f:
      f.write("print('ended by itself', flush=True)\\n")
    read_fd, write_fd = os.pipe()
    spec = {"mode": "bwrap", "folder": folder, "uid": 0, "gid": 0, "status_fd": write_fd,
            "python": sys.executable, "program_fd": os.open(program, os.O_RDONLY),
            "other_processes": 1, "env": {"PATH": "/usr/bin:/bin"},
            "limits": {"wall_seconds": 0.3, "cpu_seconds": 2, "memory_bytes": 1 << 30,
                       "processes": 16, "file_bytes": 1 << 20, "scratch_bytes": 1 << 20}}
    real_wait4 = os.wait4
    def late_wait4(pid, options):
      reaped = real_wait4(pid, options)
      time.sleep(1.0)  # the alarm fires here
      return reaped
    os.wait4 = late_wait4
    code = sandbox._launch(spec)
    os.close(write_fd)
    print(json.dumps({"code": code, "reports": os.read(read_fd, 1 << 16).decode()}))
    """)


def test_a_late_alarm_with_nothing_left_to_kill_is_not_an_error():
  if shutil.which("unshare") is None:
    pytest.skip("needs util-linux's unshare for a PID namespace")
  done = subprocess.run(
      ["unshare", "--user", "--map-root-user", "--pid", "--fork", "--mount-proc",
       sys.executable, "-I", "-c", _LATE_ALARM_DRIVER, os.path.dirname(sandbox.__file__)],
      capture_output=True, text=True, timeout=60)
  assert done.returncode == 0, done.stderr
  answer = json.loads(done.stdout.strip().splitlines()[-1])
  reports = [json.loads(line) for line in answer["reports"].splitlines()]
  assert answer["code"] == 0, reports
  assert [{k: r[k] for k in r if k != "cpu"} for r in reports] == [{"exit": 0}]
  assert "ended by itself" in done.stdout


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
  if os.geteuid() != 0:
    pytest.skip("the network probe is root's (an ordinary user's is part of its namespaces)")
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


def test_configure_sets_the_settings_filters_read():
  before = sandbox.settings()
  try:
    chosen = sandbox.configure(SMALL, allow_network=True, workers=3, progress=True,
                               allow_no_namespaces=True)
    assert sandbox.settings() == chosen == sandbox.Settings(SMALL, True, 3, True, True)
    with pytest.raises(ValueError, match="workers=0"):
      sandbox.configure(SMALL, workers=0)
  finally:
    sandbox.configure(before.limits, allow_network=before.allow_network,
                      workers=before.workers, progress=before.progress,
                      allow_no_namespaces=before.allow_no_namespaces)


def test_unreadable_launcher_reports_become_errors():
  # What the launcher's pipe carries is parsed line by line; no line may raise.
  read_fd, write_fd = os.pipe()
  lines = [b'{"index": 0, "passed": true}', b"[" * 5000 + b"]" * 5000,  # < a pipe's buffer
           b"1" * 5000, b"not json", b"[1, 2]"]
  os.write(write_fd, b"\n".join(lines) + b"\n")
  os.close(write_fd)
  try:
    reports = sandbox._read_reports(read_fd)  # pylint: disable=protected-access
  finally:
    os.close(read_fd)
  assert reports[0] == {"index": 0, "passed": True}
  assert len(reports) == 5 and all("unreadable launcher report" in r["error"]
                                   for r in reports[1:])

