"""Bring your own agent (env.name=agent, env.agent.*): agent code written against any OpenAI-compatible
chat API plays each episode, and the episode holds the exact tokens the engine sampled.

Each generator process serves one loopback HTTP server (127.0.0.1, a free port, started with the
first episode, daemon threads): `GET /episodes/<id>/v1/models` and `POST /episodes/<id>/v1/chat/
completions` (non-streaming, n=1), each episode with a random bearer token of its own. An episode's
`reset` starts the user's function `fn(problem, base_url, api_key)` on a thread of its own and waits
for its first chat request; the request's messages, rendered by the chat template, replace the
episode's prompt (EnvStep.replaces_prompt). The policy's turn, sampled by the generator's engine like
any other (rollout.temperature and the budget: a request's temperature and max_tokens are ignored,
so training samples the distribution the learner assumes), is the reply: `step` answers the pending
request with it and waits for the agent's next request, whose new tokens become the observation,
or for its return value, which ends the episode with that reward.

No retokenisation drift: the episode keeps the sampled ids of each reply; an observation is the
template's tokens for what the agent added after the reply (`observation_tokens`), never a re-render
of the reply. Rules and errors: docs/ENVIRONMENTS.md, Bring your own agent.
"""

from __future__ import annotations

import asyncio
import hmac
import inspect
import json
import math
import queue
import re
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from asyncgrpo.envs.base import EnvironmentSpec, EnvStep
from asyncgrpo.envs.calls import EnvCallError
from asyncgrpo.envs.http import json_extras
from asyncgrpo.rewards.errors import one_line
from asyncgrpo.rewards.user_fn import Call, load_reward_fn
from asyncgrpo.schema import ConfigError, EnvConfig
from asyncgrpo.tasks.problem import Problem

# How `AgentEnvironment` calls the user's agent (`reset`): its signature must take this.
AGENT_CALL = Call("fn(problem, base_url, api_key)", ({}, "http://127.0.0.1:1/v1", "key"), {}, more_keywords=False)

# The model name /v1/models lists and every answer carries (a request's "model" is ignored).
MODEL_NAME = "asyncgrpo-policy"
# Ended episodes remembered so a late request gets 409 rather than 404 (the oldest forgotten first).
ENDED_EPISODES_KEPT = 4096
# A request body larger than this is refused (413) without reading it.
MAX_BODY_BYTES = 16 << 20
_ROUTE = re.compile(r"^/episodes/([A-Za-z0-9_-]+)/v1/(models|chat/completions)/?$")


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    # Many episodes' agents connect at once: with socketserver's backlog of 5 a burst of connections
    # waits for a SYN retry (a second), long enough to look like a slow policy.
    request_queue_size = 256


class AgentError(EnvCallError):
    """An agent episode failed; `cause` (invalid | exception | timeout) is what the generator counts
    (gen/env_errors_<cause>)."""


class Refused(Exception):
    """A chat request the server cannot serve: answered 400 with this text; ends the episode (invalid)."""


def _error(message: str, kind: str = "invalid_request_error") -> dict[str, Any]:
    return {"error": {"message": message, "type": kind}}


# ---- rendering


def render(tokenizer: Any, template: str, messages: list[dict[str, Any]], generation_prompt: bool) -> list[int]:
    """`messages` through the chat template (`template`, or the tokenizer's own when "") -> token ids;
    Refused when it cannot be rendered."""
    try:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True,
                                            return_dict=False, chat_template=template or None)
    except Exception as err:  # noqa: BLE001 - a template error or no template: the request's fault or the config's
        raise Refused(one_line(f"cannot render the messages with the chat template (env.agent.chat_template): "
                               f"{type(err).__name__}: {err}")) from None
    return [int(token) for token in ids]


