"""The `data:` section of a vitgraph experiment: what the datasets and loaders read.

Here, in the data layer, so that the loaders take it as it is (its defaults stated once);
vitgraph.config adds it to the experiment and checks its keys against the others'.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from vitgraph.config_keys import key
from vitgraph.data.augment import AugmentConfig


@dataclass
class PackingConfig:
    """data.resolution=native: each image at its own size and aspect ratio, packed with others
    along the sequence into microbatches of a fixed token budget (vitgraph/data/packing.py)."""
    # an image larger than this many patches is shrunk to the largest grid that fits (the
    # NaFlex rule, aspect ratio kept); one smaller than min_patches is enlarged
    max_patches: int = key(256, above=0)
    min_patches: int = key(1, above=0)
    # a pack's tokens: images (their class token and registers included) back to back, the
    # rest padding. A multiple of 16 for FP8 and of tp with sequence parallel
    tokens_per_microbatch: int = key(4096, above=0)
    # images in one pack at most; 0: as many as let tokens, not the count, end a pack of the
    # training images' sizes (a sample; vitgraph/plan.py, the choice in the log). At most 64
    # images in 16,384 tokens left SO400M/16's packs of ~231-token images 90% full
    max_images: int = key(0, min=0)
    # images the packer looks ahead over when filling a step's packs (0: all of a step's
    # packs' worth, max_images each); more fills packs better, fewer keeps the order closer
    window: int = key(0, min=0)
    # how a microbatch holds its images. packed: back to back in tokens_per_microbatch, the
    # attention kept within each image; padded: each image in a slot of its own of max_len =
    # class / register tokens + max_patches tokens, min(max_images, tokens_per_microbatch //
    # max_len) slots a microbatch, padding masked out of attention; auto: the one that costs
    # fewer tokens per image, estimated from a sample of the data's image sizes and the
    # model's attention path (vitgraph/plan.py; the choice and why are in the log). Padded
    # wins where the images nearly fill a slot
    layout: str = key("auto", choices=("auto", "packed", "padded"))


@dataclass
class DataConfig:
    # shapes (embedded, procedural) | imagefolder | webdataset
    kind: str = key("shapes", choices=("shapes", "imagefolder", "webdataset"))
    # imagefolder: root holding train/ and val/; webdataset: folder of train-*.tar, val-*.tar
    path: Optional[str] = None
    num_train: int = key(50000, above=0)  # shapes only
    num_val: int = key(2000, above=0)  # shapes only
    # size images are drawn / decoded at; resized to model.image_size
    render_size: int = key(32, above=0)
    # shapes only (the first this many of vitgraph.data.shapes.CLASSES)
    num_classes: int = key(10, min=1)
    # shapes: the caption of each image. full: size, colours, shape, background, place and
    # rotation ("a large white star on a dark blue background, in the top left, rotated 30
    # degrees"); short: size, colour and shape ("a large white star"); shape_first: the
    # shape, then size and colour ("star, large white": a captioning VLM's first word names
    # the class)
    captions: str = key("full", choices=("full", "short", "shape_first"))
    # shapes, training split only: each of a caption's size word and its shape's colour is left
    # out with this probability, drawn anew for every pair at every step (seeded by train.seed;
    # held-out captions stay whole): "a large white star" is also seen as "a white star",
    # "a large star" and "a star", so the text tower learns partial and shape-only captions
    caption_dropout: float = key(0.0, min=0, max=1)
    # the fraction of the run's steps after which caption dropout begins. From the first step
    # (0) the pair learned next to nothing on the shapes (10% zero-shot after 500 steps, loss
    # flat): the colour words are what it first aligns images and texts by
    caption_dropout_start: float = key(0.0, min=0, below=1)
    # shapes: the dataset's own seed; runs with other train.seed values share its cache entry
    # (null: derive the data from train.seed)
    seed: Optional[int] = key(0, min=0)
    # generated datasets are cached here (`vitgraph cache` shows it, `vitgraph cache --clear`
    # empties it), least recently used first out beyond cache_max_mb
    cache_dir: Optional[str] = key("~/.cache/vitgraph", resume_ok=True)
    cache_max_mb: float = key(1024.0, min=0)
    workers: int = key(2, min=1, resume_ok=True)
    # imagefolder: decode every image up front (fast steps, memory ~ N x size^2 x 3 bytes);
    # false decodes each batch on demand in `workers` threads (large folders, e.g. ImageNet)
    preload: bool = key(True, resume_ok=True)
    # training-time augmentation, batched on the device (vitgraph/data/augment.py); off for
    # held-out data always
    augment: AugmentConfig = field(default_factory=AugmentConfig)
    # where JPEGs are decoded (webdataset, and imagefolder with preload false): cpu (in
    # `workers` threads), cuda (nvJPEG via torchvision, batched on the GPU, one step ahead),
    # auto (cuda when CUDA and torchvision are there)
    decode: str = key("auto", choices=("cpu", "cuda", "auto"), resume_ok=True)
    # decode=cuda (shards, or an ImageFolder with preload false; fixed resolution): this share
    # of each microbatch is decoded in the loader's threads instead (simplejpeg or PIL, at full
    # size), the rest by nvJPEG; the GPU resizes all of them. From shards on the H200 host
    # neither share 0.6 nor 1.0 beat nvJPEG alone (0.84x and 0.76x of in-memory training;
    # benchmarks/BENCHMARKS.md): 0 by default
    cpu_decode_share: float = key(0.0, min=0, max=1)
    # webdataset: shards are shuffled, and samples within windows of this many shards
    shuffle_shards: int = key(4, min=1)
    # make the next step's microbatches while this one trains, in a thread: shard reads and
    # decoding, and on a GPU the copies to the device (pinned) and nvJPEG decode on a side
    # stream (vitgraph/data/prefetch.py). Changes no batch; off: made between steps
    prefetch: bool = True
    # fixed: every image resized to model.image_size (square batches); native: each image at
    # its own aspect ratio and size, packed along the sequence (data.packing). With native,
    # train.micro_batch_size is 1 (a microbatch is one pack) and train.global_batch_size
    # counts packs per step
    resolution: str = key("fixed", choices=("fixed", "native"))
    packing: PackingConfig = field(default_factory=PackingConfig)
