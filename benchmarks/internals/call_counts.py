"""Per request in pd-proxy, counted, not timed: Python function calls (cProfile), tasks, futures,
timers, ``call_soon`` handles and object allocations. A yardstick that CPU noise on a shared
machine does not move, for comparing two trees of the proxy.

    PYTHONPATH=TREE python benchmarks/internals/call_counts.py --out A.json [--stream] [--requests 200]
                                                               [--uvloop]
    python benchmarks/internals/call_counts.py --diff A.json B.json [--top 40]

Run as a script path, so ``PYTHONPATH`` picks the tree measured (this file imports nothing of
``benchmarks``). Starts two ``pd-sim --zero-latency`` workers (prefill and decode, from TREE),
serves the proxy of TREE in this process on loopback, and loads it from a client subprocess:
64 warm-up requests, then three rounds of ``--requests`` (at most 5,000) generate requests, 64 at
a time, of 256 prompt tokens and 32 output tokens, each round counting one thing, so that no
counter sees another's work:

1. calls (``calls_per_request``: per function, ``module:name``, paths relative to the tree) with
   cProfile, and the tasks created (``tasks_per_request``: through the loop's task factory);
2. the loop's scheduling, each call to the running loop's methods from Python code or from the
   C ``Task``/``Future`` (the methods are replaced on the loop instance for the round; what
   uvloop's Cython code does inside the loop, e.g. a transport's own futures and callbacks,
   does not go through them and is not counted):
   ``futures_per_request`` (``loop.create_future``; a task is not counted here, nor a future made
   with ``asyncio.Future()`` directly), ``timers_per_request`` (``loop.call_at`` and
   ``loop.call_later``, one per timer: asyncio's ``call_later`` calling ``call_at``, or uvloop's
   ``call_at`` calling ``call_later``, counts once),
   ``handles_per_request`` (``loop.call_soon``: every task step and future callback scheduled
   from Python or from the C ``Task``/``Future``),
   and where they come from (``sources_per_request``: per method, the Python function that
   called it, ``<- proxy/...`` naming the nearest function of ``proxy/`` further up the stack
   when the caller is not one, ``(loop)`` when the loop itself did (a task finished, a future
   was set from C); for ``call_soon`` also ``-> what`` it schedules, a task step or a callback);
3. object allocations (``objects_per_request``): the calls to CPython's object allocator
   (``PyObject_Malloc``, ``PyObject_Calloc``, ``PyObject_Realloc`` of NULL), counted by a hook
   compiled at run time with the C compiler (``cc``) and installed with ``PyMem_SetAllocator``.
   That is every object not served from a free list (floats, tuples, lists, dicts and a few more
   keep one), plus the small buffers CPython takes from the same allocator (dict tables, for
   one): an allocation count, not an exact object count. Null when no compiler or headers.

Everything in-process is counted: the proxy's work, the loop's and the measuring coroutine's own
(a handful of calls per round). ``--diff`` prints the totals' and the largest per-function
differences. Stream counts move a little from run to run (how the events of a stream fall into
reads); non-stream ones barely.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import ctypes
import json
import os
import pstats
import re
import shlex
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import aiohttp

_SIM = ("--max-running", "100000", "--max-num-seqs", "100000",
        "--num-kv-blocks", "400000", "--max-model-len", "512")
_CONCURRENCY = 64
_MAX_REQUESTS = 5000
_ROUNDS = 3
_ADDRESS = re.compile(r" at 0x[0-9a-f]+")
"""A builtin's address in its name (``<built-in method __new__ of type object at 0x...>``): not
the same from run to run."""
"""Measured rounds: calls and tasks, the loop's scheduling, object allocations."""

