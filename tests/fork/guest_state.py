"""Runs inside a workspace (python3 guest_state.py MODE): long-lived processes whose state a fork must carry.

``server MIB`` serves on http://127.0.0.1:8080/ (GET): ``/`` the heap's digest; ``/dirty/N`` rewrites one byte in
each of N MiB of distinct pages of the existing heap, in place and spread evenly over it (+ 1, so the digest changes
deterministically; the same pages every call: a working set), and answers the new digest, computed so as to write
to as few other pages as CPython allows (its refcounts); the first call indexes the heap (allocates), so a caller
measuring dirtied pages calls ``/dirty/0`` first. ``/osfork`` times ``os.fork()`` of this process until the child
runs and answers the milliseconds, as text."""

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


def heap(mib, mutable=False):
    rnd = random.Random(1234)
    blobs, total = [], 0
    while total < mib << 20:  # objects of many sizes, not one uniform buffer
        b = rnd.randbytes(rnd.randint(1, 128) * 512)
        blobs.append(bytearray(b) if mutable else b)  # same bytes, same digest; bytearrays can be written in place
        total += len(b)
    table = {i: (str(i) * 3, i * i) for i in range(100_000)}
    return blobs, table


def table_repr(table):
    return repr(sorted(table.items())[::97]).encode()


def digest(blobs, table, table_bytes=None):
    """``table_bytes``: ``table_repr(table)`` computed earlier (same digest, without walking the table, which would
    write a refcount into every one of its objects' pages)."""
    h = hashlib.sha256()
    for b in blobs:
        h.update(b)
    h.update(table_repr(table) if table_bytes is None else table_bytes)
    return h.hexdigest()


PAGE = 4096


def heap_pages(blobs):
    """(blob indexes, offsets): one byte in each distinct page the blobs' buffers touch, in heap order. Arrays, not
    lists of tuples, so that reading them later writes no refcount into the heap's pages."""
    import array
    import ctypes

    index, offset, seen = array.array("I"), array.array("I"), set()
    for i, b in enumerate(blobs):
        addr = ctypes.addressof((ctypes.c_char * len(b)).from_buffer(b))
        for off in [*range(0, len(b), PAGE), len(b) - 1]:  # the tail may reach into one more page
            if (addr + off) // PAGE not in seen:
                seen.add((addr + off) // PAGE)
                index.append(i)
                offset.append(off)
    return index, offset


def dirty(blobs, pages, mib):
    """Add 1 to one byte in each of ~MIB MiB of distinct pages, evenly spaced over ``pages`` (``heap_pages``)."""
    index, offset = pages
    n = min(len(index), mib * ((1 << 20) // PAGE))
    for j in range(n):
        k = j * len(index) // n
        b = blobs[index[k]]
        b[offset[k]] = (b[offset[k]] + 1) & 0xFF


def time_os_fork():
    """Milliseconds from os.fork() in this (multi-threaded, MIB-sized) process until the child signals it runs."""
    r, w = os.pipe()
    t0 = time.perf_counter()
    pid = os.fork()
    if pid == 0:
        os.write(w, b"x")
        os._exit(0)
    os.read(r, 1)
    ms = (time.perf_counter() - t0) * 1000
    os.close(r)
    os.close(w)
    os.waitpid(pid, 0)
    return ms


def server(mib):
    blobs, table = heap(mib, mutable=True)
    cache = {}  # the heap's page index and the table's repr (the table never changes), built by the first /dirty
    lock = threading.Lock()

    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path.startswith("/dirty/"):
                with lock:
                    if not cache:
                        cache.update(pages=heap_pages(blobs), table=table_repr(table))
                    dirty(blobs, cache["pages"], int(self.path.rsplit("/", 1)[1]))
                    body = digest(blobs, table, cache["table"]).encode()
            elif self.path == "/osfork":
                with lock:
                    body = f"{time_os_fork():.3f}".encode()
            else:
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
