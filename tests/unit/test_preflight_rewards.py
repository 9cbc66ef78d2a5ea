"""The reward preflight (asyncgrpo/preflight.py: check_rewards): before anything starts, every user
reward function is imported and the judge is probed; a typo or a judge that cannot be reached is
one line on stderr and exit code 2, with summary.json saying `failed`. The only server is local."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator

import pytest

from asyncgrpo.cli import main
from asyncgrpo.config import load
from asyncgrpo.preflight import PreflightError, check_rewards


def train(capsys, tmp_path, *overrides: str) -> tuple[int, str]:
    code = main(["train", f"run_dir={tmp_path}/run", "progress=false", *overrides])
    return code, capsys.readouterr().err


def failed_summary(tmp_path) -> dict:
    return json.loads((tmp_path / "run" / "summary.json").read_text())


@pytest.fixture()
def dead_port() -> Iterator[int]:
    """A port bound but not listening: connecting is refused, and nothing else can take it meanwhile."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


@pytest.mark.parametrize(("overrides", "expected"), [
    (["reward.fn=no_such_module_xyz:score"], "reward.fn='no_such_module_xyz:score': cannot import 'no_such_module_xyz'"),
    (["reward.fn=asyncgrpo.rewards.verifiers:exact_mach"],
     "reward.fn='asyncgrpo.rewards.verifiers:exact_mach': 'asyncgrpo.rewards.verifiers' has no attribute 'exact_mach'"),
    (["reward.terms=[{name: task}, {name: mine, kind: fn, fn: 'asyncgrpo.rewards.verifiers:nope'}]"],
     "reward.terms[1].fn='asyncgrpo.rewards.verifiers:nope'"),
])
def test_a_reward_fn_typo_stops_the_run_before_it_starts_in_one_line(capsys, tmp_path, overrides, expected):
    code, err = train(capsys, tmp_path, *overrides)
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("asyncgrpo: ") and expected in err
    summary = failed_summary(tmp_path)
    assert summary["status"] == "failed" and expected in summary["error"]
    assert "steps" not in summary and "preflight" not in summary  # nothing beyond the check ran


def test_a_judge_that_cannot_be_reached_stops_the_run_in_one_line(capsys, tmp_path, dead_port):
    url = f"http://127.0.0.1:{dead_port}/v1"
    code, err = train(capsys, tmp_path, "reward.terms=[{name: judge}]", f"reward.judge.base_url={url}")
    assert code == 2 and err.count("\n") == 1
    assert f"reward.judge.base_url='{url}': the judge cannot be reached (GET {url}/models:" in err
    assert failed_summary(tmp_path)["status"] == "failed"


def test_the_check_alone_reports_an_unreachable_judge_too(capsys, tmp_path, dead_port):
    code = main(["train", "reward.terms=[{name: judge}]", f"reward.judge.base_url=http://127.0.0.1:{dead_port}/v1",
                 f"run_dir={tmp_path}/run", "check=true"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "the judge cannot be reached" in err


def judge_config(base_url: str, *overrides: str):
    return load(["reward.terms=[{name: judge}]", f"reward.judge.base_url={base_url}", *overrides])


def test_a_running_judge_passes_the_probe(models_endpoint):
    report = check_rewards(judge_config(models_endpoint.base_url))
    assert report["judge"] == {"url": f"{models_endpoint.base_url}/models", "status": 200}


def test_a_judge_without_a_models_route_still_counts_as_up(models_endpoint):
    report = check_rewards(judge_config(models_endpoint.base_url + "/elsewhere"))
    assert report["judge"]["status"] == 404


def test_a_judge_key_that_is_unset_or_refused_is_one_line(models_endpoint, monkeypatch):
    cfg = judge_config(models_endpoint.base_url, "reward.judge.api_key_env=TEST_PROBE_KEY")
    monkeypatch.delenv("TEST_PROBE_KEY", raising=False)
    with pytest.raises(PreflightError, match="reward.judge.api_key_env names 'TEST_PROBE_KEY', which is not set"):
        check_rewards(cfg)
    monkeypatch.setenv("TEST_PROBE_KEY", "wrong")
    with pytest.raises(PreflightError, match=r"refused the request \(GET .*/models: HTTP 401\)"):
        check_rewards(cfg)
    monkeypatch.setenv("TEST_PROBE_KEY", "sekrit")
    assert check_rewards(cfg)["judge"]["status"] == 200


def test_reward_functions_that_import_pass_and_are_reported():
    cfg = load(["reward.terms=[{name: task}, {name: mine, kind: fn, fn: 'asyncgrpo.rewards.verifiers:exact_match'}]"])
    assert check_rewards(cfg) == {"functions": ["asyncgrpo.rewards.verifiers:exact_match"]}
    assert check_rewards(load([])) == {"functions": []}  # the default: nothing to import, no judge
