"""Reading a file's pieces ahead of the code that consumes them, in a bounded number of
threads: the consumer's hashing and decoding of one piece overlaps the reads of the next
(reads release the GIL; decoding holds it), and no more than ``depth`` pieces wait.

Pieces come out in order whatever the number of threads; a consumer that stops early
(an error, a refused chunk) cancels what has not started and waits for what has, so no
reader outlives the read."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

__all__ = ["read_ahead"]


def read_ahead(reads: Iterable[Callable[[], memoryview]], workers: int,
               depth: int) -> Iterator[memoryview]:
    """The results of ``reads`` in order, each started up to ``depth`` reads before the
    consumer asks for it, on ``workers`` threads (one thread keeps the calls in order,
    for a source that must be read sequentially)."""
    pending = iter(reads)
    first = next(pending, None)
    if first is None:
        return
    second = next(pending, None)
    if second is None:  # one piece: no thread to start
        yield first()
        return
    queued: deque[Future[memoryview]] = deque()
    call: Callable[[], memoryview] | None
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="nemo-ckpt-read")
    try:
        queued.extend((pool.submit(first), pool.submit(second)))
        while queued:
            while len(queued) < depth and (call := next(pending, None)) is not None:
                queued.append(pool.submit(call))
            yield queued.popleft().result()
    finally:
        for future in queued:
            future.cancel()
        pool.shutdown(wait=True)
