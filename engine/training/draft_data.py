"""Training data for the embedded draft: generated prompts and the target's own answers with its top-k.

The draft is distilled from the target (SmolLM2-135M-Instruct), so its training text is what the target
itself writes: answers to a broad set of generated prompts (chat, explanation, code, lists, summaries of
quoted text, writing, comparisons, small arithmetic). Each answer position also stores the target's
top-k log-probabilities, the soft targets of the distillation loss (Hinton et al. 2015, "Distilling the
Knowledge in a Neural Network", §2; here on the top-k of p only, as in DistillSpec, Zhou et al. 2023).

Held-out prompts never share a *topic* with training prompts: the topic lists are split once, by a fixed
hash, so held-out measurements are not on paraphrases of training prompts.
"""

from __future__ import annotations

import hashlib
import random
import re
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from engine.errors import InputError

# ---------------------------------------------------------------------------------------------- prompts

TOPICS = [
    "photosynthesis", "black holes", "the water cycle", "plate tectonics", "climate change", "vaccines",
    "the immune system", "DNA replication", "the French Revolution", "the Roman Empire", "the printing press",
    "the Industrial Revolution", "World War I", "the Renaissance", "ancient Egypt", "the Silk Road",
    "machine learning", "neural networks", "blockchain", "cloud computing", "the internet", "encryption",
    "operating systems", "databases", "compilers", "quantum computing", "electric cars", "solar power",
    "wind energy", "nuclear fusion", "inflation", "interest rates", "the stock market", "supply and demand",
    "compound interest", "budgeting", "healthy sleep", "meditation", "regular exercise", "a balanced diet",
    "drinking enough water", "stress management", "time management", "public speaking", "learning a language",
    "playing the guitar", "gardening", "baking bread", "composting", "recycling", "bees", "whales",
    "rainforests", "deserts", "volcanoes", "earthquakes", "hurricanes", "the moon landing", "Mars exploration",
    "the solar system", "gravity", "electricity", "magnetism", "light", "sound waves", "chemical reactions",
    "the periodic table", "evolution", "cells", "the human heart", "the brain", "memory", "emotions",
    "friendship", "leadership", "teamwork", "remote work", "social media", "video games", "chess",
    "photography", "jazz music", "classical music", "poetry", "Shakespeare", "democracy", "human rights",
    "the United Nations", "urban planning", "public transport", "bicycles", "airplanes", "trains",
    "the ocean", "coral reefs", "forests", "mountains", "coffee", "tea", "chocolate", "pizza", "rice",
    "honey", "dogs", "cats", "birds", "butterflies", "dinosaurs", "robots", "artificial intelligence",
    "self-driving cars", "smartphones", "3D printing", "virtual reality", "space telescopes", "satellites",
    "the Olympic Games", "football", "running a marathon", "yoga", "libraries", "museums", "volunteering",
    "saving money", "starting a small business", "writing a resume", "job interviews", "online privacy",
    "password security", "open source software", "version control", "unit testing", "the scientific method",
    "statistics", "probability", "prime numbers", "geometry", "fractions", "calculus", "maps",
]
ACTIVITIES = [
    "learning to code", "studying for exams", "cooking for a family", "traveling on a budget",
    "keeping a plant alive", "writing a novel", "staying focused", "training a puppy", "running faster",
    "making friends in a new city", "saving for retirement", "organizing a small kitchen", "sleeping better",
    "giving feedback", "preparing for a job interview", "reducing screen time", "learning to swim",
    "planning a birthday party", "moving to a new apartment", "reading more books", "staying motivated",
    "taking better photos", "writing clear emails", "speaking in public", "hiking safely", "camping",
    "starting a vegetable garden", "cleaning a laptop", "reducing food waste", "working from home",
]
CODE_TASKS = [
    "reverses a string", "checks whether a number is prime", "computes the factorial of n",
    "returns the n-th Fibonacci number", "sorts a list of dictionaries by a key", "counts the words in a text",
    "removes duplicates from a list", "finds the largest element of a list", "merges two sorted lists",
    "checks whether a string is a palindrome", "reads a CSV file and prints each row",
    "converts Celsius to Fahrenheit", "computes the average of a list of numbers", "flattens a nested list",
    "finds the most common character in a string", "validates an email address", "performs binary search",
    "counts vowels in a string", "transposes a matrix", "computes the greatest common divisor of two numbers",
    "generates a random password", "checks whether two strings are anagrams", "implements a stack class",
    "parses a date string", "sums the digits of a number", "capitalizes every word in a sentence",
]
LANGS = ["Python", "JavaScript", "Java", "C", "Rust", "Go", "SQL", "Bash"]
SNIPPETS = [
    "def f(xs):\n    return [x * x for x in xs if x % 2 == 0]",
    "for i in range(1, 11):\n    print(i, i ** 2)",
    "def g(s):\n    return s[::-1] == s",
    "total = 0\nfor n in numbers:\n    total += n\nprint(total / len(numbers))",
    "import json\nwith open('data.json') as f:\n    data = json.load(f)\nprint(data['name'])",
    "def count(text):\n    words = text.split()\n    return {w: words.count(w) for w in set(words)}",
    "while n > 1:\n    n = n // 2 if n % 2 == 0 else 3 * n + 1\n    print(n)",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y",
    "SELECT name, COUNT(*) FROM orders GROUP BY name ORDER BY 2 DESC;",
    "const add = (a, b) => a + b;\nconsole.log([1, 2, 3].map(x => add(x, 1)));",
]
PEOPLE = ["my manager", "a friend", "my teacher", "a customer", "my landlord", "a new colleague",
          "my neighbor", "my team", "a hiring manager", "my grandmother"]
