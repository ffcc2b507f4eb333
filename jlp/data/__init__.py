"""Input data: loaders (digits, CIFAR-10/100, ImageNet folders, Cityscapes, GLUE-style TSV
sentences with BERT's WordPiece tokenizer), augmentation, and the deterministic, per-process
input pipeline with prefetching.

  ds = jlp.data.get_dataset("cifar10", split="train")   # root: $JLP_DATA_DIR/cifar10 or data/cifar10
  pipe = jlp.data.Pipeline(ds, global_batch_size=512, seed=0)
  with pipe.prefetch(start_step=step, sharding=sharding) as batches:
    for batch in batches: ...        # {"image": NHWC float32, "label": int32, "mask": bool}

What each loader accepts and refuses, and its options: docs/data.md.
"""

from jlp.data.dataset import ArrayDataset, CropFlip, DataFileError, Dataset, Normalization
from jlp.data.pipeline import SAMPLERS, Pipeline, Prefetcher, Sampler
from jlp.data.registry import (DATA_DIR_ENV, DATASETS, config_kwargs, dataset_options,
                               default_root, get_dataset)
from jlp.data.text import TokenDataset, WordPiece

__all__ = [
    "ArrayDataset",
    "CropFlip",
    "DATASETS",
    "DATA_DIR_ENV",
    "DataFileError",
    "Dataset",
    "Normalization",
    "Pipeline",
    "Prefetcher",
    "SAMPLERS",
    "Sampler",
    "TokenDataset",
    "WordPiece",
    "config_kwargs",
    "dataset_options",
    "default_root",
    "get_dataset",
]
