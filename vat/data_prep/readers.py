"""Stream records out of JSON arrays and JSON Lines files (plain or .gz) without loading the whole file.

Large chat dumps (ShareGPT V3 is 125 MB, and the PyPI copy is cut off in the middle of its last record) must be read
record by record: a JSON array is parsed with :meth:`json.JSONDecoder.raw_decode` over a growing buffer fed by
chunked reads, JSON Lines line by line. A file cut off mid-record yields every complete record and reports the cut
in :class:`ReadStats` (and one warning line); a malformed JSON Lines line is counted and skipped.
"""

from __future__ import annotations

import io
import json
import logging
import os
import re
import zlib
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import IO

from vat.errors import VatError

logger = logging.getLogger(__name__)

CHUNK_CHARS = 1 << 20  # characters per read; a record larger than this just takes a few more reads
_WS = re.compile(r"[ \t\n\r]*")
_TAIL_SLACK = 16  # an error this close to the end of the buffer may be a token split by the read boundary


@dataclass
class ReadStats:
    """What :func:`iter_records` saw. Pass one in to collect it; it is filled while iterating.

    Attributes:
        format: ``"json_array"`` or ``"jsonl"`` (``None`` until the first non-blank character is read).
        records: objects yielded.
        malformed_json: values that could not be parsed (JSON Lines lines, or the record where a JSON array's
            syntax breaks: the array cannot be resynchronised after that, so reading stops there).
        non_object: well-formed values that are not JSON objects (skipped).
        truncated_tail: the file ends inside a record or before the closing ``]`` of an array.
        truncated_at_char: character offset where the incomplete tail starts (``None`` if not truncated).
        truncated_tail_chars: characters in that incomplete tail.
        warnings: the warning lines emitted.
    """

    format: str | None = None
    records: int = 0
    malformed_json: int = 0
    non_object: int = 0
    truncated_tail: bool = False
    truncated_at_char: int | None = None
    truncated_tail_chars: int = 0
    warnings: list[str] = field(default_factory=list)

    @property
    def read(self) -> int:
        """Rows seen: yielded + skipped (the truncated tail is not a row; it is reported on its own)."""
        return self.records + self.malformed_json + self.non_object

    def to_dict(self) -> dict:
        return asdict(self)

    def warn(self, message: str) -> None:
        self.warnings.append(message)
        logger.warning(message)


class _TolerantGunzip(io.RawIOBase):
    """Raw gunzip stream that returns everything decompressable from a cut-off ``.gz`` (``gzip`` raises instead).

    ``cut`` is set when the compressed data ends before the end-of-stream marker.
    """

    def __init__(self, path: str):
        self._fh = open(path, "rb")
        self._z = zlib.decompressobj(wbits=31)
        self._pending = b""
        self._started = False
        self.cut = False

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        while not self._pending:
            raw = self._fh.read(1 << 16)
            if not raw:
                self.cut = self._started and not self._z.eof
                return 0
            self._started = True
            self._pending = self._z.decompress(raw)
            while self._z.eof and self._z.unused_data:  # concatenated gzip members
                rest = self._z.unused_data
                self._z = zlib.decompressobj(wbits=31)
                self._pending += self._z.decompress(rest)
        n = min(len(b), len(self._pending))
        b[:n] = self._pending[:n]
        self._pending = self._pending[n:]
        return n

    def close(self) -> None:
        self._fh.close()
        super().close()


def open_text(path: str) -> IO[str]:
    """Open ``path`` as UTF-8 text, transparently gunzipping ``.gz``; a missing file is a :class:`VatError`.

    For ``.gz`` the returned stream has a ``gunzip`` attribute whose ``cut`` flag tells whether the compressed data
    ended early (everything before the cut is still returned).
    """
    if not os.path.isfile(path):
        raise VatError(f"input file not found: {path}")
    if path.endswith(".gz"):
        raw = _TolerantGunzip(path)
        text = io.TextIOWrapper(io.BufferedReader(raw), encoding="utf-8", errors="replace")
        text.gunzip = raw
        return text
    return open(path, encoding="utf-8", errors="replace")


def _needs_more(err: json.JSONDecodeError, buf_len: int) -> bool:
    """Whether a decode error can be explained by the buffer ending too early (vs. a real syntax error)."""
    return err.msg.startswith("Unterminated string") or err.pos >= buf_len - _TAIL_SLACK


class _Reader:
    """Chunked reads into a string buffer, remembering when the end of the data was reached."""

    def __init__(self, fh: IO[str]):
        self.fh = fh
        self.eof = False

    def read(self, n: int) -> str:
        if self.eof:
            return ""
        data = self.fh.read(n)
        if not data:
            self.eof = True
        return data

    @property
    def gzip_cut(self) -> bool:
        gunzip = getattr(self.fh, "gunzip", None)
        return bool(gunzip is not None and gunzip.cut)


