"""The HumanEval sandbox contains what a generated program does (files, devices, sockets, processes, memory,
network) and passes it only if its source ran to the end."""
from __future__ import annotations

import json
import os
import socket
import time
import uuid

import pytest

from selfspec.cli import main
from selfspec.eval import sandbox
from selfspec.eval.sandbox import SandboxUnavailable, namespace_problem, run_python
from test_eval_end_to_end import setup  # noqa: F401  (fixture: a tiny model and HumanEval-style items)

NEEDS_NAMESPACES = pytest.mark.skipif(namespace_problem() is not None,
                                      reason=f"no sandbox on this machine: {namespace_problem()}")


@pytest.fixture(params=["namespaces", "unsafe"])
def unsafe(request, monkeypatch) -> bool:
    """Each behaviour both modes share, in the sandbox and in the unconfined fallback (forced here)."""
    if request.param == "namespaces":
        if namespace_problem() is not None:
            pytest.skip(f"no sandbox on this machine: {namespace_problem()}")
        return False
    monkeypatch.setattr(sandbox, "namespace_problem", lambda: "forced by the test")
    return True


def test_passing_and_failing_programs(unsafe):
    assert run_python("assert 1 + 1 == 2\nprint('ok')", unsafe=unsafe).passed
    failed = run_python("assert 1 + 1 == 3", unsafe=unsafe)
    assert failed.status == "failed" and "AssertionError" in failed.output and "assert 1 + 1 == 3" in failed.output


@pytest.mark.parametrize("exit_call", ["import sys\nsys.exit(0)", "import os\nos._exit(0)", "raise SystemExit",
                                       "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)"])
def test_exiting_before_the_end_is_not_a_pass(unsafe, exit_call):
    result = run_python(f"def check():\n    assert False\n{exit_call}\ncheck()\n", unsafe=unsafe)
    assert result.status == "failed", result


def test_a_pass_cannot_be_printed(unsafe):
    # The token reaches the host through its own pipe, never stdout: printing anything and exiting 0 fails.
    result = run_python("import os\nos.write(1, b'passed\\n')\nos._exit(0)\n", unsafe=unsafe)
    assert result.status == "failed" and result.returncode == 0


def test_a_forked_child_reaching_the_end_is_not_a_pass(unsafe):
    result = run_python("import os, time\nif os.fork():\n    time.sleep(0.5)\n    assert False", unsafe=unsafe)
    assert result.status == "failed" and "AssertionError" in result.output


def test_threads_left_running_after_the_end_do_not_block_a_pass(unsafe):
    result = run_python("import threading, time\nthreading.Thread(target=time.sleep, args=(60,)).start()",
                        timeout_s=5, unsafe=unsafe)
    assert result.passed


def test_infinite_loop_is_killed(unsafe):
    t0 = time.monotonic()
    result = run_python("while True:\n    pass", timeout_s=1.5, unsafe=unsafe)
    assert result.status == "timeout"
    assert time.monotonic() - t0 < 10


def test_memory_is_limited(unsafe):
    result = run_python("x = bytearray(2 << 30)", memory_mb=512, unsafe=unsafe)
    assert result.status == "failed" and "MemoryError" in result.output


def test_a_small_process_pool_fits_the_default_limits(unsafe):
    program = ("import multiprocessing\nif __name__ == '__main__':\n    with multiprocessing.Pool(2) as pool:\n"
               "        assert pool.map(abs, [-1, 2]) == [1, 2]")
    assert run_python(program, unsafe=unsafe).passed


def test_printing_is_capped_by_the_file_size_limit(unsafe):
    result = run_python("while True:\n    print('x' * 4096)", file_mb=1, timeout_s=5, unsafe=unsafe)
    assert result.status == "failed"


def test_without_namespaces_it_refuses_unless_unsafe(monkeypatch):
    monkeypatch.setattr(sandbox, "namespace_problem", lambda: "unshare: Operation not permitted")
    with pytest.raises(SandboxUnavailable, match="--unsafe-sandbox") as e:
        run_python("print('hi')")
    assert "unshare: Operation not permitted" in str(e.value) and "namespaces" in str(e.value)
    result = run_python("import os\nprint(os.getcwd())", unsafe=True)
    assert result.passed and os.path.basename(result.output.strip()).startswith("selfspec-sandbox-")
    assert not os.path.exists(result.output.strip())  # the unconfined run's directory is deleted


