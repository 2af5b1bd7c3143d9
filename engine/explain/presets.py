"""Prompt presets of the live speculative decoding page.

Three kinds of request that behave differently under speculation: a chat question (free text: a trained
draft predicts it, prompt lookup finds little to copy), a code-editing request that quotes the code to
edit (the answer copies long stretches of the prompt, which is where prompt lookup shines), and a summary
of a quoted paragraph (copies some phrases).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.errors import InputError


@dataclass(frozen=True)
class PromptPreset:
    """A named prompt: ``key`` (stable, used in URLs), ``label`` (shown), ``text`` (the user turn)."""

    key: str
    label: str
    text: str


_CODE = '''def area(w, h):
    return w * h


def total_area(rects):
    return sum(area(w, h) for w, h in rects)


print(total_area([(2, 3), (4, 5)]))'''

_PARAGRAPH = (
    "The printing press, developed by Johannes Gutenberg around 1440, combined movable metal type, "
    "oil-based ink and a wooden screw press. Before it, books were copied by hand, which made them "
    "slow to produce and expensive to buy. Within fifty years, printing shops had spread to more than "
    "two hundred European cities, and millions of books were in circulation. Cheaper books helped "
    "literacy grow, let scientists share results quickly, and allowed new ideas to spread faster than "
    "any authority could control them."
)

PROMPT_PRESETS: dict[str, PromptPreset] = {p.key: p for p in (
    PromptPreset("chat", "Chat question", "What are three simple tips for sleeping better? Answer briefly."),
    PromptPreset("code", "Code edit (quotes code: prompt lookup shines)",
                 "Rename the function `area` to `rect_area` everywhere in this Python code and return "
                 f"the whole updated code:\n\n```python\n{_CODE}\n```"),
    PromptPreset("summary", "Summary of a quoted paragraph",
                 f"Summarize this paragraph in two sentences:\n\n{_PARAGRAPH}"),
)}

CUSTOM = "custom"
"""The preset key shown when the user has edited the prompt text."""


def preset_text(key: str) -> str:
    """The prompt text of preset ``key``.

    Raises:
        InputError: for an unknown key.
    """
    if key not in PROMPT_PRESETS:
        raise InputError(f"Unknown prompt preset {key!r}; choose one of {sorted(PROMPT_PRESETS)}.")
    return PROMPT_PRESETS[key].text
