"""Last in a forkserver's preload list (:mod:`lightning_sharding.strategies._start`): what the
preloaded modules made is frozen (:func:`gc.freeze`), and the collector, paused by
:mod:`lightning_sharding.preload.pause`, runs again before the server forks any worker. Python's
documentation advises this for a process that forks without exec: a worker's collections then skip
the modules' objects, whose memory pages it shares with the server and would otherwise copy."""

import gc

gc.freeze()
gc.enable()
