"""The reward preflight (asyncgrpo/driver/preflight.py: check_rewards): before anything starts, every user
reward function is imported and the judge is probed; a typo or a judge that cannot be reached is
one line on stderr and exit code 2, with summary.json saying `failed`. The only server is local."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator

import pytest

from asyncgrpo.cli import main
from asyncgrpo.config import load
from asyncgrpo.schema import ConfigError
from asyncgrpo.driver.preflight import PreflightError, check_rewards


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
    return load(["reward.terms=[{name: judge}]", f"reward.judge.base_url='{base_url}'", *overrides])


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


def test_reward_functions_that_import_pass_and_are_reported(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text("def concise(prompt, completion, answer=None, **extra):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = load(["reward.terms=[{name: task}, {name: mine, kind: fn, fn: 'my_rewards:concise'}]"])
    assert check_rewards(cfg) == {"functions": ["my_rewards:concise"]}
    assert check_rewards(load([])) == {"functions": []}  # the default: nothing to import, no judge


def test_a_function_of_another_signature_is_refused_by_the_check_not_failed_at_every_call():
    # verifiers.exact_match(completion, answer) is a verifier, not a reward function: called as
    # fn(prompt, completion, answer=...) it would raise at every completion.
    cfg = load(["reward.terms=[{name: task}, {name: mine, kind: fn, fn: 'asyncgrpo.rewards.verifiers:exact_match'}]"])
    with pytest.raises(PreflightError, match=r"cannot be called as fn\(prompt, completion, answer=None, \*\*extra\)"):
        check_rewards(cfg)


def test_the_probe_refuses_a_redirect_to_another_origin_and_the_key_never_reaches_it(redirecting_judge, monkeypatch):
    monkeypatch.setenv("TEST_PROBE_KEY", "sekrit")
    cfg = judge_config(redirecting_judge.base_url, "reward.judge.api_key_env=TEST_PROBE_KEY")
    with pytest.raises(PreflightError, match="redirected .*to another origin") as err:
        check_rewards(cfg)
    assert "\n" not in str(err.value) and redirecting_judge.other_origin in str(err.value)
    assert [server for server, *_ in redirecting_judge.seen] == ["front"]  # the other origin saw nothing


def test_the_probe_follows_a_redirect_within_the_judges_own_origin_with_the_key(redirecting_judge, monkeypatch):
    monkeypatch.setenv("TEST_PROBE_KEY", "sekrit")
    cfg = judge_config(f"{redirecting_judge.origin}/same/v1", "reward.judge.api_key_env=TEST_PROBE_KEY")
    assert check_rewards(cfg)["judge"]["status"] == 200
    assert redirecting_judge.seen[-1] == ("front", "GET", "/ok/v1/models", "Bearer sekrit")


@pytest.mark.parametrize("base_url", ["http://judge.internal:8000/v1", "http://10.0.0.7/v1", "http://[2001:db8::1]:80/v1"])
def test_a_plain_http_judge_with_a_key_is_refused_in_one_line_unless_on_loopback(base_url):
    with pytest.raises(ConfigError) as err:
        judge_config(base_url, "reward.judge.api_key_env=JUDGE_API_KEY")
    message = str(err.value)
    assert "\n" not in message and message.startswith("reward.judge.base_url ") and "https://" in message
    assert "JUDGE_API_KEY" in message


@pytest.mark.parametrize("base_url", ["http://127.0.0.1:8000/v1", "http://127.3.2.1/v1", "http://[::1]:8000/v1",
                                      "http://localhost:8000/v1", "http://LOCALHOST/v1", "https://judge.internal/v1"])
def test_a_judge_key_may_go_over_https_or_plain_http_on_loopback(base_url):
    assert judge_config(base_url, "reward.judge.api_key_env=JUDGE_API_KEY").reward.judge.base_url == base_url


def test_a_plain_http_judge_without_a_key_is_allowed_anywhere():
    assert judge_config("http://judge.internal:8000/v1").reward.judge.api_key_env == ""
