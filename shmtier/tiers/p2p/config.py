"""``p2p`` tier options (any process): what ``secondary_tiers[i]`` of type ``p2p`` accepts.

vLLM's keys (contract §10.4): ``host``, ``port``, ``backends``, ``num_threads``,
``unbound_store_timeout_s``; and shmtier's: the CurveZMQ key pair and allow-list,
``peers`` (which public key a peer's server has), ``plaintext``, and the endpoint's
deadlines. Key files are read and checked here, when the spec is built, so a missing or
wrong key fails naming its option before any process or socket is made; the scheduler
half reads them again at start and hands them to its endpoint process in its settings
(``P2PTierManager._settings``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from shmtier.options import (
    Check,
    ConfigError,
    Secret,
    SecretCheck,
    boolean,
    integer,
    number,
    secret_plain,
    text,
)
from shmtier.tiers.config import TierConfig, TierContext, option

DEFAULT_HOST = os.environ.get("VLLM_P2P_SIDE_CHANNEL_HOST", "localhost")
DEFAULT_PORT = int(os.environ.get("VLLM_P2P_SIDE_CHANNEL_PORT", "5710") or 5710)
BACKENDS = ("zmq", "UCX")


def _backends() -> Check:
    def convert(v):
        if isinstance(v, str):
            v = [v]
        if not isinstance(v, (list, tuple)) or not v:
            raise ValueError("")
        out = []
        for b in v:
            if not isinstance(b, str) or b.lower() not in ("zmq", "ucx"):
                raise ValueError(f"unknown backend {b!r}")
            out.append("UCX" if b.lower() == "ucx" else "zmq")
        if "UCX" in out:
            try:
                import nixl  # noqa: F401
            except ImportError:
                raise ValueError("backend 'UCX' needs the 'nixl' package, which is not "
                                 "installed (pip install nixl), or use ['zmq']") from None
        return tuple(out)
    return Check("a non-empty list of 'zmq' and 'UCX' (UCX needs the 'nixl' package)", convert)


def _z85_secret() -> SecretCheck:
    def convert(v):
        from shmtier.tiers.p2p.keys import parse_key
        return Secret(parse_key(v, "secret_key"), "config secret_key")
    return SecretCheck("a Curve secret key as 40 Z85 characters", convert,
                       **secret_plain("config secret_key"))


def _key_list() -> Check:
    def convert(v):
        from shmtier.tiers.p2p.keys import parse_key
        if isinstance(v, (str, bytes)) or not isinstance(v, (list, tuple)) or not v:
            raise ValueError("")
        return tuple(parse_key(k, f"entry {i}").decode() for i, k in enumerate(v))
    return Check("a non-empty list of Curve public keys (40 Z85 characters each)", convert)


def _peers() -> Check:
    def convert(v):
        from shmtier.tiers.p2p.keys import load_public_key, parse_key
        if not isinstance(v, Mapping):
            raise ValueError("")
        out = {}
        for peer, key in v.items():
            host, _, port = str(peer).rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"peer {peer!r} is not 'host:port'")
            if isinstance(key, str) and len(key.strip()) == 40:
                out[f"{host}:{int(port)}"] = parse_key(key, f"peer {peer}").decode()
            else:
                out[f"{host}:{int(port)}"] = load_public_key(str(key)).decode()
        return tuple(sorted(out.items()))
    return Check("a mapping 'host:port' -> the peer's public key (40 Z85 characters, or the "
                 "path of its .key file)", convert)


def _path() -> Check:
    return Check("the path of an existing file or directory",
                 lambda v: os.path.abspath(v) if isinstance(v, str) and v else _bad())


def _bad():
    raise ValueError("")


@dataclass(frozen=True, kw_only=True)
class P2PTierConfig(TierConfig):
    """A ``p2p`` tier: this engine's KV fetched by peers (and theirs by it) over ZeroMQ,
    authenticated and encrypted with CurveZMQ, through one endpoint process per engine.

    Security: the engine's key pair as ``secret_key_file`` (preferred: configs get
    logged) or ``secret_key``, with an optional ``public_key_file``/``public_key``
    checked against it; the peers admitted: ``allow_keys_dir`` and/or ``allow_keys``.
    Without a ``peers`` entry for a peer, a request naming it by address uses its
    ``remote_public_key`` if allow-listed, else the allow-list's only key; with none of
    them nothing is parked for or fetched from it (``keys_without_peers_entry``)."""

    host: str = option(
        DEFAULT_HOST, text(),
        doc="where this engine's endpoint listens for its peers (routable from them)",
        default_doc='`$VLLM_P2P_SIDE_CHANNEL_HOST` or `"localhost"`')
    port: int = option(
        DEFAULT_PORT, integer(0, 65535),
        doc="base TCP port: the endpoint binds port + the engine's data-parallel index "
            "(vLLM's rule), so DP ranks on one host never collide; 0: a free port",
        default_doc="`$VLLM_P2P_SIDE_CHANNEL_PORT` or `5710`")
    backends: tuple = option(
        ("zmq",), _backends(),
        doc="the data path: zmq; UCX is accepted only when the nixl package imports (the "
            "bytes still move over ZeroMQ)")
    num_threads: int = option(4, integer(1), doc="vLLM's UCX agent threads: accepted, unused")
    unbound_store_timeout_s: float = option(
        60.0, number(0, min_open=True),
        doc="how long a producer keeps a request's parked chunks pinned without the "
            "consumer fetching them")
    secret_key_file: str | None = option(
        None, _path().or_none(),
        doc="this engine's CurveZMQ secret certificate (NAME.key_secret, made by python -m "
            "shmtier.tiers.p2p.keys generate DIR NAME); it or secret_key is required unless "
            "plaintext")
    public_key_file: str | None = option(
        None, _path().or_none(), doc="this engine's public certificate, checked against the "
                                     "secret key")
    secret_key: Secret | None = option(
        None, _z85_secret().or_none(),
        doc="the secret key as 40 Z85 characters instead of a file (configs get logged: "
            "prefer secret_key_file)")
    public_key: str | None = option(
        None, text().or_none(), doc="this engine's public key (Z85), checked against the "
                                    "secret key")
    allow_keys_dir: str | None = option(
        None, _path().or_none(),
        doc="the peers admitted: a directory of their *.key public certificates (this "
            "and/or allow_keys required unless plaintext); others are refused at the handshake")
    allow_keys: tuple | None = option(
        None, _key_list().or_none(), doc="the peers admitted: a list of Z85 public keys")
    peers: tuple = option(
        (), _peers(),
        doc='{"host:port": public key or .key path}: the server key this engine expects at '
            "each peer",
        default_doc="`{}`")
    plaintext: bool = option(
        False, boolean(),
        doc="no CurveZMQ: peers not authenticated, bytes not encrypted (logged as a "
            "WARNING; trusted test networks only); takes no keys")
    lookup_timeout_s: float = option(
        10.0, number(0, min_open=True),
        doc="a symmetric lookup (remote_kv_source) not answered by then is a MISS")
    fetch_timeout_s: float = option(
        10.0, number(0, min_open=True),
        doc="a promotion's fetch round (it waits for chunks the producer has not parked yet) "
            "fails by then")
    hash_seed: str | None = option(
        None, text().or_none(),
        doc="must equal the peers' (a peer with another is refused)",
        default_doc="`$PYTHONHASHSEED`")
    endpoint_niceness: int = option(
        10, integer(0, 19),
        doc="added to the scheduler's niceness for the endpoint process: its transfers are "
            "background work and must not preempt the scheduler thread on a busy host; 0 "
            "runs it at the scheduler's")

    def check_together(self, where: str, context: TierContext) -> None:
        from shmtier.tiers.p2p.keys import KeyFileError
        if self.port and self.port + context.data_parallel_index > 65535:
            raise ConfigError(f"{where}.port = {self.port} is invalid: this engine's "
                              f"data-parallel index {context.data_parallel_index} is added "
                              f"to it and {self.port + context.data_parallel_index} is no "
                              f"TCP port (at most 65535)")
        keyed = [k for k in ("secret_key_file", "secret_key", "public_key_file", "public_key",
                             "allow_keys_dir", "allow_keys") if getattr(self, k) is not None]
        if self.plaintext:
            if keyed or self.peers:
                raise ConfigError(f"{where}.plaintext = true takes no keys, but {keyed or ['peers']} "
                                  f"are set: choose CurveZMQ (keys) or plaintext")
            return
        if (self.secret_key_file is None) == (self.secret_key is None):
            raise ConfigError(f"{where}: give this engine's key pair as exactly one of "
                              f"secret_key_file (preferred) or secret_key, or set "
                              f"plaintext = true (make keys with `python -m "
                              f"shmtier.tiers.p2p.keys generate DIR NAME`)")
        if self.allow_keys_dir is None and self.allow_keys is None:
            raise ConfigError(f"{where}: give the peers' public keys in allow_keys_dir and/or "
                              f"allow_keys (or set plaintext = true)")
        try:
            pair = self.keypair()
        except KeyFileError as e:
            which = "secret_key_file" if self.secret_key_file else "secret_key"
            raise ConfigError(f"{where}.{which} is invalid: {e}") from None
        for name in ("public_key_file", "public_key"):
            value = getattr(self, name)
            if value is None:
                continue
            try:
                from shmtier.tiers.p2p.keys import load_public_key, parse_key
                public = (load_public_key(value) if name == "public_key_file"
                          else parse_key(value, name))
            except KeyFileError as e:
                raise ConfigError(f"{where}.{name} = {value!r} is invalid: {e}") from None
            if public != pair.public:
                raise ConfigError(f"{where}.{name} = {value!r} is invalid: it is not the "
                                  f"public key of this engine's secret key")
        try:
            self.allow_list()
        except KeyFileError as e:
            which = "allow_keys_dir" if self.allow_keys_dir else "allow_keys"
            raise ConfigError(f"{where}.{which} = {getattr(self, which)!r} is invalid: "
                              f"{e}") from None

    def listen_port(self, data_parallel_index: int = 0) -> int:
        """The port this engine's endpoint binds: ``port`` + the engine's data-parallel
        index (vLLM's rule, so DP ranks on one host do not collide); 0 stays 0 (a free
        port)."""
        return self.port + data_parallel_index if self.port else 0

    def keypair(self):
        from shmtier.tiers.p2p.keys import keypair_from_config, load_keypair
        if self.secret_key_file is not None:
            return load_keypair(self.secret_key_file)
        return keypair_from_config(self.secret_key.value)

    def allow_list(self):
        from shmtier.tiers.p2p.keys import AllowList
        keys: list = []
        sources = []
        if self.allow_keys_dir is not None:
            keys.extend(AllowList.from_directory(self.allow_keys_dir))
            sources.append(f"directory {self.allow_keys_dir}")
        if self.allow_keys is not None:
            keys.extend(self.allow_keys)
            sources.append("allow_keys")
        return AllowList(keys, " + ".join(sources))

    def keys_without_peers_entry(self) -> list[str]:
        """The allow-listed keys (Z85) a request naming a peer by address cannot be bound
        to without its ``remote_public_key``: none when plaintext or the allow-list holds
        one key (that key is used), else those no ``peers`` entry names."""
        if self.plaintext:
            return []
        allow = self.allow_list()
        if len(allow) <= 1:
            return []
        named = {key for _, key in self.peers}
        return [k.decode() for k in allow if k.decode() not in named]

    def effective_hash_seed(self) -> str:
        return self.hash_seed if self.hash_seed is not None else os.environ.get(
            "PYTHONHASHSEED", "")