def _iter_array(reader: _Reader, buf: str, offset: int, stats: ReadStats) -> Iterator[dict]:
    """Yield the objects of a top-level JSON array. ``buf`` starts just after ``[``; ``offset`` is its char offset."""
    decoder = json.JSONDecoder()
    pos = 0
    expect_value = True  # after "[" or ",": a value (or "]" right after "[")
    first = True
    while True:
        pos = _WS.match(buf, pos).end()
        if pos >= len(buf) - _TAIL_SLACK and not reader.eof:
            buf = buf[pos:] + reader.read(CHUNK_CHARS)
            offset += pos
            pos = 0
            continue
        if pos >= len(buf):  # EOF with nothing left: the array was never closed
            _mark_truncated(stats, offset + pos, 0, "before the closing ']' of the JSON array")
            return
        ch = buf[pos]
        if not expect_value:
            if ch == ",":
                pos, expect_value = pos + 1, True
                continue
            if ch == "]":
                return
            stats.malformed_json += 1
            stats.warn(f"malformed JSON array at char {offset + pos}: expected ',' or ']'; stopped reading there")
            return
        if ch == "]" and first:
            return
        try:
            value, end = decoder.raw_decode(buf, pos)
        except json.JSONDecodeError as err:
            if not reader.eof and _needs_more(err, len(buf)):
                # Grow geometrically so a record much larger than a chunk costs O(size), not O(size^2).
                buf = buf[pos:] + reader.read(max(CHUNK_CHARS, len(buf) - pos))
                offset += pos
                pos = 0
                continue
            if reader.eof and _needs_more(err, len(buf)):
                _mark_truncated(stats, offset + pos, len(buf) - pos, "inside a record")
            else:
                stats.malformed_json += 1
                stats.warn(f"malformed JSON at char {offset + err.pos}: {err.msg}; stopped reading the array there")
            return
        if end >= len(buf) and not reader.eof and not isinstance(value, (dict, list, str)):
            # A bare number/literal touching the buffer end may continue in the next chunk.
            buf = buf[pos:] + reader.read(CHUNK_CHARS)
            offset += pos
            pos = 0
            continue
        first, expect_value = False, False
        pos = end
        if isinstance(value, dict):
            stats.records += 1
            yield value
        else:
            stats.non_object += 1
        if pos > CHUNK_CHARS:  # drop consumed text so the buffer stays about one chunk long
            buf, offset, pos = buf[pos:], offset + pos, 0


def _iter_lines(reader: _Reader, first_part: str, stats: ReadStats) -> Iterator[dict]:
    """Yield the objects of a JSON Lines stream; ``first_part`` is text already read by ``reader``."""
    offset = 0
    pending = first_part
    lines = iter(reader.fh)
    while True:
        nl = pending.find("\n")
        if nl < 0:
            more = next(lines, None)
            if more is not None:
                pending += more
                continue
            line, pending, has_newline = pending, "", False
        else:
            line, pending, has_newline = pending[: nl + 1], pending[nl + 1 :], True
        if not line:
            return
        start, offset = offset, offset + len(line)
        text = line.strip()
        if not text:
            continue
        try:
            value = json.loads(text)
        except json.JSONDecodeError as err:
            if not has_newline and _needs_more(err, len(text)):
                _mark_truncated(stats, start, len(line), "inside the last JSON Lines record")
            else:
                stats.malformed_json += 1
                logger.debug("malformed JSON line at char %d: %s", start, err.msg)
            continue
        if isinstance(value, dict):
            stats.records += 1
            yield value
        else:
            stats.non_object += 1


def _mark_truncated(stats: ReadStats, at: int, chars: int, where: str) -> None:
    stats.truncated_tail = True
    stats.truncated_at_char = at
    stats.truncated_tail_chars = chars
    stats.warn(
        f"input is truncated {where} at char {at} ({chars} chars in the incomplete tail); "
        f"kept the {stats.records} complete records before it"
    )


def iter_records(path: str, stats: ReadStats | None = None) -> Iterator[dict]:
    """Stream the JSON objects of a JSON array or JSON Lines file (``.gz`` allowed), one at a time.

    The layout is detected from the first non-blank character (``[`` = array, anything else = JSON Lines), not
    from the extension. Never raises on bad content: malformed values are counted and skipped, a truncated tail is
    reported in ``stats`` and with one warning line.

    Args:
        path: file path.
        stats: optional :class:`ReadStats` filled while iterating (read it after the iterator is exhausted).

    Yields:
        Each top-level JSON object (``dict``), in file order.

    Raises:
        VatError: the file does not exist.
    """
    stats = stats if stats is not None else ReadStats()
    with open_text(path) as fh:
        reader = _Reader(fh)
        head = ""
        while not reader.eof:
            head += reader.read(4096)
            stripped = head.lstrip("\ufeff \t\r\n")
            if stripped:
                break
        else:
            stripped = head.lstrip("\ufeff \t\r\n")
        if not stripped:
            if reader.gzip_cut:
                _mark_truncated(stats, 0, 0, "(the gzip stream ends early)")
            return
        lead = len(head) - len(stripped)
        if stripped[0] == "[":
            stats.format = "json_array"
            yield from _iter_array(reader, stripped[1:], lead + 1, stats)
        else:
            stats.format = "jsonl"
            yield from _iter_lines(reader, head, stats)
        if reader.gzip_cut and not stats.truncated_tail:
            _mark_truncated(stats, -1, 0, "(the gzip stream ends early, at a record boundary)")
