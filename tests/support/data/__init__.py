"""The tests' data builders: what they write to disk and the readers, sources and transforms that
read it, module level so that job processes, DataLoader workers and dispatch processes import them
by these module paths (``tests.support.data.<module>``, from the repository root on ``PYTHONPATH``).

``streams``: mixtures of synthetic streams whose sample ids do not overlap, and what an epoch of one
plans; ``tokens``: Megatron token corpora whose every token is a distinct id; ``windows``: one
``.npy`` file per month for the broadcast strategy; ``sources``: a SQLite file and a TCP log stream
for the dispatch strategy; ``dali``: a reader and transform the DALI tests send into DALI's workers;
``worker_probe``: a reader whose samples tell what its worker process sees.

Light to import, like every module here: this package imports nothing (no torch, no Lightning), so a
process that unpickles a reader from it pays only for that module's own imports.
"""
