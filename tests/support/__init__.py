"""What the tests share: the process harness (``harness``: jobs, topologies, launches, exactly-once
checks), the docs' code blocks (``doc_blocks``), optional packages (``extras``), and the fault tools
and servers (``fault_proxy``: a TCP proxy that drops and delays; ``s3`` and ``gcs``: loopback object
stores)."""
