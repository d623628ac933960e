"""Runs untrusted programs (a model's HumanEval/MBPP answers) in a sandbox.

(One file on purpose, over 800 lines: the launcher inside the namespaces is this same
file run as a script with the standard library only, so both sides of the boundary,
and the spec and reports they exchange, are read and reviewed in one place.)

Each program runs in its own process tree, never in the evaluating process:

    evaluator --Popen(new session)--> unshare or bwrap --> launcher (PID 1) --fork--> sample

* New namespaces: mount, PID, IPC, UTS and, unless `allow_network=True`, a
  network namespace whose only interface is a loopback of its own (down, or
  up with nothing listening under bwrap): nothing on this machine or beyond
  can be reached, not even 127.0.0.1 of the host.
  How they are made depends on who evaluates (`check_platform` picks):

  - as root ("root" mode): `unshare` (util-linux) makes them directly;
  - as an ordinary user, through an unprivileged user namespace that maps the
    evaluating user to itself (bubblewrap, "bwrap" mode, where installed) or
    to uid 0 of the namespace (`unshare --user --map-root-user`, "unshare"
    mode). Capabilities exist only inside that namespace and the sample has
    none: bwrap drops them; in "unshare" mode the launcher empties the
    sample's capability sets and bounding set and locks the securebits, so
    exec as uid 0 gives none back. Neither lets the sample create further
    user namespaces.

* The launcher is this file run as a script (`python -I -S sandbox.py SPEC`,
  standard library only). It (or bwrap, before starting it) makes every mount
  read-only, puts fresh size-capped tmpfs over /tmp, /var/tmp and /dev/shm,
  and mounts a fresh tmpfs, owned by the sample, at the sample's folder
  (which holds only the program). Folders the interpreter needs but that
  another uid could not enter (a Python under /root, say), and, without
  root, the evaluating user's home, are hidden under a tmpfs with what the
  interpreter needs bound back, read-only. Whatever the sample writes lives
  in these tmpfs and disappears with the namespace.
* The sample is forked by the launcher, gets its resource limits (CPU time,
  address space, processes, file size, no core files), as root also drops
  every group and switches to a uid of its own (random, from a range nothing
  else uses, so the process cap counts only its processes and no file outside
  its folder is its; without root the user namespace plays that part: the
  process cap counts per namespace and the mounts are read-only), sets
  no_new_privs (no setuid binary can give privileges back), and execs
  `python -I program.py` with a stripped environment (PATH, HOME = its
  folder, LANG and thread caps for numerical libraries: none of the
  evaluator's variables).
* The launcher waits for the sample with its own wall-clock timer, reports
  how it ended through a pipe the sample cannot write to (the launcher is not
  dumpable, so not even a sample of the same uid can reach its descriptors),
  and exits; being PID 1 of the namespace, its exit makes the kernel kill
  every process the sample left behind (children that outlive it, a fork
  bomb, a process that called setsid). The evaluator also kills the whole
  process group when the wall-clock limit plus a grace period has passed, so
  a stuck sandbox never blocks the evaluation.

Without root, the sample runs as the evaluating user's uid (through the
namespace mapping): it can read what that user can read outside the hidden
home folder, but write nothing outside its tmpfs. Where unprivileged user
namespaces are disabled (`kernel.unprivileged_userns_clone=0`,
`user.max_user_namespaces=0`, or Ubuntu's
`kernel.apparmor_restrict_unprivileged_userns=1` without a bwrap that may use
them), `SandboxError` names the setting to change and the opt-out
`allow_no_namespaces=True` (`--config.sandbox_allow_no_namespaces=true`),
which runs samples with resource limits and a wall-clock kill of their
process group only ("none" mode, with a loud warning): they can then read
and write whatever the evaluating user can and reach the network. Before the
first run the evaluator checks once that the chosen namespaces can be
created (as root: a network namespace; where the platform refuses,
`SandboxError` names the opt-out `allow_network=True`,
`--config.sandbox_allow_network=true`, which runs samples with the host's
network and means accepting that risk).

Settings for code scored inside lm-eval (whose metric functions take no
sandbox arguments) are set once per process with `configure` and read with
`settings`.
"""

from __future__ import annotations

# The launcher runs this file as a script and stops at the `__main__` check
# below: it needs only these light modules, and each program's sandbox starts
# that much faster (the evaluator's imports follow the check).
import ctypes
import errno
import json
import os
import resource
import signal
import stat
import sys

PROGRAM_NAME = "program.py"

# Folders where any uid may write: each gets a fresh tmpfs in the sandbox.
_SCRATCH_FOLDERS = ("/tmp", "/var/tmp", "/dev/shm")
_HIDDEN_TMPFS_BYTES = 1 << 20  # the tmpfs that hides a folder (what is bound back needs none)

# Modes (module docstring): how the namespaces are made, hence what the launcher does.
MODES = ("root", "bwrap", "unshare", "none")


# --- launcher side (PID 1 of the new namespaces, standard library only) ------------------

