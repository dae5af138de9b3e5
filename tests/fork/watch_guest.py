"""In-workspace watcher for the fsnotify fidelity test: one inotify instance with watches of different masks on
a directory and a file the workspace made (overlay upper), a file of the image (lower) and /tmp; one fanotify group
with inode marks (one with a legacy ignored mask, one with a ``FAN_MARK_IGNORE`` ignore mask), a mount mark and a
filesystem mark. ``marks`` prints every mark of this
process as (kind, object path, masks), the object found by its device and inode number; ``events`` drains the
queues into /workspace/events.log. Driven through files: ``/workspace/cmd`` holds the next command."""

import ctypes
import os
import struct
import sys
import time

W = "/workspace"
libc = ctypes.CDLL(None, use_errno=True)
libc.fanotify_mark.argtypes = [ctypes.c_int, ctypes.c_uint, ctypes.c_uint64, ctypes.c_int, ctypes.c_char_p]

IN_MODIFY, IN_ATTRIB, IN_CLOSE_WRITE, IN_CREATE, IN_DELETE = 0x2, 0x4, 0x8, 0x100, 0x200
FAN_MODIFY, FAN_CLOSE_WRITE, FAN_OPEN = 0x2, 0x8, 0x20
FAN_MARK_ADD, FAN_MARK_MOUNT, FAN_MARK_FILESYSTEM, FAN_MARK_IGNORED_MASK = 0x1, 0x10, 0x100, 0x20
FAN_MARK_IGNORE, FAN_MARK_IGNORED_SURV_MODIFY = 0x400, 0x40
FAN_CLASS_NOTIF, FAN_NONBLOCK = 0x0, 0x2
CANDIDATES = [f"{W}/dir", f"{W}/dir/file", f"{W}/fan-file", f"{W}/fan-ignore", "/etc/hostname", "/tmp", "/"]


def check(ret: int, what: str) -> int:
    if ret < 0:
        sys.exit(f"{what}: {os.strerror(ctypes.get_errno())}")
    return ret


def setup() -> tuple[int, int, dict[int, str]]:
    os.makedirs(f"{W}/dir", exist_ok=True)
    for path in (f"{W}/dir/file", f"{W}/fan-file", f"{W}/fan-ignore"):
        with open(path, "w") as f:
            f.write("0\n")
    ino = check(libc.inotify_init1(os.O_NONBLOCK), "inotify_init1")
    wds = {}
    for path, mask in (
        (f"{W}/dir", IN_CREATE | IN_DELETE),
        (f"{W}/dir/file", IN_MODIFY | IN_CLOSE_WRITE),
        ("/etc/hostname", IN_ATTRIB),
        ("/tmp", IN_CREATE),
    ):
        wds[check(libc.inotify_add_watch(ino, path.encode(), mask), f"inotify {path}")] = path
    fan = check(libc.fanotify_init(FAN_CLASS_NOTIF | FAN_NONBLOCK, os.O_RDONLY), "fanotify_init")
    check(libc.fanotify_mark(fan, FAN_MARK_ADD, FAN_CLOSE_WRITE | FAN_MODIFY, -100, f"{W}/fan-file".encode()), "i")
    check(libc.fanotify_mark(fan, FAN_MARK_ADD | FAN_MARK_IGNORED_MASK, FAN_OPEN, -100, f"{W}/fan-file".encode()), "ig")
    ignore = f"{W}/fan-ignore".encode()
    check(libc.fanotify_mark(fan, FAN_MARK_ADD, FAN_CLOSE_WRITE, -100, ignore), "i2")
    new_style = FAN_MARK_ADD | FAN_MARK_IGNORE | FAN_MARK_IGNORED_SURV_MODIFY
    check(libc.fanotify_mark(fan, new_style, FAN_MODIFY, -100, ignore), "ign")
    check(libc.fanotify_mark(fan, FAN_MARK_ADD | FAN_MARK_MOUNT, FAN_CLOSE_WRITE, -100, b"/"), "mount")
    check(libc.fanotify_mark(fan, FAN_MARK_ADD | FAN_MARK_FILESYSTEM, FAN_CLOSE_WRITE, -100, b"/"), "fs")
    return ino, fan, wds


def objects() -> dict[tuple[int, int], str]:
    out = {}
    for path in CANDIDATES:
        st = os.stat(path)
        out.setdefault((st.st_dev, st.st_ino), path)  # "/" last: the filesystem marks' name
    return out


