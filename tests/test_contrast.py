"""app.contrast against hand-computed WCAG ratios, and the ratios of the colours the pages use: the Live page's
token backgrounds (.streamlit/config.toml's [theme.light] / [theme.dark] under Streamlit's own text colours) and
the token tree's labels (drawn at full opacity)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
import streamlit.config

from app.contrast import AA_TEXT, blend, contrast_ratio, hue_distance, parse_hex, relative_luminance
from app.live_view import STYLE
from app.tree_view import LABEL_COLOR, OPACITY, tree_figure
from tests.tree_fixtures import greedy_tree, tree_round

CONFIG = Path(__file__).resolve().parents[1] / ".streamlit" / "config.toml"


def test_ratios_by_hand():
    assert contrast_ratio("#000000", "#ffffff") == pytest.approx(21.0)
    assert contrast_ratio("#fff", "#000") == pytest.approx(21.0)  # symmetric, short form
    assert contrast_ratio("#ffffff", "#ffffff") == pytest.approx(1.0)
    # #777777: c = 119/255, ((c + 0.055) / 1.055) ** 2.4 = 0.18447; (1.05) / (0.18447 + 0.05) = 4.478
    assert relative_luminance("#777777") == pytest.approx(0.18447, abs=1e-5)
    assert contrast_ratio("#777777", "#ffffff") == pytest.approx(4.478, abs=1e-3)
    # pure red: L = 0.2126, (1.05) / (0.2626) = 3.998
    assert contrast_ratio("#ff0000", "#ffffff") == pytest.approx(3.998, abs=1e-3)
    assert blend("#000000", "#ffffff", 0.5) == "#808080" and blend("#123456", "#ffffff", 1.0) == "#123456"
    assert hue_distance("#ff0000", "#00ff00") == pytest.approx(120) and hue_distance("#ff0000", "#ff00ff") == 60


@pytest.mark.parametrize("bad", ["red", "#12345", "rgba(0,0,0,1)", "#ggg", "123456"])
def test_bad_colours_are_refused(bad):
    with pytest.raises(ValueError, match="colour"):
        parse_hex(bad)
    with pytest.raises(ValueError, match="alpha"):
        blend("#000", "#fff", 1.5)


def _streamlit_default(option: str) -> dict[str, str]:
    """{"light": ..., "dark": ...}: the installed Streamlit's documented default of a theme option."""
    streamlit.config.get_config_options()
    text = " ".join(streamlit.config._config_options_template[f"theme.{option}"].description.split())
    m = re.search(r"(#[0-9a-fA-F]{6}) for the light theme and (#[0-9a-fA-F]{6}) for the dark", text)
    assert m, f"Streamlit no longer documents theme.{option}'s defaults: {text!r}"
    return {"light": m.group(1), "dark": m.group(2)}


def _theme(mode: str) -> dict[str, str]:
    """The colours the page runs with in ``mode``: Streamlit's defaults overridden by config.toml."""
    set_here = tomllib.loads(CONFIG.read_text()).get("theme", {}).get(mode, {})
    names = ["textColor", "backgroundColor", "greenTextColor", "blueTextColor", "orangeTextColor"]
    colours = {n: _streamlit_default(n)[mode] for n in names}
    colours.update(set_here)
    return colours


ROLES = {"accepted": "green", "correction": "orange", "bonus": "blue"}


@pytest.mark.parametrize("mode", ["light", "dark"])
def test_token_backgrounds_reach_aa_and_differ(mode):
    theme = _theme(mode)
    bg = {}
    for role, colour in ROLES.items():
        assert STYLE[role] == f"{colour}-background"  # the page's directive reads this theme colour
        bg[role] = theme[f"{colour}BackgroundColor"]
        # the token's text (body text colour) on its background, and the alert boxes' text that shares it
        assert contrast_ratio(theme["textColor"], bg[role]) >= AA_TEXT
        assert contrast_ratio(theme[f"{colour}TextColor"], bg[role]) >= AA_TEXT
        # a token's background shows against the page's (Streamlit's defaults: 1.06-1.10:1 on white, near
        # white; 1.21-1.25:1 on the dark page)
        assert contrast_ratio(bg[role], theme["backgroundColor"]) >= 1.3
    # accepted and bonus (and correction): hues far apart
    assert hue_distance(bg["accepted"], bg["bonus"]) >= 60
    assert hue_distance(bg["accepted"], bg["correction"]) >= 60


@pytest.mark.parametrize("mode", ["light", "dark"])
def test_tree_labels_reach_aa(mode):
    theme = _theme(mode)
    assert LABEL_COLOR[mode] == theme["textColor"]
    fig = tree_figure(tree_round(greedy_tree(), "correction"), greedy=True, theme=mode)
    nodes = [t for t in fig.data if t.name]
    assert {t.name for t in nodes} >= {"rejected", "never judged", "accepted"}
    for t in nodes + [next(t for t in fig.data if list(t.text or ()) == ["context"])]:
        alpha = 1.0 if t.opacity is None else t.opacity  # a trace's opacity is its labels' too
        label = blend(t.textfont.color, theme["backgroundColor"], alpha)
        assert contrast_ratio(label, theme["backgroundColor"]) >= AA_TEXT
    # what a faded trace gave (1.8:1 for never judged in light mode), and Streamlit's chart text grey (3.7:1)
    faded = blend(theme["textColor"], theme["backgroundColor"], OPACITY["unvisited"])
    assert contrast_ratio(faded, theme["backgroundColor"]) < AA_TEXT
    if mode == "light":
        assert contrast_ratio("#808495", theme["backgroundColor"]) < AA_TEXT


def test_tree_labels_keep_the_chart_theme_colour_when_the_theme_is_unknown():
    fig = tree_figure(tree_round(greedy_tree(), "correction"), greedy=True, theme=None)
    assert all(t.textfont.color is None for t in fig.data if t.text)