_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 1, 2, 4, 8
_MS_REMOUNT, _MS_NOATIME, _MS_NODIRATIME, _MS_BIND = 32, 1024, 2048, 4096
_MS_RELATIME, _MS_STRICTATIME = 1 << 21, 1 << 24
_PR_SET_DUMPABLE, _PR_CAPBSET_DROP, _PR_SET_SECUREBITS = 4, 24, 28
_PR_SET_NO_NEW_PRIVS, _PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL = 38, 47, 4
# Every securebit but KEEP_CAPS, each locked: uid 0 gets no capabilities on
# exec or on a uid change, and nothing can undo that.
_SECUREBITS_NO_ROOT = 0b11101111
_LINUX_CAPABILITY_VERSION_3 = 0x20080522
# Per-mount flags a remount must restate, or the kernel clears (or refuses to clear) them.
_MOUNT_OPTION_FLAGS = {"nosuid": _MS_NOSUID, "nodev": _MS_NODEV, "noexec": _MS_NOEXEC,
                       "noatime": _MS_NOATIME, "nodiratime": _MS_NODIRATIME,
                       "relatime": _MS_RELATIME, "strictatime": _MS_STRICTATIME}


def _libc():
  libc = ctypes.CDLL(None, use_errno=True)
  libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong,
                         ctypes.c_char_p]
  libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong,
                         ctypes.c_ulong]
  return libc, ctypes.get_errno


def _prctl(option: int, arg: int = 0, arg3: int = 0, name: str = "") -> None:
  libc, get_errno = _libc()
  if libc.prctl(option, arg, arg3, 0, 0) != 0:
    errno = get_errno()
    raise OSError(errno, f"prctl({name or option}): {os.strerror(errno)}")


def _mount(source: str | None, target: str, fstype: str | None, flags: int,
           data: str | None = None) -> None:
  libc, get_errno = _libc()
  enc = lambda s: None if s is None else os.fsencode(s)  # noqa: E731
  if libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)) != 0:
    errno = get_errno()
    raise OSError(errno, f"mount({source!r}, {target!r}, {fstype!r}): {os.strerror(errno)}")


def _unescape_mountinfo(field: str) -> str:
  # mountinfo writes space, tab, newline and backslash as octal escapes.
  for escaped, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
    field = field.replace(escaped, char)
  return field


def _make_all_mounts_read_only() -> None:
  with open("/proc/self/mountinfo") as f:
    mounts = []
    for line in f:
      fields = line.split()
      mounts.append((_unescape_mountinfo(fields[4]), fields[5].split(",")))
  for point, options in sorted(mounts, key=lambda m: m[0].count("/")):
    flags = _MS_REMOUNT | _MS_BIND | _MS_RDONLY
    for option in options:
      flags |= _MOUNT_OPTION_FLAGS.get(option, 0)
    try:
      _mount(None, point, None, flags)
    except OSError as e:
      # A mount point hidden under a later mount (the host's /proc/* under our
      # fresh /proc) cannot be reached by the sample either.
      if e.errno not in (errno.EINVAL, errno.ENOENT):
        raise


def _first_closed_ancestor(path: str) -> str | None:
  """The shallowest folder on `path` that a uid with no rights of owner or
  group cannot enter (None when every folder is open)."""
  current = "/"
  for part in [p for p in path.split("/") if p]:
    current = os.path.join(current, part)
    if not os.stat(current).st_mode & stat.S_IXOTH:
      return current
  return None


def _within(path: str, folder: str) -> bool:
  return path == folder or path.startswith(folder.rstrip("/") + "/")


def _view(expose: list[str], hide: list[str]) -> tuple[list[str], list[str], list[str]]:
  """The sample's view of the file system, as (scratch folders that get a
  fresh tmpfs, folders hidden under a tmpfs, folders of `expose` bound back
  read-only over those tmpfs): the interpreter's folders below a folder
  another uid cannot enter, and the folders in `hide`, are hidden."""
  scratch = [d for d in _SCRATCH_FOLDERS if os.path.isdir(d) and not os.path.islink(d)]
  kept = []
  for path in expose:
    if not any(_within(path, e) for e in kept):
      kept.append(path)
  hidden = {h for h in hide if os.path.isdir(h) and h != "/"}
  for path in kept:
    if not any(_within(path, s) for s in scratch):
      closed = _first_closed_ancestor(path)
      if closed is not None:
        hidden.add(closed)
  hidden = sorted(h for h in hidden if not any(h != o and _within(h, o) for o in hidden)
                  and not any(_within(h, s) for s in scratch))
  rebind = [p for p in kept if any(_within(p, f) for f in [*scratch, *hidden])]
  return scratch, hidden, rebind


