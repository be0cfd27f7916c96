#!/usr/bin/env python3
"""Random O_DIRECT read bandwidth of a file at several queue depths: the disk side of the expert
cache (docs/expert-cache.md). Each thread keeps one read of SIZE bytes in flight at random
4 KiB-aligned offsets; QD threads run at once.

Usage: odirect_bandwidth.py FILE SIZE_BYTES QD[,QD...]
"""
import mmap
import os
import random
import sys
import threading
import time


def reader(path, size, reads, file_size):
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    buf = mmap.mmap(-1, size)  # page-aligned, as O_DIRECT needs
    rnd = random.Random()
    try:
        for _ in range(reads):
            offset = rnd.randrange(0, file_size - size) // 4096 * 4096
            os.preadv(fd, [buf], offset)
    finally:
        os.close(fd)


def main():
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    path, size = sys.argv[1], int(sys.argv[2])
    depths = [int(q) for q in sys.argv[3].split(",")]
    file_size = os.path.getsize(path)
    for qd in depths:
        per_thread = max(64, qd * 16) // qd
        threads = [threading.Thread(target=reader, args=(path, size, per_thread, file_size))
                   for _ in range(qd)]
        t0 = time.time()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        dt = time.time() - t0
        print(f"size {size // 1024} KiB, {qd} in flight: {per_thread * qd * size / dt / 1e9:.2f} GB/s, "
              f"{dt / per_thread * 1e3:.2f} ms per read", flush=True)


if __name__ == "__main__":
    main()
