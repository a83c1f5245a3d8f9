"""First in a forkserver's preload list (:mod:`lightning_sharding.strategies._start`): the garbage
collector pauses while the server imports. Importing torch allocates about a million objects, and
the collector walks all of them at each of the full collections they set off: 0.1-0.2 s of a
second's import on the machine of docs/performance.md. :mod:`lightning_sharding.preload.resume`,
last in the list, freezes what the imports made and turns the collector back on.

Imported anywhere else (a tool that imports every module), it changes nothing; nor in a server whose
collector was off already (a training script, preloaded first as ``__main__``, that turned it off)."""

import gc
import sys


def _in_a_forkserver() -> bool:
    """Whether this import is a forkserver's preload: ``multiprocessing.forkserver.main`` called it."""
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "main" and code.co_filename.replace("\\", "/").endswith("multiprocessing/forkserver.py"):
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


PAUSED = gc.isenabled() and _in_a_forkserver()  # whether this module turned the collector off
if PAUSED:
    gc.disable()