def _prepare_filesystem(spec: dict[str, Any]) -> None:
  """Builds the sample's view of the file system (module docstring)."""
  folder, limits = spec["folder"], spec["limits"]
  with open(os.path.join(folder, PROGRAM_NAME), encoding="utf-8") as f:
    source = f.read()
  scratch, hidden, rebind = _view(spec["expose"], spec["hide"])
  # Opened now, while they are still visible.
  handles = {path: os.open(path, os.O_PATH | os.O_DIRECTORY) for path in rebind}

  if spec["mode"] == "unshare":
    # Nested user namespaces are refused to everything in ours (the sysctl
    # counts per user namespace); /proc is still writable here.
    with open("/proc/sys/user/max_user_namespaces", "w") as f:
      f.write("0")
  _make_all_mounts_read_only()
  size = int(limits["scratch_bytes"])
  for folder_ in scratch:
    _mount("tmpfs", folder_, "tmpfs", _MS_NOSUID | _MS_NODEV, f"size={size},mode=1777")
  for folder_ in hidden:
    _mount("tmpfs", folder_, "tmpfs", _MS_NOSUID | _MS_NODEV,
           f"size={_HIDDEN_TMPFS_BYTES},mode=0755")
  for path, handle in handles.items():
    os.makedirs(path, mode=0o755, exist_ok=True)
    _mount(f"/proc/self/fd/{handle}", path, None, _MS_BIND)
    _mount(None, path, None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _MS_NOSUID | _MS_NODEV)
    os.close(handle)

  # The sample's folder: a fresh tmpfs at the same path, holding only the program.
  os.makedirs(folder, mode=0o755, exist_ok=True)
  _mount("tmpfs", folder, "tmpfs", _MS_NOSUID | _MS_NODEV,
         f"size={size},mode=0700,uid={spec['uid']},gid={spec['gid']}")
  _write_program(spec, source)


def _write_program(spec: dict[str, Any], source: str) -> None:
  program = os.path.join(spec["folder"], PROGRAM_NAME)
  with open(program, "w", encoding="utf-8") as f:
    f.write(source)
  os.chown(program, spec["uid"], spec["gid"])


def _drop_capabilities() -> None:
  """Empties this process's capability sets for good (it is uid 0 of a user
  namespace: the securebits keep exec from granting them back)."""

  class Header(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

  class Data(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                ("inheritable", ctypes.c_uint32)]

  with open("/proc/sys/kernel/cap_last_cap") as f:
    last = int(f.read())
  _prctl(_PR_SET_SECUREBITS, _SECUREBITS_NO_ROOT, name="PR_SET_SECUREBITS")
  for cap in range(last + 1):
    _prctl(_PR_CAPBSET_DROP, cap, name="PR_CAPBSET_DROP")
  _prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL, name="PR_CAP_AMBIENT_CLEAR_ALL")
  libc, get_errno = _libc()
  if libc.capset(ctypes.byref(Header(_LINUX_CAPABILITY_VERSION_3, 0)), (Data * 2)()) != 0:
    raise OSError(get_errno(), "capset")


def _tasks_of(uid: int) -> int:
  """Processes and threads this machine runs as `uid` (what RLIMIT_NPROC counts
  when no user namespace of its own separates the sample)."""
  count = 0
  for entry in os.listdir("/proc"):
    if entry.isdigit():
      try:
        if os.stat(f"/proc/{entry}").st_uid == uid:
          count += len(os.listdir(f"/proc/{entry}/task"))
      except OSError:
        continue
  return count


def _enter_sample(spec: dict[str, Any]) -> None:
  """In the forked child: limits, an unprivileged identity, then the program."""
  limits, mode = spec["limits"], spec["mode"]
  cpu = int(limits["cpu_seconds"])
  # Processes of the sample's uid that are not the sample's (its launcher).
  processes = int(limits["processes"]) + int(spec["other_processes"])
  if mode == "none":
    os.setsid()  # a group of its own, for the launcher to kill
    processes += _tasks_of(os.getuid()) - 1  # itself is counted in limits
  # The soft CPU limit sends SIGXCPU; the hard one, a second later, SIGKILL
  # for a program that ignores it. Set while privileged, so the sample cannot raise them.
  for which, soft, hard in (
      (resource.RLIMIT_CPU, cpu, cpu + 1),
      (resource.RLIMIT_AS, limits["memory_bytes"], limits["memory_bytes"]),
      (resource.RLIMIT_NPROC, processes, processes),
      (resource.RLIMIT_FSIZE, limits["file_bytes"], limits["file_bytes"]),
      (resource.RLIMIT_CORE, 0, 0)):
    resource.setrlimit(which, (int(soft), int(hard)))
  if mode == "root":
    os.setgroups([])
    os.setgid(spec["gid"])
    os.setuid(spec["uid"])
  elif mode == "unshare":
    _drop_capabilities()
  _prctl(_PR_SET_NO_NEW_PRIVS, 1, name="PR_SET_NO_NEW_PRIVS")
  try:
    os.chdir(spec["folder"])
  except PermissionError as e:
    raise PermissionError(
        f"the sample's folder {spec['folder']} is not reachable by an unprivileged uid: "
        "every folder above it must be world-searchable (o+x); set TMPDIR to such a "
        "folder, e.g. /tmp") from e
  python = spec["python"]
  os.execve(python, [python, "-I", os.path.join(spec["folder"], PROGRAM_NAME)], spec["env"])