_ALLOC_HOOK = r"""
#include <Python.h>
static PyMemAllocatorEx orig;
static unsigned long long allocations;
static int installed, counting;
static void *hook_malloc(void *ctx, size_t n) { allocations += counting; return orig.malloc(orig.ctx, n); }
static void *hook_calloc(void *ctx, size_t k, size_t n) {
    allocations += counting; return orig.calloc(orig.ctx, k, n); }
static void *hook_realloc(void *ctx, void *p, size_t n) {
    allocations += counting && p == NULL; return orig.realloc(orig.ctx, p, n); }
static void hook_free(void *ctx, void *p) { orig.free(orig.ctx, p); }
void count_start(void) {
    if (!installed) {  /* never uninstalled: blocks it saw allocated may be freed at any time */
        PyMemAllocatorEx hook = {NULL, hook_malloc, hook_calloc, hook_realloc, hook_free};
        PyMem_GetAllocator(PYMEM_DOMAIN_OBJ, &orig);
        PyMem_SetAllocator(PYMEM_DOMAIN_OBJ, &hook);
        installed = 1;
    }
    allocations = 0;
    counting = 1;
}
unsigned long long count_stop(void) { counting = 0; return allocations; }
"""
"""Counts the calls to the object allocator (the GIL is held in all of them: no atomics)."""


async def _client_batch(session: aiohttp.ClientSession, url: str, count: int, tag: str, stream: bool) -> None:
    sem = asyncio.Semaphore(_CONCURRENCY)

    async def one(i: int) -> None:
        body = {"request_id": f"{tag}-{i}", "token_ids": [(i * 7 + k) % 400 + 1 for k in range(256)],
                "sampling_params": {"max_tokens": 32, "temperature": 0.0, "ignore_eos": True},
                "stream": stream, "output_mode": "tokens"}
        async with sem, session.post(url + "/inference/v1/generate", json=body,
                                       headers={"X-Request-Id": f"{tag}-{i}"}) as r:
            data = await r.read()
            if r.status != 200:
                raise RuntimeError(f"HTTP {r.status}: {data[:300]!r}")

    await asyncio.gather(*(one(i) for i in range(count)))


async def _client(url: str, count: int, stream: bool, rounds: int = _ROUNDS) -> None:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        await _client_batch(session, url, 64, "warm", stream)
        print("ready", flush=True)
        for n in range(rounds):
            sys.stdin.readline()
            await _client_batch(session, url, count, f"meas{n}", stream)
            print("done", flush=True)


def _alloc_counter() -> tuple[Callable[[], None], Callable[[], int]] | None:
    """``(start, stop)`` of the object-allocation count (``_ALLOC_HOOK``), or None when it cannot
    be built here."""
    include = sysconfig.get_paths()["include"]
    with tempfile.TemporaryDirectory() as tmp:
        c, so = Path(tmp, "alloc_count.c"), Path(tmp, "alloc_count.so")
        c.write_text(_ALLOC_HOOK)
        try:
            subprocess.run(["cc", "-O2", "-shared", "-fPIC", f"-I{include}", "-o", str(so), str(c)],
                           check=True, capture_output=True)
        except (OSError, subprocess.CalledProcessError):
            return None
        lib = ctypes.PyDLL(str(so))  # PyDLL: called with the GIL held
    lib.count_stop.restype = ctypes.c_ulonglong
    return lib.count_start, lambda: int(lib.count_stop())


_LOOP_RUNNERS = frozenset(("run", "run_until_complete", "run_forever", "_run_once", "_run"))
_LOOP_FILES = tuple(f"asyncio/{name}.py" for name in ("runners", "base_events", "events"))


