"""The demo (SPEC §7) run as a user runs it: ``python -m redis_locks_async demo`` in a subprocess.

Output goes to a pipe, so the demo prints plain progress lines instead of the live view; the
tests read its summary. ``$REDIS_SERVER_BIN`` passes through unchanged, so ``make test`` runs the
embedded-server case once per server binary.
"""

from __future__ import annotations

import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from redis_locks_async.cli._demo import _analyse, _Hold
from tests.servers import ServerProcess, free_port

# What this checks does not depend on the server: `make test` runs it in its first pass only.
pytestmark = pytest.mark.once

ROOT = Path(__file__).resolve().parent.parent
DEMO_TIMEOUT = 45.0


def _demo_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def _run_demo(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "redis_locks_async", "demo", *args],
        cwd=ROOT,
        env=_demo_env(),
        capture_output=True,
        text=True,
        timeout=DEMO_TIMEOUT,
        check=False,
    )


def _assert_clean_pass(result: subprocess.CompletedProcess[str]) -> None:
    report = f"exit {result.returncode}\n--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}"
    assert result.returncode == 0, report
    assert re.search(r"^exclusion verified\s+yes\b", result.stdout, re.MULTILINE), report
    assert re.search(r"^fencing tokens\s+monotonic: yes\b", result.stdout, re.MULTILINE), report
    assert re.search(r"^handoff latency\s+median [\d.]+ ms", result.stdout, re.MULTILINE), report
    assert "verdict: OK" in result.stdout, report
    holds = re.search(r"^total acquisitions\s+(\d+)", result.stdout, re.MULTILINE)
    assert holds is not None and int(holds[1]) > 0, report


def _port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1].split("/")[0])


def _listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


@pytest.mark.slow
def test_demo_on_embedded_server_verifies_exclusion() -> None:
    result = _run_demo("--seconds", "3", "--workers", "3")
    _assert_clean_pass(result)
    url = re.search(r"^server: .* at (redis://\S+) \(started for this demo\)", result.stdout, re.M)
    assert url is not None, result.stdout
    assert not _listening(_port_of(url[1])), "the embedded server outlived the demo"


@pytest.mark.slow
def test_demo_with_url_uses_that_server_and_cleans_up(server: ServerProcess) -> None:
    result = _run_demo("--seconds", "2", "--workers", "2", "--tasks", "2", "--url", server.url)
    _assert_clean_pass(result)
    assert f"at {server.url} (given)" in result.stdout
    leftovers = subprocess.run(
        [sys.executable, "-c", _SCAN_DEMO_KEYS, server.url],
        capture_output=True,
        text=True,
        timeout=10,
        check=True,
    ).stdout.split()
    assert leftovers == [], f"demo keys left on the server: {leftovers}"


@pytest.mark.slow
def test_demo_never_prints_the_password_of_its_url(server: ServerProcess) -> None:
    """Bug (helper-76): the demo printed ``--url``/``$REDIS_URL`` as given — its title
    ("server: … at redis://:secret@…") and its errors ("cannot reach …?password=secret") —
    where every other command masks the password (README, *Permissions*)."""
    import redis

    secret = "pw-" + secrets.token_hex(8)
    admin = redis.Redis.from_url(server.url)
    admin.acl_setuser("rla-demo-user", enabled=True, passwords=[f"+{secret}"],
                      keys=["*"], channels=["*"], commands=["+@all"])  # fmt: skip
    try:
        url = server.url.replace("redis://", f"redis://rla-demo-user:{secret}@")
        result = _run_demo("--seconds", "2", "--workers", "2", "--tasks", "2", "--url", url)
        _assert_clean_pass(result)
        assert secret not in result.stdout + result.stderr
        assert "rla-demo-user:***@" in result.stdout
    finally:
        admin.acl_deluser("rla-demo-user")
        admin.close()
    for unreachable in (f"redis://:{secret}@127.0.0.1:{free_port()}",
                        f"redis://127.0.0.1:{free_port()}?password={secret}"):  # fmt: skip
        failed = _run_demo("--seconds", "1", "--url", unreachable)
        assert failed.returncode == 2, failed
        assert "cannot reach" in failed.stderr and secret not in failed.stderr, failed.stderr