def added_tokens(tokenizer: Any, template: str, previous: list[dict[str, Any]], previous_render: list[int],
                 reply: str, sampled: tuple[int, ...], messages: list[dict[str, Any]]) -> tuple[list[int], list[int]]:
    """The tokens an agent's next request `messages` adds after the episode so far, which ends with
    `previous_render` (its last request) and `sampled` (the reply, as the engine sampled it; `reply`
    is its text). The request must extend the last one: its render must start with the render of
    `previous` + the reply as an assistant message. What follows the reply's text in that render
    (the template's end of an assistant message, less an end token the engine sampled already) and
    what the request adds after it are the new tokens; the reply's own text is never re-rendered
    into the episode. Returns (the new tokens, the request's render); Refused when it does not extend."""
    new = render(tokenizer, template, messages, True)
    replied = render(tokenizer, template, [*previous, {"role": "assistant", "content": reply}], False)
    empty = render(tokenizer, template, [*previous, {"role": "assistant", "content": ""}], False)
    if new[:len(replied)] != replied:
        raise Refused("the conversation must extend the previous one: send back its messages and the "
                      "assistant's reply unchanged, then add yours")
    start = len(previous_render)
    if replied[:start] != previous_render or empty[:start] != previous_render:
        raise Refused("the chat template rewrites the conversation when a reply is added; it cannot be "
                      "trained on as one growing sequence")
    closing = empty[start:]  # what the template writes after an assistant message's text
    if len(replied) - len(closing) < start or replied[len(replied) - len(closing):] != closing:
        raise Refused("the chat template ends an assistant message differently depending on its text")
    if closing and sampled and closing[0] == sampled[-1]:  # the end token the policy sampled itself
        closing = closing[1:]
    return closing + new[len(replied):], new


def _messages(body: Any) -> list[dict[str, Any]]:
    """A chat request's messages, or Refused for what this server does not serve."""
    if not isinstance(body, dict):
        raise Refused("the body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
        raise Refused("messages must be a non-empty list of objects with a role")
    if body.get("n", 1) not in (1, None):
        raise Refused("only n=1 is served: each episode samples one reply per request")
    if body.get("stream"):
        raise Refused("streaming is not served: send stream=false")
    if body.get("tools") or body.get("functions"):
        raise Refused("tools are not served: describe them in the messages and parse the reply's text")
    if body.get("stop"):
        raise Refused("stop is not served: a reply ends at the model's end of message")
    return messages


def completion_body(episode_id: str, number: int, text: str, prompt_tokens: int, reply_tokens: int) -> dict[str, Any]:
    """An OpenAI chat.completion answer carrying the policy's reply `text`."""
    return {"id": f"chatcmpl-{episode_id}-{number}", "object": "chat.completion", "created": int(time.time()),
            "model": MODEL_NAME,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop",
                         "logprobs": None}],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": reply_tokens,
                      "total_tokens": prompt_tokens + reply_tokens}}


# ---- the server


class _Pending:
    """A chat request waiting for its answer (the handler's thread blocks on `answered`)."""

    def __init__(self, body: Any) -> None:
        self.body = body
        self.answered = threading.Event()
        self.status, self.payload = 500, _error("not answered", "server_error")
        self._lock = threading.Lock()

    def answer(self, status: int, payload: dict[str, Any]) -> None:
        """The first answer counts (a close racing a step must not pair one's status with the other's body)."""
        with self._lock:
            if self.answered.is_set():
                return
            self.status, self.payload = status, payload
            self.answered.set()