MATTERS = ["a delayed project", "a meeting next week", "a thank-you for their help", "a broken heater",
           "a request for a day off", "a welcome to the team", "a change of plans", "a late payment"]
MOODS = ["tired", "excited", "a bit stressed", "bored", "curious", "happy", "nervous"]
AUDIENCES = ["a five-year-old", "a high school student", "a beginner", "an expert", "my grandparents"]
CHARACTERS = ["a lonely robot", "a brave mouse", "an old lighthouse keeper", "a young inventor",
              "a talking cat", "a lost astronaut", "a shy dragon", "a curious child"]
EVENTS = ["finds a secret door", "learns to fly", "makes an unexpected friend", "loses a map",
          "discovers a hidden talent", "travels back in time", "wins a strange contest"]
ORGS = ["The city council", "A local school", "A small software company", "The national museum",
        "A community garden group", "The regional hospital", "A football club", "A research team"]
ACTIONS = ["open a new library branch", "switch to a four-day work week", "ban cars from the old town",
           "plant ten thousand trees", "offer free evening classes", "replace its buses with electric ones",
           "publish all of its data online", "build a new bicycle path"]
REASONS = ["a year of public consultations", "rising costs", "complaints from residents",
           "a successful pilot program", "new funding from the government", "a study on air quality"]
REACTIONS = ["Supporters said the plan was long overdue", "Some residents worried about the cost",
             "Critics argued that the timeline was too short", "Local shops expected more visitors",
             "Experts called the results encouraging", "Several groups asked for more details"]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "last week", "this morning"]


def _passage(r: random.Random, topic: str) -> str:
    org, act, why = r.choice(ORGS), r.choice(ACTIONS), r.choice(REASONS)
    reac = r.sample(REACTIONS, 2)
    n = r.randint(2, 9)
    return (f"{org} announced on {r.choice(DAYS)} that it would {act}. The decision follows {why}. "
            f"{reac[0]}, while {reac[1][0].lower() + reac[1][1:]}. Officials said the first results would be "
            f"visible within {n} months, and that a public report on {topic} would follow.")


