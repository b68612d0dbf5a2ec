"""The generated task suite dilaserve-tiny is trained and evaluated on.

Every problem has a checkable answer, and the suite is built so that committing many tokens
in one step (a low threshold τ) measurably causes mistakes, as it does for real diffusion LMs:

- `add`: multi-digit addition (3 or 5 digits); each digit depends on the carry chain below;
- `tr`: copy-with-edits of 32 or 128 letters (answers up to 128 tokens, four blocks);
- `pick`: any entry of a list of near-identical strings (two, three or more valid answers);
  where the per-position majority letters spell no entry, independent parallel commits mix
  entries into an invalid answer, below a threshold set by the majority's share;
- `perm`: any ordering of 3-5 distinct letters (n, n-1, ..., 2 valid continuations);
  two positions committed in the same step can repeat a letter;
- `draw`: one letter from each of 3-6 groups of four (`aaab` gives `a` 3/4, `b` 1/4): the
  groups are independent, so every choice is valid, but a choice whose top share is below τ
  waits for a step of its own: the task that makes steps fall as τ falls without errors.

Every task has a fixed layout per size (fixed widths, zero padding), so that where an answer
token's evidence sits is a fixed relative offset: a tiny RoPE model learns that quickly, while
variable layouts took it far longer than the CPU budget of its training run.

A prompt ends with `=` or `>`; the answer is the text the model should generate (cut at
EOS). `Problem.max_tokens` bounds the answer's length from the prompt alone.
"""

from __future__ import annotations

import random
import string
from collections.abc import Callable
from dataclasses import dataclass

LETTERS = string.ascii_lowercase
DIGITS = string.digits


@dataclass(frozen=True)
class Problem:
    task: str
    prompt: str
    answer: str  # one valid answer (the training target)
    max_tokens: int  # an upper bound on any valid answer's length, known from the prompt


# One layout per task: where an answer token's evidence sits is then a fixed offset, which a
# tiny RoPE model learns in a few hundred steps; mixing sizes (3- and 5-digit sums, texts of
# 32 and 128 letters) kept it from learning those tasks at all within the CPU budget.
ADD_WIDTH = 5
TR_LENGTH = 128
PERM_LETTERS = 5


def _width_number(rng: random.Random, width: int) -> int:
    """A number of exactly `width` digits."""
    return rng.randint(10 ** (width - 1), 10**width - 1)


def add(rng: random.Random) -> Problem:
    """`a+b=` with two five-digit numbers whose sum keeps five digits; each digit of the sum
    depends on the carry chain below it."""
    while True:
        a, b = _width_number(rng, ADD_WIDTH), _width_number(rng, ADD_WIDTH)
        if a + b < 10**ADD_WIDTH:
            return Problem("add", f"{a}+{b}=", str(a + b), ADD_WIDTH)


def translate(rng: random.Random) -> Problem:
    """Copy with edits: every `x` becomes `y` (`tr:xy:text>`), texts of 128 letters."""
    text = "".join(rng.choices(LETTERS, k=TR_LENGTH))
    x = rng.choice(text)
    y = rng.choice([c for c in LETTERS if c != x])
    return Problem("tr", f"tr:{x}{y}:{text}>", text.replace(x, y), len(text))


PICK_LENGTH = 5


