"""What a forkserver's preload list begins and ends with (:mod:`lightning_sharding.strategies._start`):
:mod:`~lightning_sharding.preload.pause` pauses the garbage collector while the server imports, and
:mod:`~lightning_sharding.preload.resume` freezes what the imports made and runs it again. This
folder imports nothing, so that the pause comes before any other import of the server."""
