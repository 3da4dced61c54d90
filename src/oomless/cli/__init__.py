"""Command line: ``oomless.cli.main:main`` dispatches to one module per subcommand."""
