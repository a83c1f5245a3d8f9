"""``python -m lightning_sharding.cli``: the ``lightning-sharding`` command."""

from lightning_sharding.cli.main import main

raise SystemExit(main())
