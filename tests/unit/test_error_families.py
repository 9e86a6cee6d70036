"""The errors come in families a caller can catch (usage, the log, consumers, the writer, the
stream), each class in one family, and every class says whether retrying the same call can
succeed (``retriable``)."""

from __future__ import annotations

import inspect
from typing import Dict, List, Set

from persistent_delta import errors as e

FAMILIES: Dict[type, List[type]] = {
    e.UsageError: [e.InvalidInputError, e.RankDirectoryError, e.OrderError, e.StaleBaseError,
                   e.ReplicaMismatchError, e.ServingLockError, e.UnsupportedTrackingError,
                   e.UnsupportedModeError, e.LogClosedError, e.ForkedProcessError, e.InexactRangeError],
    e.LogError: [e.NotALogError, e.FormatMismatchError, e.ConfigMismatchError, e.WorldSizeMismatchError,
                 e.CorruptRecordError, e.DamagedLogError, e.LogFullError, e.LogIOError, e.ReadOnlyLogError,
                 e.LogAccessError, e.LogOwnershipError, e.LogLockedError],
    e.ConsumerError: [e.UnknownConsumerError, e.OffsetOutOfRangeError, e.ConsumerConflictError,
                      e.ConsumerRoleError, e.IncompletePollError, e.RanksBehindError, e.RanksBehindWarning],
    e.WriterError: [e.WriterLogFullError],
    e.StreamError: [e.TransportError, e.PermissionDeniedError, e.JobNotFoundError, e.StreamLayoutError,
                    e.KeyConflictError, e.StreamKeyError, e.KeyFileError, e.RejectedMessageError,
                    e.AuthenticationError, e.StreamDataError, e.OlderLogError],
}
ALONE = {e.CommandStoppedError}  # a stop asked for, not a failure
# Where the same call, made again later unchanged, can succeed without anyone acting first.
RETRIABLE: Set[type] = {e.TransportError, e.LogLockedError, e.LogIOError, e.IncompletePollError,
                        e.RanksBehindError}
# Deliberately in two families: the writer's full disk is caught as either, and so is a
# checkpoint of another shard layout (a configuration mismatch of the log's job).
TWO_FAMILIES = {"WriterLogFullError": {"WriterError", "LogError"}, "ShardLayoutError": {"ConfigMismatchError", "CheckpointError"}}


def _all_errors() -> List[type]:
    return [c for _, c in inspect.getmembers(e, inspect.isclass)
            if issubclass(c, e.PersistentDeltaError) and c.__module__ == e.__name__]


def test_every_error_is_in_exactly_one_family():
    for family, members in FAMILIES.items():
        assert family.__bases__ == (e.PersistentDeltaError,), family
        for cls in members:
            assert issubclass(cls, family), (cls.__name__, family.__name__)
    # every error derives from one family base (a direct subclass of the root), but the
    # deliberate pairs, and only the families' bases and ALONE derive from the root itself
    bases = [c for c in _all_errors() if c.__bases__[0] is e.PersistentDeltaError and c not in ALONE]
    assert set(FAMILIES) <= set(bases), bases
    for cls in _all_errors():
        if cls is e.PersistentDeltaError or cls in ALONE or cls in bases:
            continue
        families = {f.__name__ for f in bases if issubclass(cls, f)}
        two = TWO_FAMILIES.get(cls.__name__)
        if two is not None:
            assert len(families) == 2 and all(issubclass(cls, getattr(e, n)) for n in two), (cls.__name__, families)
        else:
            assert len(families) == 1, (cls.__name__, families)
    for cls in ALONE:
        assert not any(issubclass(cls, f) for f in bases if f is not cls), cls


def test_stream_errors_are_not_log_errors():
    for cls in (e.AuthenticationError, e.StreamDataError, e.OlderLogError):
        assert issubclass(cls, e.RejectedMessageError) and not issubclass(cls, e.CorruptRecordError), cls
        assert not issubclass(cls, e.LogError), cls
    assert not issubclass(e.JobNotFoundError, e.NotALogError)
    assert not issubclass(e.StreamLayoutError, e.ConfigMismatchError)
    exc = e.AuthenticationError("forged", subject="pd.j.lookups.0.end", seq=7)
    assert (exc.subject, exc.seq) == ("pd.j.lookups.0.end", 7) and not isinstance(exc, e.CorruptRecordError)


def test_every_error_says_whether_it_is_retriable():
    for cls in _all_errors():
        assert isinstance(cls.retriable, bool), cls
        assert cls.retriable == (cls in RETRIABLE), (cls.__name__, cls.retriable)
    assert e.TransportError("down").retriable and not e.PermissionDeniedError("denied").retriable


def test_the_built_in_types_torchrec_code_catches_stay():
    assert issubclass(e.InvalidInputError, ValueError)
    assert issubclass(e.UnknownConsumerError, KeyError) and issubclass(e.UnknownConsumerError, AssertionError)
    assert issubclass(e.UnsupportedTrackingError, AssertionError)
    assert issubclass(e.UnsupportedModeError, NotImplementedError)
    assert issubclass(e.WorldSizeMismatchError, e.ConfigMismatchError)
    assert issubclass(e.WriterLogFullError, e.LogFullError)
