"""Training data: sources (JSONL / Parquet, local or s3://) -> records -> token ids + loss masks -> shards.

    flashdraft prepare --data data/*.jsonl --tokenizer TARGET_DIR --out shards/run1     # once
    ds = TokenizedDataset("shards/run1")                                               # in every rank
    for i in ds.epoch_order(epoch, seed, rank, world_size):
        input_ids, loss_mask = ds[i]          # loss_mask[t] == 1: token t is a response token (a label)

See prepare.py for the command, formats.py for the record formats, encoder.py for how records become tokens and
masks, sources.py and remote.py for reading them, shards.py for the layout.
"""

from flashdraft.data.encoder import Encoder, Sample
from flashdraft.data.errors import DataError, DataReport
from flashdraft.data.formats import FormatConfig, detect_format
from flashdraft.data.prepare import PrepareConfig, PrepareResult, prepare_shards
from flashdraft.data.shards import ShardWriter, TokenizedDataset, epoch_order, permutation
from flashdraft.data.sources import Record, SourceFile, iter_records, resolve_sources

__all__ = [
    "DataError",
    "DataReport",
    "Encoder",
    "FormatConfig",
    "PrepareConfig",
    "PrepareResult",
    "Record",
    "Sample",
    "ShardWriter",
    "SourceFile",
    "TokenizedDataset",
    "detect_format",
    "epoch_order",
    "iter_records",
    "permutation",
    "prepare_shards",
    "resolve_sources",
]
