"""The sandbox's own side: `python -I sandbox_child.py CONFIG_JSON`, started by sandbox.py (standard library only,
so it imports nothing of the engine). Four processes:

launcher (host namespaces) forks
  creator: unshares user, mount, PID, network, IPC, UTS and cgroup namespaces; the launcher, still outside,
           maps one sandbox uid/gid (1000) to an unprivileged host uid (a random high one when we are root, else
           our own), so per-uid limits (RLIMIT_NPROC) bind and host files are never the sandbox's to override;
  init:    PID 1 of the new PID namespace: builds a fresh root (a size-capped tmpfs with read-only binds of the
           system and Python directories, /dev with null, zero and urandom only, /proc of this PID namespace),
           pivots into it, forks the program and reaps; when it exits the kernel kills everything left inside;
  program: no capabilities, no_new_privs, rlimits, runs HARNESS with the source read from stdin.
Any setup failure exits with SETUP_FAILED after one line on stderr that starts with SETUP_ERROR.
"""
from __future__ import annotations

import ctypes
import json
import os
import platform
import random
import re
import resource
import signal
import socket
import sys

# The program's side: stdin carries a per-run token, a newline and the source. The token is written to the result
# pipe only once the source ran to its end, so exit(0) / os._exit(0) before the tests finish is never a pass.
HARNESS = r"""
import linecache, os, sys, traceback
def main(result_fd):
    harness_pid = os.getpid()
    token, _, source = sys.stdin.buffer.read().partition(b"\n")
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    text = source.decode()
    linecache.cache["program.py"] = (len(text), None, text.splitlines(True), "program.py")
    sys.excepthook = traceback.print_exception  # quotes the source lines, from linecache
    sys.argv = ["program.py"]
    exec(compile(text, "program.py", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    sys.stdout.flush()
    sys.stderr.flush()
    if os.getpid() == harness_pid:  # not a child the program forked that ran on to the end
        os.write(result_fd, token)
    os._exit(0)
main(int(sys.argv[1]))
"""

SETUP_FAILED = 125
SETUP_ERROR = "selfspec sandbox setup failed:"
SANDBOX_ID = 1000  # the uid and gid inside; not 0, so execve grants the program no capabilities
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
DEVICES = ("null", "zero", "urandom")

CLONE_NEWNS, CLONE_NEWCGROUP, CLONE_NEWUTS, CLONE_NEWIPC = 0x20000, 0x2000000, 0x4000000, 0x8000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC, MS_PRIVATE, MS_RELATIME = 1024, 2048, 4096, 16384, 1 << 18, 1 << 21
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS = 1, 4, 24, 38
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "s390x": 217}
# statvfs flag -> mount flag: a read-only remount inside a user namespace must keep these (they are locked)
KEPT_FLAGS = ((os.ST_NOSUID, MS_NOSUID), (os.ST_NODEV, MS_NODEV), (os.ST_NOEXEC, MS_NOEXEC),
              (os.ST_NOATIME, MS_NOATIME), (os.ST_NODIRATIME, MS_NODIRATIME), (os.ST_RELATIME, MS_RELATIME))

libc = ctypes.CDLL(None, use_errno=True)


def check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    check(libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)), f"mount {target}")


def prctl(option: int, value: int) -> None:
    check(libc.prctl(option, ctypes.c_ulong(value), 0, 0, 0), f"prctl {option}")


def exit_code(status: int) -> int:
    code = os.waitstatus_to_exitcode(status)
    return 128 - code if code < 0 else code  # killed by a signal: 128 + its number, as a shell reports it


def launcher(config: dict) -> None:
    """Fork the creator, write its uid/gid maps once it has unshared, and exit with its exit code."""
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    config["as_root"] = os.getuid() == 0
    if config["as_root"]:
        os.setgroups([])  # carry no supplementary group into the sandbox
        host_uid = host_gid = random.SystemRandom().randrange(1 << 30, 1 << 31)  # owns nothing on the host
    else:
        host_uid, host_gid = os.getuid(), os.getgid()
    unshared_r, unshared_w = os.pipe()
    mapped_r, mapped_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(unshared_r)
        os.close(mapped_w)
        creator(config, unshared_w, mapped_r)
    os.close(unshared_w)
    os.close(mapped_r)
    if os.read(unshared_r, 1) == b"1":
        try:
            for name, line in (("setgroups", "deny"), ("uid_map", f"{SANDBOX_ID} {host_uid} 1"),
                               ("gid_map", f"{SANDBOX_ID} {host_gid} 1")):
                with open(f"/proc/{pid}/{name}", "w") as f:
                    f.write(line)
        except OSError as e:
            fail(f"writing the uid/gid map: {e}")
        os.write(mapped_w, b"1")
    os._exit(exit_code(os.waitpid(pid, 0)[1]))


def creator(config: dict, unshared_w: int, mapped_r: int) -> None:
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    flags = CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS | CLONE_NEWCGROUP
    try:
        check(libc.unshare(flags), "unshare")
    except OSError as e:
        fail(str(e))
    os.write(unshared_w, b"1")
    if os.read(mapped_r, 1) != b"1":
        os._exit(SETUP_FAILED)  # the launcher said why
    pid = os.fork()
    if pid == 0:
        init(config)
    os._exit(exit_code(os.waitpid(pid, 0)[1]))


