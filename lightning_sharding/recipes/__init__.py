"""The Python side of the packaged recipes: data builders (the ``data`` group's ``_target_``) and models.

Each builder takes the ``data`` config's fields plus the chosen ``sharding`` options and returns a
:class:`~lightning_sharding.lightning.datamodule.ShardedDataModule`. With no path given, it first generates a
small synthetic data set into the cache directory, so every recipe runs on a fresh machine.
"""
