"""Benchmarks lookups in build/index.json (prints what it computed, not how fast, so runs compare)."""
import hashlib
import json
import random

with open("build/index.json") as f:
    index = json.load(f)
rng = random.Random(0)
keys = sorted(index)
acc = hashlib.sha256()
hits = 0
for _ in range(700000):
    k = keys[rng.randrange(len(keys))]
    hits += index[k][0] in "0123"
    acc.update(index[k].encode()[:2])
print(f"700000 lookups, {hits} in the low quarter, checksum {acc.hexdigest()[:12]}")
