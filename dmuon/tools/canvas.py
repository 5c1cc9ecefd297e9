"""A tiny raster canvas and PNG encoder (no dependencies beyond ``zlib`` / ``struct``): lines,
rectangles and 3x5 bitmap text on an RGB grid, encoded as an 8-bit RGB PNG (PNG spec, ISO/IEC
15948: signature, IHDR, one zlib-compressed IDAT of filter-0 scanlines, IEND). The demo's loss
plot and the projector's timeline draw with it when matplotlib is absent.
"""
from __future__ import annotations

import math
import struct
import zlib

__all__ = ["Canvas", "encode_png", "nice_ticks", "PNG_SIGNATURE"]

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

_FONT = {  # 3x5 glyphs, rows top to bottom
    "0": "111101101101111", "1": "010110010010111", "2": "111001111100111",
    "3": "111001111001111", "4": "101101111001001", "5": "111100111001111",
    "6": "111100111101111", "7": "111001001010010", "8": "111101111101111",
    "9": "111101111001111", ".": "000000000000010", "-": "000000111000000",
    " ": "000000000000000", "(": "010100100100010", ")": "010001001001010",
    "=": "000111000111000", "/": "001001010100100", ":": "000010000010000",
    ",": "000000000010100", "+": "000010111010000",
    "A": "010101111101101", "B": "110101110101110", "C": "011100100100011",
    "D": "110101101101110", "E": "111100110100111", "F": "111100110100100",
    "G": "011100101101011", "H": "101101111101101", "I": "111010010010111",
    "J": "001001001101010", "K": "101101110101101", "L": "100100100100111",
    "M": "101111111101101", "N": "110101101101101", "O": "010101101101010",
    "P": "110101110100100", "Q": "010101101110011", "R": "110101110101101",
    "S": "011100010001110", "T": "111010010010010", "U": "101101101101111",
    "V": "101101101101010", "W": "101101111111101", "X": "101101010101101",
    "Y": "101101010010010", "Z": "111001010100111",
}


class Canvas:
    """An RGB pixel grid with lines, rectangles and 3x5 bitmap text."""

    def __init__(self, w: int, h: int, bg: tuple[int, int, int] = (255, 255, 255)):
        self.w, self.h = w, h
        self.px = bytearray(bytes(bg) * (w * h))

    def dot(self, x: int, y: int, c: tuple[int, int, int]) -> None:
        if 0 <= x < self.w and 0 <= y < self.h:
            i = 3 * (y * self.w + x)
            self.px[i:i + 3] = bytes(c)

    def rect(self, x0: int, y0: int, x1: int, y1: int, c: tuple[int, int, int]) -> None:
        for y in range(max(0, y0), min(self.h, y1 + 1)):
            for x in range(max(0, x0), min(self.w, x1 + 1)):
                self.dot(x, y, c)

    def line(self, x0: float, y0: float, x1: float, y1: float, c: tuple[int, int, int],
             width: int = 1, dash: int = 0) -> None:
        """Straight segment sampled at unit steps; ``dash > 0`` draws ``dash`` on / ``dash`` off."""
        n = int(max(abs(x1 - x0), abs(y1 - y0))) + 1
        for i in range(n + 1):
            if dash and (i // dash) % 2:
                continue
            t = i / n
            x, y = round(x0 + (x1 - x0) * t), round(y0 + (y1 - y0) * t)
            for dy in range(-(width // 2), width - width // 2):
                for dx in range(-(width // 2), width - width // 2):
                    self.dot(x + dx, y + dy, c)

    def text(self, x: int, y: int, s: str, c: tuple[int, int, int] = (0, 0, 0),
             scale: int = 2, anchor: str = "left") -> None:
        adv = 4 * scale
        if anchor == "right":
            x -= adv * len(s)
        elif anchor == "center":
            x -= adv * len(s) // 2
        for k, ch in enumerate(s.upper()):
            g = _FONT.get(ch, _FONT[" "])
            for r in range(5):
                for col in range(3):
                    if g[3 * r + col] == "1":
                        self.rect(x + k * adv + col * scale, y + r * scale,
                                  x + k * adv + col * scale + scale - 1, y + r * scale + scale - 1, c)

    def png(self) -> bytes:
        return encode_png(self.w, self.h, bytes(self.px))


def encode_png(width: int, height: int, rgb: bytes) -> bytes:
    """Encode ``rgb`` (``height`` rows of ``width`` RGB triplets) as an 8-bit RGB PNG."""
    if len(rgb) != 3 * width * height:
        raise ValueError(f"rgb has {len(rgb)} bytes, expected {3 * width * height}")

    def chunk(tag: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + tag + data
                + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF))

    stride = 3 * width
    raw = b"".join(b"\x00" + rgb[y * stride:(y + 1) * stride] for y in range(height))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (PNG_SIGNATURE + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(raw, 9))
            + chunk(b"IEND", b""))


def nice_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    span = max(hi - lo, 1e-12)
    raw = span / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step) * step
    return [first + i * step for i in range(int((hi - first) / step + 1e-9) + 1)]
