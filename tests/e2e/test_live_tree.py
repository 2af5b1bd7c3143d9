"""Browser test of the Live page's token trees on the embedded model: a real tree round (the trained draft
head expanded as an EAGLE-2 dynamic tree), drawn as a tree with its attention mask, at 1280 px, in presenter
mode and at 390 px wide; and the What-if page's Token trees tab."""

import re

import pytest

from tests.e2e.conftest import screenshot, wait_idle, wait_url

pytestmark = pytest.mark.e2e

LINK = "/live?lv_draft=head&lv_preset=chat&lv_gamma=3&lv_temp=0&lv_max_new=24&lv_seed=0&lv_tree=8&lv_branch=2"


def _plot_titles(page) -> list[str]:
    return page.locator(".js-plotly-plot .gtitle").all_text_contents()


def _step_tree_round(page, url: str, width: int) -> None:
    page.set_viewport_size({"width": width, "height": 1000})
    page.goto(url)
    wait_idle(page, timeout_ms=240_000)  # the first load of the embedded model takes a while
    page.get_by_text("No round yet.").wait_for(timeout=120_000)
    page.locator(".st-key-lv_step button:visible").first.click()
    page.get_by_text("Round 1:").first.wait_for(timeout=120_000)
    page.get_by_text("Kept: the accepted path of").first.wait_for(timeout=120_000)
    wait_idle(page)
    page.set_viewport_size({"width": width, "height": 3200 if width < 600 else 2600})
    wait_idle(page)
    try:
        page.wait_for_function("() => [...document.querySelectorAll('.js-plotly-plot .gtitle')]"
                               ".some(t => t.textContent.startsWith('Tree attention mask'))", timeout=60_000)
    except Exception as e:  # say what the page showed instead (a fresh-clone CI run timed out here once)
        screenshot(page, "live_tree_timeout")
        body = page.inner_text("body")
        shown = [ln for ln in body.splitlines() if re.search(r"Round 1|decoding on this server|Draw the charts|"
                                                               r"Token tree|Error|error", ln)]
        raise AssertionError(f"no tree mask chart after the round; plot titles {_plot_titles(page)}; "
                             f"the page said: {shown[:12]}") from e


def test_live_tree_round_on_the_embedded_model(page, app_url):
    _step_tree_round(page, app_url + LINK, 1280)
    titles = _plot_titles(page)
    tree_titles = [t for t in titles if re.match(r"Round 1: token tree of \d+ nodes?", t)]
    assert len(tree_titles) == 2, titles  # the round box and the inspector
    assert any(t.startswith("Tree attention mask") for t in titles)
    body = page.inner_text("body")
    assert re.search(r"Token tree: \d+ nodes, depth \d", body) and "judged by greedy" in body
    assert "accepted" in body and "Kept: the accepted path of" in body
    wait_url(page, "lv_tree=8", "lv_branch=2")
    assert not page.locator('[data-testid="stException"]').count()
    screenshot(page, "live_tree")


def test_live_tree_presenter_and_phone(page, app_url):
    _step_tree_round(page, app_url + LINK + "&present=1", 1280)
    assert not page.locator('[data-testid="stException"]').count()
    screenshot(page, "live_tree_present")
    _step_tree_round(page, app_url + LINK, 390)
    # at 390 px nothing spills sideways: the page does not scroll horizontally
    assert page.evaluate("() => document.documentElement.scrollWidth") <= 392
    assert not page.locator('[data-testid="stException"]').count()
    screenshot(page, "live_tree_390")


def test_a_draft_that_cannot_branch_says_so(page, app_url):
    page.goto(app_url + "/live?lv_draft=early-exit&lv_k=10&lv_tree=4&lv_preset=chat")
    wait_idle(page, timeout_ms=240_000)
    page.get_by_text("cannot make token trees").first.wait_for(timeout=60_000)
    assert not page.locator('[data-testid="stException"]').count()


def test_whatif_token_trees_tab(page, app_url):
    page.goto(app_url + "/whatif?wi_tab=Token+trees&wi_tree_n=12&wi_tree_branch=2")
    wait_idle(page)
    page.get_by_text("Best tree size").first.wait_for()
    page.wait_for_function("() => [...document.querySelectorAll('.js-plotly-plot .gtitle')]"
                           ".some(t => t.textContent.startsWith('The best tree of 12 nodes'))", timeout=60_000)
    body = page.inner_text("body")
    assert re.search(r"Best tree size\s*N = \d+ \([\d.]+×\)", body)
    page.get_by_text("Linear: slope s").click()
    wait_url(page, "wi_tree_curve=slope", "wi_tree_n=12")
    assert not page.locator('[data-testid="stException"]').count()
    screenshot(page, "whatif_tree")


def test_whatif_token_trees_tab_with_a_tree_smaller_than_the_size_asked(page, app_url):
    """Depth 1 and branching 3 hold 3 nodes: the tab shows the full tree of 3 and says why, instead of an IndexError
    (a reader dragged the depth to 1 at the default size 8)."""
    page.goto(app_url + "/whatif?wi_tab=Token+trees&wi_tree_n=8&wi_tree_branch=3&wi_tree_depth=1")
    wait_idle(page)
    page.get_by_text("holds at most 3 nodes: shown at N = 3").first.wait_for(timeout=60_000)
    page.wait_for_function("() => [...document.querySelectorAll('.js-plotly-plot .gtitle')]"
                           ".some(t => t.textContent.startsWith('The best tree of 3 nodes'))", timeout=60_000)
    assert not page.locator('[data-testid="stException"]').count()
    screenshot(page, "whatif_tree_capacity")
