"""S3 client libraries against one store, in one run: fsspec's s3fs (the harvest's) and obstore.

Each round, per client: an upload of ``--mib`` MiB in 8 MiB writes (s3fs: its file object in 16 MiB parts, as the
harvest's generic path; also the harvest's own upload, `Location.write_parts`: 16 MiB parts, four at once; obstore:
its writer in 16 MiB buffers), a whole-object read, ``--ranges`` reads of 64 KiB at scattered places, and the
harvest's block reads (8 MiB blocks, fetched concurrently by ``cat_ranges``). Medians of ``--rounds`` rounds; the
store from the usual environment (``AWS_ENDPOINT_URL``, keys, ``AWS_REGION``). Prints the numbers; asserts nothing.

    python benchmarks/store_clients.py s3://bucket/prefix [--mib 256] [--ranges 200] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("url", help="s3://bucket/prefix (the bucket must exist)")
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--ranges", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    import obstore
    from obstore.store import S3Store

    from nnterp_vllm.harvest.cache import BLOCK
    from nnterp_vllm.harvest.location import PART_BYTES, Location

    place = Location.of(args.url)
    bucket, prefix = place.root.split("/", 1)
    endpoint = os.environ.get("AWS_ENDPOINT_URL")
    store = S3Store(bucket, endpoint=endpoint, allow_http=bool(endpoint and endpoint.startswith("http:")))
    size = args.mib * 2**20
    block = os.urandom(8 * 2**20)
    writes = [block] * (size // len(block))
    results: dict[str, list[float]] = {}

    def timed(name: str, work, amount: float) -> None:
        began = time.perf_counter()
        work()
        results.setdefault(name, []).append(amount / (time.perf_counter() - began))

    def s3fs_file() -> None:
        with place.fs.open(place.path("s3fs"), "wb", block_size=PART_BYTES) as handle:
            for data in writes:
                handle.write(data)

    def obstore_writer() -> None:
        with obstore.open_writer(store, f"{prefix}/obstore", buffer_size=PART_BYTES) as writer:
            for data in writes:
                writer.write(data)

    places = [(i * 1_000_003) % (size - 65536) for i in range(args.ranges)]

    def s3fs_blocks() -> None:
        starts = list(range(0, size, BLOCK))
        place.fs.cat_ranges([place.path("s3fs")] * len(starts), starts, [min(s + BLOCK, size) for s in starts])

    for _ in range(args.rounds):
        timed("upload: s3fs file object (MiB/s)", s3fs_file, args.mib)
        ours = "upload: the harvest's (s3fs, 4 parts at once) (MiB/s)"
        timed(ours, lambda: place.write_parts("ours", writes), args.mib)
        timed("upload: obstore writer (MiB/s)", obstore_writer, args.mib)
        timed("whole read: s3fs (MiB/s)", lambda: place.fs.cat_file(place.path("s3fs")), args.mib)
        timed("whole read: obstore (MiB/s)", lambda: obstore.get(store, f"{prefix}/obstore").bytes(), args.mib)
        timed("8 MiB blocks, concurrent: s3fs cat_ranges (MiB/s)", s3fs_blocks, args.mib)
        timed(
            "64 KiB ranges, one at a time: s3fs (reads/s)",
            lambda: [place.fs.cat_file(place.path("s3fs"), start=p, end=p + 65536) for p in places],
            args.ranges,
        )
        timed(
            "64 KiB ranges, one at a time: obstore (reads/s)",
            lambda: [obstore.get_range(store, f"{prefix}/obstore", start=p, length=65536) for p in places],
            args.ranges,
        )
    for name, rates in results.items():
        print(f"{name:58s} {statistics.median(rates):8.1f}   (rounds {min(rates):.1f}..{max(rates):.1f})")


if __name__ == "__main__":
    main()
