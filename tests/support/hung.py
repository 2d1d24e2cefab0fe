"""A TCP listener that never answers: how a stopped (SIGSTOP) or wedged server looks to a client.

The kernel completes the TCP handshake for connections in the listen backlog whether or not the
process ever calls accept(), so requests are sent and no reply comes: the client's read timeout
is the only way out. Used by the fast fleet tests; the real thing (a vLLM instance stopped by
SIGSTOP mid-rollout) is in tests/fleet/test_fleet_vllm.py.
"""

from __future__ import annotations

import socket


class HungListener:
    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> HungListener:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
