"""One rank of a job that only builds its manifest: ``torchrun ... tests/jobs/index_job.py OUT GLOB``.

Its reader writes down every shard it walks (``<OUT>/scans-rank<r>.txt``, one URL a line), and the
rank writes its manifest's total and fingerprint to ``<OUT>/manifest-rank<r>.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from lightning_sharding import TarReader


class CountingTar(TarReader):
    """A TarReader that logs each shard it walks (alone, or in a batch)."""

    def __init__(self, urls: str, log: str, **options: Any) -> None:
        super().__init__(urls, **options)
        self.log = log

    def scan_content(self, info: Any) -> Any:
        self._write([info])
        return super().scan_content(info)

    def scan_batch(self, files: Any) -> Any:
        found = super().scan_batch(files)
        self._write(
            [info for info, got in zip(files, found, strict=False) if got is not None]
        )  # the others: scan_content
        return found

    def _write(self, files: Any) -> None:
        with open(self.log, "a") as f:
            f.writelines(info.url + "\n" for info in files)


def main(out: str, pattern: str) -> None:
    import torch
    import torch.distributed as dist

    from lightning_sharding import ShardedData

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    reader = CountingTar(pattern, log=f"{out}/scans-rank{rank}.txt", cache_dir=f"{out}/cache")
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    data = ShardedData(reader, optimizer=optimizer, batch_size=8, num_workers=0, seed=0)
    manifest = {"total": data.manifest.total, "fingerprint": data.manifest.fingerprint, "scan": reader.last_scan}
    Path(out, f"manifest-rank{rank}.json").write_text(json.dumps(manifest))
    data.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
