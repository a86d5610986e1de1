#!/usr/bin/env python3
"""Checks an fp8train comparison report (HTML) as a reader would get it.

Usage: check_report.py REPORT.html MIN_PICTURES

The page must hold a verdict line and at least MIN_PICTURES embedded pictures, each a PNG that
decodes (signature, IHDR chunk with its CRC) to 960 x 540 RGB pixels. Prints "ok: ..." or
"FAIL: ..." and exits 1.
"""
import base64
import re
import struct
import sys
import zlib


def fail(message: str) -> None:
    print(f"FAIL: {message}")
    sys.exit(1)


def main() -> None:
    html = open(sys.argv[1], encoding="utf-8").read()
    minimum = int(sys.argv[2])
    verdicts = re.findall(r"verdict: [^<]*within [0-9.]+ %", html)
    if not verdicts:
        fail("no verdict line")
    pictures = re.findall(r'<img alt="([^"]+)" src="data:image/png;base64,([^"]+)"', html)
    if len(pictures) < minimum:
        fail(f"{len(pictures)} pictures, expected at least {minimum}")
    for title, data in pictures:
        png = base64.b64decode(data, validate=True)
        if png[:8] != b"\x89PNG\r\n\x1a\n":
            fail(f"'{title}': not a PNG")
        length, kind = struct.unpack(">I4s", png[8:16])
        if kind != b"IHDR" or length != 13:
            fail(f"'{title}': no IHDR chunk first")
        chunk = png[12:12 + 4 + length]
        (crc,) = struct.unpack(">I", png[16 + length:20 + length])
        if zlib.crc32(chunk) != crc:
            fail(f"'{title}': IHDR CRC mismatch")
        width, height, depth, color = struct.unpack(">IIBB", png[16:26])
        if (width, height, depth, color) != (960, 540, 8, 2):
            fail(f"'{title}': {width}x{height}, depth {depth}, colour type {color}")
    print(f"ok: {len(verdicts)} verdict(s), {len(pictures)} pictures of 960x540")


if __name__ == "__main__":
    main()
