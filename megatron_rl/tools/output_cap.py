"""Cap a program's output while it is read: bounded memory, UTF-8 bytes, head and tail kept.

Tool output becomes prompt tokens, so the sandbox keeps at most `head_bytes` from the start and
`tail_bytes` from the end of each stream (the tail is where results and tracebacks are), counts
every byte it drops, and decodes binary-safely (`errors="replace"`). A cut never splits a UTF-8
character: the bytes of a character cut in half are dropped and counted as omitted. Memory stays
within about `head_bytes + 2 * tail_bytes` whatever the program writes (CASES.md T07).
"""

from __future__ import annotations

OMITTED_MARKER = "\n[... {n} bytes omitted ...]\n"
"""Put between the head and the tail where bytes were dropped; `{n}` is their number."""


def _utf8_head_end(buf: bytes | bytearray) -> int:
    """Length of `buf` without a trailing UTF-8 character cut in half (at most 3 bytes shorter)."""
    n = len(buf)
    for back in range(1, min(4, n) + 1):
        b = buf[n - back]
        if b & 0xC0 == 0x80:  # a continuation byte: look further back for its lead byte
            continue
        need = 2 if b & 0xE0 == 0xC0 else 3 if b & 0xF0 == 0xE0 else 4 if b & 0xF8 == 0xF0 else 1
        return n - back if need > back else n
    return n


def _utf8_tail_start(buf: bytes | bytearray) -> int:
    """Index of the first byte of `buf` that does not continue a character begun before it (<= 3)."""
    i = 0
    while i < min(3, len(buf)) and buf[i] & 0xC0 == 0x80:
        i += 1
    return i


class OutputCap:
    """One stream's capped capture: `feed` the chunks as they are read, then `text()`.

    Keeps the first `head_bytes` and the last `tail_bytes`; `total` counts every byte fed and
    `omitted` (after `text()`) the bytes left out, including the pieces of characters a cut split.
    """

    def __init__(self, head_bytes: int, tail_bytes: int) -> None:
        if head_bytes < 0 or tail_bytes < 0:
            raise ValueError(f"output cap: head_bytes={head_bytes} and tail_bytes={tail_bytes} must be >= 0")
        self.head_bytes, self.tail_bytes = head_bytes, tail_bytes
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0
        self.omitted = 0

    def feed(self, chunk: bytes) -> None:
        """Add the next bytes read; memory stays bounded however many are fed."""
        self.total += len(chunk)
        room = self.head_bytes - len(self.head)
        if room > 0:
            self.head += chunk[:room]
            chunk = chunk[room:]
        if not chunk or not self.tail_bytes:
            return
        if len(chunk) >= self.tail_bytes:
            self.tail[:] = chunk[-self.tail_bytes:]
            return
        self.tail += chunk
        if len(self.tail) > 2 * self.tail_bytes:  # trim now and then, not on every chunk
            del self.tail[: len(self.tail) - self.tail_bytes]

    def text(self) -> str:
        """The kept head, a marker with the number of omitted bytes when any were, and the kept tail."""
        head, tail = bytes(self.head), bytes(self.tail[-self.tail_bytes:] if self.tail_bytes else b"")
        kept = len(head) + len(tail)
        if kept >= self.total:  # nothing dropped: decode as is (binary bytes become U+FFFD)
            self.omitted = 0
            return (head + tail).decode("utf-8", errors="replace")
        head = head[:_utf8_head_end(head)]
        tail = tail[_utf8_tail_start(tail):]
        self.omitted = self.total - len(head) - len(tail)
        return (head.decode("utf-8", errors="replace") + OMITTED_MARKER.format(n=self.omitted)
                + tail.decode("utf-8", errors="replace"))


def cap_output(data: bytes, head_bytes: int, tail_bytes: int) -> tuple[str, int]:
    """`data` capped to `head_bytes` + `tail_bytes` as `OutputCap` does it: (text, omitted bytes)."""
    cap = OutputCap(head_bytes, tail_bytes)
    cap.feed(data)
    text = cap.text()
    return text, cap.omitted
