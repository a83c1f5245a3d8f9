"""Readers turn items into samples; each reader is one small module with the same interface.

The file readers import fsspec (and pyarrow for Parquet) only when used, so the core stays light.
"""

from lightning_sharding.readers.base import Reader
from lightning_sharding.readers.decoding import AudioDecoder, ImageDecoder, VideoDecoder, decoders
from lightning_sharding.readers.files import FileReader
from lightning_sharding.readers.jsonl import JsonlReader
from lightning_sharding.readers.npy import NpyReader
from lightning_sharding.readers.parquet import ParquetReader
from lightning_sharding.readers.synthetic import SyntheticReader
from lightning_sharding.readers.tar import TarReader
from lightning_sharding.readers.windows import NpyWindows, WindowedReader

#: The file reader of each format name, as recipes and ``data.format=`` spell it.
FILE_READERS: dict[str, type[FileReader]] = {
    "tar": TarReader,
    "parquet": ParquetReader,
    "npy": NpyReader,
    "jsonl": JsonlReader,
}

__all__ = [
    "FILE_READERS",
    "AudioDecoder",
    "FileReader",
    "ImageDecoder",
    "JsonlReader",
    "NpyReader",
    "NpyWindows",
    "ParquetReader",
    "Reader",
    "SyntheticReader",
    "TarReader",
    "VideoDecoder",
    "WindowedReader",
    "decoders",
]