def _templates(r: random.Random, topic: str, topic2: str) -> list[tuple[str, str]]:
    """(category, prompt) candidates for one topic; one of them is drawn."""
    n = r.randint(3, 7)
    act, task, lang = r.choice(ACTIVITIES), r.choice(CODE_TASKS), r.choice(LANGS)
    return [
        ("explain", f"Explain {topic} in simple terms."),
        ("explain", f"What is {topic}?"),
        ("explain", f"How does {topic} work?"),
        ("explain", f"Why is {topic} important?"),
        ("explain", f"Explain {topic} to {r.choice(AUDIENCES)}."),
        ("explain", f"Give me a short history of {topic}."),
        ("list", f"List {n} interesting facts about {topic}."),
        ("list", f"Give me {n} tips for {act}."),
        ("list", f"What are the pros and cons of {topic}?"),
        ("list", f"Write a step-by-step guide to {act}."),
        ("compare", f"Compare {topic} and {topic2}."),
        ("compare", f"What do {topic} and {topic2} have in common?"),
        ("code", f"Write a {lang if r.random() < 0.4 else 'Python'} function that {task}."),
        ("code", f"How do I write a program that {task}?"),
        ("code", f"Explain what this code does:\n\n```\n{r.choice(SNIPPETS)}\n```"),
        ("chat", f"Hi! I'm feeling {r.choice(MOODS)} today. Can you tell me something about {topic}?"),
        ("chat", f"Hello, how are you? I want to get better at {act}."),
        ("chat", f"I have a question: what should I know before {act}?"),
        ("chat", f"Can you help me understand {topic}? I keep getting confused."),
        ("chat", f"Tell me a fun fact about {topic}."),
        ("write", f"Write a short poem about {topic}."),
        ("write", f"Write an email to {r.choice(PEOPLE)} about {r.choice(MATTERS)}."),
        ("write", f"Write a short story about {r.choice(CHARACTERS)} who {r.choice(EVENTS)}."),
        ("write", f"Write a paragraph about {topic} for a school newsletter."),
        ("summary", f"Summarize the following text in {r.randint(1, 3)} sentences:\n\n{_passage(r, topic)}"),
        ("summary", f"What is the main point of this passage?\n\n\"{_passage(r, topic)}\""),
        ("math", f"What is {r.randint(2, 99)} times {r.randint(2, 99)}? Explain your steps."),
        ("math", f"Solve for x: {r.randint(2, 9)}x + {r.randint(1, 30)} = {r.randint(31, 99)}."),
    ]


