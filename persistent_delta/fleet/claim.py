"""The one-process claim on a remote consumer name, and its heartbeat.

Owns: the rule that one process at a time uses a remote consumer name of a job: a key of the
job's ``locks`` bucket (:func:`persistent_delta.fleet.subjects.lock_key`) created exclusively,
refreshed by a heartbeat thread, and deleted on release. A killed holder's key expires after
the bucket's TTL (:attr:`~persistent_delta.fleet.transport.StreamOptions.lock_ttl_s`); a second
user is refused with :class:`~persistent_delta.errors.LogLockedError` naming the holder.
:class:`~persistent_delta.fleet.remote.RemoteConsumer` holds one.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import Optional

from persistent_delta.errors import KeyConflictError, LogLockedError, TransportError
from persistent_delta.fleet import subjects
from persistent_delta.fleet.transport import Transport
from persistent_delta.log import codec

logger = logging.getLogger(__name__)

_RETRY_S = 0.2
_BEAT_S = 1.0


class NameClaim:
    """A process's claim on consumer ``name`` of ``job`` (see the module docs).

    Its methods are called by the thread that owns the consumer; the heartbeat runs in a
    daemon thread of its own from :meth:`acquire` until :meth:`release`.

    Args:
        conn: the job's transport (the claim never closes it).
        job: the job.
        name: the consumer name.
    """

    def __init__(self, conn: Transport, job: str, name: str) -> None:
        self.conn: Optional[Transport] = conn
        self.job, self.name = job, name
        self.key = subjects.lock_key(name)
        self.lost = False  # another process took the name (the heartbeat found its key replaced)
        self._rev: Optional[int] = None
        self._value = b""
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    @property
    def held(self) -> bool:
        """Whether :meth:`acquire` succeeded and the claim was neither lost nor released."""
        return self._rev is not None and not self.lost and not self._stop.is_set()

    def acquire(self, deadline: float) -> None:
        """Create the name's key, waiting (until ``deadline``, monotonic) for a holder to go;
        then start the heartbeat.

        Raises:
            LogLockedError: another process holds the name at the deadline.
            TransportError: the server cannot be reached at the deadline.
        """
        assert self.conn is not None
        self._value = codec.pack({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()})
        while True:
            try:
                rev = self.conn.kv_create(self.job, subjects.LOCKS, self.key, self._value)
                break
            except KeyConflictError:
                pass  # held by another process: wait for it to go, within the deadline
            except TransportError as exc:
                if not exc.retriable or time.monotonic() >= deadline:
                    raise  # (a permission denied is not retried: waiting would not change it)
                time.sleep(_RETRY_S)
                continue
            if time.monotonic() >= deadline:
                held = self.conn.kv_get(self.job, subjects.LOCKS, self.key)
                who = codec.unpack(held.value, "lock") if held else {}
                raise LogLockedError(
                    f"consumer {self.name!r} of job {self.job!r} is in use by pid "
                    f"{who.get('pid') if isinstance(who, dict) else '?'} on "
                    f"{who.get('host') if isinstance(who, dict) else '?'}; close it, or wait for its claim to expire "
                    "(a killed holder's claim expires after the locks bucket's TTL)"
                )
            time.sleep(_RETRY_S)
        self._rev = rev
        self._thread = threading.Thread(target=self._beat, name="pd-remote-claim", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(_BEAT_S):
            conn = self.conn
            if conn is None:
                return
            try:
                try:
                    rev = conn.kv_update(self.job, subjects.LOCKS, self.key, self._value, self._rev)
                except KeyConflictError:  # expired meanwhile (server down longer than the TTL): take it again
                    rev = conn.kv_create(self.job, subjects.LOCKS, self.key, self._value)
                self._rev = rev
            except KeyConflictError:
                self.lost = True
                logger.error("remote consumer %r of job %s lost its claim to another process", self.name, self.job)
                return
            except (TransportError, AttributeError):
                continue

    def release(self) -> None:
        """Stop the heartbeat and delete the key (unless the claim was lost: then it is another
        process's). Idempotent; a server away leaves the key to expire by itself."""
        self._stop.set()
        conn, self.conn = self.conn, None
        if conn is not None and self._rev is not None and not self.lost:
            try:
                conn.kv_delete(self.job, subjects.LOCKS, self.key)
            except TransportError:
                pass  # it expires by itself


__all__ = ["NameClaim"]
