"""Run untrusted generated Python (HumanEval completions) in a child process, never in the engine's.

Every run: a fresh temporary directory as cwd (deleted afterwards, HOME and TMPDIR point into it),
`python -I`, a wall-clock timeout that kills the whole process group, and rlimits (CPU seconds, address
space, file size, processes).

Where Linux namespaces are available (root, or unprivileged user namespaces), the child also runs under
`unshare --net --mount --pid`: no network interface but a downed loopback, its own PID namespace (every
process it forks dies with it), and a private mount table in which every mount except /dev and the
temporary directory is re-mounted read-only and /dev/shm is a private tmpfs; all capabilities are then
dropped (`setpriv`), so it cannot re-mount anything writable. Writes outside the temporary directory fail.
Without namespaces it falls back to a prelude that replaces `socket.socket` (stops casual network use,
not a determined program) and writes outside the temporary directory are NOT prevented.
"""
from __future__ import annotations

import functools
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass

# Namespaced: the directory stays writable (bind-mounted onto itself), everything else becomes read-only.
NAMESPACE_SETUP = r"""
set -e
D="$PWD"
mount --bind "$D" "$D"
for t in $(findmnt -rn -o TARGET | sort -ru); do
  case "$t" in "$D"|/dev|/dev/pts|/dev/null) ;; *) mount -o remount,bind,ro "$t" 2>/dev/null || true ;; esac
done
mount -t tmpfs -o size=16m tmpfs /dev/shm
cd "$D"
exec setpriv --no-new-privs --inh-caps=-all --bounding-set=-all "$@"
"""

NO_SOCKET_PRELUDE = (
    "import socket, runpy, sys\n"
    "def _refuse(*a, **k): raise OSError('network access is disabled in the selfspec sandbox')\n"
    "socket.socket = socket.create_connection = socket.socketpair = _refuse\n"
    "sys.argv = sys.argv[1:]\n"
    "runpy.run_path(sys.argv[0], run_name='__main__')\n"
)


@dataclass
class SandboxResult:
    status: str  # "passed" (exit 0), "failed" (non-zero exit) or "timeout"
    returncode: int | None
    output: str  # the tail of stdout + stderr

    @property
    def passed(self) -> bool:
        return self.status == "passed"


@functools.cache
def namespaces_available() -> bool:
    """Whether `unshare` can give us network, mount and PID namespaces here (checked once)."""
    if shutil.which("unshare") is None or shutil.which("setpriv") is None:
        return False
    cmd = ["unshare", "--net", "--mount", "--pid", "--fork", "--kill-child", "--propagation", "private"]
    if os.geteuid() != 0:
        cmd.insert(1, "--map-root-user")
    try:
        return subprocess.run(cmd + ["true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _limits(cpu_s: int, memory_mb: int, file_mb: int, processes: int):
    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))
        resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_mb << 20, file_mb << 20))
        # Not enforced for uid 0; there the PID namespace bounds the processes' lifetime instead.
        resource.setrlimit(resource.RLIMIT_NPROC, (processes, processes))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    return apply


def run_python(source: str, timeout_s: float = 10.0, memory_mb: int = 1024, file_mb: int = 16,
               processes: int = 256, isolate: bool | None = None) -> SandboxResult:
    """Run `source` as a Python program in the sandbox; isolate=None uses namespaces where available."""
    isolate = namespaces_available() if isolate is None else isolate
    workdir = tempfile.mkdtemp(prefix="selfspec-sandbox-")
    try:
        with open(os.path.join(workdir, "program.py"), "w") as f:
            f.write(source)
        python = [sys.executable, "-I"]
        if isolate:
            cmd = ["unshare", "--net", "--mount", "--pid", "--fork", "--kill-child", "--propagation", "private"]
            if os.geteuid() != 0:
                cmd.insert(1, "--map-root-user")
            cmd += ["sh", "-c", NAMESPACE_SETUP, "sandbox", *python, "program.py"]
        else:
            cmd = [*python, "-c", NO_SOCKET_PRELUDE, "program.py"]
        env = {"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8"}
        proc = subprocess.Popen(cmd, cwd=workdir, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=_limits(int(timeout_s) + 1, memory_mb, file_mb, processes))
        try:
            out, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            return SandboxResult("timeout", None, _tail(out))
        return SandboxResult("passed" if proc.returncode == 0 else "failed", proc.returncode, _tail(out))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _tail(out: bytes, limit: int = 2000) -> str:
    return out[-limit:].decode("utf-8", "replace")
