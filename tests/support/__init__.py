"""What the tests share: the process harness (``harness``: jobs, topologies, launches, exactly-once
checks), the data builders (``data``: streams, token corpora, month files, dispatch sources, and the
readers job processes and workers unpickle from there), the docs' code blocks (``doc_blocks``),
optional packages (``extras``), the fault tools and servers (``fault_proxy``: a TCP proxy that drops
and delays; ``s3`` and ``gcs``: loopback object stores), and what a job's processes hold
(``resources``: /dev/shm files and TCP ports)."""
