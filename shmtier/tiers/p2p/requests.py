"""A request's p2p role, read from its ``kv_transfer_params`` and bound to a peer's key
(:class:`RoleReader`), and the records the tier's scheduler half keeps per request.

Runs in: the scheduler process, called by the tier's scheduler half (``scheduler.py``)
under the tiering manager's lock (``on_new_request``). Never blocks; no I/O.

Roles (the scheduler half's docstring says what each does): ``remote_decoder`` (this
engine produces), ``remote_prefiller`` and ``remote_kv_source`` (it consumes). With
CurveZMQ a request is bound to a key the handshake proves: from ``peers``, the request's
``remote_public_key`` if allow-listed, or the allow-list's only key; never to the name a
peer's hello gives (the client chooses it). In plaintext, to that name.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from shmtier.contract import ReqContext
from shmtier.tiers.p2p.peer_metrics import REFUSED, P2PMetrics

logger = logging.getLogger(__name__)

ROLES = ("remote_prefiller", "remote_kv_source", "remote_decoder")
PRODUCER = "remote_decoder"


@dataclass
class Request:
    """A request's p2p role (ctx state)."""

    role: str
    kvid: str
    peer: str = ""
    server_key: str | None = None
    failed: bool = False
    answers: dict = field(default_factory=dict)   # key -> bool (symmetric)
    # a consumer's peer may hold rows for it: true until a fetch round ended with "done"
    # (a request that finishes unsettled sends a release, also one that never loaded)
    unsettled: bool = True
    probing: dict = field(default_factory=dict)   # key -> deadline (symmetric)
    to_probe: list = field(default_factory=list)
    to: list | None = None  # producer bound to one consumer: [its "host:port", its key or ""]

    @property
    def consumer(self) -> bool:
        return self.role != PRODUCER


@dataclass
class Parked:
    """A request's cascades parked for a peer (their rows pinned)."""

    jobs: list = field(default_factory=list)
    rows: int = 0
    deadline: float = 0.0
    left: dict = field(default_factory=dict)  # job id -> its keys not yet fetched


@dataclass
class External:
    """A peer's symmetric lookup being answered through the ParentManager."""

    tid: int
    req: str
    peer: str
    keys: list
    deadline: float
    ctx: ReqContext | None = None
    results: dict = field(default_factory=dict)
    dead: bool = False
    parked_keys: list = field(default_factory=list)  # its hits, parked with the answer
    parked_rows: list = field(default_factory=list)


class RoleReader:
    """Reads requests' roles for one tier: ``plaintext``, its allow-list (None in
    plaintext), ``peer_keys`` ("host:port" -> Z85 key, from ``peers``); requests naming a
    peer without a known key are counted on ``metrics`` (``REFUSED``) and logged."""

    def __init__(self, label: str, plaintext: bool, allow: Any, peer_keys: dict,
                 metrics: P2PMetrics) -> None:
        self._label, self._plaintext, self._allow = label, plaintext, allow
        self._peer_keys = dict(peer_keys)
        self._metrics = metrics
        self._unbindable_logged: set[str] = set()  # consumers named without a known key

    def read(self, params: Any, req_id: str) -> Request | None:
        """The role the first of ``ROLES`` in ``params`` gives, or None (no role, or a
        role without what it needs: logged)."""
        for role in ROLES:
            info = params.get(role) if isinstance(params, dict) else None
            if info is not None:
                return self._parse(role, info, req_id)
        return None

    def _parse(self, role: str, info: Any, req_id: str) -> Request | None:
        kvid = info.get("kv_request_id") if isinstance(info, dict) else None
        if not isinstance(kvid, str) or not kvid:
            logger.warning("p2p tier %s: request %s: kv_transfer_params.%s has no "
                           "kv_request_id; ignored", self._label, req_id, role)
            return None
        host, port = info.get("remote_host"), info.get("remote_port")
        if role == PRODUCER and host is None and port is None:
            return Request(role, kvid)  # any admitted peer may fetch it (vLLM's rule)
        if not isinstance(host, str) or not isinstance(port, int) or isinstance(port, bool):
            logger.warning("p2p tier %s: request %s: kv_transfer_params.%s needs remote_host "
                           "and remote_port; ignored", self._label, req_id, role)
            return None
        peer = f"{host}:{port}"
        req = Request(role, kvid, peer)
        if role == PRODUCER:  # bound to that consumer
            if self._plaintext:
                req.to = [peer, ""]  # by the name its hello gives: nothing better exists
                return req
            key = self.server_key(peer, info.get("remote_public_key"))
            if key is None:
                # a hello's name is the client's claim: with CurveZMQ a request is bound
                # to a key the handshake proves, or it is not parked (docs/architecture.md)
                req.failed = True
                self._metrics.count(REFUSED, 1, peer)
                if peer not in self._unbindable_logged:
                    self._unbindable_logged.add(peer)
                    logger.warning(
                        "p2p tier %s: request %s: remote_decoder names consumer %s, whose "
                        "public key is not known (no peers entry for it, no allow-listed "
                        "remote_public_key in the request, and the allow-list holds %d "
                        "keys): its chunks are not parked (a peer's hello name proves "
                        "nothing); further such requests for %s are only counted",
                        self._label, req_id, peer, len(self._allow), peer)
                return req
            req.to = [peer, key]
            return req
        if not self._plaintext:
            req.server_key = self.server_key(peer, info.get("remote_public_key"))
            if req.server_key is None:
                req.failed = True
                self._metrics.count(REFUSED, 1, peer)
                logger.warning("p2p tier %s: request %s: no public key known for peer %s "
                               "(set peers, or allow-list its key); its chunks are not "
                               "fetched", self._label, req_id, peer)
        return req

    def server_key(self, peer: str, offered: Any) -> str | None:
        """The key a request naming ``peer`` (offering ``offered``) is bound to, or None."""
        known = self._peer_keys.get(peer)
        if known is not None:
            return known
        if isinstance(offered, str) and offered in self._allow:
            return offered
        if len(self._allow) == 1:
            return next(iter(self._allow)).decode()
        return None
