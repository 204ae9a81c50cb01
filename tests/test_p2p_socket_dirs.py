"""The p2p tier's socket directories (shmtier/tiers/p2p/socket_dirs.py): a directory whose
owner died is removed (by the guardian's ``engine_died`` and by ``shmtier clean``), one
whose owner runs never is, nor anything that is not a socket directory of this user's;
``shmtier clean`` alone also removes an idle one of an older shmtier (no owner file).
The guardian's part with a real engine SIGKILLed together with its endpoint is in
tests/test_p2p_tier.py (``test_producer_killed_mid_transfer``)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import pytest

from shmtier.cli import main
from shmtier.options import ConfigError
from shmtier.tiers.p2p import socket_dirs
from shmtier.tiers.p2p.socket_dirs import OWNER_FILE, UNOWNED_GRACE_S, P2PFsck

_MAKE_AND_EXIT = ("import sys; from shmtier.tiers.p2p import socket_dirs; "
                  "print(socket_dirs.make(sys.argv[1], sys.argv[2]))")


def made_by_a_dead_process(engine_id: str, tmp_dir: str) -> str:
    """A socket directory made by a process that has exited since."""
    out = subprocess.run([sys.executable, "-c", _MAKE_AND_EXIT, engine_id, tmp_dir],
                         capture_output=True, text=True, timeout=60, check=True)
    return out.stdout.strip()


def age(path: str, seconds: float) -> None:
    """Make ``path`` and what is in it look last written ``seconds`` ago."""
    then = time.time() - seconds
    for entry in os.scandir(path):
        os.utime(entry.path, (then, then), follow_symlinks=False)
    os.utime(path, (then, then))


def test_a_directory_names_its_engine_and_its_owner(tmp_path):
    path = socket_dirs.make("llm_dp1", str(tmp_path))
    try:
        assert os.path.basename(path).startswith("shmtier-p2p-llm_dp1-")
        assert socket_dirs.engine_of(path) == "llm_dp1"
        assert os.stat(path).st_mode & 0o777 == 0o700
        with open(os.path.join(path, OWNER_FILE)) as f:
            owner = json.load(f)
        assert owner["pid"] == os.getpid() and owner["start"] > 0 and len(owner["boot"]) == 32
        assert sorted(os.listdir(path)) == [OWNER_FILE]  # no temp file left
        assert socket_dirs.stale(str(tmp_path)) == []  # its owner (this process) runs
    finally:
        shutil.rmtree(path)


def test_only_directories_of_dead_owners_are_removed(tmp_path):
    base = str(tmp_path)
    live = socket_dirs.make("live", base)
    dead = made_by_a_dead_process("dead", base)
    other_dead = made_by_a_dead_process("dead-too", base)
    # without an owner file: an older shmtier's, live (written just now) and idle; someone
    # else's directory under the prefix (this suite's key directories are), idle too
    fresh = os.path.join(base, "shmtier-p2p-fresh-abcd1234")
    old = os.path.join(base, "shmtier-p2p-old-abcd1234")
    keys = os.path.join(base, "shmtier-p2p-keys-abcd1234")
    for d in (fresh, old, keys):
        os.mkdir(d, 0o700)
        open(os.path.join(d, "ep1.sock"), "w").close()
        with open(os.path.join(d, "status.json"), "w") as f:
            f.write("{}")
    os.mkdir(os.path.join(keys, "a"))
    for d in (old, keys):
        age(d, UNOWNED_GRACE_S + 5)
    # not socket directories: a file, a link to a dead owner's directory, another prefix
    plain = os.path.join(base, "shmtier-p2p-file-abcd1234")
    open(plain, "w").close()
    link = os.path.join(base, "shmtier-p2p-link-abcd1234")
    os.symlink(dead, link)
    foreign = os.path.join(base, "shmtier-e2e-x")
    os.mkdir(foreign)

    assert socket_dirs.stale(base) == sorted([dead, other_dead])  # the guardian's
    assert socket_dirs.stale(base, unowned=True) == sorted([dead, other_dead, old])
    assert socket_dirs.stale(base, engine_ids={"dead"}) == [dead]
    assert socket_dirs.remove_stale(base, engine_ids={"dead"}) == [dead]
    assert socket_dirs.remove_stale(base) == [other_dead]
    assert socket_dirs.remove_stale(base, unowned=True) == [old]
    assert sorted(os.listdir(base)) == sorted(
        os.path.basename(p) for p in (live, fresh, keys, plain, link, foreign))
    assert socket_dirs.remove_stale(base, unowned=True) == []


def test_a_torn_owner_file_leaves_the_directory_alone(tmp_path):
    path = made_by_a_dead_process("torn", str(tmp_path))
    with open(os.path.join(path, OWNER_FILE), "w") as f:
        f.write('{"pid": 12')  # not shmtier's writing (it renames a whole file in place)
    age(path, UNOWNED_GRACE_S + 5)
    assert socket_dirs.stale(str(tmp_path), unowned=True) == []


@pytest.fixture
def temp_dir_of_this_process(tmp_path, monkeypatch):
    """``tempfile.gettempdir()`` is ``tmp_path`` (the guardian and the CLI look there)."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return str(tmp_path)


def test_engine_died_removes_what_dead_engines_left(temp_dir_of_this_process):
    base = temp_dir_of_this_process
    live = socket_dirs.make("live", base)
    dead = made_by_a_dead_process("dead", base)
    lines = P2PFsck("p2p").engine_died([])
    assert lines == [f"p2p socket directory {dead}: its engine died; removed"]
    assert os.listdir(base) == [os.path.basename(live)]


def test_shmtier_clean_removes_them(temp_dir_of_this_process):
    base = temp_dir_of_this_process
    mine = made_by_a_dead_process("cm", base)
    other = made_by_a_dead_process("co", base)
    older = os.path.join(base, "shmtier-p2p-co-abcd1234")  # an older shmtier's
    os.mkdir(older)
    open(os.path.join(older, "ep3.sock"), "w").close()
    age(older, UNOWNED_GRACE_S + 5)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["clean", "cm"])  # only that engine's
    assert code == 0 and f"removed {mine}" in out.getvalue(), out.getvalue()
    assert not os.path.exists(mine) and os.path.exists(other)
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["clean", "co"]) == 0
    assert os.listdir(base) == []


def test_a_socket_path_too_long_for_a_unix_socket_is_a_config_error(tmp_path):
    """The endpoint's socket would not bind (107 bytes at most): the tier refuses to start
    with an error naming TMPDIR, before it makes anything."""
    deep = tmp_path / ("d" * 60)
    deep.mkdir()
    with pytest.raises(ConfigError, match=r"set TMPDIR to a shorter directory.*"
                                          r"or give the engine a shorter id") as e:
        socket_dirs.make("e" * 40, str(deep))
    assert str(deep) in str(e.value) and "107" in str(e.value)
    assert os.listdir(deep) == []
    path = socket_dirs.make("e", str(tmp_path))  # a short one is fine
    assert len(os.path.join(path, socket_dirs.LONGEST_SOCKET)) <= socket_dirs.SOCKET_PATH_MAX
