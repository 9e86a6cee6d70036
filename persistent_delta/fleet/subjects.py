"""How a job is named on the stream: subjects, message ids, buckets and their keys.

Owns: every name the fleet writes to or reads from a streaming engine -- the job's stream and
buckets, the subjects of a rank's parts and range markers (and the filters that select them),
message ids, a shipper registration's epoch, and the keys of the ``meta`` bucket and the base
store. The bytes behind those names are :mod:`persistent_delta.fleet.wire`'s.

Design note
-----------
**Subjects** (by default one stream per job, ``PD_<job>``, subjects ``pd.<job>.>``; a job laid
out over several streams has a stream per rank group, ``PDG_<job>_<group>``, holding its ranks'
subjects ``pd.<job>.*.<rank>.>``: :mod:`persistent_delta.fleet.streams`)::

    pd.<job>.<channel>.<rank>.t<base32(fqn)>   a table's rows of one shipped range (chunked)
    pd.<job>.<channel>.<rank>.end              the range's marker: it is complete

``base32`` (lower case, no padding) of the fqn's UTF-8 bytes is injective and uses only
``[a-z2-7]``, so every fqn the log accepts maps to one valid subject token. A job name is
``[A-Za-z0-9_-]{1,64}``; channel and rank are fixed words and integers. A filter is a subject
whose last token is ``>`` (every subject with that prefix) or with a ``*`` token (any one
token there), as :func:`rank_filter` and :func:`ends_filter` build them.

**Message ids** are ``<job>:<epoch>:<channel>:<rank>:<start>:<end>:<part>:<chunk>``. The
*epoch* is the shipper registration's identity (the log id plus a random token, new whenever
the shipper registers afresh: a new log, a log started afresh with ``fresh=True``), so ids
are unique for the stream's whole life across jobs and re-created logs; a re-send of the same
range has the same ids, and the transport drops it within its duplicate window. After the
window the consumer drops it: a range ending at or below its position is never applied again.

**Buckets** (key-value, same replicas as the stream): ``PD_<job>_meta`` (per rank: the table
metadata a remote consumer needs, key :func:`tables_key`; per shipper: its epoch and
statistics, key :func:`shipper_key`), ``PD_<job>_offsets`` (remote consumers' positions, key
:func:`offsets_key`), ``PD_<job>_locks`` (one active process per remote consumer name, key
:func:`lock_key`: created exclusively,
refreshed by a heartbeat, expiring by the bucket's TTL when its holder died), and the object
store ``PD_<job>_base`` (each rank's base, object :func:`base_name`). The ``meta`` key
:data:`LAYOUT_KEY` records a layout over several streams (:mod:`persistent_delta.fleet.streams`).
"""

from __future__ import annotations

import base64
import os
import re
from typing import List, Sequence, Union

from persistent_delta.errors import CorruptRecordError, InvalidInputError

_JOB = re.compile(r"^[A-Za-z0-9_-]{1,64}$")

# The job's key-value buckets (the ``what`` of :func:`bucket`), and its object store.
META = "meta"
OFFSETS = "offsets"
LOCKS = "locks"
BUCKETS = (META, OFFSETS, LOCKS)
BASE = "base"

# Key prefixes of the job's ``meta`` bucket: each rank's table metadata, and each shipper's state.
TABLES_KEYS = "tables."
SHIPPER_KEYS = "ship."
# The ``meta`` bucket's key of the job's stream layout (absent: the single stream ``PD_<job>``).
LAYOUT_KEY = "layout"


def check_job(job: object) -> str:
    """A valid job name.

    Args:
        job: the candidate name.

    Returns:
        ``job``, when it matches ``[A-Za-z0-9_-]{1,64}``.

    Raises:
        InvalidInputError: anything else.
    """
    if not isinstance(job, str) or not _JOB.match(job):
        raise InvalidInputError(f"job must match [A-Za-z0-9_-]{{1,64}}, got {job!r}")
    return job


def token(text: str) -> str:
    """An injective, valid subject token / bucket key for any string (base32 of its UTF-8)."""
    return base64.b32encode(text.encode("utf-8")).decode("ascii").rstrip("=").lower() or "0"


def untoken(tok: str) -> str:
    """Inverse of :func:`token`."""
    if tok == "0":
        return ""
    t = tok.upper()
    return base64.b32decode(t + "=" * (-len(t) % 8)).decode("utf-8")


def stream_name(job: str) -> str:
    """``PD_<job>``: the job's stream."""
    return f"PD_{check_job(job)}"


def stream_subjects(job: str) -> str:
    """``pd.<job>.>``: every subject of the job's stream."""
    return f"pd.{check_job(job)}.>"