# Prompt set 2 (stage-3 data): more topics and activities, new kinds of requests (how-to, advice,
# rewriting, classification, extraction, definitions, recipes, editing and testing code). A category is
# drawn first, then a template in it (set 1 draws among all templates at once); categories with few
# distinct prompts (code, rewrite) still run out early, since prompts are never repeated.
TOPICS_2 = TOPICS + [
    "the Great Wall of China", "the Amazon river", "glaciers", "the Sahara", "the Arctic", "penguins",
    "octopuses", "elephants", "wolves", "sharks", "mushrooms", "tomatoes", "potatoes", "cheese", "yogurt",
    "bread", "olive oil", "spices", "the human skin", "the lungs", "the liver", "blood types", "bones",
    "muscles", "vision", "hearing", "allergies", "antibiotics", "the common cold", "first aid",
    "the Moon's phases", "eclipses", "comets", "the Milky Way", "the Big Bang", "rockets",
    "the International Space Station", "GPS", "Wi-Fi", "batteries", "semiconductors", "lasers",
    "radio", "television", "cameras", "the telephone", "the steam engine", "bridges", "skyscrapers",
    "roads", "cities", "villages", "farming", "fishing", "irrigation", "water treatment", "plastic",
    "glass", "steel", "paper", "cotton", "wool", "fashion", "architecture", "painting", "sculpture",
    "theater", "film", "opera", "dance", "rap music", "rock music", "novels", "fairy tales", "mythology",
    "philosophy", "ethics", "logic", "psychology", "sociology", "economics", "taxes", "banks",
    "credit cards", "insurance", "retirement plans", "elections", "the constitution", "courts",
    "journalism", "advertising", "marketing", "customer service", "negotiation", "kindness", "curiosity",
    "habits", "motivation", "creativity", "critical thinking", "debate", "note-taking", "reading speed",
    "spreadsheets", "email etiquette", "typing", "web browsers", "search engines", "HTML", "CSS",
    "JavaScript", "Python", "SQL", "APIs", "Linux", "Git", "recursion", "sorting algorithms",
    "hash tables", "linked lists", "graphs", "regular expressions", "debugging", "code review",
    "algebra", "percentages", "averages", "triangles", "circles", "negative numbers", "decimals",
]
ACTIVITIES_2 = ACTIVITIES + [
    "learning to cook rice", "painting a room", "fixing a flat bicycle tire", "making a budget",
    "writing a cover letter", "studying with flashcards", "waking up early", "drinking less coffee",
    "planting tomatoes", "making new habits stick", "learning to draw", "packing for a trip",
    "choosing a laptop", "backing up my files", "preparing for a marathon", "meal prepping",
    "decluttering my room", "learning chess", "writing a speech", "dealing with a difficult coworker",
    "asking for a raise", "starting a podcast", "learning SQL", "building a website", "cooking pasta",
    "keeping a journal", "reducing stress before exams", "teaching a child to read", "caring for a cat",
    "organizing my email inbox",
]
CODE_TASKS_2 = CODE_TASKS + [
    "counts how often each word appears in a file", "returns the second largest number in a list",
    "converts a list of strings to uppercase", "checks whether a year is a leap year",
    "computes the area of a circle", "splits a list into chunks of size n", "rotates a list by k places",
    "finds the intersection of two lists", "converts a number to binary", "checks balanced parentheses",
    "calculates a running total", "reverses the words in a sentence", "finds all even numbers in a list",
    "computes the mean and median of a list", "removes whitespace from a string",
    "finds the longest word in a sentence", "counts lines in a text file", "implements a queue",
    "returns the keys of a dictionary sorted by value", "converts a string to title case",
]
FUNCS = [
    ("add", "def add(a, b):\n    return a + b"),
    ("is_even", "def is_even(n):\n    return n % 2 == 0"),
    ("mean", "def mean(xs):\n    return sum(xs) / len(xs)"),
    ("greet", "def greet(name):\n    print('Hello, ' + name + '!')"),
    ("maximum", "def maximum(xs):\n    best = xs[0]\n    for x in xs:\n        if x > best:\n            best = x\n    return best"),
    ("count_words", "def count_words(text):\n    return len(text.split())"),
    ("square_all", "def square_all(nums):\n    result = []\n    for n in nums:\n        result.append(n * n)\n    return result"),
    ("first_char", "def first_char(s):\n    return s[0]"),
    ("average", "def average(values):\n    total = 0\n    for v in values:\n        total += v\n    return total / len(values)"),
    ("divide", "def divide(a, b):\n    return a / b"),
]
SENTENCES = [
    "me and him goes to the store yesterday", "the meeting have been moved to friday",
    "I can't wait to see you at the party tonight!", "Please send the report by end of day.",
    "this product broke after two days and nobody answered my emails",
    "The hotel was clean, the staff were friendly and the view was amazing.",
    "their going to announce the results tomorrow", "We regret to inform you that the event is cancelled.",
    "The food was cold and the waiter forgot our drinks.", "I love how simple this app is to use.",
    "Anna Smith met David Lee in Paris on 3 May to discuss the new contract.",
    "The package arrived late, but the quality is excellent.",
]
DISHES = ["pancakes", "tomato soup", "a simple salad", "fried rice", "banana bread", "guacamole",
          "scrambled eggs", "vegetable curry", "lemonade", "chocolate chip cookies", "pasta with pesto",
          "a smoothie", "roasted vegetables", "hummus", "oatmeal"]
