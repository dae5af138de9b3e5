"""Runs inside a workspace (python3 guest_state.py MODE): long-lived processes whose state a fork must carry."""

import hashlib
import http.server
import os
import random
import socket
import sys
import threading
import time

W = "/workspace"


def put(name, value):
    tmp = f"{W}/{name}.tmp"
    with open(tmp, "w") as f:
        f.write(str(value))
    os.replace(tmp, f"{W}/{name}")


def heap(mib):
    rnd = random.Random(1234)
    blobs, total = [], 0
    while total < mib << 20:  # objects of many sizes, not one uniform buffer
        b = rnd.randbytes(rnd.randint(1, 128) * 512)
        blobs.append(b)
        total += len(b)
    table = {i: (str(i) * 3, i * i) for i in range(100_000)}
    return blobs, table


def digest(blobs, table):
    h = hashlib.sha256()
    for b in blobs:
        h.update(b)
    h.update(repr(sorted(table.items())[::97]).encode())
    return h.hexdigest()


def server(mib):
    blobs, table = heap(mib)

    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = digest(blobs, table).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 8080), H)
    echo = socket.create_server(("127.0.0.1", 9090))

    def serve_echo():
        while True:
            c, _ = echo.accept()
            echo_one = lambda c=c: [c.sendall(d) for d in iter(lambda: c.recv(64), b"")]  # noqa: E731
            threading.Thread(target=echo_one, daemon=True).start()

    threading.Thread(target=serve_echo, daemon=True).start()
    put("digest", digest(blobs, table))
    httpd.serve_forever()


def reader():
    with open(f"{W}/data.bin", "rb") as f:
        f.read(1000)
        put("reader.ready", f.tell())
        while not os.path.exists(f"{W}/go"):
            time.sleep(0.01)
        data = f.read(10)
        put("reader.out", f"{f.tell()} {data.hex()}")


def pipe():
    r, w = os.pipe()
    if os.fork() == 0:
        os.close(r)
        i = 0
        while True:
            i += 1
            os.write(w, f"{i}\n".encode())
            time.sleep(0.01)
    os.close(w)
    expect = 1
    for line in os.fdopen(r):
        if int(line) != expect:
            put("pipe.error", f"got {line!r}, expected {expect}")
        expect = int(line) + 1
        put("pipe.last", line.strip())


def sockpair():
    a, b = socket.socketpair()
    if os.fork() == 0:
        a.close()
        while True:
            d = b.recv(64)
            b.sendall(d)
    b.close()
    i = 0
    while True:
        i += 1
        a.sendall(f"{i:08d}".encode())
        if a.recv(64) != f"{i:08d}".encode():
            put("sp.error", i)
        put("sp.count", i)
        time.sleep(0.01)


def tcpclient():
    while True:  # wait for the echo server
        try:
            c = socket.create_connection(("127.0.0.1", 9090))
            break
        except OSError:
            time.sleep(0.05)
    i = 0
    while True:
        i += 1
        try:
            c.sendall(f"{i:08d}".encode())
            if c.recv(64) != f"{i:08d}".encode():
                put("tcp.error", i)
        except OSError as exc:
            put("tcp.error", repr(exc))
            return
        put("tcp.count", i)
        time.sleep(0.01)


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "server":
        server(int(sys.argv[2]))
    else:
        globals()[mode]()
