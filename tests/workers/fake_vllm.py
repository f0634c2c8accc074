"""A stand-in for the ``vllm`` executable, for fast launcher tests (never run real vLLM here).

``fake_vllm.py serve MODEL --host H --port P ...`` behaves by ``FAKE_VLLM_MODE``:

- ``ok``: starts a child process (like vLLM's engine) in its own process group, writes
  ``{FAKE_VLLM_RECORD_DIR}/{port}.json`` (argv, the child's PID, the launcher-set environment) and
  answers ``GET /health`` with 200 until SIGTERM.
- ``stubborn``: as ``ok`` but the child ignores SIGTERM (the launcher must escalate to SIGKILL).
- ``die``: prints a recognisable line to its log and exits with code 3. Also when any argument contains
  ``FAKE_VLLM_DIE_IF_ARG`` (e.g. ``kv_consumer``: only the decode workers die).
- ``hang``: never answers /health.
"""

from __future__ import annotations

import http.server
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ENV_KEYS = (
    "VLLM_NIXL_SIDE_CHANNEL_HOST",
    "VLLM_NIXL_SIDE_CHANNEL_PORT",
    "VLLM_CPU_OMP_THREADS_BIND",
    "VLLM_CPU_KVCACHE_SPACE",
    "CUDA_VISIBLE_DEVICES",
    "HF_HUB_OFFLINE",
    "PD_NIXL_PROGRESS_DELAY_US",
    "PYTHONPATH",
)
CHILD_OK = "import time\nwhile True: time.sleep(1)"
CHILD_STUBBORN = (
    "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nwhile True: time.sleep(1)"
)


class _Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass


def main() -> int:
    argv = sys.argv[1:]
    mode = os.environ.get("FAKE_VLLM_MODE", "ok")
    print(f"fake vllm starting in mode {mode}: {argv}", flush=True)
    die_if = os.environ.get("FAKE_VLLM_DIE_IF_ARG")
    if mode == "die" or (die_if and any(die_if in a for a in argv)):
        print("fake vllm: boom, the engine failed to start", flush=True)
        return 3
    if mode == "hang":
        while True:
            time.sleep(1)
    host, port = argv[argv.index("--host") + 1], int(argv[argv.index("--port") + 1])
    child = subprocess.Popen([sys.executable, "-c", CHILD_STUBBORN if mode == "stubborn" else CHILD_OK])
    record = {
        "pid": os.getpid(),
        "argv": argv,
        "child_pid": child.pid,
        "env": {k: os.environ[k] for k in ENV_KEYS if k in os.environ},
    }
    record_dir = Path(os.environ["FAKE_VLLM_RECORD_DIR"])
    (record_dir / f"{port}.json").write_text(json.dumps(record))
    server = http.server.HTTPServer((host, port), _Health)

    def on_sigterm(signum: int, frame: object) -> None:
        child.terminate()  # as vLLM's API server shuts its engine down
        sys.exit(0)

    signal.signal(signal.SIGTERM, on_sigterm)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
