"""Owns: the small logs tests build by hand -- plain ``LmdbDeltaStore`` files, one per rank, whose
records a test describes as a function of (rank, batch)."""

from __future__ import annotations

import functools
import os
from typing import Callable, Iterable, Optional, Tuple

import torch
from torchrec.distributed.model_tracker.types import UpdateMode

from persistent_delta import LmdbDeltaStore

# (table fqn, ids, states or None): one ``LmdbDeltaStore.append`` call.
Record = Tuple[str, torch.Tensor, Optional[torch.Tensor]]


def fill_store(path: str, records: Callable[[int], Iterable[Record]], *, batches: int,
               mode: UpdateMode = UpdateMode.NONE, start: int = 0) -> None:
    """Write a plain store at ``path``: batch ``b`` (``start <= b < start + batches``) appends
    ``records(b)`` in order.

    Args:
        path: The store's directory (created when missing).
        records: The records of one batch, in append order.
        batches: How many batches to write.
        mode: The store's update mode.
        start: The first batch index.
    """
    with LmdbDeltaStore(path, mode) as store:
        for b in range(start, start + batches):
            for fqn, ids, states in records(b):
                store.append(b, fqn, ids, states)


def fill_ranks(root: str, records: Callable[[int, int], Iterable[Record]], *, ranks: int, batches: int,
               mode: UpdateMode = UpdateMode.NONE, start: int = 0) -> None:
    """Write one plain store per rank under ``root/rank-<r>``: batch ``b`` of rank ``r`` appends
    ``records(r, b)`` in order (the layout a tracked job leaves, read by consumers and the CLI).

    Args:
        root: The job's log root.
        records: The records of one rank's batch, in append order.
        ranks: How many ranks.
        batches: How many batches per rank.
        mode: The stores' update mode.
        start: The first batch index.
    """
    for r in range(ranks):
        fill_store(os.path.join(root, f"rank-{r}"), functools.partial(records, r), batches=batches, mode=mode,
                   start=start)