def _kill_sample(mode: str, pid: int) -> bool:
  """SIGKILL to every process of the sample `pid`; False when none was left.
  In a namespace (the launcher is its PID 1) kill(-1) reaches every other
  process of the namespace and nothing outside it; without one, the sample's
  process group is all the launcher knows of."""
  try:
    if mode == "none":
      os.killpg(pid, signal.SIGKILL)
    else:
      os.kill(-1, signal.SIGKILL)
  except ProcessLookupError:
    return False
  return True


def _launch(spec: dict[str, Any]) -> int:
  status_fd, mode = spec["status_fd"], spec["mode"]
  os.set_inheritable(status_fd, False)  # the sample must not inherit it

  def report(**fields: Any) -> None:
    os.write(status_fd, (json.dumps(fields) + "\n").encode())

  try:
    # Not dumpable: a sample of the same uid can neither trace the launcher nor
    # open its descriptors (the status pipe) through /proc.
    _prctl(_PR_SET_DUMPABLE, 0, name="PR_SET_DUMPABLE")
    if mode != "none" and os.getpid() != 1:
      # kill(-1) below would reach every process of the uid, not just the namespace's.
      raise RuntimeError(f"the launcher is PID {os.getpid()}, not PID 1 of a namespace")
    os.umask(0o022)
    if mode in ("root", "unshare"):
      _prepare_filesystem(spec)
    elif mode == "bwrap":  # bwrap built the view; the program comes through a descriptor
      with os.fdopen(spec["program_fd"], encoding="utf-8") as f:
        _write_program(spec, f.read())
    pid = os.fork()
    if pid == 0:
      try:
        _enter_sample(spec)
      except BaseException as e:  # noqa: BLE001 (the child must never return)
        report(error=f"{type(e).__name__}: {e}")
      finally:
        os._exit(127)

    timed_out = []

    def on_alarm(signum, frame):
      # The alarm may come after wait4 has reaped a sample that ended by itself
      # just then, with nothing left to kill: no timeout in that case.
      if _kill_sample(mode, pid):
        timed_out.append(True)

    signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, float(spec["limits"]["wall_seconds"]))
    _, status, usage = os.wait4(pid, 0)
    signal.setitimer(signal.ITIMER_REAL, 0)
    if mode == "none":
      _kill_sample(mode, pid)  # what the sample left in its group
    cpu = usage.ru_utime + usage.ru_stime
    if timed_out:
      report(timeout=True, cpu=cpu)
    elif os.WIFSIGNALED(status):
      report(signal=os.WTERMSIG(status), cpu=cpu)
    else:
      report(exit=os.WEXITSTATUS(status), cpu=cpu)
    return 0  # exiting, PID 1 takes every process left in the namespace with it
  except Exception as e:  # noqa: BLE001 (reported to the evaluator, which raises)
    report(error=f"{type(e).__name__}: {e}")
    return 1


if __name__ == "__main__":
  sys.exit(_launch(json.loads(sys.argv[1])))


# --- evaluator side ---------------------------------------------------------------------

import dataclasses  # noqa: E402  (after the launcher's exit: module comment above)
import math  # noqa: E402
import platform  # noqa: E402
import pwd  # noqa: E402
import secrets  # noqa: E402
import select  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from concurrent import futures  # noqa: E402
from typing import Any, Sequence  # noqa: E402

_OUTPUT_NAME = "output.txt"
DETAIL_CHARS = 2000

# Sample uids are drawn at random from [UID_BASE, UID_BASE + UID_SPAN): above
# the ranges that distributions hand to users, systemd's dynamic users and
# containers' subordinate ids, so no file or process on the machine is expected
# to have one, and two samples running at once share one with odds ~1e-7.
UID_BASE = 0x70000000
UID_SPAN = 1 << 24

# Seconds the evaluator waits beyond the wall-clock limit (namespace and
# interpreter start-up, a loaded machine) before it kills the process group.
_SETUP_GRACE_SECONDS = 5.0

# The command whose success shows that this platform lets root create a network
# namespace (a module attribute so that tests can simulate a refusal).
NETWORK_PROBE = ("unshare", "--net", "--", "true")

# Without root: the tools tried, in order, to make the namespaces (tests choose
# one), and where each is (empty: looked up on PATH; tests point one elsewhere).
UNPRIVILEGED_TOOLS = ("bwrap", "unshare")
TOOL_PATHS: dict[str, str] = {}

# Settings that disable unprivileged user namespaces: (file, the value that
# disables them, the `sysctl` setting that enables them). Module attribute
# so that tests can point them at files of their own.
USERNS_SYSCTLS = (
    ("/proc/sys/kernel/unprivileged_userns_clone", "0", "kernel.unprivileged_userns_clone=1"),
    ("/proc/sys/user/max_user_namespaces", "0", "user.max_user_namespaces=15000"),
    ("/proc/sys/kernel/apparmor_restrict_unprivileged_userns", "1",
     "kernel.apparmor_restrict_unprivileged_userns=0"),
)

# Processes of the sample's uid (as the kernel counts them for RLIMIT_NPROC)
# that are not the sample's: its launcher, and `unshare` itself, which enters
# the user namespace it creates.
_NO_REPORT = "without a report from its launcher; its output:"

