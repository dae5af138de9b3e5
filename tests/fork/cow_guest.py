"""Runs inside a workspace (python3 cow_guest.py MIB): a non-uniform heap of MIB MiB of mutable buffers, served
over HTTP on 127.0.0.1:8081. GET /digest hashes the heap (and the table); GET /write/SEED rewrites every other
buffer in place (the other buffers' pages stay untouched) and answers "ok"; GET /dirty/SEED/MIB rewrites about MIB
MiB of buffers spread over the heap. Writes /workspace/cow.ready when set up."""

import hashlib
import http.server
import os
import random
import sys

MIB = int(sys.argv[1])
rnd = random.Random(4321)
blobs: list[bytearray] = []
total = 0
while total < MIB << 20:
    b = bytearray(rnd.randbytes(rnd.randint(1, 256) * 512))
    blobs.append(b)
    total += len(b)
table = {i: (str(i) * 3, i * i) for i in range(50_000)}


def digest() -> str:
    h = hashlib.sha256()
    for b in blobs:
        h.update(b)
    h.update(repr(sorted(table.items())[::97]).encode())
    return h.hexdigest()


def write(seed: int) -> None:
    r = random.Random(seed)
    for b in blobs[::2]:
        n = len(b)
        b[:] = r.randbytes(n)
    table[seed] = ("w", seed)


def dirty(seed: int, mib: int) -> None:
    r = random.Random(seed)
    step = max(1, (total // (mib << 20)) if mib else len(blobs))
    for b in blobs[seed % step :: step]:
        b[:] = r.randbytes(len(b))


class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        if self.path.startswith("/write/"):
            write(int(self.path.rsplit("/", 1)[1]))
            body = b"ok"
        elif self.path.startswith("/dirty/"):
            _, _, seed, mib = self.path.split("/")
            dirty(int(seed), int(mib))
            body = b"ok"
        else:
            body = digest().encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


httpd = http.server.HTTPServer(("127.0.0.1", 8081), H)
with open("/workspace/cow.ready.tmp", "w") as f:
    f.write(str(os.getpid()))
os.replace("/workspace/cow.ready.tmp", "/workspace/cow.ready")
httpd.serve_forever()
