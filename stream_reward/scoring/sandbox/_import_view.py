"""Letting the checker's unprivileged sample children import from wherever Python lives.

The checker (root) runs each sample's tests as ``nobody``. When the interpreter or
the site-packages live below a directory ``nobody`` cannot enter (pyenv under
``/root``, a venv in a 0700 temporary directory), every import a test makes at test
time (``import heapq``, ``unittest``) would fail, and a right answer would score
below 1. Importing a list of modules before dropping privilege cannot cover every
import a test may make; making host directories world-readable would change the
host. Instead the checker, once and before it forks any sample child, moves into a
mount namespace of its own in which each such directory is a fresh tmpfs (mode
0755) holding only bind mounts of the import paths below it: the paths keep their
names, the tests reach exactly them and nothing else there, and the host's mounts
are untouched (the namespace's mounts are made private first).

Shipped to the checker ahead of its source (stdlib only); ``main`` calls
``open_import_paths`` while it is still root.
"""

import ctypes
import os

CLONE_NEWNS = 0x00020000
MS_NOSUID, MS_NODEV, MS_BIND, MS_REC, MS_PRIVATE = 2, 4, 4096, 16384, 1 << 18


def _blocked(path):
    """The topmost ancestor of ``path`` that others cannot search, or None."""
    parts = path.strip("/").split("/")
    for i in range(1, len(parts)):
        ancestor = "/" + "/".join(parts[:i])
        try:
            if not os.stat(ancestor).st_mode & 0o001:
                return ancestor
        except OSError:
            return None
    return None


def _between(top, path):
    """The directories from just below ``top`` down to ``path``."""
    out = []
    while path != top and path not in ("", "/"):
        out.append(path)
        path = os.path.dirname(path)
    return out


def open_import_paths(paths):
    """Make ``paths`` (directories) importable for any uid, in a mount namespace of
    this process's own. Returns None, or what went wrong (the caller goes on: imports
    below a closed directory then fail for the tests)."""
    wanted = sorted({os.path.realpath(p) for p in paths if p and os.path.isdir(p)})
    # a path inside another one comes with it
    wanted = [p for p in wanted if not any(p != q and p.startswith(q.rstrip("/") + "/") for q in wanted)]
    covers = {}
    for path in wanted:
        top = _blocked(path)
        if top is not None:
            covers.setdefault(top, []).append(path)
    if not covers:
        return None
    libc = ctypes.CDLL(None, use_errno=True)

    def check(rc, what):
        if rc != 0:
            e = ctypes.get_errno()
            raise OSError(e, f"{what}: {os.strerror(e)}")

    def mount(src, dst, fstype, flags, data=None):
        enc = [None if s is None else s.encode() for s in (src, dst, fstype, data)]
        check(libc.mount(enc[0], enc[1], enc[2], ctypes.c_ulong(flags), enc[3]), f"mount {dst}")

    try:
        check(libc.unshare(CLONE_NEWNS), "unshare")
        mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing we mount reaches the host
        # the paths, held open (in this namespace: a bind's source must be in it), as
        # the tmpfs is about to cover them
        held = {path: os.open(path, os.O_PATH | os.O_DIRECTORY) for paths in covers.values() for path in paths}
        for top, inside in covers.items():
            mount("tmpfs", top, "tmpfs", MS_NOSUID | MS_NODEV, "size=64k,mode=755")
            for path in inside:
                os.makedirs(path, exist_ok=True)
                for made in _between(top, path):  # whatever our umask: searchable by all
                    os.chmod(made, 0o755)
                mount(f"/proc/self/fd/{held[path]}", path, None, MS_BIND | MS_REC)
        for fd in held.values():
            os.close(fd)
    except OSError as exc:
        return str(exc)
    return None
