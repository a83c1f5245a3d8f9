"""Language-model pretraining: tokenized documents packed into fixed-length sequences.

:mod:`~lightning_sharding.tokens.documents` reads documents of token ids with their lengths from an
index; :mod:`~lightning_sharding.tokens.packing` lays an epoch out as packed sequences (an epoch
order the core plans like any other); :mod:`~lightning_sharding.tokens.batch` builds what a batch
holds; :mod:`~lightning_sharding.tokens.reader` joins them for ``ShardedDataModule(packing=...)``;
:mod:`~lightning_sharding.tokens.text` tokenizes text into documents once (``tokenize_files``).
"""

from lightning_sharding.tokens.batch import join_packed
from lightning_sharding.tokens.documents import DocumentReader, IndexedTokens, ParquetTokens, TokenFiles, write_indexed
from lightning_sharding.tokens.packing import FIELDS, MODES, PackedEpochs, PackedOrder, Packing
from lightning_sharding.tokens.reader import PackedReader
from lightning_sharding.tokens.text import tokenize_files

__all__ = [
    "FIELDS",
    "MODES",
    "DocumentReader",
    "IndexedTokens",
    "PackedEpochs",
    "PackedOrder",
    "PackedReader",
    "Packing",
    "ParquetTokens",
    "TokenFiles",
    "join_packed",
    "tokenize_files",
    "write_indexed",
]
