"""SPDY/3.1 framing, the part a remotecommand (exec) server needs: the transport the
API server speaks to a kubelet for `kubectl exec` (draft-mbelshe-httpbis-spdy-00).

Frames: a control frame is `1 | version(15) | type(16) | flags(8) | length(24) | data`,
a data frame `0 | stream id(31) | flags(8) | length(24) | data`; FIN (0x01) ends a
stream's direction. Header blocks are `count(32)` then `len(32) name len(32) value`
pairs, zlib-compressed with the dictionary below, one compression context per
direction for the whole connection, each block ending with a sync flush.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

VERSION = 3
SYN_STREAM, SYN_REPLY, RST_STREAM, SETTINGS, PING, GOAWAY, HEADERS, WINDOW_UPDATE = \
    1, 2, 3, 4, 6, 7, 8, 9
FLAG_FIN = 0x01
MAX_FRAME = 1 << 24
# a header block's size once decompressed: a few small headers in practice; the limit
# keeps a block that inflates a thousandfold (a zlib bomb) from filling memory
HEADER_LIMIT = 64 * 1024

# The header compression dictionary of SPDY/3: length-prefixed header names and values,
# then a run of common status codes, reason phrases, dates and media types.
_NAMES = (
    "options head post put delete trace accept accept-charset accept-encoding "
    "accept-language accept-ranges age allow authorization cache-control connection "
    "content-base content-encoding content-language content-length content-location "
    "content-md5 content-range content-type date etag expect expires from host if-match "
    "if-modified-since if-none-match if-range if-unmodified-since last-modified location "
    "max-forwards pragma proxy-authenticate proxy-authorization range referer retry-after "
    "server te trailer transfer-encoding upgrade user-agent vary via warning "
    "www-authenticate method get status")
_WORDS = [*_NAMES.split(), "200 OK", "version", "HTTP/1.1", "url", "public", "set-cookie",
          "keep-alive", "origin"]
_TAIL = (
    "100101201202205206300302303304305306307402405406407408409410411412413414415416417502"
    "504505203 Non-Authoritative Information204 No Content301 Moved Permanently400 Bad "
    "Request401 Unauthorized403 Forbidden404 Not Found500 Internal Server Error501 Not "
    "Implemented503 Service UnavailableJan Feb Mar Apr May Jun Jul Aug Sept Oct Nov Dec "
    "00:00:00 Mon, Tue, Wed, Thu, Fri, Sat, Sun, GMTchunked,text/html,image/png,image/jpg,"
    "image/gif,application/xml,application/xhtml+xml,text/plain,text/javascript,public"
    "privatemax-age=gzip,deflate,sdchcharset=utf-8charset=iso-8859-1,utf-,*,enq=0.")
DICTIONARY = b"".join(struct.pack(">I", len(w)) + w.encode() for w in _WORDS) + _TAIL.encode()


class ProtocolError(ValueError):
    pass


@dataclass
class Frame:
    control: bool
    type: int        # control frame type; 0 for data
    flags: int
    stream_id: int   # data frames, and control frames that carry one
    data: bytes      # the payload after the stream id (control) or the data


def control(kind: int, flags: int, payload: bytes) -> bytes:
    return struct.pack(">HHI", 0x8000 | VERSION, kind, (flags << 24) | len(payload)) + payload


def data(stream_id: int, payload: bytes, fin: bool = False) -> bytes:
    return struct.pack(">II", stream_id & 0x7FFFFFFF,
                       ((FLAG_FIN if fin else 0) << 24) | len(payload)) + payload


def parse(buf: bytearray) -> Frame | None:
    """Take one whole frame off the front of `buf`, or None if it is not all there."""
    if len(buf) < 8:
        return None
    first, second = struct.unpack(">II", buf[:8])
    flags, length = second >> 24, second & 0xFFFFFF
    if len(buf) < 8 + length:
        return None
    payload = bytes(buf[8:8 + length])
    del buf[:8 + length]
    if not first & 0x80000000:
        return Frame(False, 0, flags, first & 0x7FFFFFFF, payload)
    version, kind = (first >> 16) & 0x7FFF, first & 0xFFFF
    if version != VERSION:
        raise ProtocolError(f"SPDY version {version}, not {VERSION}")
    sid = 0
    if kind in (SYN_STREAM, SYN_REPLY, RST_STREAM, HEADERS, WINDOW_UPDATE) and len(payload) >= 4:
        sid = struct.unpack(">I", payload[:4])[0] & 0x7FFFFFFF
        payload = payload[4:]
    return Frame(True, kind, flags, sid, payload)


class HeaderCodec:
    """The connection's two compression contexts (ours out, the peer's in)."""

    def __init__(self) -> None:
        self._out = zlib.compressobj(zdict=DICTIONARY)
        self._in = zlib.decompressobj(zdict=DICTIONARY)

    def encode(self, headers: dict[str, str]) -> bytes:
        raw = struct.pack(">I", len(headers)) + b"".join(
            struct.pack(">I", len(k)) + k.encode() + struct.pack(">I", len(v)) + v.encode()
            for k, v in ((k.lower(), v) for k, v in headers.items()))
        return self._out.compress(raw) + self._out.flush(zlib.Z_SYNC_FLUSH)

    def decode(self, block: bytes) -> dict[str, str]:
        try:
            raw = self._in.decompress(block, HEADER_LIMIT + 1)
        except zlib.error as e:
            raise ProtocolError(f"header block: {e}") from None
        if len(raw) > HEADER_LIMIT:
            raise ProtocolError(f"header block: over {HEADER_LIMIT} bytes decompressed")
        out: dict[str, str] = {}
        try:
            (count,), pos = struct.unpack(">I", raw[:4]), 4
            for _ in range(count):
                (n,) = struct.unpack(">I", raw[pos:pos + 4])
                name = raw[pos + 4:pos + 4 + n].decode()
                pos += 4 + n
                (n,) = struct.unpack(">I", raw[pos:pos + 4])
                out[name] = raw[pos + 4:pos + 4 + n].decode()
                pos += 4 + n
        except (struct.error, UnicodeDecodeError) as e:
            raise ProtocolError(f"header block: {e}") from None
        return out


def syn_reply(codec: HeaderCodec, stream_id: int, headers: dict[str, str] | None = None) -> bytes:
    return control(SYN_REPLY, 0, struct.pack(">I", stream_id) + codec.encode(headers or {}))
