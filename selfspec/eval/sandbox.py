"""Run untrusted generated Python (HumanEval completions) in a sandbox, never in the engine's process.

A program passes only if its source ran to the end: the harness writes a random per-run token to a pipe after
the last statement returns, so `sys.exit(0)` or `os._exit(0)` before the tests finish fails, as in the reference
harness. (A program that digs the token out of its harness's frame could forge a pass; the token stops accidents,
the namespaces contain what the code does.)

The sandbox (sandbox_child.py builds it) runs the program in its own user, mount, PID, network, IPC, UTS and cgroup
namespaces as uid 1000 mapped to an unprivileged host uid, with no capabilities and no_new_privs. Its root is a
private tmpfs of `file_mb` MiB holding /tmp (the working directory, HOME and TMPDIR), /run and /dev/shm, a /dev
with only null, zero and urandom, its own /proc, and read-only binds of /usr, /bin, /lib... and the Python
installation; no other host file, no host process, no network interface but a downed loopback (so no host UNIX
socket, abstract or not). Limits: a wall-clock timeout (the whole namespace dies with its init), CPU seconds,
`processes` tasks (processes and threads: RLIMIT_NPROC binds because the host uid is not root), `memory_mb` of
address space in all (memory_mb / processes per process), `file_mb` per file and for all files together.

Where the kernel refuses namespaces, running the code is refused too, unless the caller passes unsafe=True
(`selfspec eval --unsafe-sandbox`): then it runs unconfined in a temporary directory with rlimits only.
"""
from __future__ import annotations

import functools
import json
import os
import resource
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass

from selfspec.errors import SelfspecError
from selfspec.eval.sandbox_child import HARNESS, SETUP_ERROR

CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_child.py")
ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
       "MKL_NUM_THREADS": "1"}
MIN_PROCESS_MB = 64  # the least address space a Python process starts in


class SandboxUnavailable(SelfspecError):
    pass


@dataclass
class SandboxResult:
    status: str  # "passed" (ran to its end), "failed" (an exception, an exit, a signal) or "timeout"
    returncode: int | None
    output: str  # the tail of stdout + stderr

    @property
    def passed(self) -> bool:
        return self.status == "passed"


@functools.cache
def namespace_problem() -> str | None:
    """None where the sandbox can be built here, else why not (checked once, by running an empty program)."""
    try:
        result = _run("pass", 10.0, 256, 4, 4, confined=True)
    except OSError as e:
        return str(e)
    if result.passed:
        return None
    lines = [line for line in result.output.splitlines() if line.startswith(SETUP_ERROR)]
    return lines[-1][len(SETUP_ERROR):].strip() if lines else f"{result.status}: {result.output.strip()[-300:]}"


def check_sandbox(unsafe: bool = False) -> None:
    """Raise a SandboxUnavailable that says what to do if generated code cannot be sandboxed here."""
    problem = namespace_problem()
    if problem is not None and not unsafe:
        raise SandboxUnavailable(
            f"cannot sandbox generated code on this machine ({problem}). The sandbox needs Linux user, mount, "
            "PID and network namespaces: run as root, or allow unprivileged user namespaces (sysctl "
            "user.max_user_namespaces > 0; on Debian kernel.unprivileged_userns_clone=1, on Ubuntu "
            "kernel.apparmor_restrict_unprivileged_userns=0). Or pass --unsafe-sandbox to run it without them: "
            "the generated code could then read and write your files, use the network and signal your processes.")


def run_python(source: str, timeout_s: float = 10.0, memory_mb: int = 2048, file_mb: int = 16,
               processes: int = 8, unsafe: bool = False) -> SandboxResult:
    """Run `source` as a Python program in the sandbox; unsafe=True allows running it unconfined where
    namespaces are unavailable (never where they are)."""
    if memory_mb // processes < MIN_PROCESS_MB:
        raise ValueError(f"memory_mb={memory_mb} over processes={processes} leaves under {MIN_PROCESS_MB} MiB "
                         "per process: raise memory_mb or lower processes")
    check_sandbox(unsafe)
    return _run(source, timeout_s, memory_mb, file_mb, processes, confined=namespace_problem() is None)


def _run(source: str, timeout_s: float, memory_mb: int, file_mb: int, processes: int,
         confined: bool) -> SandboxResult:
    token = secrets.token_hex(16).encode()
    result_r, result_w = os.pipe()
    workdir = None if confined else tempfile.mkdtemp(prefix="selfspec-sandbox-")
    limits = {"cpu_s": int(timeout_s) + 1, "memory_mb": memory_mb, "file_mb": file_mb, "processes": processes}
    try:
        with tempfile.TemporaryFile() as out:  # a file, not a pipe: RLIMIT_FSIZE caps what the program prints
            if confined:
                config = {**limits, "python": sys.executable, "env": {**ENV, "HOME": "/tmp", "TMPDIR": "/tmp"},
                          "python_dirs": python_dirs(), "result_fd": result_w}
                proc = subprocess.Popen([sys.executable, "-I", CHILD, json.dumps(config)], cwd="/", env=ENV,
                                        stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT,
                                        pass_fds=(result_w,), start_new_session=True)
            else:
                proc = subprocess.Popen([sys.executable, "-I", "-c", HARNESS, str(result_w)], cwd=workdir,
                                        env={**ENV, "HOME": workdir, "TMPDIR": workdir}, stdin=subprocess.PIPE,
                                        stdout=out, stderr=subprocess.STDOUT, pass_fds=(result_w,),
                                        start_new_session=True, preexec_fn=functools.partial(rlimits, **limits))
            os.close(result_w)
            result_w = -1
            timed_out = False
            try:
                proc.communicate(token + b"\n" + source.encode(), timeout=timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
                os.killpg(proc.pid, signal.SIGKILL)  # confined: the PID namespace dies with its init
                proc.wait()
            os.set_blocking(result_r, False)
            try:
                reported = os.read(result_r, len(token) + 1)
            except BlockingIOError:  # unconfined: a child it left behind holds the pipe open
                reported = b""
            status = "passed" if reported == token else "timeout" if timed_out else "failed"
            return SandboxResult(status, None if timed_out else proc.returncode, tail(out))
    finally:
        os.close(result_r)
        if result_w != -1:
            os.close(result_w)
        if workdir:
            shutil.rmtree(workdir, ignore_errors=True)


def python_dirs() -> list[str]:
    """The Python installation (and virtual environment) the program runs under, as the paths it knows them by."""
    return sorted({sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix})


def rlimits(cpu_s: int, memory_mb: int, file_mb: int, processes: int) -> None:
    """Unconfined only: per-process limits; RLIMIT_NPROC counts all of the user's processes (none for root)."""
    for limit, value in ((resource.RLIMIT_CPU, cpu_s), (resource.RLIMIT_AS, (memory_mb // processes) << 20),
                         (resource.RLIMIT_FSIZE, file_mb << 20), (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(limit, (value, value))


def tail(out, limit: int = 2000) -> str:
    out.seek(max(0, out.seek(0, os.SEEK_END) - limit))
    return out.read().decode("utf-8", "replace")
