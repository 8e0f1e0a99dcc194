"""Command-line interface: typer wiring only (flags -> frozen config -> stage function)."""
