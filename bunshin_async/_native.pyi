import os

CLONE_NEWNS: int
CLONE_NEWPID: int
CLONE_NEWNET: int
CLONE_NEWIPC: int
CLONE_NEWUTS: int
CLONE_NEWUSER: int
MS_RDONLY: int
MS_BIND: int
MS_REC: int
MS_PRIVATE: int
MNT_DETACH: int
RESOLVE_NO_XDEV: int
RESOLVE_NO_MAGICLINKS: int
RESOLVE_NO_SYMLINKS: int
RESOLVE_BENEATH: int
RESOLVE_IN_ROOT: int

def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None, /) -> None: ...
def umount2(target: str, flags: int = 0, /) -> None: ...
def set_memory_merge(on: bool, /) -> None: ...
def get_memory_merge() -> bool: ...
def openat2(
    dirfd: int, path: str | bytes | os.PathLike[str] | os.PathLike[bytes], flags: int, resolve: int, mode: int = 0, /
) -> int: ...
