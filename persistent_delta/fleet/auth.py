"""Authentication of what a job's shipper writes: stream keys, key files, and authenticators.

Owns: the job's stream key (:class:`StreamKey`: a key id and a 32-byte secret), its key file
(:func:`write_key_file`, :func:`read_key_file`: mode 0600; a regular file, reached through
symbolic links as a secret volume mounts it, readable by its owner only -- or its group too
when root owns it), which keys a shipper or
consumer holds (:class:`Keyring`: one signs, any verifies -- a rotation), how a key is found
(:func:`resolve_keyring`: an argument, then ``PERSISTENT_DELTA_STREAM_KEY_FILE``, else a
refusal unless the caller opted out with ``insecure=True``), and the authenticators
themselves: a message's (:func:`sign_message` / :func:`verify_message`) and a bucket value's or
base's (:func:`seal_value` / :func:`open_value`).

Design note
-----------
An authenticator is **HMAC-SHA256** (stdlib :mod:`hmac`) under the job's key over a canonical
encoding (each field length-prefixed) of what the value means, not only its bytes:

* a stream message: ``("msg", job, subject, its PD-* headers sorted -- the shipper's epoch,
  the range, the part and chunk --, sha256(payload))``. The message id is a function of those
  headers, so a message cannot be moved to another job, subject, rank, range or epoch. It
  travels in the ``PD-Auth`` header as ``<key id>:<hex>``.
* a bucket value or a base: ``("val", job, bucket, key, sha256(body))``: the value of
  ``tables.0`` cannot be replayed as ``tables.1``.

A range marker lists the sha256 of each of its parts (:mod:`persistent_delta.fleet.wire`), its
previous range's end and its epoch, all under its authenticator: a marker is bound to its
parts, its place in the rank's sequence and its shipper's registration.

HMAC is symmetric: whoever verifies can also sign. Consumers are given the key, so a consumer
host that is broken into can forge; NATS permissions (only the shipper's credentials may
publish the job's subjects: ``docs/guides/security.md``) are the wall against that, the key
against every other client of the server. Replays of genuine messages cannot be refused by an
authenticator; readers recognise them by their place (a rank's ranges only move forward).
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import logging
import os
import re
import stat
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Sequence, Tuple, Union

from persistent_delta.config import stream_key_files
from persistent_delta.errors import AuthenticationError, KeyFileError, StreamKeyError
from persistent_delta.log import codec

logger = logging.getLogger(__name__)

AUTH_HEADER = "PD-Auth"
_KEY_ID = re.compile(r"^[A-Za-z0-9_-]{1,32}$")
_MAGIC = "persistent-delta-stream-key-v1"
_SECRET_BYTES = 32
PathLike = Union[str, "os.PathLike[str]"]


@dataclass(frozen=True)
class StreamKey:
    """A job's stream key: its id (names it in authenticators, for rotation) and its secret.

    Attributes:
        key_id: ``[A-Za-z0-9_-]{1,32}``.
        secret: 32 random bytes.
    """

    key_id: str
    secret: bytes

    def __post_init__(self) -> None:
        if not isinstance(self.key_id, str) or not _KEY_ID.match(self.key_id):
            raise StreamKeyError(f"a stream key id must match [A-Za-z0-9_-]{{1,32}}, got {self.key_id!r}")
        if not isinstance(self.secret, bytes) or len(self.secret) < 16:
            raise StreamKeyError("a stream key's secret must be at least 16 bytes")

    def __repr__(self) -> str:  # never print the secret
        return f"StreamKey({self.key_id!r})"


def generate_key(key_id: Optional[str] = None) -> StreamKey:
    """A new random stream key (``key_id`` default: 8 random hex digits)."""
    return StreamKey(key_id or os.urandom(4).hex(), os.urandom(_SECRET_BYTES))


def write_key_file(path: PathLike, key: Optional[StreamKey] = None) -> StreamKey:
    """Write ``key`` (default: a new one) to a new file ``path``, mode 0600 whatever the umask.

    Args:
        path: the file to create; it must not exist (a key is never overwritten by accident).
        key: the key to write.

    Returns:
        The key written.

    Raises:
        StreamKeyError: ``path`` exists or cannot be created.
    """
    key = key or generate_key()
    text = f"{_MAGIC} {key.key_id} {key.secret.hex()}\n".encode()
    try:
        fd = os.open(os.fspath(path), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise StreamKeyError(f"{os.fspath(path)} exists: a key file is never overwritten; remove it first or choose "
                             "another path") from None
    except OSError as exc:
        raise StreamKeyError(f"cannot create key file {os.fspath(path)}: {exc}") from exc
    try:
        os.fchmod(fd, 0o600)  # the umask may have taken bits away; never added, but be explicit
        os.write(fd, text)
        os.fsync(fd)
    finally:
        os.close(fd)
    return key


def read_key_file(path: PathLike) -> StreamKey:
    """The key in a key file written by :func:`write_key_file` (``persistent-delta keygen``).

    Symbolic links are followed (a Kubernetes secret volume lays a key out as ``key ->
    ..data/key``, ``..data -> ..<timestamp>``); the rule applies to the file they end at: a
    regular file (never a FIFO, device, socket or directory: it is opened without blocking and
    refused before a byte is read), readable by its owner only (mode 0600 or 0400), or, when
    root owns it, by its group too (0640 or 0440: a secret volume with ``fsGroup``), never by
    others, never writable by anyone but its owner. See ``docs/guides/security.md``.

    Raises:
        KeyFileError: missing or unreadable, not a regular file, or its mode is too open (the
            message names the path, the file it resolves to, what is refused and the fix).
        StreamKeyError: malformed.
    """
    p = os.fspath(path)
    # stat first: a device is refused without opening it; the fstat below checks what was opened
    try:
        _check_key_file(p, os.stat(p))
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        why = "a loop of symbolic links" if exc.errno == errno.ELOOP else exc.strerror or str(exc)
        raise KeyFileError(f"cannot read stream key file {p}{_via(p)}: {why}", path=p, target=_target(p),
                           refused=why) from exc
    try:
        _check_key_file(p, os.fstat(fd))
        raw = os.read(fd, 4096)
    finally:
        os.close(fd)
    parts = raw.decode("ascii", "replace").split()
    try:
        if len(parts) != 3 or parts[0] != _MAGIC:
            raise ValueError("not a persistent-delta stream key file")
        return StreamKey(parts[1], bytes.fromhex(parts[2]))
    except (ValueError, StreamKeyError) as exc:
        raise StreamKeyError(f"stream key file {p} is malformed ({exc}); create one with `persistent-delta keygen PATH`"
                             ) from exc


_NOT_REGULAR = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a directory"))


def key_file_refusal(st: os.stat_result) -> Optional[Tuple[str, str]]:
    """What is refused in a key file with status ``st`` (of the file its path resolves to) and
    why, or None when it passes.

    The rule: a regular file; no permission bit for others; no group bit either, except that a
    file root owns may be readable by its group (root chose the group: a Kubernetes secret
    volume with ``fsGroup``, a service group). The owner may read and write it.

    Returns:
        ``(refused, why)``, e.g. ``("mode 0644", "mode 0644 lets others read it")``, or None.
    """
    if not stat.S_ISREG(st.st_mode):
        kind = next((name for test, name in _NOT_REGULAR if test(st.st_mode)), "not a regular file")
        return kind, f"it is {kind}, and a key file must be a regular file (reading a FIFO or a device could block)"
    mode = stat.S_IMODE(st.st_mode)
    loose = mode & 0o077 & ~(0o040 if st.st_uid == 0 else 0)
    if not loose:
        return None
    lets = []
    for who, shift in (("its group", 3), ("others", 0)):
        bits = (loose >> shift) & 0o7
        if bits:
            lets.append(f"{who} " + "/".join(w for b, w in ((4, "read"), (2, "write"), (1, "execute")) if bits & b))
    why = f"mode {mode:04o} lets {' and '.join(lets)} it"
    if loose & 0o040:
        why += " (only a key file owned by root may be readable by its group)"
    return f"mode {mode:04o}", why


def _check_key_file(p: str, st: os.stat_result) -> None:
    found = key_file_refusal(st)
    if found is None:
        return
    refused, why = found
    target = _target(p)
    if stat.S_ISREG(st.st_mode):
        fix = (f"chmod 600 {target} (0600 or 0400; 0640 or 0440 when root owns it), or in a Kubernetes secret "
               "volume set defaultMode: 0400 (see docs/guides/security.md)")
    else:
        fix = "give the path of the key file itself"
    raise KeyFileError(f"stream key file {p}{_via(p)} is refused: {why}; {fix}", path=p, target=target,
                       refused=refused)


def _target(p: str) -> str:
    return os.path.realpath(p)


def _via(p: str) -> str:
    """`` (-> TARGET)`` when ``p`` resolves through symbolic links, else ""."""
    target = _target(p)
    return f" (-> {target})" if target != os.path.abspath(p) else ""


class Keyring:
    """The keys a shipper or consumer holds: the first signs, any verifies (during a rotation a
    consumer holds the old and the new key; see ``docs/guides/security.md``). An *insecure*
    keyring (no key, chosen with ``insecure=True``) signs nothing and verifies nothing.

    Thread-safe (immutable).
    """

    def __init__(self, keys: Sequence[StreamKey]) -> None:
        self.keys: List[StreamKey] = list(keys)
        self._by_id: Dict[str, StreamKey] = {}
        for k in self.keys:
            if not isinstance(k, StreamKey):
                raise StreamKeyError(f"a keyring holds StreamKey objects, got {type(k).__name__}")
            if k.key_id in self._by_id and self._by_id[k.key_id].secret != k.secret:
                raise StreamKeyError(f"two different keys share the id {k.key_id!r}")
            self._by_id[k.key_id] = k

    @property
    def insecure(self) -> bool:
        """Whether it holds no key (nothing is signed or verified)."""
        return not self.keys

    def sign(self, fields: Iterable[Union[str, bytes]]) -> str:
        """The authenticator (``<key id>:<hex>``) of ``fields`` under the signing key ("" when insecure)."""
        if not self.keys:
            return ""
        k = self.keys[0]
        return f"{k.key_id}:{_mac(k.secret, fields)}"

    def check(self, tag: Optional[str], fields: Iterable[Union[str, bytes]]) -> Optional[str]:
        """None when ``tag`` authenticates ``fields`` (always, when insecure), else why not."""
        if not self.keys:
            return None
        if not tag or ":" not in tag:
            return "it carries no authenticator (sent without a stream key, or by another client)"
        kid, _, mac = tag.partition(":")
        k = self._by_id.get(kid)
        if k is None:
            return (f"it is signed with key id {kid[:40]!r}, which this reader does not hold (held: "
                    f"{sorted(self._by_id)}); give it that key (a rotation) or check who publishes")
        if not hmac.compare_digest(mac, _mac(k.secret, fields)):
            return "its authenticator does not match (forged or altered)"
        return None

    def __repr__(self) -> str:
        return f"Keyring({[k.key_id for k in self.keys]})" if self.keys else "Keyring(insecure)"


KeySpec = Union[None, StreamKey, PathLike, Keyring, Sequence[Union[StreamKey, PathLike]]]


def resolve_keyring(key: KeySpec, insecure: bool, who: str) -> Keyring:
    """The keyring of a shipper, consumer or tool: ``key`` (a key, a key file, or several: the
    first signs), else the files in ``PERSISTENT_DELTA_STREAM_KEY_FILE`` (``os.pathsep``
    separated), else -- only with ``insecure=True`` -- none.

    Args:
        key: as above, or a :class:`Keyring`.
        insecure: opt out of authentication when no key is found (logged as a warning).
        who: names the caller in the refusal.

    Raises:
        StreamKeyError: no key and not ``insecure``; a key file unreadable or malformed.
    """
    if isinstance(key, Keyring):
        return key
    items: List[Union[StreamKey, PathLike]]
    if key is None:
        items = list(stream_key_files())
    elif isinstance(key, (StreamKey, str)) or hasattr(key, "__fspath__"):
        items = [key]  # type: ignore[list-item]
    else:
        items = list(key)  # type: ignore[arg-type]
    keys = [k if isinstance(k, StreamKey) else read_key_file(k) for k in items]
    if keys:
        return Keyring(keys)
    if insecure:
        logger.warning("%s runs without a stream key (insecure=True): stream data is not authenticated", who)
        return Keyring([])
    raise StreamKeyError(
        f"{who} has no stream key: stream data is authenticated with the job's key. Create one with "
        "`persistent-delta keygen PATH` (mode 0600), give the same file to the shipper and every consumer of the job "
        "(key=PATH, --key-file PATH, or PERSISTENT_DELTA_STREAM_KEY_FILE=PATH), or opt out explicitly with "
        "insecure=True / --insecure")


def _mac(secret: bytes, fields: Iterable[Union[str, bytes]]) -> str:
    h = hmac.new(secret, b"pd-auth-v1", hashlib.sha256)
    for f in fields:
        b = f.encode("utf-8") if isinstance(f, str) else bytes(f)
        h.update(len(b).to_bytes(8, "big"))
        h.update(b)
    return h.hexdigest()


def digest(data: Union[bytes, bytearray, memoryview]) -> str:
    """sha256 of ``data``, hex."""
    return hashlib.sha256(data).hexdigest()


def _message_fields(job: str, subject: str, headers: Dict[str, str], data: Union[bytes, bytearray, memoryview]
                    ) -> List[str]:
    pd = sorted(f"{k}={v}" for k, v in headers.items() if k.startswith("PD-") and k != AUTH_HEADER)
    return ["msg", job, subject, *pd, digest(data)]


def sign_message(ring: Keyring, job: str, subject: str, headers: Dict[str, str],
                 payload: Union[bytes, bytearray, memoryview]) -> None:
    """Add the ``PD-Auth`` header to a message's ``headers`` (nothing when insecure)."""
    if not ring.insecure:
        headers[AUTH_HEADER] = ring.sign(_message_fields(job, subject, headers, payload))


