"""Write realistic synthetic click logs in Criteo's TSV format.

Categorical ids are Zipf-distributed over id spaces of up to `--vocab` distinct values per
feature (the big features get the full space, the small ones less); integer features are
heavy-tailed counts; ~5% of values are missing. Labels come from a hidden logistic model
(a weight per (feature, id) from a hash, plus the dense features), so AUC is meaningful:
a model can learn it, and a random one scores 0.5.

    python examples/ctr_data.py --rows 200000 --out /tmp/criteo_train.tsv --seed 1
"""

import argparse

import numpy as np

NUM_DENSE, NUM_SPARSE = 13, 26


def hidden_weight(feature: np.ndarray, value: np.ndarray) -> np.ndarray:
    """The hidden model's weight of each (feature, id): a fixed pseudo-random normal."""
    x = (value.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)) ^ (feature.astype(np.uint64) << np.uint64(40))
    x ^= x >> np.uint64(31)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(29)
    u = ((x >> np.uint64(11)).astype(np.float64) + 0.5) / float(1 << 53)
    return (u - 0.5) * 2.0


def generate(rows: int, vocab: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    sizes = np.geomspace(vocab, 50, NUM_SPARSE).astype(np.int64)  # a few huge features, many small ones
    sparse = np.stack([np.minimum(rng.zipf(1.15, rows), size) - 1 for size in sizes], axis=1)
    dense = np.floor(rng.pareto(1.5, (rows, NUM_DENSE)) * 3).astype(np.int64)
    features = np.broadcast_to(np.arange(NUM_SPARSE), sparse.shape)
    logit = hidden_weight(features, sparse).sum(axis=1) * 0.7 + 0.3 * np.log1p(dense[:, :4]).sum(axis=1) - 2.0
    labels = (rng.random(rows) < 1 / (1 + np.exp(-logit))).astype(np.int64)
    return labels, dense, sparse


def write(path: str, labels, dense, sparse, missing: float, seed: int) -> None:
    rng = np.random.default_rng(seed + 1)
    with open(path, "w") as out:
        for i in range(labels.shape[0]):
            d = ["" if rng.random() < missing else str(v) for v in dense[i]]
            s = ["" if rng.random() < missing else format(v * 2654435761 % (1 << 32), "08x") for v in sparse[i]]
            out.write("\t".join([str(labels[i]), *d, *s]) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--vocab", type=int, default=2_000_000, help="id space of the biggest features")
    parser.add_argument("--missing", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    write(args.out, *generate(args.rows, args.vocab, args.seed), args.missing, args.seed)


if __name__ == "__main__":
    main()
