from persistent_delta.cli import run_subcommand  # `persistent-delta replay ...`: export a batch range as safetensors
raise SystemExit(run_subcommand("replay"))
