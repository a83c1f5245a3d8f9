"""Last in a forkserver's preload list (:mod:`lightning_sharding.strategies._start`): what the
preloaded modules made is frozen (:func:`gc.freeze`), and the collector, paused by
:mod:`lightning_sharding.preload.pause`, runs again before the server forks any worker. Python's
documentation advises this for a process that forks without exec: a worker's collections then skip
the modules' objects, whose memory pages it shares with the server and would otherwise copy. What
cyclic garbage the imports left is frozen with them, never collected. Where the pause did not turn
the collector off, nothing is done."""

import gc

from lightning_sharding.preload import pause

if pause.PAUSED:
    gc.freeze()
    gc.enable()
