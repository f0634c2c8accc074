"""``pd-proxy``: run the proxy in front of prefill and decode pools."""

from __future__ import annotations

import argparse
import hmac
import ipaddress
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from proxy.config.config_file import CONFIG_FLAG, HelpFormatter, with_config_file
from proxy.config.logs import EscapingFormatter
from proxy.config.settings import AUTO, ProxySettings
from proxy.config.table import add_arguments, secret_flags, settings_from_args
from proxy.http.multiproc import available_cpus
from proxy.http.server import serve
from proxy.observe.tracing import otel_installed
from proxy.pools import normalize_url

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"
log = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    """Every flag of pd-proxy, each with a help line; ``--help`` adds its default. The settings' flags
    come from their declarations (``proxy.config.table``)."""
    p = argparse.ArgumentParser(prog="pd-proxy", description=__doc__, formatter_class=HelpFormatter)
    p.add_argument(CONFIG_FLAG, type=Path, default=None, metavar="FILE",
                   help="read settings from this YAML file, keys being the long flag names (decode-timeout: "
                        "900); flags given here win; secrets only from the environment or key files")
    add_arguments(p)
    return p


def resolve_workers(value: int | str) -> tuple[int, str]:
    """The process count for ``--workers`` and how it was reached, for the start-up log."""
    if value != AUTO:
        return int(value), f"--workers {value}"
    cpus = available_cpus()
    return cpus.count, f"--workers auto: {cpus.describe()}"


def parse_args(argv: Sequence[str] | None = None) -> ProxySettings:
    return parse_args_explained(argv)[0]


def parse_args_explained(argv: Sequence[str] | None = None) -> tuple[ProxySettings, str]:
    """The settings, and how ``--workers`` came to its process count."""
    p = build_parser()
    a = p.parse_args(with_config_file(p, sys.argv[1:] if argv is None else argv))
    if a.otel and not otel_installed():
        p.error("--otel needs the OpenTelemetry packages: pip install 'pd-proxy[otel]'")
    logging.basicConfig(level=a.log_level.upper(), format=LOG_FORMAT)
    for handler in logging.getLogger().handlers:
        handler.setFormatter(EscapingFormatter(LOG_FORMAT))
    try:
        for url in (*a.prefill_urls, *a.decode_urls):
            normalize_url(url)
        a.workers, why = resolve_workers(a.workers)
        if a.workers > 1 and not a.abort_unknown_broadcast:
            raise ValueError(f"{why} gives {a.workers} processes, and several processes need the abort "
                             "broadcast (an abort may reach another process): drop --no-abort-broadcast "
                             "or give --workers 1")
        settings = settings_from_args(a, os.environ)
        _check_admin(settings)
        return settings, why
    except ValueError as e:
        p.error(str(e))


def _check_admin(s: ProxySettings) -> None:
    """``ValueError`` for an admin key that is also a client key, or an admin port that is the main one."""
    pools = s.pools
    if pools.admin_key is not None and any(hmac.compare_digest(pools.admin_key.encode(), k.encode())
                                           for _, k in s.api_keys):
        raise ValueError("the admin key is also a client API key: every tenant could change the "
                         "pools; use a key of its own")
    if pools.admin_port and pools.admin_port == s.port and pools.admin_host == s.host:
        raise ValueError("--admin-port must differ from --port (the admin API's own listener)")


def is_loopback(host: str) -> bool:
    """``localhost`` or a loopback address (127.0.0.0/8, ::1); any other name or address is not."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def warn_if_unguarded(settings: ProxySettings) -> None:
    """A WARNING when the proxy listens beyond loopback with no client API key (anyone who can reach
    the port may then generate and abort requests)."""
    if settings.client_keys() or is_loopback(settings.host):
        return
    log.warning("pd-proxy listens on %s:%d with no client API key: anyone who can reach it may generate "
                "and abort requests; set --api-key or PD_PROXY_API_KEY", settings.host, settings.port)


def warn_keys_on_command_line(argv: Sequence[str]) -> None:
    """A WARNING for each key flag given on the command line, naming the flag, never the key."""
    given = {arg.split("=", 1)[0] for arg in argv}
    for flag, instead in secret_flags():
        if flag in given:
            log.warning("%s on the command line: any local user can read it in ps or /proc; "
                        "give it with %s", flag, instead)


def log_processes(settings: ProxySettings, why: str) -> None:
    """The process count at start-up, how it was reached, and that the limits hold per process."""
    n = settings.workers
    inflight = settings.pools.max_inflight
    total = "no limit" if inflight is None else f"{inflight} per process, up to {n * inflight} in all"
    log.info("pd-proxy: %d process%s (%s); limits hold per process: --max-inflight %s, and "
             "--max-queue, --max-inflight-per-worker and the byte budgets likewise",
             n, "" if n == 1 else "es", why, total)


def main(argv: Sequence[str] | None = None) -> None:
    settings, why = parse_args_explained(argv)
    warn_keys_on_command_line(sys.argv[1:] if argv is None else argv)
    warn_if_unguarded(settings)
    log_processes(settings, why)
    if settings.workers > 1:
        from proxy.http.multiproc import run_workers  # noqa: PLC0415

        raise SystemExit(run_workers(settings, settings.workers))
    serve(settings)


if __name__ == "__main__":
    main()