class AgentServer:
    """The process's loopback chat server: routes each request to its episode's environment."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._episodes: dict[str, AgentEnvironment] = {}
        self._ended: OrderedDict[str, str] = OrderedDict()  # episode id -> its token
        self.httpd = _Server(("127.0.0.1", 0), _Handler)  # loopback only: no setting widens it
        self.httpd.agent_server = self  # type: ignore[attr-defined]
        threading.Thread(target=self.httpd.serve_forever, name="agent-server", daemon=True).start()

    @property
    def port(self) -> int:
        return int(self.httpd.server_address[1])

    def base_url(self, episode_id: str) -> str:
        return f"http://127.0.0.1:{self.port}/episodes/{episode_id}/v1"

    def register(self, env: AgentEnvironment) -> None:
        with self._lock:
            self._episodes[env.episode_id] = env

    def retire(self, env: AgentEnvironment) -> None:
        with self._lock:
            if self._episodes.pop(env.episode_id, None) is not None:
                self._ended[env.episode_id] = env.api_key
                while len(self._ended) > ENDED_EPISODES_KEPT:
                    self._ended.popitem(last=False)

    def route(self, method: str, path: str, authorization: str, body: Any) -> tuple[int, dict[str, Any]]:
        """One request -> (HTTP status, JSON answer)."""
        match = _ROUTE.match(path)
        if match is None:
            return 404, _error(f"no route {method} {path}: use /episodes/<id>/v1/chat/completions", "not_found")
        episode_id, route = match.groups()
        with self._lock:
            env = self._episodes.get(episode_id)
            token = env.api_key if env is not None else self._ended.get(episode_id)
        given = authorization[7:] if authorization.startswith("Bearer ") else ""
        if token is None or not hmac.compare_digest(given.encode(), token.encode()):
            return 401, _error("unknown episode or wrong api key", "authentication_error")
        if env is None:
            return 409, _error("the episode is over", "conflict")
        if route == "models":
            if method != "GET":
                return 405, _error("use GET /v1/models")
            return 200, {"object": "list", "data": [{"id": MODEL_NAME, "object": "model", "owned_by": "asyncgrpo"}]}
        if method != "POST":
            return 405, _error("use POST /v1/chat/completions")
        return env.handle(body)


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - the http.server naming
        self._serve("GET", None)

    def do_POST(self) -> None:  # noqa: N802
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY_BYTES:
            self._send(413, _error(f"a body is {MAX_BODY_BYTES} bytes at most"))
            return
        raw = self.rfile.read(length)
        try:
            body = json.loads(raw)
        except ValueError:
            body = None  # refused as "not a JSON object" by the episode, which it ends
        self._serve("POST", body)

    def _serve(self, method: str, body: Any) -> None:
        server: AgentServer = self.server.agent_server  # type: ignore[attr-defined]
        status, payload = server.route(method, self.path, self.headers.get("Authorization", ""), body)
        self._send(status, payload)

    def _send(self, status: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except OSError:  # the agent gave up on the request
            pass

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - no access log on the generator's stderr
        pass


_server: AgentServer | None = None
_server_lock = threading.Lock()


def shared_server() -> AgentServer:
    """This process's agent server, started on first use."""
    global _server
    with _server_lock:
        if _server is None:
            _server = AgentServer()
        return _server


# ---- the environment


