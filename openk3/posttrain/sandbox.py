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
    directory, opening a directory outside (a dir_fd there would let *at calls write outside), starting processes
    (subprocess, os.system, exec*, fork, posix_spawn, importing _posixsubprocess), sockets, ctypes, and the gc /
    introspection that would reach the hook object; it runs on private snapshots of builtins, os and posixpath, so
    patching those (or the runner's globals) from the solution does not change what it checks;
  - stderr goes to a file bounded by RLIMIT_FSIZE (a pipe would make the parent buffer endless output).
  - a pass is exit status 0 AND a per-run nonce the runner writes after the tests, which the solution cannot
    read (so `os._exit(0)` is no pass); the tests run with the builtins as they were before the solution.

NOTE: this is process-level confinement for model-written code in RL, not a security boundary against code
written to break out (reads are allowed everywhere, which imports need; Python-level hooks can be evaded by
native code). Run untrusted code at scale inside a container or VM as well.
"""

from __future__ import annotations

import os
import resource
import secrets
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass

# The program the child runs (`python -c RUNNER DIR`, the parent's nonce on stdin): install the audit hook, run
# solution.py, then tests.py with the solution's names (but genuine builtins). Exit codes: 0 with the nonce on
# stdout passed, 1 a test failed or the code raised, 3 MemoryError, 4 refused by the hook (which ends the process
# at once, so a refused action never continues).
RUNNER = r"""
import builtins, os, posixpath, stat, sys, types

# NOTE: the hook must not depend on anything the solution can change. Module globals, `builtins` and the os /
# posixpath modules are all mutable (a solution could set `__main__.root = "/"` or patch `os.path.realpath`), so
# the hook and the realpath it calls run on private snapshots of them, reachable only through the hook object
# (and gc introspection, which the hook refuses). Frames stay readable: `import re` (enum) and namedtuple need
# sys._getframe, and no hook state is in a frame the solution can reach.
def _snapshot(mod, extra):
    g = dict(mod.__dict__)
    g.update(extra)
    for k, v in list(g.items()):
        if isinstance(v, types.FunctionType) and v.__globals__ is mod.__dict__:
            g[k] = types.FunctionType(v.__code__, g, v.__name__, v.__defaults__, v.__closure__)
            g[k].__kwdefaults__ = v.__kwdefaults__
    return g

_B = dict(builtins.__dict__)
_P = _snapshot(posixpath, {"__builtins__": _B, "os": types.SimpleNamespace(**vars(os)),
                           "stat": types.SimpleNamespace(**vars(stat)),
                           "genericpath": types.SimpleNamespace(**vars(sys.modules["genericpath"]))})
_H = {"__builtins__": _B, "realpath": _P["realpath"], "join": _P["join"], "fsdecode": os.fsdecode,
      "isdir": lambda p, _stat=os.stat, _S=stat.S_ISDIR: _S(_stat(p).st_mode), "write": os.write,
      "exit_": os._exit, "root": os.path.realpath(sys.argv[1]),
      "WRITE_FLAGS": os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND,
      "PATH_EVENTS": frozenset({
          "os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.symlink", "os.link", "os.truncate", "os.chmod",
          "os.chown", "os.utime", "shutil.rmtree", "shutil.copyfile", "shutil.copytree", "shutil.move",
          "shutil.chown", "os.chflags", "os.setxattr", "os.removexattr", "os.mkfifo", "os.mknod"}),
      # "gc.": gc.get_objects / get_referrers reach the hook object and its private state
      "BLOCKED": ("subprocess.", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty",
                  "pty.", "socket.", "ctypes.", "os.chdir", "os.fchdir", "os.chroot", "os.kill", "os.killpg",
                  "os.setuid", "os.setgid", "_posixsubprocess", "mmap.", "os.add_dll_directory", "sys.addaudithook",
                  "gc."),
      # these start processes or load native code through calls that raise no audit event of their own
      "NO_IMPORT": frozenset({"_posixsubprocess", "_ctypes", "ctypes", "subprocess", "multiprocessing"})}
exec('''
def refuse(why):  # end the process at once: the solution's own try/except cannot swallow a refusal
    write(2, (why + "\\n").encode(errors="replace"))
    exit_(4)

def inside(path):
    if isinstance(path, int):
        return True  # an open descriptor (a directory outside cannot be opened, so no dir_fd escapes)
    if isinstance(path, bytes):
        path = fsdecode(path)
    if not isinstance(path, str):
        return False
    p = realpath(join(root, path))
    return p == root or p.startswith(root + "/")

def outside_dir(path):
    try:
        return not inside(path) and isdir(path)
    except (OSError, ValueError, TypeError):
        return False

def hook(event, args):
    if event == "open":
        path, mode, flags = args
        writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
            isinstance(flags, int) and flags & WRITE_FLAGS)
        if writing and not inside(path):
            refuse(f"sandbox: writing {path!r} outside the sandbox directory")
        if isinstance(path, (str, bytes)) and realpath(join(root, fsdecode(path))).startswith("/proc/") and (
                realpath(join(root, fsdecode(path))).endswith("/mem")):
            refuse(f"sandbox: opening {path!r} (process memory) is not allowed")
        if mode is None and outside_dir(path):  # os.open: its descriptor would serve as a dir_fd outside
            refuse(f"sandbox: os.open of the directory {path!r} outside the sandbox directory")
    elif event in PATH_EVENTS:
        for a in args:
            if isinstance(a, (str, bytes)) and not inside(a):
                refuse(f"sandbox: {event} on {a!r} outside the sandbox directory")
    elif event == "import":
        if isinstance(args[0], str) and args[0].partition(".")[0] in NO_IMPORT:
            refuse(f"sandbox: importing {args[0]} is not allowed")
    elif event == "object.__setattr__":
        if len(args) > 1 and args[1] == "__code__":
            refuse("sandbox: replacing a function's code is not allowed")
    elif event.startswith(BLOCKED):
        refuse(f"sandbox: {event} is not allowed")
''', _H)
# NOTE: the solution must not be able to fake a pass. Exit status 0 alone is not one (`os._exit(0)` in the
# solution would score every task): the runner ends a pass by writing the parent's nonce (read from stdin, kept
# only in `done`'s closure and this function's frame) to stdout. NOTE: not proof against code written to cheat:
# a solution that walks the frames up to `_run` (sys._getframe) can call `done` itself; it stops the simple
# cheats (exiting 0, an always-equal result, shadowed builtins). The tests run in a namespace of their own, with
# the builtins as they were before the solution ran and none of the solution's names that shadow a builtin.
_H["make_done"] = eval("lambda nonce: (lambda: write(1, nonce))", _H)
def _run(root, done, B, exit_, stdout_flush):
    with B["open"](root + "/solution.py") as f:
        solution = f.read()
    with B["open"](root + "/tests.py") as f:
        tests = f.read()
    ns = {"__name__": "solution"}
    try:
        B["exec"](B["compile"](solution, "solution.py", "exec"), ns)
        checks = {k: v for k, v in ns.items() if k not in B}
        checks["__builtins__"] = dict(B)
        B["exec"](B["compile"](tests, "tests.py", "exec"), checks)
    except MemoryError:
        exit_(3)
    except BaseException as e:
        B["print"](f"{type(e).__name__}: {e}", file=sys.stderr)
        exit_(1)
    stdout_flush()
    done()
    exit_(0)

_done = _H.pop("make_done")(os.read(0, 64))
os.close(0)
sys.addaudithook(_H["hook"])
_args = (os.path.realpath(sys.argv[1]), _done, dict(_B), os._exit, sys.stdout.flush)
del _H, _P, _B, _snapshot, _done
_run(*_args)
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
        # NOTE: stderr goes to a file outside the directory, not a pipe: the parent would buffer all of a solution
        # that prints without end (gigabytes in a second); a file is bounded by RLIMIT_FSIZE (SIGXFSZ past it).
        nonce = secrets.token_hex(16).encode()
        with tempfile.TemporaryFile() as err, tempfile.TemporaryFile() as out:
            proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", RUNNER, root], cwd=root,
                                    env={"PATH": "/usr/bin:/bin"}, stdin=subprocess.PIPE, stdout=out, stderr=err,
                                    preexec_fn=_limits(time_limit, memory_mb, file_mb))
            proc.stdin.write(nonce)
            proc.stdin.close()
            try:
                proc.wait(timeout=time_limit + 1.0)
                timed_out = False
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)  # the whole session: nothing it started survives
                proc.wait()
                timed_out = True
            err.seek(max(0, err.seek(0, os.SEEK_END) - 2000))
            stderr = err.read().decode(errors="replace")
            out.seek(max(0, out.seek(0, os.SEEK_END) - len(nonce)))
            signed = out.read() == nonce
        if timed_out:
            return SandboxResult(False, "timeout", None, stderr, time.perf_counter() - t0)
        rc = proc.returncode
        if rc == 0 and signed:
            status = "passed"
        elif rc == 0:  # exited 0 without the runner's nonce: the solution ended the process before the tests
            status = "failed"
        elif rc == 1:
            status = "failed"
        elif rc == 3:
            status = "memory"
        elif rc == 4:
            status = "blocked"
        elif rc in (-9, -24):  # SIGKILL / SIGXCPU: the CPU limit
            status = "timeout"
        elif rc == -25:  # SIGXFSZ: a file (or its stderr) past the file-size limit
            status = "blocked"
        else:
            status = "error"  # e.g. killed by the address-space limit inside the interpreter
        return SandboxResult(status == "passed", status, rc, stderr, time.perf_counter() - t0)
    finally:
        shutil.rmtree(root, ignore_errors=True)