_OTHER_PROCESSES = {"root": 0, "bwrap": 1, "unshare": 2, "none": 0}

_ENV_ESSENTIALS = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "LANG": "C.UTF-8",
    # One thread per numerical library: the process cap counts threads, and
    # a BLAS sizing its pool to a large machine's cores would exceed it.
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}


class SandboxError(RuntimeError):
  """The sandbox cannot run programs here (a platform or setup problem, never
  a verdict on the program)."""


@dataclasses.dataclass(frozen=True)
class Limits:
  """What one program may use."""

  wall_seconds: float = 10.0  # per program, then the whole process tree is killed
  cpu_seconds: int = 10  # RLIMIT_CPU of each process
  memory_bytes: int = 2 << 30  # RLIMIT_AS (address space) of each process
  processes: int = 32  # RLIMIT_NPROC of the sample's own uid (threads count too)
  file_bytes: int = 16 << 20  # RLIMIT_FSIZE: the largest file it may write (output included)
  scratch_bytes: int = 64 << 20  # size of each tmpfs it may write: its folder, /tmp, ...

  def __post_init__(self):
    for field in dataclasses.fields(self):
      value = getattr(self, field.name)
      integral = field.type in ("int", int)
      kinds = (int,) if integral else (int, float)
      if isinstance(value, bool) or not isinstance(value, kinds):
        kind = "an integer" if integral else "a number"
        raise ValueError(f"Limits.{field.name}={value!r}: must be {kind}")
      if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"Limits.{field.name}={value!r}: must be positive and finite")


@dataclasses.dataclass(frozen=True)
class Outcome:
  """How one program ended."""

  passed: bool  # exit status 0 within the limits
  status: str  # "passed" | "failed" (non-zero exit) | "timeout" (wall or CPU) | "killed" (a signal)
  detail: str  # the last DETAIL_CHARS characters of its output (stdout and stderr), plus a note
  seconds: float  # wall-clock seconds, sandbox start-up included


@dataclasses.dataclass(frozen=True)
class Plan:
  """How programs are sandboxed here (`check_platform`)."""

  mode: str  # one of MODES (module docstring)
  tool: str | None  # the unshare or bwrap binary (None in "none" mode)
  allow_network: bool  # no network namespace


@dataclasses.dataclass(frozen=True)
class Settings:
  """Sandbox settings for code scored where no arguments reach (lm-eval metrics)."""

  limits: Limits = Limits()
  allow_network: bool = False
  workers: int = 2
  progress: bool = False
  allow_no_namespaces: bool = False


_settings = Settings()


def configure(limits: Limits | None = None, *, allow_network: bool = False, workers: int = 2,
              progress: bool = False, allow_no_namespaces: bool = False) -> Settings:
  """Sets the process-wide sandbox settings that the lm-eval tasks' filters use
  (the evaluation entry point calls this before running the tasks)."""
  global _settings
  if workers < 1:
    raise ValueError(f"workers={workers}: must be at least 1")
  _settings = Settings(limits or Limits(), bool(allow_network), int(workers), bool(progress),
                       bool(allow_no_namespaces))
  return _settings


def settings() -> Settings:
  """The settings last given to `configure` (the defaults before)."""
  return _settings


_probe_lock = threading.Lock()
_probe_results: dict[Any, str | None] = {}
_warned_no_namespaces = []


def _network_namespace_refusal() -> str | None:
  """Why a network namespace cannot be created here (None when it can); the
  probe runs once per process (per probe command)."""
  command = tuple(NETWORK_PROBE)
  with _probe_lock:
    if command not in _probe_results:
      try:
        done = subprocess.run(command, stdin=subprocess.DEVNULL, capture_output=True,
                              timeout=30, env=dict(_ENV_ESSENTIALS))
        refusal = None if done.returncode == 0 else (
            f"`{' '.join(command)}` exited with status {done.returncode}: "
            f"{done.stderr.decode(errors='replace').strip() or 'no message'}")
      except (OSError, subprocess.SubprocessError) as e:
        refusal = f"`{' '.join(command)}` could not run: {e}"
      _probe_results[command] = refusal
    return _probe_results[command]


def _sandbox_refusal(plan: Plan) -> str | None:
  """Why `plan` cannot run a program here (None when it can): a trivial
  program is run through it, once per process (per plan)."""
  key = (plan, os.geteuid())
  with _probe_lock:
    if key not in _probe_results:
      try:
        outcome = _run("pass\n", Limits(), plan)
        refusal = None if outcome.passed else (
            f"a trivial program ended {outcome.status}: {outcome.detail[-500:].strip()}")
      except (OSError, SandboxError, subprocess.SubprocessError) as e:
        refusal = str(e).replace(_NO_REPORT, "").strip()
      _probe_results[key] = refusal
    return _probe_results[key]


def _userns_settings() -> list[str]:
  """The sysctl settings (`name=value` to set) that disable unprivileged user
  namespaces here."""
  found = []
  for path, disabling, enabling in USERNS_SYSCTLS:
    try:
      with open(path) as f:
        value = f.read().strip()
    except OSError:
      continue
    if value == disabling:
      found.append((path, value, enabling))
  return [f"{enabling.split('=')[0]} is {value}: `sysctl -w {enabling}`"
          for _, value, enabling in found]


