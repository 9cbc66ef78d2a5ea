"""Bring your own agent (asyncgrpo/envs/agent.py): the loopback chat server and the environment, driven
by the test as the generator would (reset, then step with each turn's text and sampled ids) and once
through the episode runner on a scripted engine. Agents are real OpenAI-client code. No vLLM."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request

import numpy as np
import pytest

from one_line import raises_one_line
from openai import OpenAI

from asyncgrpo.config import load
from asyncgrpo.envs import EpisodeRules, make_environment
from asyncgrpo.envs.agent import MODEL_NAME, AgentError, added_tokens, render
from asyncgrpo.models.tokenizer import build_char_tokenizer
from asyncgrpo.rewards.scorer import GroupScore
from asyncgrpo.rollout.episodes import EpisodeRunner, EpisodeSettings
from asyncgrpo.rollout.groups import scored_group
from asyncgrpo.rollout.stats import GeneratorStats
from asyncgrpo.schema import AgentEnvConfig, ConfigError, EnvConfig
from asyncgrpo.tasks import Problem

TOKENIZER = build_char_tokenizer()
EOS = TOKENIZER.eos_token_id
# Over the embedded tokenizer's characters: "user:\n<text>\n" per message, then "assistant:\n".
TEMPLATE = ("{% for m in messages %}{{ m['role'] }}:\n{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:\n{% endif %}")
# The same, but an assistant's text is trimmed when rendered: re-rendering a reply that the model began
# with a space would not give the tokens it sampled.
TRIMMING = ("{% for m in messages %}{{ m['role'] }}:\n{% if m['role'] == 'assistant' %}{{ m['content'] | trim }}"
            "{% else %}{{ m['content'] }}{% endif %}{{ '\\n' }}{% endfor %}{% if add_generation_prompt %}assistant:\n{% endif %}")
PROBLEM = Problem(7, "12*34=", "408")


def ids(text: str) -> list[int]:
    return TOKENIZER(text, add_special_tokens=False)["input_ids"]


def spec(fn: str, template: str = TEMPLATE, timeout_s: float = 5.0):
    return make_environment(EnvConfig(name="agent", timeout_s=timeout_s, agent=AgentEnvConfig(fn=fn, chat_template=template)))


def new_env(agent, template: str = TEMPLATE, timeout_s: float = 5.0):
    """An environment of `agent` (a function of this module, set as `current`)."""
    global current
    current = agent
    return spec(f"{__name__}:call_current", template, timeout_s).new(TOKENIZER)


current = None


def call_current(problem, base_url, api_key):
    return current(problem, base_url, api_key)


def client(base_url: str, api_key: str) -> OpenAI:
    return OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=10.0)


def ask(base_url, api_key, messages, **extra) -> str:
    return client(base_url, api_key).chat.completions.create(model="x", messages=messages, **extra).choices[0].message.content


def turn(text: str) -> tuple[str, tuple[int, ...]]:
    """A policy turn ended by EOS, as the runner hands it to step: its text and sampled ids."""
    return text, tuple(ids(text) + [EOS])


def two_questions(problem, base_url, api_key):
    messages = [{"role": "user", "content": problem["prompt"]}]
    reply = ask(base_url, api_key, messages)
    messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "=408"}]
    return 1.0 if ask(base_url, api_key, messages) == problem["answer"] else 0.0


def test_an_agents_conversation_becomes_the_episodes_prompt_its_turns_and_the_templates_tokens_between():
    env = new_env(two_questions)
    first = env.reset(PROBLEM)
    assert first.replaces_prompt and list(first.observation_tokens) == ids("user:\n12*34=\nassistant:\n")
    second = env.step(*turn("[12*34]"))
    # The template's end of the reply ("\n": the model's EOS is not the template's), then the new message.
    assert list(second.observation_tokens) == ids("\nuser:\n=408\nassistant:\n") and not second.done
    last = env.step(*turn("408"))
    assert last.done and last.reward == 1.0 and last.observation_tokens is None
    env.close()


def test_a_reply_the_template_would_render_differently_stays_as_sampled_in_the_episode():
    env = new_env(two_questions, TRIMMING)
    env.reset(PROBLEM)
    text, sampled = turn(" [12*34]")  # re-rendered, the template trims the leading space away
    answer = env.step(text, sampled)
    assert list(answer.observation_tokens) == ids("\nuser:\n=408\nassistant:\n")  # no re-rendered reply in it
    env.step(*turn("408"))
    env.close()


def test_the_observation_is_what_extends_the_episode_to_the_templates_render_of_the_next_request():
    previous = [{"role": "user", "content": "1+1="}]
    previous_render = render(TOKENIZER, TEMPLATE, previous, True)
    sampled = tuple(ids("2") + [EOS])
    messages = [*previous, {"role": "assistant", "content": "2"}, {"role": "user", "content": "ok"}]
    added, new = added_tokens(TOKENIZER, TEMPLATE, previous, previous_render, "2", sampled, messages)
    # The episode (render, sampled reply, added) is the next request's render with the reply as sampled.
    without_eos = previous_render + list(sampled[:-1]) + added
    assert without_eos == new == render(TOKENIZER, TEMPLATE, messages, True)


refusals: list = []
refused = threading.Event()


def rewrites_history(problem, base_url, api_key):
    messages = [{"role": "user", "content": problem["prompt"]}]
    reply = ask(base_url, api_key, messages)
    messages += [{"role": "assistant", "content": reply + "!"}, {"role": "user", "content": "=408"}]
    try:
        ask(base_url, api_key, messages)
    except Exception as err:  # noqa: BLE001
        refusals.append(err)
        refused.set()
        raise


def test_a_request_that_does_not_extend_the_conversation_is_refused_400_and_fails_the_episode_invalid():
    env = new_env(rewrites_history)
    env.reset(PROBLEM)
    with pytest.raises(AgentError, match="must extend the previous one") as failure:
        env.step(*turn("[12*34]"))
    assert failure.value.cause == "invalid"
    assert refused.wait(10) and refusals[0].status_code == 400
    env.close()


def asks_for_two(problem, base_url, api_key):
    ask(base_url, api_key, [{"role": "user", "content": "1+1="}], n=2)


def test_more_than_one_choice_is_refused_400_and_fails_the_episode_invalid():
    env = new_env(asks_for_two)
    with pytest.raises(AgentError, match="only n=1") as failure:
        env.reset(PROBLEM)
    assert failure.value.cause == "invalid"
    env.close()


def raises(problem, base_url, api_key):
    raise KeyError("no tool")


def never_asks(problem, base_url, api_key):
    return 1.0


def returns_text(problem, base_url, api_key):
    ask(base_url, api_key, [{"role": "user", "content": "1+1="}])
    return "yes"


def test_an_agent_that_raises_fails_its_episode_as_an_exception_and_one_that_never_asks_as_invalid():
    with pytest.raises(AgentError, match="KeyError") as failure:
        new_env(raises).reset(PROBLEM)
    assert failure.value.cause == "exception"
    with pytest.raises(AgentError, match="without a chat request") as failure:
        new_env(never_asks).reset(PROBLEM)
    assert failure.value.cause == "invalid"
    env = new_env(returns_text)
    env.reset(PROBLEM)
    with pytest.raises(AgentError, match="not a finite number") as failure:
        env.step(*turn("2"))
    assert failure.value.cause == "invalid"


def raw(url: str, token: str, body: dict | None = None) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(),
                                     headers={"Authorization": f"Bearer {token}"},
                                     method="GET" if body is None else "POST")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_the_server_checks_each_episodes_key_lists_the_model_and_answers_409_once_the_episode_is_over():
    seen = {}
    release = threading.Event()

    def waits(problem, base_url, api_key):
        seen.update(base_url=base_url, api_key=api_key)
        ask(base_url, api_key, [{"role": "user", "content": "1+1="}])
        release.wait(10)

    env = new_env(waits)
    env.reset(PROBLEM)
    base_url, key = seen["base_url"], seen["api_key"]
    assert base_url.startswith("http://127.0.0.1:")
    assert raw(base_url + "/models", key) == (200, {"object": "list", "data": [
        {"id": MODEL_NAME, "object": "model", "owned_by": "asyncgrpo"}]})
    assert raw(base_url + "/models", key + "x")[0] == 401
    body = {"messages": [{"role": "user", "content": "1+1="}]}
    assert raw(base_url + "/chat/completions", key, body)[0] == 409  # one request at a time: one is pending
    env.close()  # answers the pending request 409: the agent's ask raises
    assert raw(base_url + "/chat/completions", key, body)[0] == 409
    release.set()


def test_a_hung_agent_times_out_and_closing_ends_every_wait_so_no_thread_hangs_with_it():
    release, answered = threading.Event(), threading.Event()
    outcome = {}

    def hangs_after_a_reply(problem, base_url, api_key):
        ask(base_url, api_key, [{"role": "user", "content": "1+1="}])
        release.wait(30)  # its own work, never another request

    env = new_env(hangs_after_a_reply, timeout_s=0.3)
    env.reset(PROBLEM)
    with pytest.raises(AgentError) as failure:
        env.step(*turn("2"))
    assert failure.value.cause == "timeout"

    # The generator gave up on a step (env.timeout_s) and ends the episode: the step's thread, waiting
    # for a request that never comes (its own limit is 60 s), is let go at once.
    env = new_env(hangs_after_a_reply, timeout_s=60.0)
    env.reset(PROBLEM)
    waiter = threading.Thread(target=lambda: outcome.setdefault("step", _raised(env.step, *turn("2"))))
    waiter.start()
    env.close()
    waiter.join(10)
    assert not waiter.is_alive() and isinstance(outcome["step"], AgentError)

    def asks(problem, base_url, api_key):
        try:
            ask(base_url, api_key, [{"role": "user", "content": "1+1="}])
        except Exception as err:  # noqa: BLE001
            outcome["error"] = err
            answered.set()

    # Ended while the agent's request waits for a reply (the budget ran out): it is answered 409.
    env = new_env(asks)
    env.reset(PROBLEM)
    env.close()
    assert answered.wait(10) and outcome["error"].status_code == 409
    release.set()


def _raised(call, *args):
    try:
        return call(*args)
    except AgentError as err:
        return err


def test_through_the_runner_the_episode_trains_the_engines_tokens_between_the_templates_and_adds_the_agents_reward():
    from test_episodes import ScriptEngine, admitted, run_until_done

    # A turn ends with EOS (the scripted engine would stop a text ending in "]" at it: not a chat turn).
    engine, stats = ScriptEngine([["[12*34] ", "408"], ["407"]]), GeneratorStats()
    rules = EpisodeRules(max_turns=3, on_error="zero", threads=4, timeout_s=10.0, latency_s=0.0)
    settings = EpisodeSettings(samples_per_prompt=2, max_new_tokens=60, temperature=1.0, context_tokens=128, env=rules)
    calls = rules.calls()
    runner = EpisodeRunner(engine, TOKENIZER, spec("examples.agent_calculator:calculator_agent"), calls, settings,
                           stats)
    runner.start(admitted())
    [group] = run_until_done(runner)
    tool, plain = group.episodes
    assert tool.prompt == plain.prompt == ids("user:\n12*34=\nassistant:\n")
    assert tool.tokens == ids("[12*34] ") + [EOS] + ids("\nuser:\n=408\nassistant:\n") + ids("408") + [EOS]
    assert tool.policy == [1] * 9 + [0] * len(ids("\nuser:\n=408\nassistant:\n")) + [1] * 4
    assert (tool.env_reward, plain.env_reward) == (1.0, 0.0) and stats.env_errors == {}
    message = scored_group(0, group, GroupScore(rewards=np.asarray([1.0, 0.0], np.float32), terms={},
                                                report_terms=False), "zero")
    assert message.prompt_tokens.tolist() == tool.prompt and message.rewards.tolist() == [2.0, 0.0]
    calls.close()


def test_env_name_agent_needs_a_function_and_one_that_cannot_be_loaded_is_one_line():
    with raises_one_line(ConfigError, match="env.agent.fn"):
        load(["env.name=agent"])
    assert load(["env.name=agent", "env.agent.fn=examples.agent_calculator:calculator_agent"]).env.agent.fn
    with raises_one_line(ConfigError, match="env.agent.fn='examples.agent_calculator:nothing'"):
        spec("examples.agent_calculator:nothing")


def test_an_episode_closed_before_its_reset_runs_never_starts_its_agent():
    started = []
    env = new_env(lambda problem, base_url, api_key: started.append(base_url))
    env.close()  # dropped while its reset waited for a thread
    with pytest.raises(AgentError, match="closed before it started"):
        env.reset(PROBLEM)
    assert started == [] and env.episode_id not in env.server._episodes