class AgentEnvironment:
    """One episode driven by the user's agent `fn` through `server`; `tokenizer` and `template`
    render its requests; `wait_s` bounds each wait for the agent (env.timeout_s, which the
    generator enforces too)."""

    def __init__(self, fn: Callable[..., Any], server: AgentServer, tokenizer: Any, template: str,
                 wait_s: float) -> None:
        self.fn, self.server, self.tokenizer, self.template, self.wait_s = fn, server, tokenizer, template, wait_s
        self.episode_id, self.api_key = secrets.token_hex(8), secrets.token_urlsafe(24)
        self._events: queue.Queue = queue.Queue()  # ("request", _Pending) | ("returned", value) | ("failed", error)
        self._lock = threading.Lock()
        self._pending: _Pending | None = None  # the request received and not yet answered
        self._closed = False
        self._messages: list[dict[str, Any]] = []  # the last request's messages and their render
        self._render: list[int] = []
        self._context_tokens = 0  # the episode so far (usage's prompt_tokens)
        self._replies = 0

    # -- the HTTP side (the server's threads)

    def handle(self, body: Any) -> tuple[int, dict[str, Any]]:
        """A chat request: handed to the episode, answered when the policy's reply is in (or the
        episode ends: 409)."""
        with self._lock:
            if self._closed:
                return 409, _error("the episode is over", "conflict")
            if self._pending is not None:
                return 409, _error("one request at a time per episode", "conflict")
            pending = self._pending = _Pending(body)
        self._events.put(("request", pending))
        pending.answered.wait()
        return pending.status, pending.payload

    def _answer(self, pending: _Pending, status: int, payload: dict[str, Any]) -> None:
        with self._lock:
            if self._pending is pending:
                self._pending = None
        pending.answer(status, payload)

    # -- the generator's side (its environment-call threads)

    def reset(self, problem: Problem) -> EnvStep:
        """Start the agent; its first request's render is the episode's prompt."""
        with self._lock:  # registered only while open, so an episode closed first is never served
            if self._closed:
                raise AgentError("invalid", "the episode was closed before it started")
            self.server.register(self)
        payload = {"id": problem.id, "prompt": problem.prompt, "answer": problem.answer,
                   "extra": json_extras(problem.extra)}
        threading.Thread(target=self._run_agent, args=(payload,), name=f"agent-{self.episode_id}",
                         daemon=True).start()
        kind, value = self._wait()
        if kind == "returned":
            raise AgentError("invalid", "the agent returned without a chat request: an episode needs a turn")
        messages = self._refusing(value, _messages)
        self._messages, self._render = messages, self._refusing(value, render, self.tokenizer, self.template,
                                                                messages, True)
        self._context_tokens = len(self._render)
        return EnvStep(observation="", observation_tokens=tuple(self._render), replaces_prompt=True)

    def step(self, action: str, token_ids: tuple[int, ...]) -> EnvStep:
        """Answer the agent's request with the policy's turn; then its next request's new tokens are
        the observation, or its return value ends the episode with that reward."""
        with self._lock:
            pending = self._pending
        if pending is None:
            raise AgentError("invalid", "no chat request to answer (the episode is over)")
        self._replies += 1
        self._answer(pending, 200, completion_body(self.episode_id, self._replies, action, self._context_tokens,
                                                   len(token_ids)))
        kind, value = self._wait()
        if kind == "returned":
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise AgentError("invalid", f"the agent returned {value!r}, not a finite number (its reward)")
            return EnvStep(observation="", reward=float(value), done=True)
        messages = self._refusing(value, _messages)
        added, self._render = self._refusing(value, added_tokens, self.tokenizer, self.template, self._messages,
                                             self._render, action, token_ids, messages)
        self._messages = messages
        self._context_tokens += len(token_ids) + len(added)
        return EnvStep(observation="", observation_tokens=tuple(added))

    def close(self) -> None:
        """The episode is over: a waiting request is answered 409, later ones too; the agent's
        thread is left to finish (a daemon)."""
        with self._lock:
            self._closed, pending, self._pending = True, self._pending, None
            self.server.retire(self)
        if pending is not None:
            pending.answer(409, _error("the episode is over (its turns, its token budget or the run ended)",
                                       "conflict"))
        self._events.put(("closed", None))

    def _run_agent(self, problem: dict[str, Any]) -> None:
        try:
            value = self.fn(problem, self.server.base_url(self.episode_id), self.api_key)
            if inspect.isawaitable(value):
                value = asyncio.run(_awaited(value))
            self._events.put(("returned", value))
        except Exception as err:  # noqa: BLE001 - the agent's failure ends its episode, counted
            self._events.put(("failed", err))

    def _wait(self) -> tuple[str, Any]:
        """The agent's next request or its return value; AgentError if it raised, the episode closed
        or nothing came within wait_s."""
        try:
            kind, value = self._events.get(timeout=self.wait_s)
        except queue.Empty:
            raise AgentError("timeout", f"the agent sent nothing within env.timeout_s={self.wait_s:g} s") from None
        if kind == "failed":
            raise AgentError("exception", f"the agent raised {type(value).__name__}: {value}")
        if kind == "closed":
            raise AgentError("invalid", "the episode was closed")
        return kind, value

    def _refusing(self, pending: _Pending, work: Callable[..., Any], *args: Any) -> Any:
        """`work(*args)`, or answer `pending` 400 with its refusal and fail the episode (invalid);
        with no args, `work(pending.body)`."""
        try:
            return work(*args) if args else work(pending.body)
        except Refused as refusal:
            self._answer(pending, 400, _error(str(refusal)))
            raise AgentError("invalid", f"refused the agent's request: {refusal}") from None


async def _awaited(value: Any) -> Any:
    return await value


def agent_spec(cfg: EnvConfig) -> EnvironmentSpec:
    """The agent of env.agent.fn, one `AgentEnvironment` per episode (the server starts with the
    first). Raises ConfigError (one line) when the function cannot be loaded."""
    try:
        fn = load_reward_fn(cfg.agent.fn, key="env.agent.fn", call=AGENT_CALL)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    template, wait_s = cfg.agent.chat_template, cfg.timeout_s

    def new(tokenizer: Any) -> AgentEnvironment:
        return AgentEnvironment(fn, shared_server(), tokenizer, template, wait_s)

    return EnvironmentSpec(name="agent", new=new, stop=(), eos_calls=True, token_turns=True)
