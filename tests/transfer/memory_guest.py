"""Runs inside a workspace: holds MIB of seeded random bytes in memory; each time /workspace/ask appears it answers
in /workspace/answer the sha256 of its memory and how many questions it has answered (state only memory holds)."""

import hashlib
import os
import random
import sys
import time

mib = int(sys.argv[1])
rnd = random.Random(7)
data = [rnd.randbytes(1 << 20) for _ in range(mib)]
asked = 0
open("/workspace/ready.tmp", "w").write("1")
os.replace("/workspace/ready.tmp", "/workspace/ready")
while True:
    if os.path.exists("/workspace/ask"):
        os.unlink("/workspace/ask")
        asked += 1
        h = hashlib.sha256()
        for block in data:
            h.update(block)
        with open("/workspace/answer.tmp", "w") as f:
            f.write(f"{h.hexdigest()} {asked}")
        os.replace("/workspace/answer.tmp", "/workspace/answer")
    time.sleep(0.01)