def _kernel_version() -> tuple[int, ...]:
  numbers = []
  for part in platform.release().split("-")[0].split(".")[:2]:
    digits = "".join(c for c in part if c.isdigit())
    numbers.append(int(digits or 0))
  return tuple(numbers)


def _warn_no_namespaces() -> None:
  if not _warned_no_namespaces:
    _warned_no_namespaces.append(True)
    sys.stderr.write(
        "\n" + "!" * 78 + "\nWARNING: the code sandbox runs programs WITHOUT namespaces "
        "(allow_no_namespaces):\nonly resource limits and a wall-clock kill of their process "
        f"group apply; they can read\nand write every file uid {os.geteuid()} can, reach the "
        "network, and leave processes\nbehind. Enable unprivileged user namespaces or evaluate "
        "as root instead.\n" + "!" * 78 + "\n")
    sys.stderr.flush()


def _tool(name: str) -> str | None:
  return (TOOL_PATHS.get(name) or shutil.which(name, path=_ENV_ESSENTIALS["PATH"])
          or shutil.which(name))


def check_platform(allow_network: bool = False, allow_no_namespaces: bool = False) -> Plan:
  """How programs are sandboxed here (module docstring); raises SandboxError
  where the sandbox cannot work."""
  if not sys.platform.startswith("linux"):
    raise SandboxError(f"the code sandbox needs Linux namespaces; this is {sys.platform}")
  if os.geteuid() == 0:
    unshare = _tool("unshare")
    if unshare is None:
      raise SandboxError("the code sandbox needs util-linux's `unshare`, which is not installed")
    if not allow_network:
      refusal = _network_namespace_refusal()
      if refusal is not None:
        raise SandboxError(
            "the code sandbox cannot create a network namespace on this platform, so programs "
            f"under evaluation could reach the network ({refusal}). To run them with the host's "
            "network anyway, accepting that risk, pass allow_network=True "
            "(--config.sandbox_allow_network=true)")
    return Plan("root", unshare, bool(allow_network))
  uid = os.geteuid()
  refusals = []
  if _kernel_version() < (5, 14):
    # Before 5.14 RLIMIT_NPROC counted every process of the uid, the
    # evaluator's threads included, whatever the user namespace.
    refusals.append(f"Linux {platform.release()} is older than 5.14, which counts the "
                    "process limit per user namespace")
  else:
    for name in UNPRIVILEGED_TOOLS:
      path = _tool(name)
      if path is None:
        refusals.append(f"{name}: not installed")
        continue
      plan = Plan(name, path, bool(allow_network))
      refusal = _sandbox_refusal(plan)
      if refusal is None:
        return plan
      refusals.append(f"{name}: {refusal}")
  if allow_no_namespaces:
    _warn_no_namespaces()
    return Plan("none", None, True)
  disabled = _userns_settings()
  fix = (f"unprivileged user namespaces are disabled ({'; '.join(disabled)}, as root)"
         if disabled else
         "enable unprivileged user namespaces (check the sysctls "
         + ", ".join(enabling.split("=")[0] for _, _, enabling in USERNS_SYSCTLS)
         + ", and that a container allows them)")
  raise SandboxError(
      f"the code sandbox cannot create user namespaces as uid {uid}: {fix}; or run the "
      "evaluation as root; or pass allow_no_namespaces=True "
      "(--config.sandbox_allow_no_namespaces=true) to run programs with resource limits only, "
      f"accepting that they can read and write whatever uid {uid} can and reach the network "
      f"[{'; '.join(refusals) or 'no tool tried'}]")


def _interpreter() -> str:
  """The interpreter as the sample's view can reach it: its folder with every
  link resolved (a venv reached through a link below /tmp, which the sample
  sees as a fresh tmpfs, is named where it really is), its own name kept, so a
  venv's python still finds its pyvenv.cfg."""
  return os.path.join(os.path.realpath(os.path.dirname(os.path.abspath(sys.executable))),
                      os.path.basename(sys.executable))


def _interpreter_paths() -> list[str]:
  """Folders the sample's interpreter reads: its prefixes and every folder on
  the chain of symbolic links to its binary."""
  paths = {sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix}
  link = os.path.abspath(sys.executable)
  for _ in range(40):  # the kernel's own bound on nested links
    paths.add(os.path.dirname(link))
    if not os.path.islink(link):
      break
    link = os.path.join(os.path.dirname(link), os.readlink(link))
  return sorted({os.path.realpath(p) for p in paths if os.path.isdir(p)})


def _home_folders() -> list[str]:
  """The evaluating user's home folders (hidden from a sample of the same uid)."""
  homes = {os.environ.get("HOME", "")}
  try:
    homes.add(pwd.getpwuid(os.geteuid()).pw_dir)
  except KeyError:
    pass
  return sorted({os.path.realpath(h) for h in homes if h and os.path.isdir(h)} - {"/"})


