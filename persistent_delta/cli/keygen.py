"""``persistent-delta keygen PATH``: create a job's stream key file.

Owns: turning the command line into :func:`persistent_delta.fleet.auth.write_key_file` (a new
file, mode 0600, never overwriting one); what a key is and how it is used is
:mod:`persistent_delta.fleet.auth`'s.
"""

from __future__ import annotations

import argparse

from persistent_delta.fleet.auth import StreamKey, generate_key, write_key_file


def run_keygen(args: argparse.Namespace) -> StreamKey:
    """Write a new key to ``args.path`` (``args.key_id``: its id, default random).

    Raises:
        StreamKeyError: the file exists or cannot be created, or a bad key id.
    """
    return write_key_file(args.path, generate_key(args.key_id))
