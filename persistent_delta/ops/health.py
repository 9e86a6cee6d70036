"""A consumer's health, judged Burrow-style over a sliding window of its own commits.

Owns: the health rule (OK, LAGGING, STALLED, EXPIRED) and nothing else; callers bring the
commit history (:attr:`persistent_delta.log.schema.ConsumerEntry.history`) and the channel's
end now.

Design note. Burrow (LinkedIn's Kafka consumer monitor) judges a consumer without lag
thresholds, from the lag at each of its last commits. The same rules here, in this order:

1. **EXPIRED**: the retention bound dropped the consumer behind the log start.
2. **OK** when nothing is unread now.
   **BEHIND** (a snapshots consumer) when a rank of the job is behind on the channel
   (:func:`persistent_delta.log.position_rules.snapshots_behind`): its polls stop at that
   rank's end, so its lag cannot shrink whatever it does; the rank is at fault, not the consumer.
3. **STALLED** (Burrow's "stopped"): data arrived since the last commit (the end moved past the
   end seen then) and no commit came for longer than the window's own span (the time between
   its first and last commits), and at least ``stall_after_s`` (a consumer with one commit has
   no span to judge by).
4. **OK** when some commit in the window caught up (lag 0 at that commit).
5. **STALLED** (Burrow's "stalled"): it commits, but the same offset every time while the lag
   does not shrink.
6. **LAGGING**: the lag grew at every commit of the window and has not shrunk since: it reads,
   but slower than the trainer writes.
7. **OK** otherwise (behind, but keeping up or catching up).
"""

from __future__ import annotations

import enum
from typing import List, Optional, Sequence

from persistent_delta.config import stall_after_s as resolve_stall_after
from persistent_delta.log.schema import CommitPoint


class Health(str, enum.Enum):
    """A consumer's status over its window (Burrow's OK, WARN/lagging, STALL/STOP, and expired)."""

    OK = "ok"
    BEHIND = "behind"  # snapshots: a rank of the job is behind (position_rules.snapshots_behind): no poll can catch up
    LAGGING = "lagging"
    STALLED = "stalled"
    EXPIRED = "expired"
    MALFORMED = "malformed"  # a stored entry the tools cannot read (a remote consumer's, forged or damaged)


def health(
    history: Sequence[CommitPoint],
    offset: int,
    end: int,
    now: float,
    last_commit: float = 0.0,
    expired: bool = False,
    stall_after_s: Optional[float] = None,
    behind: bool = False,
) -> Health:
    """The consumer's status (see the module docs for the rule).

    Args:
        history: its last commits, oldest first (points whose end is unknown count only by time).
        offset: its committed offset now.
        end: the channel's end now (one past the last complete batch).
        now: the time to judge at (seconds since the epoch).
        last_commit: its last commit time when ``history`` is empty (e.g. the registration).
        expired: the entry's expired flag.
        stall_after_s: the least silence that counts as stalled (default:
            :func:`persistent_delta.config.stall_after_s`).
        behind: a rank of the job is behind on the consumer's channel.

    Returns:
        The :class:`Health`.
    """
    if expired:
        return Health.EXPIRED
    lag_now = max(0, end - offset)
    if lag_now == 0:
        return Health.OK
    if behind:
        return Health.BEHIND
    least = resolve_stall_after(stall_after_s)
    last_time = history[-1].time if history else last_commit
    seen_end = history[-1].end if history else -1
    span = history[-1].time - history[0].time if history else 0.0
    if end > seen_end and now - last_time > max(span, least):
        return Health.STALLED
    lags: List[int] = [p.lag for p in history if p.lag is not None]
    if any(lag == 0 for lag in lags):
        return Health.OK
    if len(history) >= 2 and len({p.offset for p in history}) == 1 and (not lags or lag_now >= lags[0]):
        return Health.STALLED
    if len(lags) >= 2 and all(b > a for a, b in zip(lags, lags[1:])) and lag_now >= lags[-1]:
        return Health.LAGGING
    return Health.OK


__all__ = ["Health", "health"]
