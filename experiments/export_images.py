"""Writes a shard directory of ``tools/convert_images.py`` as one ``.npz`` (``train_images``,
``train_labels``, ``test_images``, ``test_labels``: uint8 [N, H, W, 3] and int32 [N]), so that a
peer outside hopperjax's venv (``experiments/airbench_reference_torch.py``) trains on exactly the
decoded pixels hopperjax trains on.

    python experiments/export_images.py --shards data/cifar10_shards --out cifar10.npz
"""

from __future__ import annotations

import argparse

import numpy as np

from hopperjax.data import image_shards


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shards", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--train-split", default="train")
    parser.add_argument("--test-split", default="test")
    args = parser.parse_args()
    arrays = {}
    for name, split in (("train", args.train_split), ("test", args.test_split)):
        images = image_shards.read_image_shards(args.shards, split).load()
        arrays[f"{name}_images"], arrays[f"{name}_labels"] = images.images, images.labels
        print(f"{name}: {len(images)} images {images.images.shape[1:]}, classes {images.classes}")
    np.savez(args.out, **arrays)


if __name__ == "__main__":
    main()