@NEEDS_NAMESPACES
def test_a_setup_failure_is_reported_with_its_cause(monkeypatch):
    monkeypatch.setattr(sandbox, "python_dirs", lambda: ["/nonexistent-python-prefix"])
    problem = namespace_problem.__wrapped__()  # uncached
    assert "No such file or directory" in problem and "/nonexistent-python-prefix" in problem, problem


@NEEDS_NAMESPACES
def test_runs_as_an_unprivileged_uid_without_capabilities():
    program = ("import os\nstatus = dict(l.split(':', 1) for l in open('/proc/self/status'))\n"
               "print(os.getuid(), os.getgid(), status['CapEff'].strip(), status['CapBnd'].strip(), "
               "status['NoNewPrivs'].strip(), open('/proc/self/uid_map').read().split())")
    result = run_python(program)
    assert result.passed, result.output
    uid, gid, eff, bnd, nnp, uid_map = result.output.split(" ", 5)
    assert (uid, gid, eff, bnd, nnp) == ("1000", "1000", "0000000000000000", "0000000000000000", "1")
    inside, host, count = eval(uid_map)
    assert inside == "1000" and count == "1" and int(host) != 0  # never the host's root


@NEEDS_NAMESPACES
def test_no_nested_user_namespace_to_regain_capabilities():
    program = ("import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
               "print(libc.unshare(0x10000000), os.strerror(ctypes.get_errno()))  # CLONE_NEWUSER")
    result = run_python(program)
    assert result.passed and result.output.split()[0] == "-1", result.output


