"""CurveZMQ keys of the ``p2p`` tier: key pairs in files or config, and the allow-list.

Runs in: the p2p endpoint process (its key pair and allow-list, for
:mod:`shmtier.tiers.p2p.endpoint.transport`), every process that builds the spec (the
tier's config check loads the key files), the scheduler process (the tier's scheduler
half reads its key pair and allow-list once, at start), and the operator's shell for the
command line below. Reads small files, never blocks on the
network. Imports pyzmq (for its Curve25519 key functions and certificate reader), not
torch or vLLM.

Every engine has one key pair: a 32-byte Curve25519 public key, which its peers list in
their allow-lists, and the secret key, which never leaves its host. Keys are written as
Z85 text (40 characters). Files use ZeroMQ's certificate format (czmq's and pyzmq's
``zmq.auth``), so keys made with ``zmq.auth.create_certificates`` or czmq's ``zcert``
load too::

    NAME.key          public certificate (0644): give it to the peers, who put it in
                      their allow-list directory
    NAME.key_secret   secret certificate (0600): public and secret key; stays here

A peer's allow-list is either a directory of ``*.key`` public certificates (every such
file is one admitted key; other files are ignored) or a list of Z85 public keys in the
config. An empty allow-list is an error: it would refuse every peer.

Command line (the operator's tool to make and inspect keys)::

    python -m shmtier.tiers.p2p.keys generate DIR NAME   # DIR/NAME.key, DIR/NAME.key_secret
    python -m shmtier.tiers.p2p.keys show FILE           # print the public key of a key file

Errors are :class:`KeyFileError` (a ``ValueError``): each names the file or config key and
what is wrong with it. A secret key file that others may read is loaded with a WARNING
(mounted secrets are often 0644; the operator should know, but it is not refused).
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import stat
import struct
import sys
from collections.abc import Iterable
from dataclasses import dataclass

import zmq
import zmq.auth
from zmq.utils import z85

__all__ = ["AllowList", "CurveKeyPair", "KeyFileError", "PUBLIC_SUFFIX", "SECRET_SUFFIX",
           "generate_keypair_files", "keypair_from_config", "load_keypair", "load_public_key",
           "parse_key"]

log = logging.getLogger(__name__)

PUBLIC_SUFFIX = ".key"
SECRET_SUFFIX = ".key_secret"
Z85_KEY_LEN = 40  # 32 bytes as Z85 text
RAW_KEY_LEN = 32


class KeyFileError(ValueError):
    """A key file, key string or allow-list that cannot be used; the message names it."""


@dataclass(frozen=True)
class CurveKeyPair:
    """One endpoint's Curve25519 keys as Z85 bytes (40 characters each); ``secret`` is
    None for a peer's public key alone. ``source`` says where they came from (a file
    path or a config key), for messages."""

    public: bytes
    secret: bytes | None = None
    source: str = ""

    def __repr__(self) -> str:  # never print a secret key
        return (f"CurveKeyPair(public={self.public.decode()!r}, "
                f"secret={'<set>' if self.secret else None}, source={self.source!r})")


def parse_key(value: str | bytes, what: str) -> bytes:
    """``value`` (Z85 text, 40 characters, str or bytes) checked and returned as Z85
    bytes. ``what`` names it in the error (a config key or a file)."""
    if isinstance(value, str):
        try:
            value = value.encode("ascii")
        except UnicodeEncodeError:
            raise KeyFileError(f"{what}: not a Z85 key (non-ASCII characters)") from None
    if not isinstance(value, bytes):
        raise KeyFileError(f"{what}: a key must be a Z85 string, got {type(value).__name__}")
    value = value.strip()
    if len(value) != Z85_KEY_LEN:
        raise KeyFileError(f"{what}: a Curve key is {Z85_KEY_LEN} Z85 characters, got "
                           f"{len(value)}")
    try:
        raw = z85.decode(value)
    except (ValueError, KeyError, IndexError, struct.error):
        raise KeyFileError(f"{what}: not valid Z85 text") from None
    if len(raw) != RAW_KEY_LEN:
        raise KeyFileError(f"{what}: decodes to {len(raw)} bytes, a Curve key has "
                           f"{RAW_KEY_LEN}")
    return value


def _public_of(secret: bytes, what: str) -> bytes:
    try:
        return zmq.curve_public(secret)
    except zmq.ZMQError as e:
        raise KeyFileError(f"{what}: cannot derive the public key from the secret key "
                           f"({e})") from None


def _read_certificate(path: str) -> tuple[bytes, bytes | None]:
    """(public, secret or None) of a ZeroMQ certificate file, errors naming the file."""
    if not os.path.exists(path):
        raise KeyFileError(f"p2p key file {path}: does not exist")
    if not os.path.isfile(path):
        raise KeyFileError(f"p2p key file {path}: not a regular file")
    try:
        public, secret = zmq.auth.load_certificate(path)
    except ValueError:
        raise KeyFileError(f"p2p key file {path}: no 'public-key = \"...\"' line (not a "
                           f"ZeroMQ certificate file)") from None
    except OSError as e:
        raise KeyFileError(f"p2p key file {path}: cannot read it ({e.strerror or e})") from None
    public = parse_key(public, f"p2p key file {path} (public-key)")
    if secret is not None:
        secret = parse_key(secret, f"p2p key file {path} (secret-key)")
    return public, secret


def load_public_key(path: str) -> bytes:
    """The public key (Z85 bytes) of a certificate file (public or secret one)."""
    return _read_certificate(os.fspath(path))[0]


def load_keypair(path: str) -> CurveKeyPair:
    """This endpoint's key pair from its secret certificate file (``NAME.key_secret``).

    Raises :class:`KeyFileError` when the file is missing, unreadable, not a certificate,
    holds no secret key, or holds a public key that does not belong to its secret key.
    Logs a WARNING when the file may be read by group or others."""
    path = os.fspath(path)
    public, secret = _read_certificate(path)
    if secret is None:
        raise KeyFileError(f"p2p key file {path}: holds no secret key (a public "
                           f"certificate; this endpoint needs its {SECRET_SUFFIX} file)")
    if _public_of(secret, f"p2p key file {path}") != public:
        raise KeyFileError(f"p2p key file {path}: its public key does not belong to its "
                           f"secret key")
    mode = stat.S_IMODE(os.stat(path).st_mode)
    if mode & 0o077:
        log.warning("p2p secret key file %s is readable by group or others (mode %04o); "
                    "chmod 600 it", path, mode)
    return CurveKeyPair(public, secret, path)


def keypair_from_config(secret_key: str | bytes, public_key: str | bytes | None = None, *,
                        what: str = "secret_key") -> CurveKeyPair:
    """A key pair from config strings: the Z85 secret key and, optionally, the public
    key (derived from the secret when absent; checked against it when given)."""
    secret = parse_key(secret_key, what)
    derived = _public_of(secret, what)
    if public_key is not None:
        public = parse_key(public_key, f"public key given with {what}")
        if public != derived:
            raise KeyFileError(f"{what}: the public key given with it does not belong "
                               f"to this secret key")
    return CurveKeyPair(derived, secret, f"config {what}")


def generate_keypair_files(directory: str, name: str, *,
                           overwrite: bool = False) -> tuple[str, str]:
    """Make a new key pair as ``DIR/NAME.key`` (0644) and ``DIR/NAME.key_secret``
    (0600, created with that mode: never readable by others, not even briefly).
    Returns (public path, secret path). Refuses to overwrite existing files unless
    ``overwrite``. ``directory`` is created (0700) if missing."""
    directory = os.fspath(directory)
    if not name or os.sep in name or name.startswith("."):
        raise KeyFileError(f"p2p key name {name!r}: must be a plain file name")
    os.makedirs(directory, mode=0o700, exist_ok=True)
    public, secret = zmq.curve_keypair()
    base = os.path.join(directory, name)
    public_path, secret_path = base + PUBLIC_SUFFIX, base + SECRET_SUFFIX
    now = datetime.datetime.now().isoformat(timespec="seconds")
    _write_cert(secret_path, 0o600, overwrite,
                f"#   ****  Generated on {now} by shmtier  ****\n"
                "#   ZeroMQ CURVE **Secret** Certificate\n"
                "#   DO NOT PROVIDE THIS FILE TO OTHER USERS nor change its permissions.\n\n"
                f"metadata\ncurve\n    public-key = \"{public.decode()}\"\n"
                f"    secret-key = \"{secret.decode()}\"\n")
    _write_cert(public_path, 0o644, overwrite,
                f"#   ****  Generated on {now} by shmtier  ****\n"
                "#   ZeroMQ CURVE Public Certificate\n"
                "#   Give it to the peers that should admit this engine (their allow-list).\n\n"
                f"metadata\ncurve\n    public-key = \"{public.decode()}\"\n")
    return public_path, secret_path


def _write_cert(path: str, mode: int, overwrite: bool, text: str) -> None:
    flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if overwrite else os.O_EXCL)
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW, mode)
    except FileExistsError:
        raise KeyFileError(f"p2p key file {path}: exists already (not overwritten)") from None
    try:
        os.fchmod(fd, mode)  # the umask may have taken bits off; an old file kept its mode
        os.write(fd, text.encode())
    finally:
        os.close(fd)


class AllowList:
    """The public keys (Z85) a server admits at the CurveZMQ handshake.

    Built once by the process that runs a
    :class:`~shmtier.tiers.p2p.endpoint.transport.ChunkServer`
    (``from_directory`` reads files; ``from_keys`` checks config strings). Membership
    tests (``key in allow``, Z85 text or the 32 raw bytes the handshake gives) are a set
    lookup."""

    def __init__(self, keys: Iterable[str | bytes], source: str = "config"):
        self.source = source
        found = {parse_key(k, f"{source} entry {i}") for i, k in enumerate(keys)}
        if not found:
            raise KeyFileError(f"p2p allow-list {source}: no public keys (it would refuse "
                               f"every peer)")
        self._keys = frozenset(found)

    @classmethod
    def from_keys(cls, keys: Iterable[str | bytes], source: str = "allowed_keys") -> "AllowList":
        """From Z85 public keys given in the config (``source`` names the config key)."""
        if isinstance(keys, (str, bytes)):
            raise KeyFileError(f"p2p allow-list {source}: a list of Z85 public keys, got "
                               f"one string")
        return cls(keys, source)

    @classmethod
    def from_directory(cls, directory: str) -> "AllowList":
        """Every ``*.key`` public certificate in ``directory`` (not its subdirectories)."""
        directory = os.fspath(directory)
        if not os.path.isdir(directory):
            problem = "not a directory" if os.path.exists(directory) else "does not exist"
            raise KeyFileError(f"p2p allow-list directory {directory}: {problem}")
        paths = sorted(os.path.join(directory, n) for n in os.listdir(directory)
                       if n.endswith(PUBLIC_SUFFIX))
        if not paths:
            raise KeyFileError(f"p2p allow-list directory {directory}: no *{PUBLIC_SUFFIX} "
                               f"public key files (it would refuse every peer)")
        return cls([load_public_key(p) for p in paths], f"directory {directory}")

    def __contains__(self, key: str | bytes) -> bool:
        if isinstance(key, str):
            key = key.encode("ascii", "replace")
        if len(key) == RAW_KEY_LEN:
            key = z85.encode(key)
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def __iter__(self):
        return iter(sorted(self._keys))

    def __repr__(self) -> str:
        return f"AllowList({len(self._keys)} keys from {self.source})"


def _main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m shmtier.tiers.p2p.keys",
        description="Make and inspect CurveZMQ keys for shmtier's p2p tier.")
    sub = parser.add_subparsers(dest="cmd", required=True)
    gen = sub.add_parser("generate", help="make DIR/NAME.key (public) and "
                                          "DIR/NAME.key_secret (secret, 0600)")
    gen.add_argument("directory")
    gen.add_argument("name")
    gen.add_argument("--overwrite", action="store_true")
    show = sub.add_parser("show", help="print the public key of a key file")
    show.add_argument("file")
    args = parser.parse_args(argv)
    try:
        if args.cmd == "generate":
            public_path, secret_path = generate_keypair_files(args.directory, args.name,
                                                              overwrite=args.overwrite)
            print(f"public key {load_public_key(public_path).decode()}")
            print(f"wrote {public_path} (give it to the peers' allow-lists) and "
                  f"{secret_path} (secret, 0600: keep it on this host)")
        else:
            print(load_public_key(args.file).decode())
    except KeyFileError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(_main())
