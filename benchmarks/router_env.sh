#!/usr/bin/env bash
# Installs vllm-router (the vLLM project's Rust P/D router) into its own virtual environment, apart
# from the project's, for the router comparison (python -m benchmarks.compare_routers).
# Idempotent: when the environment already holds the pinned version it does nothing.
#
#   bash benchmarks/router_env.sh [VENV_DIR]      (default .venv-router; env PYTHON picks the interpreter)
set -euo pipefail

VENV="${1:-${ROUTER_VENV:-.venv-router}}"
VERSION="0.1.17"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null 2>&1 || PY=python3

installed_version() {
    "$VENV/bin/python" - <<'EOF' 2>/dev/null
import importlib.metadata as m
print(m.version("vllm-router"))
EOF
}

if [ -x "$VENV/bin/vllm-router" ] && [ "$(installed_version || true)" = "$VERSION" ]; then
    echo "vllm-router $VERSION already installed in $VENV"
    exit 0
fi

"$PY" -m venv "$VENV"
"$VENV/bin/pip" install --quiet --disable-pip-version-check "vllm-router==$VERSION"
# The wheel ships the Rust router as a Python extension (vllm_router_rs); check that it loads.
"$VENV/bin/python" -c "import vllm_router_rs" >/dev/null
test "$(installed_version)" = "$VERSION"
echo "vllm-router $VERSION installed in $VENV"
