"""Pages read through the maps are released as reading goes on, the last read of each file too."""

from __future__ import annotations

import os
import zlib
from pathlib import Path

from reshard.io.reader import MappedFiles


def _mapped_rss(paths: set[str]) -> int:
    """Bytes of this process's maps of ``paths`` resident now (/proc/self/smaps)."""
    total, ours = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and len(head) >= 5 and ":" in head[3]:  # a mapping's first line
                ours = len(head) >= 6 and head[5] in paths
            elif ours and line.startswith("Rss:"):
                total += int(head[1]) * 1024
    return total


def test_the_last_chunk_read_of_each_file_is_released_too(tmp_path: Path) -> None:
    # inspect --check hashes DCP chunks file after file in chunks through the maps (check._Data):
    # each file's last chunk stayed mapped (the release came before its read and forgot the
    # file), so 8 files of 128 MiB chunks held 8 x 32 MiB
    paths = []
    for i in range(6):
        p = tmp_path / f"f{i}.bin"
        p.write_bytes(os.urandom(4 << 20))
        paths.append(str(p))
    chunk = 2 << 20
    m = MappedFiles(paths, 1 << 20)
    try:
        for fi, p in enumerate(paths):
            crc = 0
            for pos in range(0, 4 << 20, chunk):
                crc = zlib.crc32(m.raw(fi, pos, chunk).data, crc)
            assert crc == zlib.crc32(Path(p).read_bytes())
        # what is mapped now: at most the last read (and the kernel's fault-around past it)
        assert _mapped_rss(set(paths)) <= chunk + (1 << 20)
        m.release()
        assert _mapped_rss(set(paths)) == 0
    finally:
        m.close()
