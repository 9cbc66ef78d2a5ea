"""The study's cluster helper leaves no process of its session behind (asyncgrpo/study/cluster.py):
what exits on its own is waited for, what is still there after the timeout is killed."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from asyncgrpo.study.cluster import _reap_session, session_processes

# A session leader that starts a grandchild (ignoring SIGTERM; after `lasts` s it writes `marker` and
# ends), prints the grandchild's pid and exits.
LEADER = """
import subprocess, sys
child = subprocess.Popen([sys.executable, "-c", "import signal, sys, time; signal.signal(signal.SIGTERM, "
    "signal.SIG_IGN); time.sleep(float(sys.argv[1])); open(sys.argv[2], 'w').close()", sys.argv[1], sys.argv[2]])
print(child.pid, flush=True)
"""


def start_session(lasts_s: float, marker: Path) -> tuple[int, int]:
    leader = subprocess.Popen([sys.executable, "-c", LEADER, str(lasts_s), str(marker)], stdout=subprocess.PIPE,
                              text=True, start_new_session=True)
    grandchild = int(leader.stdout.readline())
    leader.wait(30)
    return leader.pid, grandchild


def alive(pid: int) -> bool:
    return pid in session_processes(os.getsid(pid)) if _exists(pid) else False


def _exists(pid: int) -> bool:
    try:
        os.getsid(pid)
        return True
    except ProcessLookupError:
        return False


def test_session_processes_finds_a_grandchild_left_by_an_exited_session_leader(tmp_path):
    session, grandchild = start_session(30, tmp_path / "ended")
    try:
        assert session_processes(session) == [grandchild]
    finally:
        _reap_session(session, timeout_s=0)


def test_what_outlives_the_timeout_is_killed_and_nothing_of_the_session_is_left(tmp_path):
    session, grandchild = start_session(300, tmp_path / "ended")
    _reap_session(session, timeout_s=0.5)
    deadline = time.monotonic() + 10  # SIGKILL is delivered at once; its reaping by init may lag
    while alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(grandchild) and session_processes(session) == []
    assert not (tmp_path / "ended").exists()


def test_a_process_that_ends_within_the_timeout_is_waited_for_not_killed(tmp_path):
    session, grandchild = start_session(1, tmp_path / "ended")
    _reap_session(session, timeout_s=120)
    assert session_processes(session) == [] and (tmp_path / "ended").exists()
