"""A subprocess sandbox for the coding environment: run a candidate solution and its tests with time, memory and
file-size limits, inside a fresh directory that it cannot write outside of.

    result = run_python("def f(x):\n    return x + 3", "assert f(1) == 4", time_limit=2.0, memory_mb=256)
    result.passed, result.status    # True, "passed" | "failed" | "timeout" | "memory" | "blocked" | "error"

How it is confined (Linux; the parent process is never touched):
  - a new process (`python -I -S`: no user site, no site-packages, no PYTHON* variables) in its own session, so a
    timeout kills its whole process group;
  - rlimits set before exec: RLIMIT_CPU (CPU seconds), RLIMIT_AS (address space, so an allocation without bound
    raises MemoryError or dies), RLIMIT_FSIZE (largest file it may write), RLIMIT_CORE 0; plus a wall-clock timeout
    in the parent (a `sleep` uses no CPU);
  - the working directory is a fresh temporary directory, deleted afterwards, and the environment is empty but PATH;
  - an audit hook (PEP 578; it cannot be removed once added) refuses, before they happen: opening a file for writing
    outside the directory, every path-changing call (remove, rename, mkdir, chmod, ...) outside it, changing
    directory, starting processes (subprocess, os.system, exec*, fork, posix_spawn), sockets and ctypes.

NOTE: this is process-level confinement for model-written code in RL, not a security boundary against code
written to break out (reads are allowed everywhere, which imports need; Python-level hooks can be evaded by
native code). Run untrusted code at scale inside a container or VM as well.
"""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass

# The program the child runs (`python -c RUNNER DIR`): install the audit hook, then run solution.py and tests.py
# in one namespace. Exit codes: 0 passed, 1 a test failed or the code raised, 3 MemoryError, 4 refused by the hook
# (which ends the process at once, so a refused action never continues).
RUNNER = r"""
import os, sys
root = os.path.realpath(sys.argv[1])
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
PATH_EVENTS = {"os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.symlink", "os.link", "os.truncate",
               "os.chmod", "os.chown", "os.utime", "shutil.rmtree", "shutil.copyfile", "shutil.copytree",
               "shutil.move", "shutil.chown", "os.chflags", "os.setxattr", "os.removexattr", "os.mkfifo", "os.mknod"}
BLOCKED = ("subprocess.", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty", "pty.",
           "socket.", "ctypes.", "os.chdir", "os.chroot", "os.kill", "os.killpg", "os.setuid", "os.setgid",
           "_posixsubprocess", "mmap.", "os.add_dll_directory", "sys.addaudithook")

def refuse(why):  # end the process at once: the solution's own try/except cannot swallow a refusal
    sys.stderr.write(why + "\n")
    sys.stderr.flush()
    os._exit(4)

def inside(path):
    if isinstance(path, int):
        return True  # an already-open descriptor
    if isinstance(path, bytes):
        path = os.fsdecode(path)
    if not isinstance(path, str):
        return False
    p = os.path.realpath(os.path.join(root, path))
    return p == root or p.startswith(root + os.sep)

def hook(event, args):
    if event == "open":
        path, mode, flags = args
        writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
            isinstance(flags, int) and flags & WRITE_FLAGS)
        if writing and not inside(path):
            refuse(f"sandbox: writing {path!r} outside the sandbox directory")
    elif event in PATH_EVENTS:
        for a in args:
            if isinstance(a, (str, bytes)) and not inside(a):
                refuse(f"sandbox: {event} on {a!r} outside the sandbox directory")
    elif event.startswith(BLOCKED):
        refuse(f"sandbox: {event} is not allowed")

with open(os.path.join(root, "solution.py")) as f:
    solution = f.read()
with open(os.path.join(root, "tests.py")) as f:
    tests = f.read()
sys.addaudithook(hook)
ns = {"__name__": "solution"}
try:
    exec(compile(solution, "solution.py", "exec"), ns)
    exec(compile(tests, "tests.py", "exec"), ns)
except MemoryError:
    os._exit(3)
except BaseException as e:
    print(f"{type(e).__name__}: {e}", file=sys.stderr)
    os._exit(1)
sys.stdout.flush()
os._exit(0)
"""

STATUSES = ("passed", "failed", "timeout", "memory", "blocked", "error")


@dataclass
class SandboxResult:
    passed: bool
    status: str  # one of STATUSES
    returncode: int | None
    stderr: str
    wall_s: float


def _limits(time_limit: float, memory_mb: int, file_mb: int):
    cpu = max(1, int(time_limit + 0.999))

    def apply() -> None:  # runs in the child between fork and exec
        os.setsid()
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_mb << 20, file_mb << 20))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    return apply


def run_python(code: str, tests: str, *, time_limit: float = 2.0, memory_mb: int = 256,
               file_mb: int = 1) -> SandboxResult:
    """Run `code` then `tests` (asserts) in a sandboxed child process; see the module docstring."""
    import time

    if not time_limit > 0:
        raise ValueError(f"time_limit={time_limit!r}: must be > 0 seconds")
    if not isinstance(memory_mb, int) or memory_mb < 64:
        raise ValueError(f"memory_mb={memory_mb!r}: must be an integer >= 64 (the interpreter itself needs ~30 MB)")
    root = tempfile.mkdtemp(prefix="openk3-sandbox-")
    t0 = time.perf_counter()
    try:
        with open(os.path.join(root, "solution.py"), "w") as f:
            f.write(code)
        with open(os.path.join(root, "tests.py"), "w") as f:
            f.write(tests)
        proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", RUNNER, root], cwd=root,
                                env={"PATH": "/usr/bin:/bin"}, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, preexec_fn=_limits(time_limit, memory_mb, file_mb))
        try:
            _, err = proc.communicate(timeout=time_limit + 1.0)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)  # the whole session: nothing it started survives
            _, err = proc.communicate()
            return SandboxResult(False, "timeout", None, err.decode(errors="replace")[-2000:],
                                 time.perf_counter() - t0)
        rc = proc.returncode
        stderr = err.decode(errors="replace")[-2000:]
        if rc == 0:
            status = "passed"
        elif rc == 1:
            status = "failed"
        elif rc == 3:
            status = "memory"
        elif rc == 4:
            status = "blocked"
        elif rc in (-9, -24):  # SIGKILL / SIGXCPU: the CPU limit
            status = "timeout"
        else:
            status = "error"  # e.g. killed by the address-space limit inside the interpreter
        return SandboxResult(rc == 0, status, rc, stderr, time.perf_counter() - t0)
    finally:
        shutil.rmtree(root, ignore_errors=True)