def verify_message(ring: Keyring, job: str, subject: str, headers: Dict[str, str], data: bytes, seq: int) -> None:
    """Check a stored message's authenticator.

    Raises:
        AuthenticationError: it does not authenticate (naming the subject and stream sequence).
    """
    why = ring.check(headers.get(AUTH_HEADER), _message_fields(job, subject, headers, data))
    if why is not None:
        raise AuthenticationError(f"message {seq} on {subject[:200]!r} of job {job}: {why}", subject=subject, seq=seq)


def seal_value(ring: Keyring, job: str, bucket: str, key: str, body: bytes) -> bytes:
    """``body`` wrapped with its authenticator, for bucket ``bucket`` key ``key`` (or the base store)."""
    return codec.pack({"pd_auth": 1, "body": body, "tag": ring.sign(["val", job, bucket, key, digest(body)])})


def open_value(ring: Keyring, job: str, bucket: str, key: str, buf: bytes) -> bytes:
    """The body of a value written by :func:`seal_value`, once its authenticator checks.

    Raises:
        AuthenticationError: not a sealed value, or its authenticator does not check.
    """
    try:
        d = codec.unpack(buf, f"{bucket} value {key!r}")
    except Exception as exc:  # noqa: BLE001 - any damage is "not authentic"
        raise AuthenticationError(f"job {job} {bucket} {key!r}: {exc}", subject=f"{bucket}/{key}") from exc
    if not isinstance(d, dict) or d.get("pd_auth") != 1 or not isinstance(d.get("body"), bytes):
        raise AuthenticationError(f"job {job} {bucket} {key!r}: not a value written by a persistent_delta shipper",
                                  subject=f"{bucket}/{key}")
    body: bytes = d["body"]
    tag = d.get("tag")
    why = ring.check(tag if isinstance(tag, str) else None, ["val", job, bucket, key, digest(body)])
    if why is not None:
        raise AuthenticationError(f"job {job} {bucket} {key!r}: {why}", subject=f"{bucket}/{key}")
    return body


__all__ = ["AUTH_HEADER", "StreamKey", "generate_key", "write_key_file", "read_key_file", "key_file_refusal",
           "Keyring", "KeySpec",
           "resolve_keyring", "digest", "sign_message", "verify_message", "seal_value", "open_value"]
