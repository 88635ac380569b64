"""The ``headprobe`` subcommands, one module each (registered in :data:`headprobe.cli.SUBCOMMANDS`)."""