class _LoopCounts:
    """Counts the calls to a loop's scheduling methods and who made them, while installed."""

    METHODS = ("create_future", "call_soon", "call_at", "call_later")

    def __init__(self, tree: str) -> None:
        self.tree = tree
        self.counts = {m: 0 for m in self.METHODS}
        self.sources: dict[str, dict[str, int]] = {m: {} for m in self.METHODS}

    def _source(self, method: str, args: tuple[Any, ...]) -> None:
        frame: Any = sys._getframe(2)  # the caller of the replaced method
        while frame is not None and frame.f_code.co_filename == __file__ and \
                frame.f_code.co_name in ("wrapped", "_source"):
            frame = frame.f_back
        if frame is None or (frame.f_code.co_name in _LOOP_RUNNERS
                             and frame.f_code.co_filename.endswith(_LOOP_FILES)):
            site = "(loop)"  # called from the loop's own code: no Python function asked
        else:
            site = _key(frame.f_code.co_filename, frame.f_code.co_name, self.tree)
            if not site.startswith("proxy/"):
                up = frame.f_back
                while up is not None and not _key(up.f_code.co_filename, "", self.tree).startswith("proxy/"):
                    up = up.f_back
                if up is not None:
                    site += " <- " + _key(up.f_code.co_filename, up.f_code.co_name, self.tree)
        if method == "call_soon" and args:  # what runs: a task's step, a future's callback
            site += " -> " + getattr(args[0], "__qualname__", type(args[0]).__name__)
        sources = self.sources[method]
        sources[site] = sources.get(site, 0) + 1

    @contextmanager
    def installed(self, loop: asyncio.AbstractEventLoop) -> Iterator[None]:
        in_timer = False

        def replace(method: str) -> None:
            original = getattr(loop, method)
            timer = method in ("call_at", "call_later")

            def wrapped(*args: Any, **kwargs: Any) -> Any:
                nonlocal in_timer
                if not timer:
                    self.counts[method] += 1
                    self._source(method, args)
                    return original(*args, **kwargs)
                if in_timer:  # asyncio's call_later calls call_at, uvloop's call_at call_later
                    return original(*args, **kwargs)
                self.counts[method] += 1
                self._source(method, args)
                in_timer = True
                try:
                    return original(*args, **kwargs)
                finally:
                    in_timer = False

            setattr(loop, method, wrapped)

        for method in self.METHODS:
            replace(method)
        try:
            yield
        finally:
            for method in self.METHODS:
                delattr(loop, method)


def _start_sim(role: str, tree: str, itl_ms: float = 0.0) -> tuple[subprocess.Popen[bytes], str]:
    """A pd-sim worker with no simulated delays, or with ``itl_ms`` between its tokens (and
    nothing else: prefill and transfers take no time)."""
    timing = ("--zero-latency",) if not itl_ms else (
        "--prefill-base-ms", "0", "--prefill-per-token-ms", "0", "--transfer-per-block-ms", "0",
        "--itl-ms", str(itl_ms))
    argv = [sys.executable, "-m", "workers.sim.cli", "--host", "127.0.0.1", "--port", "0", "--role", role,
            *timing, *_SIM]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd=tree)
    assert proc.stdout is not None
    return proc, str(json.loads(proc.stdout.readline())["url"])


def _key(path: str, name: str, tree: str) -> str:
    if "site-packages/" in path:  # before the tree: a venv may live inside it
        path = path.split("site-packages/", 1)[1]
    elif "/lib/python3" in path:
        path = "stdlib/" + path.split("/lib/python3", 1)[1].split("/", 1)[-1]
    elif path.startswith(tree + "/"):
        path = path[len(tree) + 1:]
    return f"{path}:{_ADDRESS.sub('', name)}"


