"""Draw a bar chart of the numbers given as arguments into out/chart.png (a grey PNG made
with zlib alone) and write out/report.json; the relay keeps both as the run's artifacts."""

import json
import pathlib
import struct
import sys
import zlib

WIDTH, HEIGHT, BAR, GAP = 240, 100, 16, 4


def chunk(kind: bytes, data: bytes) -> bytes:
    body = kind + data
    return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))


def png(rows: list[bytes]) -> bytes:
    header = struct.pack(">IIBBBBB", WIDTH, HEIGHT, 8, 0, 0, 0, 0)  # 8-bit greyscale
    raw = b"".join(b"\x00" + row for row in rows)  # filter type 0 on each row
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(raw))
        + chunk(b"IEND", b"")
    )


def main() -> None:
    bars = [int(value) for value in sys.argv[1:]]
    top = max(bars, default=1) or 1
    rows = []
    for y in range(HEIGHT):
        row = bytearray(b"\xff" * WIDTH)
        for index, value in enumerate(bars):
            if HEIGHT - y <= value * (HEIGHT - 4) // top:
                left = GAP + index * (BAR + GAP)
                row[left : left + BAR] = b"\x30" * BAR
        rows.append(bytes(row))
    out = pathlib.Path("out")
    out.mkdir(exist_ok=True)
    (out / "chart.png").write_bytes(png(rows))
    (out / "report.json").write_text(json.dumps({"bars": bars, "max": max(bars, default=0)}) + "\n")
    print(f"drew {len(bars)} bars")


if __name__ == "__main__":
    main()
