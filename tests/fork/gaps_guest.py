"""Runs inside a workspace (python3 gaps_guest.py MODE): the known gaps of a CRIU live fork (issue #3, item 7)."""

import ctypes
import fcntl
import hashlib
import os
import socket
import struct
import sys
import time

W = "/workspace"
TCP_PORT = 9191
SIOCOUTQNSD = 0x894B  # bytes in the send queue not yet sent (linux/sockios.h)
TCP_TOTAL = 4 << 20  # far more than the 64 KiB receive window and 256 KiB send buffer take: part stays unsent


def put(name, value):
    tmp = f"{W}/{name}.tmp"
    with open(tmp, "w") as f:
        f.write(str(value))
    os.replace(tmp, f"{W}/{name}")


def pattern(n):
    block = hashlib.sha256(b"bunshin").digest() * 2048  # 64 KiB
    out = bytearray()
    while len(out) < n:
        out += block
    return bytes(out[:n])


def tcpunsent():
    """A loopback connection whose receiver does not read until /workspace/go exists, so the sender's queue holds
    data the peer's closed window never let out (the "not-sent" part of the send queue). Both ends live in this
    process, the sender's descriptor below the receiver's: CRIU restores a task's descriptors in order, so the
    sender's socket comes back while its peer does not exist yet (stock CRIU 4.2.1 then fails the restore with
    "Can't restore not-sent send queue data ... Broken pipe"). Writes tcp.ready ("<bytes sent> <bytes unsent>")
    once the window is closed, and tcp.result ("<bytes> <sha256>") once the receiver has read it all."""
    data = pattern(TCP_TOTAL)
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
    srv.bind(("127.0.0.1", TCP_PORT))
    srv.listen(1)
    c = socket.create_connection(("127.0.0.1", TCP_PORT))
    conn, _ = srv.accept()
    assert c.fileno() < conn.fileno()
    c.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 262144)
    c.setblocking(False)
    off = 0
    while off < len(data):
        try:
            off += c.send(data[off : off + 65536])
        except BlockingIOError:
            break
    unsent = struct.unpack("i", fcntl.ioctl(c, SIOCOUTQNSD, b"\0" * 4))[0]
    put("tcp.ready", f"{off} {unsent}")
    while not os.path.exists(f"{W}/go"):
        time.sleep(0.01)
    got = bytearray()
    conn.setblocking(False)
    while len(got) < TCP_TOTAL:
        if off < len(data):
            try:
                off += c.send(data[off : off + 65536])
            except BlockingIOError:
                pass
        try:
            d = conn.recv(1 << 16)
        except BlockingIOError:
            time.sleep(0.001)
            continue
        if not d:
            break
        got += d
    put("tcp.result", f"{len(got)} {hashlib.sha256(got).hexdigest()}")


FAN_CLOSE_WRITE = 0x08
FAN_CLASS_NOTIF = 0x00
FAN_MARK_ADD = 0x01
FAN_MARK_KINDS = {"inode": 0x00, "mount": 0x10, "filesystem": 0x100}
AT_FDCWD = -100


def fanotify(kind="inode", target=f"{W}/watched", watched=f"{W}/watched"):
    """An fanotify group with one FAN_CLOSE_WRITE mark of ``kind`` (inode, mount or filesystem) on ``target``;
    counts the events for ``watched`` in fan.count (fan.error if the mark cannot be made)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.fanotify_mark.argtypes = [ctypes.c_int, ctypes.c_uint, ctypes.c_uint64, ctypes.c_int, ctypes.c_char_p]
    open(watched, "a").close()
    fd = libc.fanotify_init(FAN_CLASS_NOTIF, os.O_RDONLY)
    flags = FAN_MARK_ADD | FAN_MARK_KINDS[kind]
    if fd < 0 or libc.fanotify_mark(fd, flags, FAN_CLOSE_WRITE, AT_FDCWD, target.encode()) < 0:
        put("fan.error", os.strerror(ctypes.get_errno()))
        return
    n = 0
    put("fan.count", n)
    while True:
        buf = os.read(fd, 4096)
        off = 0
        while off < len(buf):
            event_len, _vers, _res, _mlen, _mask, efd, _pid = struct.unpack_from("IBBHQii", buf, off)
            if efd >= 0:
                if os.readlink(f"/proc/self/fd/{efd}") == watched:
                    n += 1
                os.close(efd)
            off += event_len
        put("fan.count", n)


if __name__ == "__main__":
    globals()[sys.argv[1]](*sys.argv[2:])
