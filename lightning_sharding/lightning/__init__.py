"""The Lightning glue: the DataModule and the callbacks, an adapter that drives the loading engine
(``lightning_sharding.loading``) from the Trainer's hooks."""
