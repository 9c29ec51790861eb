#!/usr/bin/env bash
# Install tailguard (editable) into a virtual environment, quietly, with a live
# elapsed-time line when stdout is a terminal (pip -q is silent for a minute).
#   scripts/install.sh VENV SPEC        e.g.  scripts/install.sh .venv '.[dev]'
# pip's own output goes to a log that is printed only if the install fails.
set -euo pipefail
venv=$1
spec=$2
py=${PY:-python3}

[ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
log=$(mktemp)
trap 'rm -f "$log"' EXIT
start=$SECONDS
echo "installing tailguard ($spec) into $venv (once)"
"$venv/bin/python" -m pip install -q --disable-pip-version-check -e "$spec" >"$log" 2>&1 &
pid=$!
if [ -t 1 ]; then
    while kill -0 "$pid" 2>/dev/null; do
        printf '\r  installing... %3d s' $((SECONDS - start))
        sleep 1
    done
    printf '\r\033[K'
fi
if ! wait "$pid"; then
    cat "$log" >&2
    echo "install failed (pip's log above)" >&2
    exit 1
fi
echo "installed in $((SECONDS - start)) s"
