"""The HumanEval sandbox contains what a generated program does: loops, writes, network, memory."""
from __future__ import annotations

import os
import socket
import time
import uuid

import pytest

from selfspec.eval.sandbox import namespaces_available, run_python

ISOLATION = [pytest.param(False, id="prelude")]
ISOLATION += [pytest.param(True, id="namespaces")] if namespaces_available() else []


@pytest.mark.parametrize("isolate", ISOLATION)
def test_passing_and_failing_programs(isolate):
    assert run_python("assert 1 + 1 == 2\nprint('ok')", isolate=isolate).passed
    failed = run_python("assert 1 + 1 == 3", isolate=isolate)
    assert failed.status == "failed" and "AssertionError" in failed.output


@pytest.mark.parametrize("isolate", ISOLATION)
def test_infinite_loop_is_killed(isolate):
    t0 = time.monotonic()
    result = run_python("while True:\n    pass", timeout_s=1.5, isolate=isolate)
    assert result.status == "timeout"
    assert time.monotonic() - t0 < 10


@pytest.mark.parametrize("isolate", ISOLATION)
def test_relative_writes_land_in_a_temp_dir_that_is_deleted(isolate):
    result = run_python("import os\nopen('out.txt', 'w').write('x')\nprint(os.getcwd())", isolate=isolate)
    assert result.passed
    workdir = result.output.strip()
    assert os.path.basename(workdir).startswith("selfspec-sandbox-")
    assert not os.path.exists(workdir)


@pytest.mark.skipif(not namespaces_available(), reason="no namespaces here: the prelude fallback does not stop "
                                                        "absolute-path writes (documented in sandbox.py)")
def test_writes_outside_the_temp_dir_fail(tmp_path):
    targets = [tmp_path / f"escape-{uuid.uuid4().hex}", f"/tmp/selfspec-escape-{uuid.uuid4().hex}",
               f"/dev/shm/selfspec-escape-{uuid.uuid4().hex}"]
    program = "\n".join(f"open({str(t)!r}, 'w').write('x')" for t in targets)
    result = run_python(program, isolate=True)
    assert result.status == "failed" and "Read-only file system" in result.output
    program = "\n".join(f"try:\n    open({str(t)!r}, 'w').write('x')\nexcept OSError:\n    pass" for t in targets)
    assert run_python(program + "\nprint('done')", isolate=True).passed
    for t in targets:
        assert not os.path.exists(t), t


@pytest.mark.parametrize("isolate", ISOLATION)
def test_network_connect_fails_even_to_a_listening_local_server(isolate):
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        assert socket.create_connection(("127.0.0.1", port), timeout=2)  # reachable from outside the sandbox
        result = run_python(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)",
                            isolate=isolate)
    assert result.status == "failed"
    assert "Network is unreachable" in result.output or "network access is disabled" in result.output


@pytest.mark.parametrize("isolate", ISOLATION)
def test_memory_is_limited(isolate):
    result = run_python("x = bytearray(2 << 30)", memory_mb=512, isolate=isolate)
    assert result.status == "failed" and "MemoryError" in result.output
