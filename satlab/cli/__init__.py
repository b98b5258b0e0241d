"""Command-line entry points. Kept free of heavy imports so `--help` is instant."""
