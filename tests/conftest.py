import os

import pytest

# Tests run on 2 shared cores; keep torch from oversubscribing them.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


class _ModelsEndpoint:
    """A local stand-in for an OpenAI-compatible server's GET /v1/models (the judge's start-up
    probe), refusing any key but `key` when one is sent."""

    def __init__(self, key: str = "sekrit") -> None:
        import http.server
        import json
        import threading

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # http.server's name for the GET handler
                sent = self.headers.get("Authorization")
                status = 200 if self.path == "/v1/models" else 404
                if sent is not None and sent != f"Bearer {key}":
                    status = 401
                body = json.dumps({"object": "list", "data": [{"id": "judge"}]}).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:  # keep the test output clean
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base_url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(5)


@pytest.fixture()
def models_endpoint():
    """A local judge endpoint for the reward preflight; `.base_url` ends in /v1, the key is `sekrit`."""
    endpoint = _ModelsEndpoint()
    yield endpoint
    endpoint.close()


class _RedirectingJudge:
    """Two loopback HTTP servers for the judge's redirect rules. `front` (`.base_url`, ending in /v1)
    answers every GET and POST under /v1/ with a 307 to the same path on `other`, a different origin
    (another port), and under /same/v1/ with a 307 to /ok/v1/ on itself, where it answers as a judge
    would (a model listing, or a chat reply "Score: 10"). Every request either server sees is kept
    in `.seen` as (server, method, path, its Authorization header or None)."""

    def __init__(self) -> None:
        import http.server
        import json
        import threading

        self.seen: list[tuple[str, str, str, str | None]] = []
        outer = self

        def handler(name: str):
            class Handler(http.server.BaseHTTPRequestHandler):
                def _answer(self, method: str) -> None:
                    length = int(self.headers.get("Content-Length") or 0)
                    if length:
                        self.rfile.read(length)
                    outer.seen.append((name, method, self.path, self.headers.get("Authorization")))
                    if name == "front" and self.path.startswith("/v1/"):
                        self._redirect(f"{outer.other_origin}{self.path}")
                    elif name == "front" and self.path.startswith("/same/"):
                        self._redirect("/ok/" + self.path[len("/same/"):])
                    else:
                        reply = ({"object": "list", "data": [{"id": "judge"}]} if method == "GET" else
                                 {"choices": [{"index": 0, "message": {"role": "assistant", "content": "Score: 10"}}]})
                        self._send(200, json.dumps(reply).encode())

                def _redirect(self, location: str) -> None:
                    self.send_response(307)
                    self.send_header("Location", location)
                    self.send_header("Content-Length", "0")
                    self.end_headers()

                def _send(self, status: int, body: bytes) -> None:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)

                def do_GET(self) -> None:  # http.server's name for the GET handler
                    self._answer("GET")

                def do_POST(self) -> None:
                    self._answer("POST")

                def log_message(self, *args) -> None:  # keep the test output clean
                    pass

            return Handler

        self.servers = [http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler(name)) for name in ("front", "other")]
        front, other = (server.server_address[1] for server in self.servers)
        self.origin, self.other_origin = f"http://127.0.0.1:{front}", f"http://127.0.0.1:{other}"
        self.base_url = f"{self.origin}/v1"
        self._threads = [threading.Thread(target=server.serve_forever, daemon=True) for server in self.servers]
        for thread in self._threads:
            thread.start()

    def close(self) -> None:
        for server, thread in zip(self.servers, self._threads):
            server.shutdown()
            server.server_close()
            thread.join(5)


@pytest.fixture()
def redirecting_judge():
    """A judge at `.base_url` that redirects to another origin (and, under /same/v1, to its own); see _RedirectingJudge."""
    endpoint = _RedirectingJudge()
    yield endpoint
    endpoint.close()


@pytest.fixture(scope="session", autouse=True)
def no_socket_directories_left_by_killed_processes():
    """Tests that SIGKILL a learner leave its socket directories (a killed process runs no clean-up;
    a run's start removes such leftovers, `remove_stale_ipc_dirs`): the suite removes them too."""
    yield
    from asyncgrpo.wire.sockets import remove_stale_ipc_dirs

    remove_stale_ipc_dirs()
