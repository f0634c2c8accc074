#!/usr/bin/env bash
# Make a `prometheus` binary available for `make up` when this machine allows it (Debian's package).
# Idempotent (does nothing when one is on PATH) and never fails the caller: when it cannot install
# (not root, no apt, no candidate, apt errors) it says why and `make up` runs without Prometheus.
set -u

say() { echo "install_prometheus: $*"; }

if command -v prometheus >/dev/null 2>&1; then
    say "using $(command -v prometheus) (already installed)"
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1 || ! command -v apt-cache >/dev/null 2>&1; then
    say "SKIPPED: no prometheus binary and no apt-get here; install Prometheus yourself to get scraping"
    exit 0
fi
if [ "$(id -u)" != "0" ]; then
    say "SKIPPED: no prometheus binary and not root; run 'sudo apt-get install prometheus' to get scraping"
    exit 0
fi

candidate() { apt-cache policy prometheus 2>/dev/null | awk '/Candidate:/ {print $2}'; }

say "apt-cache policy prometheus: candidate '$(candidate)'; refreshing the package lists once"
if ! DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null 2>&1; then
    say "SKIPPED: apt-get update failed (no network to the Debian mirror?)"
    exit 0
fi
version="$(candidate)"
if [ -z "$version" ] || [ "$version" = "(none)" ]; then
    say "SKIPPED: apt has no 'prometheus' package here"
    exit 0
fi
say "installing Debian package prometheus $version"
log="$(mktemp)"
if DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends prometheus >"$log" 2>&1; then
    say "installed $(command -v prometheus)"
else
    say "SKIPPED: apt-get install prometheus failed; last lines:"
    tail -n 5 "$log"
fi
rm -f "$log"
exit 0
