"""The ``lightning-sharding`` command line: ``plan``, ``inspect``, ``audit``, ``index`` and ``tokenize``.

``plan`` shows which samples, batches and items every (rank, worker) gets for a topology;
``inspect`` reads the data ledger inside a Lightning checkpoint; ``index`` writes the data's index
beside it; ``tokenize`` turns text into Megatron token files. Heavy imports (Hydra, torch,
matplotlib) happen inside the commands, so ``--help`` answers at once.
"""

from __future__ import annotations

import argparse
import sys

from lightning_sharding.cli._common import PROG, CliError, _Parser


def build_parser() -> argparse.ArgumentParser:
    """The ``lightning-sharding`` argument parser and its subcommands (``plan``, ``inspect``, ``tokenize``...)."""
    from lightning_sharding import _version
    from lightning_sharding.cli.audit import register as register_audit
    from lightning_sharding.cli.checkpoint import register as register_inspect
    from lightning_sharding.cli.index import register as register_index
    from lightning_sharding.cli.plan import register as register_plan
    from lightning_sharding.cli.tokenize import register as register_tokenize

    parser = _Parser(
        prog=PROG,
        description="Plan, inspect and audit exactly-once sharded data loading; index data files; tokenize text.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    register_plan(sub)
    register_inspect(sub)
    register_audit(sub)
    register_index(sub)
    register_tokenize(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command line on ``argv`` (default ``sys.argv[1:]``); returns the exit status."""
    parser = build_parser()
    prog = PROG
    try:
        args, extra = parser.parse_known_args(argv)
        prog = f"{PROG} {args.command}"
        if extra:
            # Hydra overrides may come after options (`plan --world-size 2 data.num_items=4`).
            if args.command != "plan" or any(e.startswith("-") for e in extra):
                raise CliError(f"unrecognized arguments: {' '.join(extra)} (see `{prog} --help`)")
            args.overrides = [*args.overrides, *extra]
        status: int = args.func(args)
        return status
    except SystemExit as done:  # --help and --version
        return done.code if isinstance(done.code, int) else 0
    except CliError as err:
        message = str(err)
        prog = err.prog or prog
    except (OSError, ValueError) as err:  # what the audit raises for a bad directory or file
        message = str(err)
    print(f"{prog}: error: {' '.join(message.split())}", file=sys.stderr)
    return 2
