"""Each worker's KV block size (from ``vllm:cache_config_info`` on its ``/metrics``) and model
length (from ``GET /v1/models``), learned from the worker itself; ``--kv-block-size`` and
``--max-model-len`` override them (proxy/pools/README.md, "KV block sizes"). An unknown block size
counts as the smallest common one, so a short prompt goes through the prefill hop."""

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
    """The largest ``block_size`` of ``vllm:cache_config_info`` in a ``/metrics`` page, or None.
    Only that series' lines are read; an escaped quote means ``,block_size="`` only starts a label."""
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
    """Each worker's block size: ``override``, else the worker's, else the fallback."""

    def __init__(self, override: int | None = None, fallback: int = FALLBACK_BLOCK_SIZE) -> None:
        if override is not None and override < 1:
            raise ValueError("the KV block size must be at least 1")
        self.override = override
        self.fallback = fallback

    @property
    def learning(self) -> bool:
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
        return min((self.of(w) for w in workers), default=self.of(None))


class WorkerLearner:
    """Reads one value of every worker that lacks it, when woken and every ``interval`` seconds,
    never on a request's path. A worker whose answer has no value is left out until forgotten;
    one unreachable for now is asked again at the next round."""

    what = ""

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
        raise NotImplementedError

    def unknown(self) -> list[Worker]:
        return [w for pool in self.pools for w in pool
                if self.known(w) is None and (w.pool, w.url) not in self._silent]

    def forget(self, worker: Worker) -> None:
        """Read the worker's value again (it may have restarted)."""
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


MODELS_PATH = "/v1/models"
MODELS_BODY_LIMIT = 1024 * 1024


def parse_max_model_len(text: str) -> int | None:
    """The largest ``max_model_len`` of the cards (no stream is ended early), or None; ``ValueError``
    when it is not JSON."""
    page = json.loads(text)
    cards = page.get("data") if isinstance(page, dict) else None
    lens = [c["max_model_len"] for c in cards if isinstance(c, dict)
            and type(c.get("max_model_len")) is int and c["max_model_len"] > 0] \
        if isinstance(cards, list) else []
    return max(lens) if lens else None


class ModelLenLearner(WorkerLearner):
    """Each worker's model length; nothing is decided on it until it is read."""

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
        """Whether the prompt leaves room for one generated token at most on every one of
        ``workers``, each length known (False for none)."""
        if self.override is not None:
            return prompt_tokens + 1 >= self.override
        lens = [w.max_model_len for w in workers]
        return bool(lens) and all(n is not None and prompt_tokens + 1 >= n for n in lens)
