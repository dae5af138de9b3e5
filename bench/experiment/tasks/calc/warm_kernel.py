"""A warm interpreter, as agents keep one (a REPL, a Jupyter kernel, a language server): it loads the project's
data into memory once and then waits. Its memory is what forking saves copying."""
import random
import sys
import time

rng = random.Random(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
MIB = int(sys.argv[2]) if len(sys.argv) > 2 else 96
# Non-uniform data: a list of distinct floats (about 32 bytes each with the list slot).
state = [rng.random() for _ in range(MIB * (1 << 20) // 32)]
print("kernel ready", len(state), flush=True)
while True:
    time.sleep(3600)