def group_stream_name(job: str, group: int) -> str:
    """``PDG_<job>_<group>``: the stream of rank group ``group`` of a job laid out over several
    streams. The prefix is its own, so no job's single stream ``PD_<job>`` (nor a bucket's
    ``KV_``/``OBJ_`` stream) can take the name, and the group is the last ``_<digits>``."""
    if isinstance(group, bool) or not isinstance(group, int) or group < 0:
        raise InvalidInputError(f"a stream group is a non-negative int, got {group!r}")
    return f"PDG_{check_job(job)}_{group}"


def rank_subjects(job: str, ranks: Sequence[int]) -> List[str]:
    """``pd.<job>.*.<rank>.>`` for each of ``ranks``: every subject of those ranks (all channels)."""
    return [f"pd.{check_job(job)}.*.{int(r)}.>" for r in ranks]


def filters_overlap(a: str, b: str) -> bool:
    """Whether some subject is selected by both filters (``*``: one token, a last ``>``: one or
    more): JetStream refuses two streams whose subjects overlap."""
    ta, tb = a.split("."), b.split(".")
    for i in range(max(len(ta), len(tb))):
        if i >= len(ta) or i >= len(tb):
            return False
        x, y = ta[i], tb[i]
        if (x == ">" and i == len(ta) - 1) or (y == ">" and i == len(tb) - 1):
            return True
        if x != y and x != "*" and y != "*":
            return False
    return True


def bucket(job: str, what: str) -> str:
    """``PD_<job>_<what>``: ``meta``, ``offsets``, ``locks`` (key-value) or ``base`` (objects)."""
    return f"PD_{check_job(job)}_{what}"


def data_subject(job: str, channel: str, rank: int, fqn: str) -> str:
    """The subject of table ``fqn``'s parts of one rank and channel."""
    return f"pd.{job}.{channel}.{int(rank)}.t{token(fqn)}"


def end_subject(job: str, channel: str, rank: int) -> str:
    """The subject of one rank and channel's range markers."""
    return f"pd.{job}.{channel}.{int(rank)}.end"


def rank_filter(job: str, channel: str, rank: int) -> str:
    """A filter for every message (parts and markers) of one rank and channel."""
    return f"pd.{job}.{channel}.{int(rank)}.>"


def ends_filter(job: str, channel: str) -> str:
    """A filter for every rank's range markers of one channel."""
    return f"pd.{job}.{channel}.*.end"


def fqn_of_subject(subject: str) -> str:
    """The table fqn of a :func:`data_subject`.

    Raises:
        CorruptRecordError: ``subject`` is not a table subject.
    """
    last = subject.rsplit(".", 1)[-1]
    if not last.startswith("t"):
        raise CorruptRecordError(f"subject {subject!r} is not a table subject")
    return untoken(last[1:])


def subject_matches(filter_: str, subject: str) -> bool:
    """Whether ``subject`` is selected by ``filter_`` (``*``: one token, a last ``>``: the rest)."""
    want, got = filter_.split("."), subject.split(".")
    for i, w in enumerate(want):
        if w == ">" and i == len(want) - 1:
            return len(got) > i
        if i >= len(got) or (w != "*" and w != got[i]):
            return False
    return len(got) == len(want)


def msg_id(job: str, epoch: str, channel: str, rank: int, start: int, end: int, part: Union[int, str], chunk: int = 0) -> str:
    """The id of one message of a shipped range (``part``: its number, or ``"end"`` for the marker)."""
    return f"{job}:{epoch}:{channel}:{rank}:{start}:{end}:{part}:{chunk}"


def new_epoch(log_id: object) -> str:
    """A shipper registration's identity: the log id and a random token."""
    return f"{log_id}-{os.urandom(6).hex()}"


def tables_key(rank: int) -> str:
    """The ``meta`` bucket's key of a rank's table metadata."""
    return f"{TABLES_KEYS}{int(rank)}"


def shipper_key(rank: int, channel: str) -> str:
    """The ``meta`` bucket's key of a shipper's state for one rank and channel."""
    return f"{SHIPPER_KEYS}{int(rank)}.{channel}"


def offsets_key(name: str, channel: str) -> str:
    """The ``offsets`` bucket's key of a remote consumer's stored positions on one channel."""
    return f"{token(name)}.{channel}"


def lock_key(name: str) -> str:
    """The ``locks`` bucket's key of a remote consumer name's one-process claim."""
    return token(name)


def base_name(rank: int) -> str:
    """The object name of a rank's base in the job's ``base`` store."""
    return f"rank-{int(rank)}"


__all__ = ["check_job", "token", "untoken", "stream_name", "stream_subjects", "group_stream_name", "rank_subjects",
           "filters_overlap", "bucket", "data_subject", "end_subject",
           "rank_filter", "ends_filter", "fqn_of_subject", "subject_matches", "msg_id", "new_epoch", "tables_key",
           "shipper_key", "offsets_key", "lock_key", "base_name", "META", "OFFSETS", "LOCKS", "BUCKETS", "BASE", "TABLES_KEYS", "SHIPPER_KEYS", "LAYOUT_KEY"]
