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
