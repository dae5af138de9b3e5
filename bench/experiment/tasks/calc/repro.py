"""Prints a summary of a synthetic data set (and burns a little CPU, as real repro scripts do)."""
import random

import tablefmt
from statkit import mean, median, variance

rng = random.Random(7)
data = [rng.gauss(10, 2) for _ in range(300_000)]
rows = [("n", len(data)), ("mean", round(mean(data), 4)), ("median", round(median(data), 4)),
        ("variance", round(variance(data), 4))]
print(tablefmt.table(rows))
