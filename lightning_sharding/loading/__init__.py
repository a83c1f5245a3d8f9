"""The loading engine, free of Lightning: the arguments, the plan every rank agrees on, the ledger
keeper, the accounting of applied optimizer steps, the audit trail and the summary, driven by plain
calls; and ``ShardedData``, which drives it from a loop of your own. The Lightning glue
(``lightning_sharding.lightning``) is an adapter over it."""
