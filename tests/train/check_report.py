#!/usr/bin/env python3
"""Checks an fp8train comparison report (HTML) as a reader would get it.

Usage: check_report.py REPORT.html MIN_PICTURES

The page must hold a verdict line and at least MIN_PICTURES curve pictures, each a PNG of
960 x 540 RGB pixels; and, as a convergence report compares a BF16 run with an FP8 one, a
section "FP8 health: RUN" for a run other than the first (the BF16 reference logs no FP8
health) holding its two heat-maps, underflow and saturation, 960 pixels wide and 100 to 1300
tall. Every picture must decode: the signature, the IHDR chunk with its CRC, and IDAT data that
inflates to a filter byte and the RGB bytes of each row. Prints "ok: ..." or "FAIL: ..." and
exits 1.
"""
import base64
import re
import struct
import sys
import zlib

PICTURE = re.compile(r'<img alt="([^"]+)" src="data:image/png;base64,([^"]+)"')


def fail(message: str) -> None:
    print(f"FAIL: {message}")
    sys.exit(1)


def png_size(title: str, data: str) -> tuple:
    """The width and height of a PNG picture, checked to decode as 8-bit RGB."""
    png = base64.b64decode(data, validate=True)
    if png[:8] != b"\x89PNG\r\n\x1a\n":
        fail(f"'{title}': not a PNG")
    chunks = []
    at = 8
    while at + 12 <= len(png):
        length, kind = struct.unpack(">I4s", png[at:at + 8])
        body = png[at + 8:at + 8 + length]
        (crc,) = struct.unpack(">I", png[at + 8 + length:at + 12 + length])
        if zlib.crc32(kind + body) != crc:
            fail(f"'{title}': {kind.decode(errors='replace')} CRC mismatch")
        chunks.append((kind, body))
        at += 12 + length
    if not chunks or chunks[0][0] != b"IHDR" or len(chunks[0][1]) != 13:
        fail(f"'{title}': no IHDR chunk first")
    width, height, depth, color = struct.unpack(">IIBB", chunks[0][1][:10])
    if (depth, color) != (8, 2):
        fail(f"'{title}': depth {depth}, colour type {color}, expected 8-bit RGB")
    pixels = zlib.decompress(b"".join(body for kind, body in chunks if kind == b"IDAT"))
    if len(pixels) != height * (1 + 3 * width):
        fail(f"'{title}': {len(pixels)} bytes of pixels for {width}x{height}")
    return width, height


def main() -> None:
    html = open(sys.argv[1], encoding="utf-8").read()
    minimum = int(sys.argv[2])
    verdicts = re.findall(r"verdict: [^<]*within [0-9.]+ %", html)
    if not verdicts:
        fail("no verdict line")
    runs = re.findall(r"<tr><td>([^<]*)</td>", html)
    if len(runs) < 2:
        fail(f"{len(runs)} runs in the table, expected at least 2")

    # The page by its headings: the curves first, then one section per run with FP8 health.
    health = {}
    curves = 0
    for section in html.split("<h2>")[1:]:
        heading = section[:section.index("</h2>")]
        pictures = PICTURE.findall(section)
        if heading.startswith("FP8 health: "):
            health[heading[len("FP8 health: "):]] = pictures
            continue
        for title, data in pictures:
            size = png_size(title, data)
            if size != (960, 540):
                fail(f"'{title}': {size[0]}x{size[1]}, expected 960x540")
            curves += 1
    if curves < minimum:
        fail(f"{curves} curve pictures, expected at least {minimum}")

    if runs[0] in health:
        fail(f"an FP8 health section for the reference {runs[0]}, a BF16 run")
    fp8_runs = [run for run in runs[1:] if run in health]
    if not fp8_runs:
        fail(f"no FP8 health section for {', '.join(runs[1:])} (no fp8_health.jsonl?)")
    for run in fp8_runs:
        titles = [title for title, _ in health[run]]
        if len(titles) != 2 or "underflow" not in titles[0] or "saturated" not in titles[1]:
            fail(f"FP8 health of {run}: pictures {titles}, expected underflow and saturation")
        for title, data in health[run]:
            width, height = png_size(title, data)
            if width != 960 or not 100 <= height <= 1300:
                fail(f"'{title}': {width}x{height}, expected 960 wide, 100 to 1300 tall")
    print(f"ok: {len(verdicts)} verdict(s), {curves} pictures of 960x540, FP8 health heat-maps "
          f"of {', '.join(fp8_runs)}")


if __name__ == "__main__":
    main()
