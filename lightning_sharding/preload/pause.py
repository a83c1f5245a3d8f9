"""First in a forkserver's preload list (:mod:`lightning_sharding.strategies._start`): the garbage
collector pauses while the server imports. Importing torch allocates about a million objects, and
the collector walks all of them at each of the full collections they set off: 0.1-0.2 s of a
second's import on the machine of docs/performance.md. :mod:`lightning_sharding.preload.resume`,
last in the list, freezes what the imports made and turns the collector back on."""

import gc

gc.disable()