def _bwrap_command(plan: Plan, spec: dict[str, Any]) -> list[str]:
  """bwrap's arguments that build the sample's view (what the launcher builds
  itself in the other modes) and start the launcher."""
  command = [plan.tool, "--unshare-user", "--unshare-pid", "--unshare-ipc", "--unshare-uts",
             "--unshare-cgroup-try"]
  if not plan.allow_network:
    command.append("--unshare-net")
  command += ["--die-with-parent", "--as-pid-1", "--disable-userns",
              "--ro-bind", "/", "/", "--proc", "/proc", "--dev", "/dev"]
  size = str(int(spec["limits"]["scratch_bytes"]))
  scratch, hidden, rebind = _view(spec["expose"], spec["hide"])
  for folder in scratch:
    command += ["--size", size, "--perms", "1777", "--tmpfs", folder]
  for folder in hidden:
    command += ["--size", str(_HIDDEN_TMPFS_BYTES), "--perms", "0755", "--tmpfs", folder]
  for folder in rebind:
    command += ["--ro-bind", folder, folder]
  command += ["--size", size, "--perms", "0700", "--tmpfs", spec["folder"], "--chdir", "/"]
  return command


def _tail(path: str, chars: int = DETAIL_CHARS) -> str:
  with open(path, "rb") as f:
    f.seek(0, os.SEEK_END)
    f.seek(max(0, f.tell() - 4 * chars))
    return f.read().decode("utf-8", errors="replace")[-chars:]


def _read_reports(fd: int) -> list[dict[str, Any]]:
  os.set_blocking(fd, False)
  chunks = []
  while True:
    try:
      chunk = os.read(fd, 1 << 16)
    except BlockingIOError:
      break
    if not chunk:
      break
    chunks.append(chunk)
  reports = []
  for line in b"".join(chunks).decode(errors="replace").splitlines():
    try:
      report = json.loads(line)
    except (ValueError, RecursionError):  # not JSON, a number too long, nested too deep
      report = None
    reports.append(report if isinstance(report, dict)
                   else {"error": f"unreadable launcher report {line[:200]!r}"})
  return reports


def _wait(proc: subprocess.Popen, timeout: float) -> None:
  """`proc.wait(timeout)` without its polling: sleeps on a pidfd until the
  process ends (Popen's timed wait checks every 50 ms, a delay that adds up
  over hundreds of short programs). Raises subprocess.TimeoutExpired."""
  try:
    pidfd = os.pidfd_open(proc.pid)
  except (AttributeError, OSError):  # Linux < 5.3 or Python < 3.9
    proc.wait(timeout=timeout)
    return
  try:
    ready, _, _ = select.select([pidfd], [], [], timeout)
  finally:
    os.close(pidfd)
  if not ready:
    raise subprocess.TimeoutExpired(proc.args, timeout)
  proc.wait()


def _kill_group(pgid: int) -> None:
  try:
    os.killpg(pgid, signal.SIGKILL)
  except ProcessLookupError:
    pass


def run_program(source: str, limits: Limits = Limits(), *, allow_network: bool = False,
                allow_no_namespaces: bool = False) -> Outcome:
  """Runs `python -I` on `source` in the sandbox (module docstring); returns
  how it ended. Raises SandboxError when the sandbox cannot run here."""
  if not isinstance(source, str):
    raise TypeError(f"run_program: source must be a str, got {type(source).__name__}")
  return _run(source, limits, check_platform(allow_network, allow_no_namespaces))


