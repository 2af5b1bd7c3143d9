"""WCAG 2.x contrast of sRGB colours, to check the page's text colours against their backgrounds.

Formulas from WCAG 2.2, "relative luminance" and "contrast ratio" (https://www.w3.org/TR/WCAG22/#dfn-relative-luminance,
https://www.w3.org/TR/WCAG22/#dfn-contrast-ratio); level AA asks for at least 4.5:1 for normal text
(success criterion 1.4.3).
"""

from __future__ import annotations

import colorsys

AA_TEXT = 4.5
"""WCAG 2.2 level AA minimum contrast ratio for normal-size text (success criterion 1.4.3)."""


def parse_hex(colour: str) -> tuple[int, int, int]:
    """``"#rrggbb"`` or ``"#rgb"`` (case-insensitive) → (r, g, b), each 0..255.

    Raises:
        ValueError: for anything else (a name, rgba(), a missing "#").
    """
    s = colour.strip()
    if not s.startswith("#") or len(s) not in (4, 7) or any(c not in "0123456789abcdefABCDEF" for c in s[1:]):
        raise ValueError(f"not a #rrggbb or #rgb colour: {colour!r}")
    h = s[1:]
    if len(h) == 3:
        h = "".join(c * 2 for c in h)
    return int(h[0:2], 16), int(h[2:4], 16), int(h[4:6], 16)


def relative_luminance(colour: str) -> float:
    """WCAG relative luminance of an sRGB colour, 0 (black) .. 1 (white).

    Each channel c = value / 255 is linearised as c / 12.92 if c <= 0.04045, else ((c + 0.055) / 1.055) ** 2.4;
    L = 0.2126 R + 0.7152 G + 0.0722 B. Raises ``ValueError`` for a colour ``parse_hex`` refuses.
    """
    def lin(v: int) -> float:
        c = v / 255
        return c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4

    r, g, b = parse_hex(colour)
    return 0.2126 * lin(r) + 0.7152 * lin(g) + 0.0722 * lin(b)


def contrast_ratio(fg: str, bg: str) -> float:
    """WCAG contrast ratio (L1 + 0.05) / (L2 + 0.05) of two colours, L1 the lighter: 1.0 .. 21.0, symmetric.

    Raises ``ValueError`` for a colour ``parse_hex`` refuses.
    """
    a, b = relative_luminance(fg), relative_luminance(bg)
    hi, lo = max(a, b), min(a, b)
    return (hi + 0.05) / (lo + 0.05)


def blend(fg: str, bg: str, alpha: float) -> str:
    """The colour ``fg`` drawn with opacity ``alpha`` (0..1) over ``bg``, as ``#rrggbb`` (sRGB channels mixed,
    as browsers composite). Raises ``ValueError`` for alpha outside 0..1 or a colour ``parse_hex`` refuses."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    f, b = parse_hex(fg), parse_hex(bg)
    return "#" + "".join(f"{round(alpha * x + (1 - alpha) * y):02x}" for x, y in zip(f, b))


def hue_degrees(colour: str) -> float:
    """The HSV hue of a colour in degrees, 0..360 (red 0, green 120, blue 240)."""
    r, g, b = parse_hex(colour)
    return colorsys.rgb_to_hsv(r / 255, g / 255, b / 255)[0] * 360


def hue_distance(a: str, b: str) -> float:
    """The angle between two colours' hues in degrees, 0..180."""
    d = abs(hue_degrees(a) - hue_degrees(b)) % 360
    return min(d, 360 - d)
