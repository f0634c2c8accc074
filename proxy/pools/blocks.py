"""Each worker's KV block size, learned from the worker itself.

vLLM exposes its cache configuration on ``/metrics`` as an info gauge::

    vllm:cache_config_info{block_size="16",engine="0",...} 1.0

(pd-sim exposes the same series). The block size drives the short-prompt bypass (a prompt shorter
than one block of the prefill worker that would take it skips the prefill hop), the prefix policy's
key (the prompt's first blocks), the pair preflight's prompt (one block and a token) and the
``pd_proxy_suspect_no_transfer_total`` counter (prompts of at least one block of the pair).

GPU vLLM's block is 16 tokens, the CPU build's 128; one setting for every worker would be wrong for
one of them, so :class:`BlockSizeLearner` reads each worker's ``/metrics`` once (again after the
worker failed its probes: it may come back with another configuration). ``--kv-block-size`` is an
override for every worker (then nothing is read). Until a worker's size is known, it counts as
:data:`FALLBACK_BLOCK_SIZE`, the smallest common one: a short prompt then goes through the prefill
hop (a correct answer, a little work wasted) instead of silently skipping it.

Each worker's model length is learned alike (:class:`ModelLenLearner`), from vLLM's
``GET /v1/models`` (each card's ``max_model_len``, behind the workers' API key), whether
``--kv-block-size`` is set or not; ``--max-model-len`` overrides it. A prompt that leaves room for
one token only on every decode worker ends at the prefill worker's token (``proxy.stream.first_stream``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
from collections.abc import Awaitable, Callable, Iterable, Sequence

import aiohttp

from proxy.pools.worker import Worker
from proxy.upstream.capped import AnswerTooLarge

log = logging.getLogger(__name__)

CACHE_CONFIG_INFO = "vllm:cache_config_info"
FALLBACK_BLOCK_SIZE = 16
"""A worker's block size until it is known: vLLM's default on GPUs, the smallest in common use."""

FetchFn = Callable[[Worker], Awaitable[str]]
_BLOCK_SIZE_LABEL = re.compile(r'[{,]block_size="(\d+)"')


def parse_block_size(text: str) -> int | None:
    """The ``block_size`` label of ``vllm:cache_config_info`` in a ``/metrics`` page (the largest
    when several engines disagree), or None when the page has none. Only that series' lines are
    read: a vLLM page is ~750 lines (65 kB), and prometheus_client's parser would hold the event
    loop for ~20 ms per worker on it. In the exposition format a quote inside a label value is
    escaped (``\\"``), so ``,block_size="`` or ``{block_size="`` can only start that label."""
    sizes: list[int] = []
    key, at = "\n" + CACHE_CONFIG_INFO + "{", 0
    text = "\n" + text
    while (at := text.find(key, at)) >= 0:
        end = text.find("\n", at + 1)
        line = text[at:end] if end >= 0 else text[at:]
        sizes += [int(v) for v in _BLOCK_SIZE_LABEL.findall(line) if int(v) > 0]
        at += 1
    return max(sizes) if sizes else None


class BlockSizes:
    """The block size the proxy uses for each worker: ``override`` (``--kv-block-size``) when set,
    else what the worker said (``Worker.block_size``), else :data:`FALLBACK_BLOCK_SIZE`."""

    def __init__(self, override: int | None = None, fallback: int = FALLBACK_BLOCK_SIZE) -> None:
        if override is not None and override < 1:
            raise ValueError("the KV block size must be at least 1")
        self.override = override
        self.fallback = fallback

    @property
    def learning(self) -> bool:
        """Whether the workers' sizes are read from them (no override)."""
        return self.override is None

    def of(self, worker: Worker | None) -> int:
        if self.override is not None:
            return self.override
        if worker is None or worker.block_size is None:
            return self.fallback
        return worker.block_size

    def pair(self, prefill: Worker | None, decode: Worker | None) -> int:
        """A pair's block: the larger of its two (a prompt shorter than it fills no block of one side)."""
        return max(self.of(prefill), self.of(decode))

    def smallest(self, workers: Iterable[Worker]) -> int:
        """The smallest block among ``workers`` (the fallback for none)."""
        return min((self.of(w) for w in workers), default=self.of(None))


class WorkerLearner:
    """Reads one value of every worker that does not know it yet, at once when woken (a worker
    joined) and every ``interval`` seconds: one bounded fetch per worker and round, never on a
    request's path. A worker whose answer has no value (another server, a 4xx, a page it cannot
    read) is logged once and left out until it is forgotten (it failed its probes, or left and
    came back); one unreachable for now is asked again at the next round."""

    what = ""
    """What is learned, for the logs."""

    def __init__(self, pools: Sequence[Iterable[Worker]], fetch: FetchFn) -> None:
        self.pools = list(pools)
        self.fetch = fetch
        self._silent: set[tuple[str, str]] = set()
        self._wake = asyncio.Event()

    def known(self, worker: Worker) -> int | None:
        raise NotImplementedError

    def store(self, worker: Worker, value: int | None) -> None:
        raise NotImplementedError

    def parse(self, text: str) -> int | None:
        raise NotImplementedError

    def missing(self, worker: Worker, why: str) -> None:
        """Log (once per worker until forgotten) why its value cannot be learned."""
        raise NotImplementedError

    def unknown(self) -> list[Worker]:
        return [w for pool in self.pools for w in pool
                if self.known(w) is None and (w.pool, w.url) not in self._silent]

    def forget(self, worker: Worker) -> None:
        """Read the worker's value again (it may have restarted with another configuration)."""
        self.store(worker, None)
        self._silent.discard((worker.pool, worker.url))
        self.wake()

    def wake(self) -> None:
        self._wake.set()

    async def _one(self, worker: Worker) -> None:
        try:
            value = self.parse(await self.fetch(worker))
            why = "" if value is not None else "none in its answer"
        except AnswerTooLarge as e:  # not the expected page: read again only after a restart
            value, why = None, str(e)
        except aiohttp.ClientResponseError as e:
            if e.status >= 500:
                return  # failing for now: tried again at the next round
            value, why = None, f"its answer was {e.status}"
        except (aiohttp.ClientError, TimeoutError, OSError):
            return  # unreachable for now: tried again at the next round
        except ValueError as e:  # not the expected page (not JSON)
            value, why = None, str(e) or type(e).__name__
        if value is None:
            self._silent.add((worker.pool, worker.url))
            self.missing(worker, why)
            return
        if self.known(worker) != value:
            log.info("%s worker %s: %s %d", worker.pool, worker.url, self.what, value)
        self.store(worker, value)

    async def learn_once(self) -> None:
        await asyncio.gather(*(self._one(w) for w in self.unknown()))

    async def run(self, interval: float) -> None:
        if interval <= 0:
            raise ValueError("interval must be positive")
        while True:
            self._wake.clear()
            try:
                await self.learn_once()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("learning the workers' %s failed", self.what)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(interval):
                    await self._wake.wait()


class BlockSizeLearner(WorkerLearner):
    """Each worker's KV block size, from its ``/metrics``; a worker without
    ``vllm:cache_config_info`` keeps the fallback."""

    what = "KV block size"

    def known(self, worker: Worker) -> int | None:
        return worker.block_size

    def store(self, worker: Worker, value: int | None) -> None:
        worker.block_size = value

    def parse(self, text: str) -> int | None:
        return parse_block_size(text)

    def missing(self, worker: Worker, why: str) -> None:
        log.warning("%s worker %s: no %s on its /metrics; its KV block size counts as %d "
                    "(set --kv-block-size to override)", worker.pool, worker.url, CACHE_CONFIG_INFO,
                    FALLBACK_BLOCK_SIZE)


# -- the model length -------------------------------------------------------------------------

MODELS_PATH = "/v1/models"
MODELS_BODY_LIMIT = 1024 * 1024
"""The most of a ``/v1/models`` answer read (one model's card is ~450 bytes)."""


def parse_max_model_len(text: str) -> int | None:
    """The ``max_model_len`` a ``GET /v1/models`` answer gives (vLLM: one card per served name,
    all of one engine; the largest when they differ, so that no stream is ended early), or None
    when it gives none. ``ValueError`` when it is not JSON."""
    page = json.loads(text)
    cards = page.get("data") if isinstance(page, dict) else None
    lens = [c["max_model_len"] for c in cards if isinstance(c, dict)
            and type(c.get("max_model_len")) is int and c["max_model_len"] > 0] \
        if isinstance(cards, list) else []
    return max(lens) if lens else None


class ModelLenLearner(WorkerLearner):
    """Each worker's model length (prompt and output tokens together), from its
    ``GET /v1/models`` (sent with the workers' API key). Unknown (None) until read: nothing is
    then decided on it."""

    what = "max_model_len"

    def known(self, worker: Worker) -> int | None:
        return worker.max_model_len

    def store(self, worker: Worker, value: int | None) -> None:
        worker.max_model_len = value

    def parse(self, text: str) -> int | None:
        return parse_max_model_len(text)

    def missing(self, worker: Worker, why: str) -> None:
        log.warning("%s worker %s: no max_model_len from its %s (%s); its model length is unknown "
                    "(set --max-model-len to give it)", worker.pool, worker.url, MODELS_PATH, why)


class ModelLens:
    """The model length the proxy uses for each worker: ``override`` (``--max-model-len``) when
    set, else what the worker said (``Worker.max_model_len``), else None (unknown)."""

    def __init__(self, override: int | None = None) -> None:
        if override is not None and override < 1:
            raise ValueError("the model length must be at least 1")
        self.override = override

    @property
    def learning(self) -> bool:
        return self.override is None

    def of(self, worker: Worker) -> int | None:
        return self.override if self.override is not None else worker.max_model_len

    def one_token_left(self, prompt_tokens: int, workers: Iterable[Worker]) -> bool:
        """Whether a prompt of ``prompt_tokens`` leaves room for one generated token at most on
        every one of ``workers`` (each length known; False for none): any of them ends the
        request at its first token with ``length``."""
        if self.override is not None:
            return prompt_tokens + 1 >= self.override
        lens = [w.max_model_len for w in workers]
        return bool(lens) and all(n is not None and prompt_tokens + 1 >= n for n in lens)
