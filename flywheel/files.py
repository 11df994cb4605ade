"""Files other processes read while they are written: always whole, never half.

A reader (a test waiting for a port, the launcher reading a generator's stats, DeepSpeed reading
``latest``) polls these files; a plain write can be read empty or cut short, and a kill mid-write
would leave it so for good. So each is written to a temporary file of its own beside it (named
for the writing process: two writers never share one) and renamed over it, which POSIX makes atomic.
"""

from __future__ import annotations

import os
from pathlib import Path


def write_atomically(path: str | Path, data: str | bytes, private: bool = False, durable: bool = False) -> None:
    """``data`` in ``path``, whole or not at all.

    ``private``: readable by the owner only (0600; the file may hold a password). ``durable``:
    fsync'd before the rename, for a file that must survive a machine's crash, not only a kill."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    raw = data.encode() if isinstance(data, str) else data
    tmp.unlink(missing_ok=True)  # one a killed writer of this pid left: made afresh, never followed
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
    fd = os.open(tmp, flags, 0o600 if private else 0o666)  # (not private: the umask decides, as open() does)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        if private:
            os.chmod(tmp, 0o600)  # (a leftover temporary file kept its mode through the open)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