@asynccontextmanager
async def load_client(port: int, count: int, stream: bool = False,
                      rounds: int = _ROUNDS) -> AsyncIterator[Callable[[], Awaitable[None]]]:
    """This file's load client in a subprocess for the server on loopback ``port``, warmed up (64
    requests); yields one round: ``count`` requests, 64 at a time, returning once they and their
    clean-up are done. At most ``rounds`` rounds."""
    client = await asyncio.create_subprocess_exec(
        sys.executable, __file__, "--client", f"http://127.0.0.1:{port}", "--requests", str(count),
        "--client-rounds", str(rounds), *(["--stream"] if stream else []),
        stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    stdin, stdout = client.stdin, client.stdout
    assert stdin is not None and stdout is not None
    try:
        if (await stdout.readline()).strip() != b"ready":
            raise RuntimeError("the load client failed its warm-up")

        async def one_round() -> None:
            stdin.write(b"go\n")
            await stdin.drain()
            if (await stdout.readline()).strip() != b"done":
                raise RuntimeError("the load client failed")
            await asyncio.sleep(0.3)  # the last requests' cleanup

        yield one_round
        stdin.close()
        if await client.wait() != 0:
            raise RuntimeError("the load client failed")
    finally:
        if client.returncode is None:  # the measuring failed
            client.kill()
            await client.wait()


@asynccontextmanager
async def loaded_proxy(count: int, stream: bool, tree: str, proxy_args: Sequence[str] = (),
                       itl_ms: float = 0.0, *,
                       rounds: int = _ROUNDS) -> AsyncIterator[Callable[[], Awaitable[None]]]:
    """pd-proxy of ``tree`` served in this process on loopback in front of two zero-latency pd-sim
    workers, and its load client warmed up (64 requests). Yields one round: ``count`` requests,
    64 at a time, returning once they and their clean-up are done. At most ``rounds`` rounds."""
    from aiohttp import web  # noqa: PLC0415

    from proxy.cli import parse_args  # noqa: PLC0415
    from proxy.http.app import build_app  # noqa: PLC0415

    sims = [_start_sim(role, tree, itl_ms) for role in ("prefill", "decode")]
    runner: web.AppRunner | None = None
    try:
        settings = parse_args(["--host", "127.0.0.1", "--port", "0", "--prefill", sims[0][1],
                               "--decode", sims[1][1], "--log-level", "warning", *proxy_args])
        runner = web.AppRunner(build_app(settings))
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        async with load_client(port, count, stream, rounds) as one_round:
            yield one_round
    finally:
        if runner is not None:
            await runner.cleanup()
        for proc, _ in sims:
            proc.terminate()
            proc.wait()


async def measure(count: int, stream: bool, tree: str, proxy_args: Sequence[str] = (),
                  itl_ms: float = 0.0) -> dict[str, Any]:
    async with loaded_proxy(count, stream, tree, proxy_args, itl_ms) as measured_round:
        loop = asyncio.get_running_loop()
        tasks = 0

        def factory(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, Any],
                    **kwargs: Any) -> asyncio.Task[Any]:
            nonlocal tasks
            tasks += 1
            return asyncio.Task(coro, loop=loop, **kwargs)

        loop.set_task_factory(factory)  # type: ignore[arg-type]
        profile = cProfile.Profile()
        profile.enable()
        try:
            await measured_round()
        finally:
            profile.disable()
            loop.set_task_factory(None)
        scheduling = _LoopCounts(tree)
        with scheduling.installed(loop):
            await measured_round()
        counter = _alloc_counter()
        allocations: int | None = None
        if counter is None:
            await measured_round()
        else:
            counter[0]()
            try:
                await measured_round()
            finally:
                allocations = counter[1]()
    calls: dict[str, float] = {}
    stats: dict[tuple[str, int, str], tuple[int, int, float, float, object]] = \
        pstats.Stats(profile).stats  # type: ignore[attr-defined]
    for (path, _line, name), (_cc, nc, _tt, _ct, _callers) in stats.items():
        key = _key(path, name, tree)
        calls[key] = calls.get(key, 0.0) + nc / count
    sources = {method: dict(sorted(((site, n / count) for site, n in by_site.items()), key=lambda kv: -kv[1]))
               for method, by_site in scheduling.sources.items()}
    counts = scheduling.counts
    return {"tree": tree, "stream": stream, "proxy_args": list(proxy_args), "requests": count,
            "tasks_per_request": tasks / count,
            "futures_per_request": counts["create_future"] / count,
            "timers_per_request": (counts["call_at"] + counts["call_later"]) / count,
            "handles_per_request": counts["call_soon"] / count,
            "objects_per_request": None if allocations is None else allocations / count,
            "sources_per_request": sources,
            "calls_per_request": dict(sorted(calls.items(), key=lambda kv: -kv[1]))}


