"""Generation across live weight updates: what the rollout manager and the weight publisher share,
and the weight-version spans of a response (ALGORITHMS.md section 8, case N10).

``GenerationGate`` is one per `ServerFleet` (``fleet.gate``). The publisher tells it when a pause
begins and ends and which version the engines hold; the manager's generation threads register the
requests they have in flight (with the oldest weight version their tokens come from), learn from it
whether an aborted request was aborted by a pause or as too stale (then they resubmit it after the
pause, ``RolloutManager``), and read the published version when a server reports no spans.

Spans: a response's tokens as ``[(version, first token index), ...]`` with integer versions (the
trainer's version; servers carry it as a string), oldest first. A server that reports SGLang
0.5.23's ``meta_info.weight_versions`` gives them exactly. A server that reports only the final
version (older SGLang, vLLM: none at all) gets the conservative fallback of ``fallback_spans``: the
version published when the request was sent, from token 0, then, if the response ends under another
one, that version with start ``UNKNOWN_START`` (somewhere after the first span's start). Staleness
must use the oldest version, ``min(v for v, _ in spans)``.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

__all__ = ["GenerationGate", "UNKNOWN_START", "concat_spans", "fallback_spans", "parse_version", "spans_of",
           "token_versions"]

UNKNOWN_START = -1
"""The start of a span whose first token is not known (a server that reported only its final
version): its tokens are somewhere after the previous span's start."""

Spans = list[tuple[int, int]]


def parse_version(label) -> int | None:
    """The trainer's integer version of a server label: ``"3"`` -> 3, ``"3+partial"`` -> 3 (weights
    partly updated past version 3: 3 is the oldest they hold); None for other labels (``"default"``)."""
    if label is None:
        return None
    text = str(label)
    if text.endswith("+partial"):
        text = text[: -len("+partial")]
    return int(text) if text.isdigit() else None


def fallback_spans(submitted: int | None, final: int | None) -> Spans:
    """Spans of a response whose server reported no per-token versions: ``submitted`` (the version
    published when it was sent) from token 0, then ``final`` (the version at its end, from the
    server's ``weight_version`` or the publisher) from ``UNKNOWN_START`` when it differs. [] when
    neither is known."""
    if submitted is None and final is None:
        return []
    if submitted is None or final is None or submitted == final:
        return [(submitted if submitted is not None else final, 0)]
    return [(submitted, 0), (final, UNKNOWN_START)]


def spans_of(server_spans: Sequence[tuple[str, int]] | None, final_label, *, submitted: int | None,
             published: int | None) -> Spans:
    """Integer spans of one response: the server's ``(label, start)`` spans when it reported them
    and every label is a version, else ``fallback_spans(submitted, final)`` with ``final`` the
    server's final label (or, when that is no version, ``published``)."""
    if server_spans:
        versions = [parse_version(label) for label, _ in server_spans]
        if all(v is not None for v in versions):
            return _merged([(v, start) for v, (_, start) in zip(versions, server_spans)])
    final = parse_version(final_label)
    return fallback_spans(submitted, final if final is not None else published)


def _merged(spans: Spans) -> Spans:
    """Drop empty spans (a start repeated: the earlier one holds no token) and join neighbours of
    one version."""
    out: Spans = []
    for v, start in spans:
        if out and start != UNKNOWN_START and out[-1][1] == start:
            out.pop()
        if out and out[-1][0] == v:
            continue
        out.append((v, start))
    return out


def concat_spans(prefix: Spans, prefix_len: int, rest: Spans) -> Spans:
    """Spans of a response made of ``prefix`` (``prefix_len`` tokens) then a continuation with spans
    ``rest`` (indices from its own first token): the continuation's starts shift by ``prefix_len``
    (``UNKNOWN_START`` stays unknown); a first span of the prefix's last version merges, and an
    empty span (a continuation aborted before its first token) leaves no trace once followed."""
    shifted = [(v, s if s == UNKNOWN_START else s + prefix_len) for v, s in rest]
    return _merged(list(prefix) + shifted)


def token_versions(spans: Spans, length: int) -> list[int | None]:
    """The version of each of ``length`` tokens (None when no span is known). A span with an
    unknown start contributes nothing: its tokens keep the older version before it (conservative)."""
    out: list[int | None] = [None] * length
    known = [(v, s) for v, s in spans if s != UNKNOWN_START]
    for k, (v, s) in enumerate(known):
        end = known[k + 1][1] if k + 1 < len(known) else length
        for i in range(max(s, 0), min(end, length)):
            out[i] = v
    return out


class GenerationGate:
    """Shared state of generation across live weight updates (thread-safe; see the module docstring).

    Pause epochs: ``begin_pause`` counts a new pause (before the engines are paused, so that a
    request aborted by it sees the epoch change); ``end_pause`` follows the engines' continue.
    """

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._version: int | None = None
        self._epoch = 0
        self._paused = False
        self._inflight: dict[str, int | None] = {}
        self._stale: set[str] = set()
        self._floor: int | None = None

    @property
    def version(self) -> int | None:
        """The weight version the engines hold, as the publisher last said (None before any)."""
        return self._version

    def set_version(self, version: int) -> None:
        """The engines now hold ``version`` (the publisher, before it continues generation)."""
        with self._cv:
            self._version = int(version)

    @property
    def pause_epoch(self) -> int:
        """Pauses begun so far."""
        return self._epoch

    @property
    def paused(self) -> bool:
        """True between ``begin_pause`` and ``end_pause``."""
        return self._paused

    def begin_pause(self) -> int:
        """A pause of every engine begins (call before pausing them); returns the new epoch."""
        with self._cv:
            self._epoch += 1
            self._paused = True
            return self._epoch

    def end_pause(self) -> None:
        """Every engine continued; wakes the threads waiting to resubmit."""
        with self._cv:
            self._paused = False
            self._cv.notify_all()

    def wait_resumed(self, timeout_s: float) -> bool:
        """Block until no pause is on (at most ``timeout_s`` seconds); returns whether none is."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._paused, timeout=timeout_s)

    def register(self, rid: str, oldest_version: int | None) -> None:
        """Request ``rid`` is in flight; its tokens will be no older than ``oldest_version``."""
        with self._cv:
            self._inflight[rid] = oldest_version

    def unregister(self, rid: str) -> None:
        """Request ``rid`` got its answer."""
        with self._cv:
            self._inflight.pop(rid, None)

    def inflight(self) -> dict[str, int | None]:
        """A copy of ``rid -> oldest version`` of the requests in flight."""
        with self._cv:
            return dict(self._inflight)

    def take_stale(self, min_version: int) -> list[str]:
        """The in-flight requests whose oldest version is below ``min_version`` (sorted), marked
        stale: once aborted they are resubmitted from scratch, never with their prefix. Raises
        ``stale_floor`` to ``min_version``."""
        with self._cv:
            rids = sorted(r for r, v in self._inflight.items() if v is not None and v < min_version)
            self._stale.update(rids)
            self._floor = min_version if self._floor is None else max(self._floor, min_version)
            return rids

    @property
    def stale_floor(self) -> int | None:
        """The highest ``min_version`` of ``take_stale`` so far (None before any): a multi-turn
        episode with a token older than this restarts (``multiturn.run_episode``), as a single
        request in flight would have been aborted."""
        return self._floor

    def pop_stale(self, rid: str) -> bool:
        """Whether ``rid`` was marked stale (forgets the mark)."""
        with self._cv:
            if rid in self._stale:
                self._stale.discard(rid)
                return True
            return False