def _run(source: str, limits: Limits, plan: Plan) -> Outcome:
  """`run_program` through a given plan."""
  euid, egid = os.geteuid(), os.getegid()
  uid = {"root": UID_BASE + secrets.randbelow(UID_SPAN), "unshare": 0}.get(plan.mode, euid)
  gid = {"unshare": 0, "bwrap": egid, "none": egid}.get(plan.mode, uid)
  folder = tempfile.mkdtemp(prefix="refusion-sandbox-")
  read_fd, write_fd = os.pipe()
  program_fd = -1
  try:
    program = os.path.join(folder, PROGRAM_NAME)
    with open(program, "w", encoding="utf-8") as f:
      f.write(source)
    output_path = os.path.join(folder, _OUTPUT_NAME)
    launcher = os.path.abspath(__file__)
    expose = _interpreter_paths()
    if plan.mode != "root":
      expose = sorted({*expose, os.path.dirname(launcher)})
    spec = {
        "mode": plan.mode, "folder": folder, "uid": uid, "gid": gid, "status_fd": write_fd,
        "python": _interpreter(), "expose": expose,
        "hide": [] if plan.mode == "root" else _home_folders(),
        "other_processes": _OTHER_PROCESSES[plan.mode],
        "limits": dataclasses.asdict(limits), "env": {**_ENV_ESSENTIALS, "HOME": folder},
    }
    pass_fds = [write_fd]
    if plan.mode == "bwrap":
      program_fd = os.open(program, os.O_RDONLY)
      spec["program_fd"] = program_fd
      pass_fds.append(program_fd)
      command = _bwrap_command(plan, spec)
    elif plan.mode == "none":
      command = []
    else:
      command = [plan.tool]
      if plan.mode == "unshare":
        command += ["--user", "--map-root-user"]
      command += ["--mount", "--propagation", "private", "--pid", "--fork", "--kill-child",
                  "--mount-proc", "--ipc", "--uts"]
      if not plan.allow_network:
        command.append("--net")
    command += (["--"] if command else []) + [
        _interpreter(), "-I", "-S", launcher, json.dumps(spec)]
    start = time.monotonic()
    with open(output_path, "wb") as output:
      proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=output,
                              stderr=subprocess.STDOUT, env=dict(_ENV_ESSENTIALS), cwd=folder,
                              start_new_session=True, pass_fds=pass_fds)
    os.close(write_fd)
    write_fd = -1
    if program_fd >= 0:
      os.close(program_fd)
      program_fd = -1
    killed_by_us = False
    try:
      _wait(proc, limits.wall_seconds + _SETUP_GRACE_SECONDS)
    except BaseException:
      # Past the limit (or interrupted): the group's processes, the launcher
      # among them, die; the kernel then kills the rest of the namespace.
      # Only while `proc` is unreaped, so its id cannot name another group.
      killed_by_us = True
      _kill_group(proc.pid)
      proc.wait()
      if not isinstance(sys.exc_info()[1], subprocess.TimeoutExpired):
        raise
    seconds = time.monotonic() - start
    reports = _read_reports(read_fd)
    output_tail = _tail(output_path)
  finally:
    os.close(read_fd)
    for fd in (write_fd, program_fd):
      if fd >= 0:
        os.close(fd)
    shutil.rmtree(folder, ignore_errors=True)
  return _outcome(reports, output_tail, seconds, limits, killed_by_us, proc.returncode)


def _outcome(reports: list[dict[str, Any]], output_tail: str, seconds: float, limits: Limits,
             killed_by_us: bool, returncode: int) -> Outcome:
  errors = [r["error"] for r in reports if "error" in r]
  if errors:
    raise SandboxError(f"the code sandbox failed to start a program: {'; '.join(errors)}\n"
                       f"{output_tail[-500:]}")
  ended = [r for r in reports if "exit" in r or "signal" in r or "timeout" in r]
  if killed_by_us or (ended and "timeout" in ended[-1]):
    note = f"[sandbox] wall-clock limit of {limits.wall_seconds:g} s reached"
    return Outcome(False, "timeout", _with_note(output_tail, note), seconds)
  if not ended:
    raise SandboxError(f"the code sandbox ended (status {returncode}) {_NO_REPORT} "
                       f"{output_tail[-1000:]!r}")
  report = ended[-1]
  cpu = float(report.get("cpu", 0.0))
  if "exit" in report:
    code = int(report["exit"])
    if code == 0:
      return Outcome(True, "passed", output_tail, seconds)
    return Outcome(False, "failed", _with_note(output_tail, f"[sandbox] exit status {code}"),
                   seconds)
  number = int(report["signal"])
  try:
    name = signal.Signals(number).name
  except ValueError:
    name = f"signal {number}"
  if number == signal.SIGXCPU or (number == signal.SIGKILL and cpu >= limits.cpu_seconds):
    note = f"[sandbox] CPU-time limit of {limits.cpu_seconds} s reached ({name})"
    return Outcome(False, "timeout", _with_note(output_tail, note), seconds)
  return Outcome(False, "killed", _with_note(output_tail, f"[sandbox] killed by {name}"), seconds)


def _with_note(text: str, note: str) -> str:
  joined = f"{text}\n{note}" if text and not text.endswith("\n") else text + note
  return joined[-DETAIL_CHARS:]


def run_programs(sources: Sequence[str], limits: Limits = Limits(), *, allow_network: bool = False,
                 workers: int = 2, progress: bool = False,
                 allow_no_namespaces: bool = False) -> list[Outcome]:
  """`run_program` on each source, `workers` at a time (threads only wait on
  the sandboxes); outcomes in input order; a progress bar on stderr when
  `progress`."""
  if workers < 1:
    raise ValueError(f"run_programs: workers={workers} must be at least 1")
  sources = list(sources)
  plan = check_platform(allow_network, allow_no_namespaces)  # fail before starting any work
  bar = None
  if progress:
    # Only here: the module otherwise needs the standard library alone (its tests run a
    # copy of it under the system Python as another user).
    from tqdm import tqdm
    bar = tqdm(total=len(sources), file=sys.stderr, desc="sandbox", unit="program")

  def one(source: str) -> Outcome:
    if not isinstance(source, str):
      raise TypeError(f"run_programs: each source must be a str, got {type(source).__name__}")
    outcome = _run(source, limits, plan)
    if bar is not None:
      bar.update(1)
    return outcome

  pool = futures.ThreadPoolExecutor(max_workers=workers)
  try:
    return list(pool.map(one, sources))
  finally:
    # After an error or an interrupt, programs not yet started never start.
    pool.shutdown(wait=True, cancel_futures=True)
    if bar is not None:
      bar.close()