_TOTALS = ("tasks", "futures", "timers", "handles", "objects")


def _shown(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _summary(result: dict[str, Any]) -> str:
    parts = [f"{sum(result['calls_per_request'].values()):.1f} calls"]
    parts += [f"{name} {_shown(result.get(f'{name}_per_request'))}" for name in _TOTALS]
    return ", ".join(parts)


def print_diff(a_path: str, b_path: str, top: int) -> None:
    a, b = (json.loads(Path(p).read_text()) for p in (a_path, b_path))
    ca, cb = a["calls_per_request"], b["calls_per_request"]
    print(f"calls per request: {sum(ca.values()):.1f} -> {sum(cb.values()):.1f}")
    for name in _TOTALS:  # runs written before a count existed lack its key
        va, vb = a.get(f"{name}_per_request"), b.get(f"{name}_per_request")
        print(f"{name} per request: {_shown(va)} -> {_shown(vb)}")
    sa, sb = a.get("sources_per_request", {}), b.get("sources_per_request", {})
    for method in sorted(set(sa) | set(sb)):
        ma, mb = sa.get(method, {}), sb.get(method, {})
        moved = sorted(((mb.get(k, 0.0) - ma.get(k, 0.0), k) for k in set(ma) | set(mb)),
                       key=lambda r: -abs(r[0]))
        for delta, site in moved[:top]:
            if abs(delta) >= 0.05:
                print(f"  {method}: {delta:+6.2f}  {ma.get(site, 0.0):6.2f} -> {mb.get(site, 0.0):6.2f}"
                      f"  {site}")
    rows = sorted(((cb.get(k, 0.0) - ca.get(k, 0.0), k) for k in set(ca) | set(cb)), key=lambda r: -abs(r[0]))
    for delta, key in rows[:top]:
        if abs(delta) >= 0.5:
            print(f"{delta:+8.2f}  {ca.get(key, 0.0):8.2f} -> {cb.get(key, 0.0):8.2f}  {key}")


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--out", type=Path, default=None, help="where to write the counts (JSON)")
    p.add_argument("--stream", action="store_true")
    p.add_argument("--itl-ms", type=float, default=0.0, help="the workers' time between tokens (0: none)")
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--uvloop", action="store_true", help="serve on uvloop, as pd-proxy does when installed")
    p.add_argument("--diff", nargs=2, metavar=("A", "B"), default=None)
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--proxy-args", default="", help="more pd-proxy flags for the measured proxy, "
                   "e.g. '--first-token-from-prefill off'")
    p.add_argument("--client", metavar="URL", default=None, help=argparse.SUPPRESS)
    p.add_argument("--client-rounds", type=int, default=_ROUNDS, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if not 1 <= a.requests <= _MAX_REQUESTS:
        p.error(f"--requests: 1 to {_MAX_REQUESTS}")
    if a.client:
        asyncio.run(_client(a.client, a.requests, a.stream, a.client_rounds))
        return
    if a.diff:
        print_diff(a.diff[0], a.diff[1], a.top)
        return
    if a.out is None:
        p.error("--out (or --diff) is required")
    import proxy  # noqa: PLC0415

    tree = os.path.dirname(os.path.dirname(os.path.realpath(proxy.__file__)))
    if a.uvloop:
        import uvloop  # noqa: PLC0415

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            result = runner.run(measure(a.requests, a.stream, tree, shlex.split(a.proxy_args), a.itl_ms))
    else:
        result = asyncio.run(measure(a.requests, a.stream, tree, shlex.split(a.proxy_args), a.itl_ms))
    a.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{result['tree']} (stream: {a.stream}), per request: {_summary(result)}")


if __name__ == "__main__":
    main()
