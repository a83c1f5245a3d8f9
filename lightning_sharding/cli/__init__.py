"""The ``lightning-sharding`` command line, one module per subcommand (``plan``, ``inspect``, ``audit``)."""

from lightning_sharding.cli._common import PROG, CliError
from lightning_sharding.cli.checkpoint import format_inspect
from lightning_sharding.cli.main import build_parser, main
from lightning_sharding.cli.plan_format import _nonempty_slots, _slots, format_plan

__all__ = ["PROG", "CliError", "_nonempty_slots", "_slots", "build_parser", "format_inspect", "format_plan", "main"]