ROLES = ["teacher", "nurse", "software engineer", "chef", "pilot", "farmer", "librarian", "architect",
         "firefighter", "scientist", "journalist", "electrician", "dentist", "data analyst", "carpenter"]
SITUATIONS = ["my friend forgot my birthday", "I failed an exam", "I can't decide which job offer to take",
              "my roommate is very messy", "I feel nervous about a presentation", "I want to change careers",
              "my neighbor is noisy at night", "I keep procrastinating", "I moved to a new city and feel lonely",
              "I have too many tasks this week"]


def _templates_2(r: random.Random, topic: str, topic2: str) -> dict[str, list[str]]:
    """Prompt set 2: category -> prompt candidates for one topic pair."""
    n = r.randint(3, 7)
    act, task, lang = r.choice(ACTIVITIES_2), r.choice(CODE_TASKS_2), r.choice(LANGS)
    fname, fsrc = r.choice(FUNCS)
    sent, dish, role, sit = r.choice(SENTENCES), r.choice(DISHES), r.choice(ROLES), r.choice(SITUATIONS)
    return {
        "explain": [f"Explain {topic} in simple terms.", f"What is {topic}?", f"How does {topic} work?",
                    f"Why do people care about {topic}?", f"Explain {topic} to {r.choice(AUDIENCES)}.",
                    f"Define {topic} in one sentence.", f"What are the basics of {topic}?",
                    f"What are common misconceptions about {topic}?", f"How has {topic} changed over time?"],
        "howto": [f"How do I get started with {act}?", f"What's the best way to approach {act}?",
                  f"Give me {n} tips for {act}.", f"Write a step-by-step guide to {act}.",
                  f"What mistakes should I avoid when {act}?", f"Make a one-week plan for {act}."],
        "advice": [f"I need advice: {sit}. What should I do?", f"{sit[0].upper() + sit[1:]}. Any suggestions?",
                   f"What does a {role} do all day?", f"How do I become a {role}?",
                   f"What skills does a {role} need?", f"Should I learn about {topic} or {topic2} first?"],
        "list": [f"List {n} interesting facts about {topic}.", f"What are the pros and cons of {topic}?",
                 f"Name {n} things everyone should know about {topic}.", f"Give me {n} questions to ask about {topic}.",
                 f"List {n} words related to {topic}."],
        "compare": [f"Compare {topic} and {topic2}.", f"What is the difference between {topic} and {topic2}?",
                    f"Which is more important, {topic} or {topic2}? Explain briefly."],
        "code": [f"Write a {lang if r.random() < 0.4 else 'Python'} function that {task}.",
                 f"How do I write a program that {task}?",
                 f"Add a docstring to this function:\n\n```python\n{fsrc}\n```",
                 f"What does this function do?\n\n```python\n{fsrc}\n```",
                 f"Rename the function `{fname}` to `{fname}_v2` in this code:\n\n```python\n{fsrc}\n```",
                 f"Add type hints to this function:\n\n```python\n{fsrc}\n```",
                 f"Write a unit test for this function:\n\n```python\n{fsrc}\n```",
                 f"Is there a bug in this code?\n\n```python\n{fsrc}\n```",
                 f"Explain what this code does:\n\n```\n{r.choice(SNIPPETS)}\n```"],
        "chat": [f"Hi! I'm feeling {r.choice(MOODS)} today. Can you tell me something about {topic}?",
                 f"Hello, how are you? I want to get better at {act}.", f"Tell me a fun fact about {topic}.",
                 f"Can you help me understand {topic}? I keep getting confused.", "Hi there!",
                 "Good morning! What's a good way to spend a free afternoon?",
                 f"Thanks for your help yesterday with {topic}. Can you remind me of the key idea?",
                 f"I'm a {role}. How could {topic} be useful in my work?"],
        "rewrite": [f'Fix the grammar in this sentence: "{sent}"', f'Rewrite this more formally: "{sent}"',
                    f'Make this sentence shorter: "{sent}"', f'Translate into French: "{sent}"',
                    f'Is this review positive or negative? "{sent}"', f'Extract the names and dates from: "{sent}"',
                    f'Rewrite this in a friendlier tone: "{sent}"'],
        "write": [f"Write a short poem about {topic}.", f"Write an email to {r.choice(PEOPLE)} about {r.choice(MATTERS)}.",
                  f"Write a short story about {r.choice(CHARACTERS)} who {r.choice(EVENTS)}.",
                  f"Give me a recipe for {dish}.", f"Write a tweet about {topic}.",
                  f"Write a product description for a book about {topic}.", f"Write a haiku about {topic}."],
        "summary": [f"Summarize the following text in {r.randint(1, 3)} sentences:\n\n{_passage(r, topic)}",
                    f"What is the main point of this passage?\n\n\"{_passage(r, topic)}\"",
                    f"Give this news story a headline:\n\n{_passage(r, topic)}"],
        "math": [f"What is {r.randint(2, 99)} times {r.randint(2, 99)}? Explain your steps.",
                 f"Solve for x: {r.randint(2, 9)}x + {r.randint(1, 30)} = {r.randint(31, 99)}.",
                 f"What is {r.randint(5, 95)}% of {r.randint(20, 500)}?",
                 f"If I buy {r.randint(2, 9)} items at ${r.randint(2, 40)} each, how much do I pay?"],
    }