@NEEDS_NAMESPACES
def test_no_host_files_only_system_directories_read_only(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("host secret")
    program = (f"import os, sys\nprint(sorted(os.listdir('/')))\nprint(sorted(os.listdir('/dev')))\n"
               f"for path in [{str(secret)!r}, '/etc/passwd', '/etc/hostname', {os.getcwd()!r}]:\n"
               f"    assert not os.path.exists(path), path\n"
               f"for path in ['/usr/x', sys.prefix + '/x']:\n"
               f"    try:\n        open(path, 'w')\n    except OSError as e:\n        print(e.strerror)\n")
    result = run_python(program)
    assert result.passed, result.output
    root, dev, *errors = result.output.splitlines()
    assert set(eval(root)) <= {"bin", "dev", "lib", "lib32", "lib64", "libx32", "proc", "root", "run", "sbin",
                               "tmp", "usr", os.path.normpath(sandbox.python_dirs()[0]).split("/")[1]}
    assert eval(dev) == ["fd", "null", "shm", "stderr", "stdin", "stdout", "urandom", "zero"]
    assert errors == ["Read-only file system"] * 2


@NEEDS_NAMESPACES
def test_writes_never_reach_the_host(tmp_path):
    name = f"selfspec-escape-{uuid.uuid4().hex}"
    targets = [f"/dev/{name}", f"/dev/shm/{name}", f"/tmp/{name}", f"/run/{name}", str(tmp_path / name), name]
    program = "\n".join(f"try:\n    open({t!r}, 'w').write('x')\nexcept OSError:\n    pass" for t in targets)
    result = run_python(program + "\nimport os\nprint(os.getcwd(), os.path.exists('/tmp/' + " + repr(name) + "))")
    assert result.passed and result.output.split() == ["/tmp", "True"]  # wrote into its own /tmp ...
    for t in targets[:-1] + [os.path.join(os.getcwd(), name)]:
        assert not os.path.exists(t), t  # ... and into nothing of the host's


@NEEDS_NAMESPACES
def test_host_unix_sockets_are_unreachable(tmp_path):
    path = str(tmp_path / "host.sock")
    abstract = f"\0selfspec-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX) as server, socket.socket(socket.AF_UNIX) as abstract_server:
        server.bind(path)
        abstract_server.bind(abstract)
        server.listen()
        abstract_server.listen()
        program = (f"import socket\nfor address in [{path!r}, {abstract!r}]:\n"
                   f"    try:\n        socket.socket(socket.AF_UNIX).connect(address)\n        print('reached')\n"
                   f"    except OSError as e:\n        print(type(e).__name__)\n")
        result = run_python(program)
    assert result.passed and result.output.split() == ["FileNotFoundError", "ConnectionRefusedError"]


@NEEDS_NAMESPACES
def test_network_connect_fails_even_to_a_listening_local_server():
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        result = run_python(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)")
    assert result.status == "failed" and "Network is unreachable" in result.output


@NEEDS_NAMESPACES
def test_host_processes_are_invisible():
    program = ("import os\nfor pid in sorted(int(p) for p in os.listdir('/proc') if p.isdigit()):\n"
               "    print(pid, open(f'/proc/{pid}/cmdline', 'rb').read().split(b'\\0')[0].decode())")
    result = run_python(program)
    assert result.passed
    pids = [line.split()[0] for line in result.output.splitlines()]
    assert pids == ["1", "2"] and str(os.getpid()) not in pids  # its init and itself


@NEEDS_NAMESPACES
def test_it_cannot_signal_its_parent_or_the_host():
    program = (f"import os, signal\nos.kill(1, signal.SIGKILL)  # its init ignores it\n"
               f"try:\n    os.kill({os.getpid()}, signal.SIGKILL)\nexcept ProcessLookupError:\n    print('no such')")
    result = run_python(program)
    assert result.passed and result.output.strip() == "no such"


@NEEDS_NAMESPACES
def test_processes_left_behind_die_with_the_sandbox():
    marker = f"{time.time_ns() % 10**9}.5"  # a unique `sleep` argument to look for on the host
    program = (f"import os\nif os.fork() == 0:\n    os.setsid()\n    for fd in range(3):\n        os.close(fd)\n"
               f"    os.execv('/usr/bin/sleep', ['sleep', {marker!r}])\nimport time\ntime.sleep(0.3)")
    assert run_python(program).passed

    def cmdline(pid: str) -> bytes:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                return f.read()
        except OSError:  # gone meanwhile
            return b""

    assert not [p for p in os.listdir("/proc") if p.isdigit() and marker.encode() in cmdline(p)]


@NEEDS_NAMESPACES
def test_process_count_is_bounded_even_as_root():
    program = ("import os, time\nforked = 0\ntry:\n    for _ in range(300):\n        if os.fork() == 0:\n"
               "            time.sleep(30)\n            os._exit(0)\n        forked += 1\n"
               "except BlockingIOError:\n    pass\nprint(forked)")
    t0 = time.monotonic()
    result = run_python(program, processes=4, timeout_s=5)
    assert result.passed and int(result.output) == 3, result.output  # the program itself + 3 children
    assert time.monotonic() - t0 < 5  # the children died with the sandbox, without waiting out their sleep


@NEEDS_NAMESPACES
def test_memory_is_bounded_in_total_across_processes():
    program = ("import os\nfor _ in range(3):\n    if os.fork() == 0:\n        break\n"
               "got = 0\ntry:\n    while True:\n"
               "        globals().setdefault('chunks', []).append(bytearray(16 << 20))\n"
               "        got += 16\nexcept MemoryError:\n    pass\nprint(got, flush=True)\n"
               "if os.getpid() == 2:\n    while True:\n        try:\n            os.wait()\n"
               "        except ChildProcessError:\n            break\n")
    result = run_python(program, memory_mb=1024, processes=4)
    assert result.passed, result.output
    got = [int(x) for x in result.output.split()]
    assert len(got) == 4 and 0 < sum(got) <= 1024, got


@pytest.mark.usefixtures("one_thread")
def test_eval_stops_before_generating_unless_unsafe_sandbox(setup, tmp_path, capsys, monkeypatch):  # noqa: F811
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(sandbox, "namespace_problem", lambda: "forced by the test")
    argv = ["eval", "--model", str(setup / "model"), "--tasks", "humaneval", "--modes", "w4a4", "--recipes", "",
            "--limit", "2", "--max-new-tokens", "4", "--out", str(tmp_path / "out"),
            "--data", f"humaneval={setup / 'humaneval.jsonl'}"]
    assert main(argv) == 2
    assert "--unsafe-sandbox" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # refused before loading the model
    assert main(argv + ["--unsafe-sandbox"]) == 0
    records = [json.loads(line) for line in (tmp_path / "out" / "w4a4" / "humaneval.jsonl").read_text().splitlines()]
    assert len(records) == 2 and all(r["answer"] in ("passed", "failed") and not r["error"] for r in records)
