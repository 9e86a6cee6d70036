"""``python -m persistent_delta ...``: the ``persistent-delta`` command line."""

from persistent_delta.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
