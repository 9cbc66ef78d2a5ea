"""tools/bench_env.py's pure parts: its modes and how it compares them (no training run)."""

from __future__ import annotations

import argparse

import pytest

from tools import bench_env as be


def run(kind: str, latency: int, repeat: int, samples_per_s: float) -> dict:
    return {"mode": f"{kind} {latency} ms", "kind": kind, "latency_ms": latency, "repeat": repeat,
            "samples_per_s": samples_per_s}


def test_every_latency_runs_sync_and_continuous_async_with_the_delay_injected():
    modes = be.modes_for([0, 200], eta=2)
    assert [m.label for m in modes] == ["sync 0 ms", "async 0 ms", "sync 200 ms", "async 200 ms"]
    assert "env.latency_s=0.2" in modes[3].overrides and "train.max_staleness=2" in modes[3].overrides
    assert "train.max_staleness=0" in modes[2].overrides and "rollout.continuous=true" in modes[3].overrides


def test_keeps_is_against_the_same_kind_at_0_ms_and_x_sync_against_sync_at_the_same_latency():
    runs = [run("sync", 0, 0, 100.0), run("async", 0, 0, 200.0), run("sync", 200, 0, 50.0),
            run("async", 200, 0, 180.0), run("sync", 0, 1, 100.0), run("async", 0, 1, 200.0),
            run("sync", 200, 1, 50.0), run("async", 200, 1, 160.0)]
    modes = be.summarize(runs)["modes"]
    assert modes["async 200 ms"]["keeps_vs_0ms"]["median"] == pytest.approx(170 / 200)
    assert modes["async 200 ms"]["speedup_vs_sync"]["median"] == pytest.approx(170 / 50)
    assert modes["async 200 ms"]["speedup_vs_sync"]["per_repeat"] == pytest.approx([3.6, 3.2])
    assert modes["sync 200 ms"]["keeps_vs_0ms"]["median"] == pytest.approx(0.5)
    assert modes["sync 200 ms"]["speedup_vs_sync"] is None


@pytest.mark.parametrize("text", ["", "-5", "0,x"])
def test_bad_latencies_are_refused(text):
    with pytest.raises((argparse.ArgumentTypeError, ValueError)):
        be.parse_latencies(text)


@pytest.mark.parametrize("text", ["0,0", "50,050"])
def test_a_latency_given_twice_is_refused_two_modes_would_share_a_run_folder(text):
    with pytest.raises(argparse.ArgumentTypeError, match="twice"):
        be.parse_latencies(text)


@pytest.mark.parametrize("argv, says", [
    (["trian.max_steps=3"], "trian"),
    (["--latencies-ms", "0,0"], "twice"),
    (["--eta", "3", "train.fixed_staleness=2"], "mode 'sync 0 ms'"),
])
def test_bad_arguments_are_one_line_and_exit_2_before_the_first_run(argv, says, monkeypatch, capsys):
    monkeypatch.setattr(be, "run_benchmark", lambda *a, **k: pytest.fail("a run started"))
    with pytest.raises(SystemExit) as exit_info:
        be.main(["--latencies-ms", "0", *argv] if "--latencies-ms" not in argv else argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err and says in err.strip().splitlines()[-1]
