# shellcheck shell=bash
# Shared virtual-environment setup for scripts/run and scripts/test. Source it from the
# repository root (both scripts cd there first), then call `shmtier_venv run|test`.
#
# The venv lives in .venv/. Installs are skipped when .venv/.shmtier-<mode>.stamp holds the
# hash of everything that decides them (setup.cfg, setup.py, pyproject.toml,
# requirements/*.txt, the C extensions' sources, the
# Python version and, for tests, SHMTIER_SKIP_VLLM), so a second run starts at once.
#
# Environment:
#   SHMTIER_SKIP_VLLM=1   scripts/test: do not install vLLM (its conformance tests then skip)
#   PYTHON=python3.12     interpreter used to create .venv (default python3)

SHMTIER_VENV=.venv
SHMTIER_PY="$SHMTIER_VENV/bin/python"

_shmtier_log() { printf '[shmtier] %s\n' "$*" >&2; }

_shmtier_stamp_key() {  # $1 = mode
    {
        printf 'mode=%s\n' "$1"
        [[ $1 == test ]] && printf 'skip_vllm=%s\n' "${SHMTIER_SKIP_VLLM:-0}"
        "$SHMTIER_PY" -c 'import sys; print(sys.version)'
        cat setup.cfg setup.py pyproject.toml requirements/*.txt $(find shmtier -name '*.c' | LC_ALL=C sort)
    } | sha256sum | cut -d' ' -f1
}

shmtier_venv() {  # $1 = run | test
    local mode=$1 stamp key
    if ! "$SHMTIER_PY" -c 'import sys' >/dev/null 2>&1; then
        _shmtier_log "creating $SHMTIER_VENV"
        rm -rf "$SHMTIER_VENV"
        "${PYTHON:-python3}" -m venv "$SHMTIER_VENV"
    fi
    stamp="$SHMTIER_VENV/.shmtier-$mode.stamp"
    key=$(_shmtier_stamp_key "$mode")
    if [[ -f $stamp && $(<"$stamp") == "$key" ]]; then
        return 0
    fi
    rm -f "$stamp"
    local pip=("$SHMTIER_PY" -m pip --disable-pip-version-check)
    _shmtier_log "installing into $SHMTIER_VENV ($mode)"
    "${pip[@]}" install -q --upgrade pip
    # torch==2.13.0 (CPU) first: everything later that asks for torch is then satisfied and
    # pip never fetches a CUDA build.
    "${pip[@]}" install -q -r requirements/test.txt
    if [[ $mode == test ]]; then
        if [[ ${SHMTIER_SKIP_VLLM:-0} != 1 ]]; then
            _shmtier_log "installing vllm==0.33.0 (no deps) and requirements/vllm.txt"
            "${pip[@]}" install -q --no-deps vllm==0.33.0 -r requirements/vllm.txt
        fi
        "${pip[@]}" install -q -e '.[test]'
    else
        "${pip[@]}" install -q -e .
    fi
    printf '%s\n' "$key" >"$stamp"
    if [[ $mode == test ]]; then
        # the test install is a superset of the run install
        _shmtier_stamp_key run >"$SHMTIER_VENV/.shmtier-run.stamp"
    fi
}

# setup.cfg lists packages explicitly (workers/ is mapped to shmtier.workers, which `find:`
# cannot express). Fail loudly when a package folder is missing from that list, since an
# editable install would hide it and only a real `pip install .` would lose it.
shmtier_check_packages() {
    "$SHMTIER_PY" - <<'PY'
import configparser, os, sys

cfg = configparser.ConfigParser()
cfg.read("setup.cfg")
listed = {p.strip() for p in cfg["options"]["packages"].split() if p.strip()}
found = set()
for top, name in (("shmtier", "shmtier"), ("workers", "shmtier.workers")):
    for dirpath, dirnames, filenames in os.walk(top):
        dirnames[:] = [d for d in dirnames if d.isidentifier() and d != "__pycache__"]
        if any(f.endswith(".py") for f in filenames):
            rel = os.path.relpath(dirpath, top)
            found.add(name if rel == "." else name + "." + rel.replace(os.sep, "."))
missing, stale = sorted(found - listed), sorted(listed - found)
if missing or stale:
    if missing:
        print("setup.cfg [options] packages lacks: " + ", ".join(missing), file=sys.stderr)
    if stale:
        print("setup.cfg [options] packages lists folders with no code: " + ", ".join(stale), file=sys.stderr)
    print("update the list in setup.cfg so that `pip install .` ships every package", file=sys.stderr)
    sys.exit(1)
PY
}
