"""Schemas of the ``data`` group: what is read, and the loader options every data option shares.

``feeds`` on each schema says what the option builds (a reader, windows or a source);
:func:`~lightning_sharding.config.checks.check_config` matches it to the strategy.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, ClassVar

from omegaconf import MISSING

from lightning_sharding.config.generated import with_fields_of
from lightning_sharding.loading.engine import LoadingEngine
from lightning_sharding.mixture import Phase, Stream
from lightning_sharding.readers.decoding import IMAGE_EXTENSIONS
from lightning_sharding.tokens import Packing


def _default(name: str) -> Any:
    """The default of the Python API's argument ``name``: the one definition of every loader option's
    default (:meth:`~lightning_sharding.loading.engine.LoadingEngine.from_arguments`)."""
    return _ARGUMENTS[name].default


_ARGUMENTS = inspect.signature(LoadingEngine.from_arguments).parameters


@dataclass
class DataOptions:
    """The options every ``data`` option shares: batching, workers, seed, even batches, errors.

    Each is an argument of ``ShardedDataModule`` of the same name, with the same default (a test
    holds them equal); a data option's YAML (``conf/data/*.yaml``) states its own choices, such as
    ``batch_size: 64``, ``num_workers: 2`` and ``persistent_workers: true``. ``feeds`` says what the
    option builds: ``"reader"`` (samples), ``"windows"`` (a
    :class:`~lightning_sharding.readers.windows.WindowedReader`) or ``"source"`` (a
    :class:`~lightning_sharding.readers.sources.Source`); :func:`check_config` matches it to the strategy.
    """

    feeds: ClassVar[str] = "reader"

    batch_size: int = _default("batch_size")
    num_workers: int = _default("num_workers")
    seed: int | None = _default("seed")  # none: drawn on rank 0 and broadcast (and stored in checkpoints)
    shuffle: bool = _default("shuffle")
    even_batches: str = _default("even_batches")  # pad | drop (| sync with sharding=dispatch)
    persistent_workers: bool = _default("persistent_workers")  # with num_workers > 0 only
    # null: forkserver, modules preloaded (Linux) | spawn | fork
    multiprocessing_context: str | None = _default("multiprocessing_context")
    pin_memory: bool = _default("pin_memory")  # the DataLoader's: batches in page-locked memory, for a GPU
    prefetch_factor: int | None = _default("prefetch_factor")  # batches a worker loads ahead; none: the DataLoader's
    timeout: float = _default("timeout")  # seconds to wait for a worker's batch; 0: no limit
    padding_key: str | None = _default("padding_key")  # the flag of padded samples in a dict batch; none: not added
    on_error: str = _default("on_error")  # raise | skip (sharding=shard only)
    cache_dir: str | None = None  # file indexes and generated data; none: ~/.cache/lightning_sharding
    # {old prefix: new prefix}: a checkpoint of lightning_sharding 0.1 (which knew items by path) resumes
    # on data that moved; later checkpoints know items by name and content and need none.
    root_map: dict[str, str] = field(default_factory=dict)
    # Resume a checkpoint of other data by starting its epoch afresh (its consumed samples are trained
    # again, with a warning), rather than refusing it.
    allow_data_change: bool = _default("allow_data_change")
    # What a resume leaves out (a loss spike's data): global steps "81200-81400,81500" (both ends included),
    # or {steps: ..., checkpoint: PATH} / {samples: "1200-1299", epoch: E} / {documents: 287} (packed).
    # docs/how-to/pretraining.md.
    skip: Any = _default("skip")

    def known_total(self) -> int | None:
        """Samples per epoch when the config alone tells (generated data), else ``None``."""
        return None


@dataclass
class SyntheticData(DataOptions):
    """The built-in synthetic regression set (no files): ``num_items`` x ``samples_per_item``."""

    _target_: str = "lightning_sharding.recipes.data.synthetic"
    num_items: int = 16
    samples_per_item: int = 1024
    dim: int = 16

    def known_total(self) -> int | None:
        """Every item holds ``samples_per_item`` samples."""
        return self.num_items * self.samples_per_item


@dataclass
class FilesData(DataOptions):
    """Files of one reader format (tar, parquet, npy, jsonl), local or remote.

    With no ``urls``, ``num_items`` files of ``samples_per_item`` regression samples (``dim``
    features) are generated once under ``cache_dir`` and read back.
    """

    _target_: str = "lightning_sharding.recipes.data.files"
    format: str = "tar"  # tar | parquet | npy | jsonl
    urls: list[str] | None = None  # paths, globs or URLs (s3://, gs://, az://, hf://); none: generate a data set
    storage_options: dict[str, Any] = field(default_factory=dict)  # fsspec options (credentials...)
    endpoint_url: str | None = None  # of s3:// (MinIO, moto...) or gs:// URLs; none: the cloud's
    cache_limit: Any = None  # keep remote files locally: bytes (int) or a fraction of free disk (float <= 1)
    index_once_per: str = "job"  # who lists and indexes: job (rank 0), node (local rank 0s), rank (every rank)
    data_index: Any = None  # `lightning-sharding index`'s: null beside the data if there, its URL, or false
    prefetch_files: int = 0  # with cache_limit: files each worker fetches ahead of the one it reads
    prefetch_bytes: int | None = None  # with prefetch_files: at most these bytes of files ahead
    num_items: int = 16
    samples_per_item: int = 1024
    dim: int = 16

    def known_total(self) -> int | None:
        """Known for the generated set only."""
        return None if self.urls else self.num_items * self.samples_per_item


@dataclass
class MonthsData(DataOptions):
    """One time-major ``.npy`` array per month, ``(steps, variables)``; samples are windows.

    With no ``paths``, ``months`` months of hourly data are generated (``steps_per_month`` steps).
    """

    feeds: ClassVar[str] = "windows"

    _target_: str = "lightning_sharding.recipes.climate.months"
    paths: list[str] | None = None  # .npy files or globs, in time order; none: generate
    window: int = 48  # steps per window: window - 1 inputs, the last step is the target
    stride: int = 6
    halo: bool = True  # windows may cross a month boundary (the months are one series)
    variables: int = 3  # per-step values; must match the files
    months: int = 12
    steps_per_month: int = 720


@dataclass
class TokensData(DataOptions):
    """Token files: 1-d ``.npy`` files of token ids, cut into samples of ``sample_length + 1`` tokens.

    With no ``urls``, ``num_files`` files of ``tokens_per_file`` tokens below ``vocab_size`` are
    generated.
    """

    _target_: str = "lightning_sharding.recipes.tokens.token_files"
    urls: list[str] | None = None
    storage_options: dict[str, Any] = field(default_factory=dict)
    sample_length: int = 64  # tokens a sample predicts (each sample reads sample_length + 1)
    vocab_size: int = 256
    num_files: int = 8
    tokens_per_file: int = 32768

    def known_total(self) -> int | None:
        """Known for the generated set only."""
        return None if self.urls else self.num_files * (self.tokens_per_file // (self.sample_length + 1))


@with_fields_of(Stream, skip=("name", "reader"))
@dataclass
class TokenStreamOptions:
    """One token stream of ``data=pretrain``: Megatron files (``prefixes``: prefixes or globs of
    ``.idx`` files), Parquet files of token lists (``prefixes``: ``.parquet`` files or globs, as
    Hugging Face ``datasets`` writes a tokenized set; ``column``: its column of token ids), or with
    none ``documents`` generated documents of 8 to ``longest`` tokens in ``files`` files. Its share is
    a :class:`~lightning_sharding.mixture.Stream`'s: ``tokens`` per epoch, or ``weight``,
    ``proportion``, ``repeat`` or ``choose`` (none: one pass)."""

    name: str = MISSING
    prefixes: list[str] | None = None
    column: str = "input_ids"  # .parquet prefixes: the column of token id lists
    files: int = 2
    documents: int = 1000
    longest: int = 400


@with_fields_of(Phase, skip=("note",))
@dataclass
class PhaseOptions:
    """One phase of ``data.schedule``, a :class:`~lightning_sharding.mixture.Phase`: from ``start`` (a
    fraction of the epoch), or from ``samples`` (or, of packed token streams, ``tokens``) trained since
    the start of training, on, the streams draw at ``shares`` (stream name -> weight; a stream not named
    draws nothing in the phase); ``ramp``: the shares move there linearly over that much after the start."""


@with_fields_of(Packing)
@dataclass
class PretrainData(DataOptions):
    """Token streams of documents mixed by tokens and packed into sequences of ``seq_len`` tokens
    (language-model pretraining). The packing's fields are a :class:`~lightning_sharding.tokens.Packing`'s,
    with its defaults (``mode``: concat | best_fit | none); ``seq_len``, which Packing requires, and the
    ``vocab_size`` of the generated documents are stated in ``conf/data/pretrain.yaml``."""

    _target_: str = "lightning_sharding.recipes.pretrain.packed_documents"
    streams: list[TokenStreamOptions] = field(default_factory=list)
    # A share schedule: phases from a number of tokens (or a fraction of the epoch) on, with their shares.
    schedule: list[PhaseOptions] | None = _default("schedule")


@dataclass
class ImagesData(DataOptions):
    """Images with class labels in WebDataset tar shards (``urls``; with none, ``num_items``
    shards of ``samples_per_item`` generated JPEG ``image_size`` squares of ``classes`` classes),
    decoded in the workers, random-resized-cropped to ``crop`` and flipped from each sample's seed;
    ``batch_path``: per batch rather than per sample. A sample's image is its first field of
    ``image_fields`` (the file extensions in the shard: ``jpg``, ``png``...), its label the
    integer in the field ``label_field``."""

    _target_: str = "lightning_sharding.recipes.images.image_shards"
    urls: list[str] | None = None
    storage_options: dict[str, Any] = field(default_factory=dict)
    num_items: int = 8
    samples_per_item: int = 64
    image_size: int = 64
    classes: int = 4
    crop: int = 48
    batch_path: bool = False  # decode each batch's JPEGs straight into one array (DecodeCropBatch)
    image_fields: list[str] = field(default_factory=lambda: list(IMAGE_EXTENSIONS))  # any image the reader decodes
    label_field: str = "cls"  # a sample's class label: an integer, as webdataset writes .cls

    def known_total(self) -> int | None:
        """Known for the generated shards only."""
        return None if self.urls else self.num_items * self.samples_per_item


@dataclass
class SqliteData(DataOptions):
    """Rows of a SQLite query, read by one dispatch process per rank (a non-replicable source).

    With no ``path``, a table of ``rows`` regression rows (``dim`` features) is generated.
    """

    feeds: ClassVar[str] = "source"

    _target_: str = "lightning_sharding.recipes.sqlite.sqlite_rows"
    path: str | None = None
    query: str = "SELECT id, x, y FROM samples ORDER BY (id * 2654435761 + :seed) % 4294967296, id"
    rows: int = 8192
    dim: int = 16

    def known_total(self) -> int | None:
        """Known for the generated table only."""
        return None if self.path else self.rows


@with_fields_of(Stream, skip=("name", "reader"))
@dataclass
class StreamOptions:
    """One stream of ``data=mixture``: files of one format and its share of the epoch, a
    :class:`~lightning_sharding.mixture.Stream`'s (give one of ``weight``, ``proportion``, ``repeat``
    or ``choose``; none is ``weight=1``).

    With no ``urls``, ``num_items`` files of ``samples_per_item`` regression samples are generated.
    """

    name: str = MISSING
    format: str = "npy"  # tar | parquet | npy | jsonl
    urls: list[str] | None = None  # paths, globs or URLs; none: generate
    num_items: int = 2
    samples_per_item: int = 256


@dataclass
class MixtureData(DataOptions):
    """Several streams of files mixed at chosen shares into epochs of ``samples_per_epoch``
    (none: what the shares imply). See docs/how-to/mixtures.md."""

    _target_: str = "lightning_sharding.recipes.mixture.mixture"
    streams: list[StreamOptions] = field(default_factory=list)
    samples_per_epoch: int | None = _default("samples_per_epoch")
    batch_composition: str = _default("batch_composition")  # mixed | stratified | per_stream
    # A share schedule: phases, each from a fraction of the epoch on, with its own shares (recipe=anneal).
    schedule: list[PhaseOptions] | None = _default("schedule")
    # Resume a checkpoint of other shares or streams: its consumed samples stay consumed, the rest of
    # its epoch is drawn at the new shares (docs/how-to/mixtures.md).
    allow_mixture_change: bool = _default("allow_mixture_change")
    storage_options: dict[str, Any] = field(default_factory=dict)
    dim: int = 16  # features of generated streams

    def known_total(self) -> int | None:
        """The epoch size when it is set."""
        return self.samples_per_epoch
