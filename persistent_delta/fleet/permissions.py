"""NATS authorization for a job: who may write what on the job's stream and buckets.

Owns: the subjects a job's shipper and each of its remote consumers need on a NATS server
(:func:`shipper_permissions`, :func:`consumer_permissions`) and the server configuration block
that grants exactly those (:func:`authorization_block`). The stream key
(:mod:`persistent_delta.fleet.auth`) makes forged data useless; these permissions are the first
wall: another client cannot publish on the job's subjects, write its table metadata or base,
create or delete its stream, or move another consumer's position.

Design note
-----------
Only the shipper side creates the job's stream, buckets and object store
(:meth:`~persistent_delta.fleet.transport.Transport.ensure_job`, ``upload_base``); a remote
consumer only reads them (:meth:`~persistent_delta.fleet.transport.Transport.job_exists`) and
writes its own keys: ``offsets/<token(name)>.<channel>`` and ``locks/<token(name)>``
(:func:`~persistent_delta.fleet.subjects.token`), so each consumer user is granted its own
names only. Reads are JetStream API requests (stream info, direct gets) answered on the
client's reply inbox; a base is read through an ephemeral ordered consumer with flow control.
A denied publish is not answered: the client sees a timeout
(:class:`~persistent_delta.errors.TransportError` naming the permissions violation).

A job laid out over several streams (:mod:`persistent_delta.fleet.streams`) needs each stream
named: JetStream API subjects carry the stream's name as one token, which no wildcard can
cut. Pass them as ``streams`` (e.g. ``list(Layout(job, 2).streams(range(world_size)))``);
the job's single stream is granted either way (a shipper looks it up to refuse mixing two
layouts, and JetStream refuses to create it over the group streams' subjects).
"""

from __future__ import annotations

import json
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from persistent_delta.fleet import subjects
from persistent_delta.fleet.subjects import BASE, LOCKS, META, OFFSETS, bucket, check_job, stream_name, token

Permissions = Dict[str, Dict[str, List[str]]]


def _streams(job: str, streams: Optional[Sequence[str]] = None) -> List[str]:
    """The JetStream streams of a job: its single stream and its group streams (``streams``),
    its buckets' and its object store's."""
    data = [stream_name(job)] + [s for s in (streams or ()) if s != stream_name(job)]
    return data + [f"KV_{bucket(job, w)}" for w in subjects.BUCKETS] + [f"OBJ_{bucket(job, BASE)}"]


def _read(job: str, streams: Optional[Sequence[str]] = None) -> List[str]:
    """What reading a job takes: stream info and direct gets on its streams, and the ordered
    consumer (with flow control) that reads a base."""
    out = ["$JS.API.INFO", "$JS.API.STREAM.NAMES"]
    for s in _streams(job, streams):
        out += [f"$JS.API.STREAM.INFO.{s}", f"$JS.API.DIRECT.GET.{s}", f"$JS.API.DIRECT.GET.{s}.>",
                f"$JS.API.STREAM.MSG.GET.{s}"]
    obj = f"OBJ_{bucket(job, BASE)}"
    out += [f"$JS.API.CONSUMER.CREATE.{obj}", f"$JS.API.CONSUMER.CREATE.{obj}.>", f"$JS.API.CONSUMER.INFO.{obj}.*",
            f"$JS.API.CONSUMER.DELETE.{obj}.*", "$JS.FC.>"]
    return out


def shipper_permissions(job: str, streams: Optional[Sequence[str]] = None) -> Permissions:
    """What a job's shipper (and ``upload_base``) may do: create the job's streams (its single
    stream, and ``streams``: its rank groups' streams), send on its subjects, write its ``meta``
    bucket and its base; read like a consumer."""
    job = check_job(job)
    pub = [subjects.stream_subjects(job), f"$KV.{bucket(job, META)}.>", f"$O.{bucket(job, BASE)}.>"]
    for s in _streams(job, streams):
        pub.append(f"$JS.API.STREAM.CREATE.{s}")
    pub += [f"$JS.API.STREAM.PURGE.OBJ_{bucket(job, BASE)}"] + _read(job, streams)
    return {"publish": {"allow": pub}, "subscribe": {"allow": ["_INBOX.>"]}}


def consumer_permissions(job: str, names: Sequence[str], streams: Optional[Sequence[str]] = None) -> Permissions:
    """What a remote consumer user may do: read the job (its single stream, and ``streams``: its
    rank groups' streams), and write only the positions and claims of the consumer ``names`` it
    runs (never the stream, the metadata or another consumer's keys)."""
    job = check_job(job)
    pub = list(_read(job, streams))
    for name in names:
        t = token(name)
        pub += [f"$KV.{bucket(job, OFFSETS)}.{t}.>", f"$KV.{bucket(job, LOCKS)}.{t}"]
    return {"publish": {"allow": pub},
            "subscribe": {"allow": ["_INBOX.>", subjects.ends_filter(job, "*")]}}


def authorization_block(job: str, shipper: Tuple[str, str], consumers: Mapping[str, Tuple[str, Sequence[str]]],
                        streams: Optional[Sequence[str]] = None) -> str:
    """A NATS server configuration block (``authorization { users = [...] }``) for one job.

    Args:
        job: the job.
        shipper: ``(user, password)`` of the shipper side (shippers and ``upload_base``).
        consumers: user -> ``(password, consumer names it runs)``.
        streams: the job's rank groups' streams, when it is laid out over several
            (:mod:`persistent_delta.fleet.streams`); its single stream is always granted.

    Returns:
        The block, to paste into the server's configuration (passwords as given: put bcrypt
        hashes from ``nats server passwd`` there in production).
    """
    users = [(shipper[0], shipper[1], shipper_permissions(job, streams))]
    users += [(u, p, consumer_permissions(job, names, streams)) for u, (p, names) in consumers.items()]
    lines = ["authorization {", "  users = ["]
    for user, password, perms in users:
        lines.append(f"    {{user: {json.dumps(user)}, password: {json.dumps(password)}, permissions: {{")
        for way in ("publish", "subscribe"):
            lines.append(f"      {way}: {{allow: [")
            lines += [f"        {json.dumps(subject)}," for subject in perms[way]["allow"]]
            lines.append("      ]}")
        lines.append("    }}")
    lines += ["  ]", "}"]
    return "\n".join(lines) + "\n"

__all__ = ["Permissions", "shipper_permissions", "consumer_permissions", "authorization_block"]
