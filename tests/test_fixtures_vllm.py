"""The real-vLLM test helpers that do not need vLLM: the metrics scrape's retry."""

from __future__ import annotations

import socket
import threading
import urllib.error
import urllib.request
from typing import Any

import pytest

from tests.fixtures_vllm import metric_value, scrape_metrics

METRICS = b"# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc 0.5\n"


def stall_then_answer(listener: socket.socket, stalls: int, done: threading.Event) -> None:
    """Accept ``stalls`` connections and say nothing on them, then answer one with METRICS."""
    held = []
    try:
        for _ in range(stalls):
            conn, _ = listener.accept()
            held.append(conn)
        conn, _ = listener.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nConnection: close\r\n"
                         b"Content-Length: %d\r\n\r\n" % len(METRICS) + METRICS)
        done.wait(10)
    finally:
        for c in held:
            c.close()


@pytest.fixture
def listener() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    sock.settimeout(10)
    return sock


@pytest.mark.parametrize("stalls", [0, 1, 2])
def test_a_scrape_that_times_out_is_tried_again(listener: socket.socket, stalls: int) -> None:
    done = threading.Event()
    server = threading.Thread(target=stall_then_answer, args=(listener, stalls, done), daemon=True)
    server.start()
    port = listener.getsockname()[1]
    try:
        text = scrape_metrics(f"http://127.0.0.1:{port}", timeout=0.5, attempts=3)
    finally:
        done.set()
        server.join(10)
        listener.close()
    assert metric_value(text, "vllm:kv_cache_usage_perc") == 0.5


def test_a_scrape_gives_up_after_its_attempts(listener: socket.socket,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    calls = count_urlopen(monkeypatch)
    try:  # nothing accepts: the kernel completes the handshake, nobody answers
        with pytest.raises((TimeoutError, urllib.error.URLError)):
            scrape_metrics(f"http://127.0.0.1:{listener.getsockname()[1]}", timeout=0.3, attempts=2)
    finally:
        listener.close()
    assert calls == [1, 1]


def test_a_refused_scrape_is_not_retried(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = count_urlopen(monkeypatch)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    with pytest.raises(urllib.error.URLError) as info:
        scrape_metrics(f"http://127.0.0.1:{port}", timeout=0.5, attempts=5)
    assert isinstance(info.value.reason, ConnectionRefusedError)
    assert calls == [1]


def count_urlopen(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    real = urllib.request.urlopen

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(urllib.request, "urlopen", counted)
    return calls