def _is_heldout_topic(topic: str) -> bool:
    """A fixed 1-in-6 split of the topic list (by hash), so held-out prompts use unseen topics."""
    return int(hashlib.sha256(topic.encode()).hexdigest(), 16) % 6 == 0


_HELDOUT_WORDS = re.compile(r"\b(" + "|".join(re.escape(t) for t in TOPICS_2 if _is_heldout_topic(t)) + r")\b",
                            re.IGNORECASE)


def build_prompts(n: int, split: str = "train", seed: int = 0, prompt_set: int = 1) -> list[dict]:
    """Generate ``n`` distinct prompts of mixed categories.

    Args:
        n: number of prompts (≥ 1).
        split: "train" or "heldout"; the two use disjoint topic sets (about 5/6 and 1/6 of the topics,
            split by ``_is_heldout_topic`` in both prompt sets, so set 2's training topics never include
            a held-out topic of set 1).
        seed: random seed; the same (n, split, seed, prompt_set) always gives the same list.
        prompt_set: 1 (the first two training stages and every held-out benchmark) or 2 (more topics and
            request kinds, categories equally likely; stage 3).

    Returns:
        list of {"category": str, "prompt": str}.

    Raises:
        InputError: for n < 1 or an unknown split.
    """
    if n < 1:
        raise InputError("The number of prompts must be at least 1.")
    if split not in ("train", "heldout"):
        raise InputError(f"Unknown split {split!r}; use 'train' or 'heldout'.")
    if prompt_set not in (1, 2):
        raise InputError(f"Unknown prompt set {prompt_set!r}; use 1 or 2.")
    topics = [t for t in (TOPICS if prompt_set == 1 else TOPICS_2) if _is_heldout_topic(t) == (split == "heldout")]
    r = random.Random(f"{split}-{seed}" if prompt_set == 1 else f"{split}-{seed}-set{prompt_set}")
    out, seen = [], set()
    tries = 0
    while len(out) < n and tries < 50 * n:
        tries += 1
        t1, t2 = r.sample(topics, 2)
        if prompt_set == 1:
            cat, prompt = r.choice(_templates(r, t1, t2))
        else:
            cands = _templates_2(r, t1, t2)
            cat = r.choice(sorted(cands))
            prompt = r.choice(cands[cat])
            if split == "train" and _HELDOUT_WORDS.search(prompt):
                continue  # a word list (activities, snippets) named a held-out topic
        if prompt in seen:
            continue
        seen.add(prompt)
        out.append({"category": cat, "prompt": prompt})
    return out


