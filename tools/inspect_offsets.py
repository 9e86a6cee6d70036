from persistent_delta.cli import run_subcommand  # `persistent-delta offsets ...`: describe/reset consumer offsets
raise SystemExit(run_subcommand("offsets"))