def init(config: dict) -> None:
    try:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        sources = open_root_sources(config["python_dirs"])
        os.setresgid(SANDBOX_ID, SANDBOX_ID, SANDBOX_ID)
        os.setresuid(SANDBOX_ID, SANDBOX_ID, SANDBOX_ID)  # keeps our capabilities in the new namespace
        socket.sethostname("sandbox")
        with open("/proc/sys/user/max_user_namespaces", "w") as f:
            f.write("0")  # no nested user namespace: the program can never hold a capability again
        build_root(config, sources)
        prctl(PR_SET_DUMPABLE, 0)  # the program (same uid) may not ptrace or read the memory of its init
    except OSError as e:
        fail(str(e))
    program_pid = os.fork()
    if program_pid == 0:
        program(config)
    while True:  # as PID 1, reap every orphan until the program itself ends
        pid, status = os.wait()
        if pid == program_pid:
            os._exit(exit_code(status))


def open_root_sources(python_dirs: list[str]) -> list[tuple[str, str | int]]:
    """(path in the sandbox, symlink target or an O_PATH descriptor of the directory to bind there), opened while
    we still have the launcher's uid: the sandbox uid may not traverse the way to them (e.g. /root is 0700)."""
    sources: list[tuple[str, str | int]] = []
    for path in SYSTEM_DIRS:
        if os.path.islink(path):
            sources.append((path, os.readlink(path)))
        elif os.path.isdir(path):
            sources.append((path, os.open(path, os.O_PATH | os.O_DIRECTORY)))
    for path in python_dirs:
        if not any(path == d or path.startswith(d + "/") for d in SYSTEM_DIRS):
            sources.append((path, os.open(path, os.O_PATH | os.O_DIRECTORY)))
    return sources


def build_root(config: dict, sources: list[tuple[str, str | int]]) -> None:
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    root = "/tmp"  # only the mount point: the new root is a fresh tmpfs over it, never the host's /tmp
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, f"size={config['file_mb']}m,mode=755")
    for path, source in sources:
        if isinstance(source, str):
            os.symlink(source, root + path)
        else:
            bind_readonly(f"/proc/self/fd/{source}", root + path)
            os.close(source)
    os.makedirs(root + "/dev", exist_ok=True)  # exist_ok: a bound source may lie below (a venv under /tmp, say)
    for name in DEVICES:
        open(f"{root}/dev/{name}", "w").close()
        mount(f"/dev/{name}", f"{root}/dev/{name}", None, MS_BIND)
    for i, name in enumerate(("stdin", "stdout", "stderr")):
        os.symlink(f"/proc/self/fd/{i}", f"{root}/dev/{name}")
    os.symlink("/proc/self/fd", f"{root}/dev/fd")
    for path in ("/dev/shm", "/tmp", "/run"):
        os.makedirs(root + path, exist_ok=True)
        os.chmod(root + path, 0o1777)
    os.makedirs(root + "/proc")
    mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)  # of our PID namespace only
    os.chdir(root)
    machine = platform.machine()
    if machine not in SYS_PIVOT_ROOT:
        raise OSError(f"pivot_root: no syscall number known for {machine}")
    check(libc.syscall(SYS_PIVOT_ROOT[machine], b".", b"."), "pivot_root")
    check(libc.umount2(b".", MNT_DETACH), "umount old root")  # the host's tree is now unreachable
    os.chdir("/tmp")


def bind_readonly(source: str, target: str) -> None:
    """Bind `source` (and the mounts under it) at `target`, every one of them read-only."""
    os.makedirs(target, exist_ok=True)
    mount(source, target, None, MS_BIND | MS_REC)
    for mount_point in mounts_under(target):
        kept = os.statvfs(mount_point).f_flag
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY | sum(m for st, m in KEPT_FLAGS if kept & st)
        mount(None, mount_point, None, flags)


def mounts_under(path: str) -> list[str]:
    with open("/proc/self/mountinfo") as f:
        points = [re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), line.split()[4]) for line in f]  # \040: " "
    return [p for p in points if p == path or p.startswith(path + "/")]


def program(config: dict) -> None:
    try:
        prctl(PR_SET_NO_NEW_PRIVS, 1)
        for cap in range(64):  # empty the bounding set (stops at the first capability this kernel lacks)
            if libc.prctl(PR_CAPBSET_DROP, ctypes.c_ulong(cap), 0, 0, 0) != 0:
                break
        set_limits(config)
    except OSError as e:
        fail(str(e))
    python = config["python"]
    os.execve(python, [python, "-I", "-c", HARNESS, str(config["result_fd"])], config["env"])


def set_limits(config: dict) -> None:
    """Per process: CPU seconds, address space (memory_mb / processes, so all of them together stay within
    memory_mb), file size; per sandbox uid: tasks, the program's processes and threads plus those of ours that
    count (init; and the creator when it kept our uid, i.e. unless we are root)."""
    per_process = (config["memory_mb"] // config["processes"]) << 20
    ours = 1 if config["as_root"] else 2
    for limit, value in ((resource.RLIMIT_CPU, config["cpu_s"]), (resource.RLIMIT_AS, per_process),
                         (resource.RLIMIT_FSIZE, config["file_mb"] << 20), (resource.RLIMIT_CORE, 0),
                         (resource.RLIMIT_NPROC, config["processes"] + ours)):
        resource.setrlimit(limit, (value, value))


def fail(message: str) -> None:
    print(SETUP_ERROR, message, file=sys.stderr, flush=True)
    os._exit(SETUP_FAILED)


if __name__ == "__main__":
    launcher(json.loads(sys.argv[1]))