def pick(rng: random.Random) -> Problem:
    """Any entry of a list of 2-6 five-letter strings; the training answer is a uniformly
    random slot of the list. The entries are variants of a hidden base string, each
    differing from it in one position, listed with repeats.

    Half of the lists hold the base in most slots: the per-position majority letters spell
    it, a valid answer. The other half spread the slots evenly over two or three variants
    and leave the base out: the majority letters (shares 1/2 to 4/5) spell the unlisted
    base, so committing them in one step produces an invalid answer, while committing one
    letter at a time settles on one entry.
    """
    slots = rng.randint(2, 6)
    base = rng.choices(LETTERS, k=PICK_LENGTH)
    spread = rng.random() < 0.5
    count = min(slots, rng.randint(2, 3)) if spread else rng.randint(1, 2)
    variants = []
    for position in rng.sample(range(PICK_LENGTH), count):
        variant = list(base)
        variant[position] = rng.choice([c for c in LETTERS if c != base[position]])
        variants.append("".join(variant))
    if spread:
        entries = [variants[i % count] for i in range(slots)]
    else:
        with_base = rng.randint(-(-slots // 2), slots - 1) if slots > 2 else 1
        entries = ["".join(base)] * with_base
        entries += [rng.choice(variants) for _ in range(slots - with_base)]
    rng.shuffle(entries)
    return Problem("pick", f"pick:{','.join(entries)}>", rng.choice(entries), PICK_LENGTH)


def permute(rng: random.Random) -> Problem:
    """Any ordering of five distinct letters (`perm:letters>`): 5, 4, 3, 2 valid choices for
    the successive letters; two positions committed at once can repeat a letter."""
    letters = "".join(rng.sample(LETTERS, PERM_LETTERS))
    answer = "".join(rng.sample(letters, len(letters)))
    return Problem("perm", f"perm:{letters}>", answer, len(letters))


DRAW_ROWS = 4
DRAW_LENGTH = 6
# Letter counts of a `draw` column over its DRAW_ROWS rows, with their probabilities: top
# shares 1, 3/4 and 1/2.
COLUMN_PATTERNS = (((4,), 0.15), ((3, 1), 0.55), ((2, 2), 0.15), ((2, 1, 1), 0.15))


def draw(rng: random.Random) -> Problem:
    """Position i of the answer takes any letter of column i of four six-letter rows
    (`draw:aabcde,abbcdf,...>`); the training answer takes a uniformly random row per column,
    so a calibrated model's confidence in a letter is its share of the column."""
    columns, answer = [], []
    for _ in range(DRAW_LENGTH):
        counts = rng.choices([c for c, _ in COLUMN_PATTERNS], [w for _, w in COLUMN_PATTERNS])[0]
        letters = rng.sample(LETTERS, len(counts))
        column = [ch for ch, count in zip(letters, counts, strict=True) for _ in range(count)]
        rng.shuffle(column)
        columns.append(column)
        answer.append(rng.choice(column))
    rows = ["".join(row) for row in zip(*columns, strict=True)]
    return Problem("draw", f"draw:{','.join(rows)}>", "".join(answer), DRAW_LENGTH)


GENERATORS: dict[str, Callable[[random.Random], Problem]] = {
    "add": add,
    "tr": translate,
    "pick": pick,
    "perm": permute,
    "draw": draw,
}
# Share of each task in training and evaluation.
WEIGHTS: dict[str, float] = {
    "add": 0.22,
    "tr": 0.10,
    "pick": 0.25,
    "perm": 0.15,
    "draw": 0.28,
}


def sample_problem(rng: random.Random, tasks: tuple[str, ...] | None = None) -> Problem:
    names = tasks or tuple(GENERATORS)
    name = rng.choices(names, weights=[WEIGHTS[n] for n in names])[0]
    return GENERATORS[name](rng)


def make_problems(n: int, seed: int, tasks: tuple[str, ...] | None = None) -> list[Problem]:
    """`n` problems drawn with `seed`: the same seed always gives the same list."""
    rng = random.Random(seed)
    return [sample_problem(rng, tasks) for _ in range(n)]


def check(problem: Problem, answer: str) -> bool:
    """Whether `answer` is a valid answer to `problem` (any valid one, where several are)."""
    if problem.task == "pick":
        entries = problem.prompt[len("pick:") : -1].split(",")
        return answer in entries
    if problem.task == "perm":
        return sorted(answer) == sorted(problem.prompt[len("perm:") : -1])
    if problem.task == "draw":
        columns = list(zip(*problem.prompt[len("draw:") : -1].split(","), strict=True))
        if len(answer) != len(columns):
            return False
        return all(a in column for a, column in zip(answer, columns, strict=True))
    return answer == problem.answer