_SCAN_DEMO_KEYS = """
import sys, redis
client = redis.Redis.from_url(sys.argv[1])
for pattern in ("rla-demo:*", "{rla-demo:*"):
    for key in client.scan_iter(match=pattern):
        print(key.decode())
"""


@pytest.mark.slow
def test_demo_stops_everything_on_ctrl_c() -> None:
    """SIGINT to the demo's process group (what a terminal's Ctrl-C does) stops it quickly."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "redis_locks_async", "demo", "--seconds", "30", "--workers", "2"],
        cwd=ROOT,
        env=_demo_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        # A terminal's foreground job has Ctrl-C's default disposition. A test run started in
        # the background of a non-interactive shell (``nohup sh -c 'make test' &``) inherits
        # SIGINT *ignored*, and Python then keeps ignoring it, as it should: the demo was
        # never told to stop, and this test hung for 15 s.
        preexec_fn=_ctrl_c_enabled,
    )
    try:
        assert proc.stdout is not None
        header = ""
        deadline = time.monotonic() + DEMO_TIMEOUT
        while "acquisitions" not in header and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            header += line
        url = re.search(r"at (redis://\S+) \(started for this demo\)", header)
        assert url is not None, header
        os.killpg(proc.pid, signal.SIGINT)
        try:
            output, _ = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            # Say where it hung (its own report of each stage), then clean up.
            os.killpg(proc.pid, signal.SIGKILL)
            rest, _ = proc.communicate()
            pytest.fail(f"the demo did not stop within 15 s of Ctrl-C; it printed:\n{header}{rest}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()  # a failure here must not leak the pipe into the next test
    assert proc.returncode == 130, header + output
    assert "verdict: interrupted" in output, header + output
    assert not _listening(_port_of(url[1])), "the embedded server outlived the demo"
    assert _group_gone(proc.pid, within=5.0), "a worker process outlived the demo"


def _ctrl_c_enabled() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _group_gone(pgid: int, within: float) -> bool:
    """Whether no process is left in process group ``pgid`` (multiprocessing's resource
    tracker may take a moment to notice its parent exited)."""
    deadline = time.monotonic() + within
    while True:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


# The checker must not be vacuous: it is fed holds that break the rules.

MS = 1_000_000


def _hold(token: int, acquired: int, released: int, waited_from: int, worker: str) -> _Hold:
    return _Hold(token, acquired * MS, released * MS, waited_from * MS, worker)


def test_analysis_accepts_disjoint_holds_and_measures_handoffs() -> None:
    holds = [
        _hold(1, 0, 10, 0, "w0"),
        _hold(2, 11, 20, 5, "w1"),  # waiting since 5 ms, released at 10: handoff of 1 ms
        _hold(3, 23, 30, 21, "w1"),  # same process: not a cross-process handoff
        _hold(5, 40, 50, 39, "w0"),  # token 4 went to a waiter that gave up: no pair
        _hold(6, 53, 60, 55, "w1"),  # started waiting after the release: no handoff
    ]
    found = _analyse({"hot": holds}, {})
    assert found.holds == 5
    assert found.exclusion_violations == 0
    assert found.fencing_violations == 0
    assert found.handoffs_ms == [1.0]


def test_analysis_counts_overlaps_and_tokens_out_of_order() -> None:
    holds = [
        _hold(1, 0, 10, 0, "w0"),
        _hold(2, 5, 15, 0, "w1"),  # entered while token 1 was inside
        _hold(4, 20, 30, 16, "w0"),
        _hold(3, 31, 40, 16, "w1"),  # later in time, lower token
    ]
    found = _analyse({"hot": holds}, {"exclusion": 2, "fencing": 1})
    assert found.overlaps == 1
    assert found.exclusion_violations == 3
    assert found.token_disorder == 1
    assert found.fencing_violations == 2