# ---------------------------------------------------------------------------------------------- generation


@dataclass
class Sample:
    """One prompt with the target's answer.

    Attributes:
        prompt_ids: chat-templated prompt, token ids, shape (P,).
        response_ids: the target's answer, shape (R,), ending with EOS unless cut at max_new_tokens.
        top_ids: the target's top-k token ids at each answer position, shape (R, k), int32.
        top_logp: their log-probabilities under p (temperature 1), shape (R, k), float16.
        temperature: the temperature the answer was sampled at (0 = greedy).
        category: prompt category.
    """

    prompt_ids: torch.Tensor
    response_ids: torch.Tensor
    top_ids: torch.Tensor
    top_logp: torch.Tensor
    temperature: float
    category: str = ""
    prompt: str = field(default="", repr=False)


def chat_ids(tokenizer, prompt: str) -> list[int]:
    """Token ids of ``prompt`` exactly as the engine encodes it (chat template with one user turn when
    the tokenizer has one; see ``engine.decoding.speculative.encode_prompt``)."""
    from engine.decoding.speculative import encode_prompt

    return encode_prompt(tokenizer, prompt, chat=True)


@torch.no_grad()
def generate_batch(model, prompt_ids: Sequence[Sequence[int]], temperatures: Sequence[float],
                   max_new_tokens: int, eos_ids: set[int], pad_id: int, top_k: int = 32,
                   generator: torch.Generator | None = None) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Decode a left-padded batch with a KV cache, keeping the target's top-k at every step.

    Rows that finish (EOS) are dropped from the batch and from the KV cache, so late steps cost less.

    Args:
        model: the target (a transformers causal LM).
        prompt_ids: B token-id lists.
        temperatures: B temperatures; 0 means greedy (argmax).
        max_new_tokens: answer length cap.
        eos_ids: ids that end an answer (kept as the last answer token).
        pad_id: id used for left padding (masked out).
        top_k: how many of p's largest log-probabilities to keep per position.

    Returns:
        B tuples (response_ids (R,), top_ids (R, k) int32, top_logp (R, k) float16).
    """
    from transformers import DynamicCache

    B = len(prompt_ids)
    L = max(len(p) for p in prompt_ids)
    ids = torch.full((B, L), pad_id, dtype=torch.long)
    mask = torch.zeros((B, L), dtype=torch.long)
    for i, p in enumerate(prompt_ids):
        ids[i, L - len(p):] = torch.tensor(p)
        mask[i, L - len(p):] = 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    temps = torch.tensor([float(t) for t in temperatures])
    cache = DynamicCache()
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True,
                logits_to_keep=1)
    logits = out.logits[:, -1].float()
    rows = torch.arange(B)  # original row index of each live row
    toks: list[list[int]] = [[] for _ in range(B)]
    tids: list[list[torch.Tensor]] = [[] for _ in range(B)]
    tlps: list[list[torch.Tensor]] = [[] for _ in range(B)]
    last_pos = pos[:, -1:]
    eos = torch.tensor(sorted(eos_ids))
    for _ in range(max_new_tokens):
        logp = torch.log_softmax(logits, dim=-1)
        tv, ti = logp.topk(top_k, dim=-1)
        t = temps[rows]
        greedy = logits.argmax(-1)
        safe_t = torch.where(t > 0, t, torch.ones_like(t))
        probs = torch.softmax(logits / safe_t[:, None], dim=-1)
        # inverse-CDF sampling (torch.multinomial's exponential draws over 49k ids cost ~90 ms a step)
        u = torch.rand((probs.shape[0], 1), generator=generator, dtype=torch.float64)
        cdf = probs.double().cumsum(-1)
        sampled = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(-1).clamp(max=probs.shape[-1] - 1)
        nxt = torch.where(t > 0, sampled, greedy)
        for j, r in enumerate(rows.tolist()):
            toks[r].append(int(nxt[j]))
            tids[r].append(ti[j].to(torch.int32))
            tlps[r].append(tv[j].to(torch.float16))
        done = torch.isin(nxt, eos)
        keep = (~done).nonzero().squeeze(-1)
        if keep.numel() == 0:
            break
        if keep.numel() < rows.numel():
            cache.batch_select_indices(keep)
            rows, nxt, mask, last_pos = rows[keep], nxt[keep], mask[keep], last_pos[keep]
        mask = torch.cat([mask, torch.ones((mask.shape[0], 1), dtype=mask.dtype)], dim=1)
        last_pos = last_pos + 1
        out = model(input_ids=nxt[:, None], attention_mask=mask, position_ids=last_pos, cache=cache,
                    use_cache=True)
        logits = out.logits[:, -1].float()
    return [(torch.tensor(toks[r], dtype=torch.long), torch.stack(tids[r]), torch.stack(tlps[r]))
            for r in range(B)]


def generate_samples(model, tokenizer, prompts: list[dict], eos_ids: set[int], *, greedy_fraction: float = 0.4,
                     temperature: float = 0.8, max_new_tokens: int = 192, batch_size: int = 48, top_k: int = 32,
                     seed: int = 0, progress: Callable[[str], None] | None = print,
                     time_budget_s: float | None = None) -> list[Sample]:
    """The target's answers to ``prompts``: a ``greedy_fraction`` of them greedy, the rest sampled.

    Prompts are sorted by length and decoded in batches (see ``generate_batch``). Stops early, keeping
    what is done, once ``time_budget_s`` seconds have passed.

    Returns:
        one Sample per decoded prompt (fewer than ``len(prompts)`` if the time budget ran out).
    """
    if not prompts:
        raise InputError("No prompts to generate from.")
    r = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    items = []
    for p in prompts:
        t = 0.0 if r.random() < greedy_fraction else temperature
        items.append((chat_ids(tokenizer, p["prompt"]), t, p))
    order = sorted(range(len(items)), key=lambda i: len(items[i][0]))
    batches = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    r.shuffle(batches)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos_ids)
    samples: list[Sample] = []
    t0, ntok = time.perf_counter(), 0
    for bi, b in enumerate(batches):
        res = generate_batch(model, [items[i][0] for i in b], [items[i][1] for i in b], max_new_tokens,
                             eos_ids, pad, top_k=top_k, generator=gen)
        for i, (resp, ti, tl) in zip(b, res):
            ids, t, p = items[i]
            samples.append(Sample(torch.tensor(ids), resp, ti, tl, t, p["category"], p["prompt"]))
            ntok += len(resp)
        el = time.perf_counter() - t0
        if progress:
            progress(f"[data] batch {bi + 1}/{len(batches)}: {len(samples)} answers, {ntok} answer tokens, "
                     f"{ntok / el:.0f} tok/s, {el / 60:.1f} min")
        if time_budget_s is not None and el > time_budget_s:
            if progress:
                progress(f"[data] time budget of {time_budget_s:.0f} s reached; stopping early")
            break
    return samples


def save_samples(samples: list[Sample], path) -> None:
    """Save samples as one torch file (plain tensors and lists; load with ``load_samples``)."""
    torch.save([{"prompt_ids": s.prompt_ids, "response_ids": s.response_ids, "top_ids": s.top_ids,
                 "top_logp": s.top_logp, "temperature": s.temperature, "category": s.category,
                 "prompt": s.prompt} for s in samples], path)


def load_samples(path) -> list[Sample]:
    """Inverse of ``save_samples``."""
    return [Sample(**d) for d in torch.load(path, weights_only=True)]
