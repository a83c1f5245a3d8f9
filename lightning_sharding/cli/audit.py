"""``lightning-sharding audit DIR...``: the ``audit`` subcommand, exactly-once over a run's audit trail.

One module per subcommand, like ``plan`` and ``inspect``: its arguments, the table it prints and
its exit status. The trail's format, what training writes and what the audit reads, belongs to
:mod:`lightning_sharding.loading.audit` alone, which knows nothing of the command line.
"""

from __future__ import annotations

import argparse
from typing import Any

from lightning_sharding.loading.audit import audit, format_audit


def register(subparsers: Any) -> None:
    """Add the ``audit`` subcommand to the ``lightning-sharding`` command line."""
    parser = subparsers.add_parser(
        "audit",
        help="check exactly-once over the audit trails of a run and its resumed continuations",
        description="Exit status 1 when any epoch served a sample twice or a finished epoch missed one.",
    )
    parser.add_argument("directories", nargs="+", help="run directories (or their audit/ folders)")
    parser.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    results = audit(args.directories)
    print(format_audit(results))
    return 0 if all(r.ok for r in results) else 1
