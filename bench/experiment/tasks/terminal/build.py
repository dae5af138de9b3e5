"""Builds build/index.json: a lookup table of the first primes and their digests (CPU-bound, a few seconds)."""
import hashlib
import json
import os

N = 160000
sieve = bytearray([1]) * N
sieve[0:2] = b"\0\0"
for i in range(2, int(N**0.5) + 1):
    if sieve[i]:
        sieve[i * i :: i] = bytearray(len(range(i * i, N, i)))
primes = [i for i in range(N) if sieve[i]]
index = {}
for p in primes:
    h = str(p).encode()
    for _ in range(60):
        h = hashlib.sha256(h).digest()
    index[p] = h.hex()[:16]
os.makedirs("build", exist_ok=True)
with open("build/index.json", "w") as f:
    json.dump(index, f, sort_keys=True)
print(f"built build/index.json: {len(index)} entries")