def by_ino(objs: dict[tuple[int, int], str], f: dict[str, str]) -> str:
    """A mark on an overlayfs file is on its real inode (its upper or lower filesystem's ``sdev``), while stat(2)
    gives the overlay's st_dev and, when the layers are on several filesystems, the real inode number with
    overlayfs's xino bits above bit 32: match the low 32 bits, when exactly one candidate has them."""
    ino = int(f["ino"], 16)
    hits = [p for (_d, i), p in objs.items() if i & 0xFFFFFFFF == ino]
    return hits[0] if len(hits) == 1 else f"?{f['sdev']}:{f['ino']}"


def marks(fds: dict[str, int]) -> list[str]:
    """One line per mark: kind, object, masks. fdinfo (proc(5)) gives ino in hex and sdev as the kernel's
    dev_t (major << 20 | minor)."""
    objs = objects()
    found = {}
    for (dev, ino), path in objs.items():
        found[(os.major(dev) << 20 | os.minor(dev), ino)] = path
    lines = []
    for name, fd in fds.items():
        for line in open(f"/proc/self/fdinfo/{fd}"):
            if not line.startswith(("inotify", "fanotify")):
                continue
            f = dict(kv.split(":", 1) for kv in line.split()[1:] if ":" in kv)
            if "event-flags" in f:
                lines.append(f"{name} group flags:{f['flags']} event-flags:{f['event-flags']}")
                continue
            if "mnt_id" in f:
                lines.append(f"{name} mount mflags:{f['mflags']} mask:{f['mask']} ignored:{f['ignored_mask']}")
                continue
            if "ino" not in f:  # a filesystem mark: name the filesystem by a candidate on it
                dev = int(f["sdev"], 16)
                obj = next((p for (d, _i), p in found.items() if d == dev), f"?{f['sdev']}")
                lines.append(f"{name} fs {obj} mflags:{f['mflags']} mask:{f['mask']} ignored:{f['ignored_mask']}")
                continue
            obj = found.get((int(f["sdev"], 16), int(f["ino"], 16))) or by_ino(objs, f)
            if "wd" in f:
                lines.append(f"{name} wd:{f['wd']} {obj} mask:{f['mask']} ignored:{f['ignored_mask']}")
            else:
                lines.append(f"{name} inode {obj} mflags:{f['mflags']} mask:{f['mask']} ignored:{f['ignored_mask']}")
    return sorted(lines)


def drain(ino: int, fan: int, wds: dict[int, str], log) -> None:
    try:
        buf = os.read(ino, 65536)
    except BlockingIOError:
        buf = b""
    off = 0
    while off < len(buf):
        wd, mask, _cookie, length = struct.unpack_from("iIII", buf, off)
        name = buf[off + 16 : off + 16 + length].rstrip(b"\0").decode()
        log.write(f"inotify {wds.get(wd, wd)} {mask:#x} {name}\n")
        off += 16 + length
    try:
        buf = os.read(fan, 65536)
    except BlockingIOError:
        buf = b""
    off = 0
    while off < len(buf):
        length, _v, _r, _ml, mask, fd, _pid = struct.unpack_from("IBBHQii", buf, off)
        if fd >= 0:
            try:
                path = os.readlink(f"/proc/self/fd/{fd}")
            finally:
                os.close(fd)
            if path.startswith(W + "/"):  # other activity (the agent, this log) is not the test's
                log.write(f"fanotify {path} {mask:#x}\n")
        off += length
    log.flush()


def write_marks(fds: dict[str, int]) -> None:
    """Atomically: a reader polling for /tmp/marks must never see it empty or half-written."""
    with open("/tmp/marks.new", "w") as f:
        f.write("\n".join(marks(fds)) + "\n")
    os.rename("/tmp/marks.new", "/tmp/marks")


def main() -> None:
    ino, fan, wds = setup()
    fds = {"inotify": ino, "fanotify": fan}
    write_marks(fds)
    log = open("/tmp/events.log", "a")
    while True:
        drain(ino, fan, wds, log)
        try:
            cmd = open(f"{W}/cmd").read().strip()
        except FileNotFoundError:
            cmd = ""
        if cmd == "marks":
            write_marks(fds)
            os.unlink(f"{W}/cmd")
        time.sleep(0.02)


main()
