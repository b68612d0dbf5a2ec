"""The generated task suite dilaserve-tiny is trained and evaluated on.

Every problem has a checkable answer, and the suite is built so that committing many tokens
in one step (a low threshold τ) measurably causes mistakes, as it does for real diffusion LMs:

- `add`: five-digit addition; each digit of the sum depends on the carry chain below it;
- `tr`: copy-with-edits of 128 letters (the long answers: four 32-token blocks);
- `rep`: one of two or three listed letters, written eight times: every answer token must
  agree with the others; with two tied letters, positions committed in the same step can
  settle on different letters;
- `draw`: one letter from each of eight columns of four (`aaab` gives `a` 3/4, `b` 1/4):
  the columns are independent, so every choice is valid, but a choice whose top share is
  below τ waits for a step of its own: the task that makes steps fall as τ falls without
  errors.

Every task has one fixed layout (fixed widths), so that where an answer token's evidence
sits is a fixed relative offset: a tiny RoPE model learns that quickly, while variable
layouts took it far longer than the CPU budget of its training run.

A prompt ends with `=` or `>`; the answer is the text the model should generate (cut at
EOS). `Problem.max_tokens` bounds the answer's length from the prompt alone.
"""

from __future__ import annotations

import random
import string
from collections.abc import Callable
from dataclasses import dataclass

from dilaserve.protocol import whole_blocks

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


# Letter counts of a multiset of letters, each with its probability: ((2, 1), 0.2) is two of
# one letter and one of another, one time in five.
CountPatterns = tuple[tuple[tuple[int, ...], float], ...]


def _shuffled_letters(rng: random.Random, patterns: CountPatterns) -> list[str]:
    """Distinct random letters repeated by a pattern drawn from `patterns`, shuffled."""
    counts = rng.choices([c for c, _ in patterns], [w for _, w in patterns])[0]
    letters = rng.sample(LETTERS, len(counts))
    listed = [ch for ch, count in zip(letters, counts, strict=True) for _ in range(count)]
    rng.shuffle(listed)
    return listed


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


# The edits of `tr`: each vowel becomes the next one. A rule given in the prompt instead
# (`tr:xy:` for "every x becomes y") needs a two-hop lookup (find the rule letter matching
# the source letter, then read its replacement) that the tiny model did not learn within its
# CPU budget; a fixed rule is a copy plus a per-letter map, learned in a few hundred steps.
TR_EDITS = str.maketrans("aeiou", "eioua")


def translate(rng: random.Random) -> Problem:
    """Copy with edits: a text of 128 letters with every vowel made the next vowel
    (`a`→`e`→`i`→`o`→`u`→`a`), about one letter in five."""
    text = "".join(rng.choices(LETTERS, k=TR_LENGTH))
    return Problem("tr", f"tr:{text}>", text.translate(TR_EDITS), len(text))


REP_LENGTH = 8
# Candidate letters of a `rep` prompt with their probabilities: two tied letters (½ each),
# three tied letters (⅓ each), and a letter listed twice beside another (⅔ against ⅓).
REP_PATTERNS: CountPatterns = (((1, 1), 0.6), ((1, 1, 1), 0.2), ((2, 1), 0.2))


def repeat(rng: random.Random) -> Problem:
    """One of the listed letters written eight times (`rep:ab>` gives `aaaaaaaa` or
    `bbbbbbbb`): every answer token must agree with the others. With two tied letters each
    position's confidence is ½, so a threshold of ½ commits all of them in one step on
    whichever letter each position leans to, and a mixed answer is wrong; above ½ the
    first commit settles the letter and the rest follow it."""
    listed = _shuffled_letters(rng, REP_PATTERNS)
    choice = rng.choice(listed)
    return Problem("rep", f"rep:{''.join(listed)}>", choice * REP_LENGTH, REP_LENGTH)


DRAW_ROWS = 4
DRAW_LENGTH = 8
# Letter counts of a `draw` column over its DRAW_ROWS rows, with their probabilities: top
# shares 1, 3/4 and 1/2.
COLUMN_PATTERNS: CountPatterns = (((4,), 0.1), ((3, 1), 0.6), ((2, 2), 0.15), ((2, 1, 1), 0.15))


def draw(rng: random.Random) -> Problem:
    """Position i of the answer takes any letter of column i of four eight-letter rows
    (`draw:aabcde,abbcdf,...>`); the training answer takes a uniformly random row per column,
    so a calibrated model's confidence in a letter is its share of the column."""
    columns, answer = [], []
    for _ in range(DRAW_LENGTH):
        column = _shuffled_letters(rng, COLUMN_PATTERNS)
        columns.append(column)
        answer.append(rng.choice(column))
    rows = ["".join(row) for row in zip(*columns, strict=True)]
    return Problem("draw", f"draw:{','.join(rows)}>", "".join(answer), DRAW_LENGTH)


GENERATORS: dict[str, Callable[[random.Random], Problem]] = {
    "add": add,
    "tr": translate,
    "rep": repeat,
    "draw": draw,
}
# Share of each task in the held-out evaluation set (and by default in any problem set).
WEIGHTS: dict[str, float] = {"add": 0.30, "tr": 0.05, "rep": 0.30, "draw": 0.35}
# Share of each task in training, set by what it costs to learn rather than by the mix
# evaluated (as shares of the training tokens): `draw` 46 %, `add` 25 %, `tr` 19 % (its
# 270-token examples would otherwise take most of the compute), `rep` 10 %.
TRAINING_WEIGHTS: dict[str, float] = {"add": 0.42, "tr": 0.03, "rep": 0.21, "draw": 0.34}


def sample_problem(
    rng: random.Random,
    tasks: tuple[str, ...] | None = None,
    weights: dict[str, float] = WEIGHTS,
) -> Problem:
    names = tasks or tuple(GENERATORS)
    name = rng.choices(names, weights=[weights[n] for n in names])[0]
    return GENERATORS[name](rng)


def make_problems(n: int, seed: int, tasks: tuple[str, ...] | None = None) -> list[Problem]:
    """`n` problems drawn with `seed`: the same seed always gives the same list."""
    rng = random.Random(seed)
    return [sample_problem(rng, tasks) for _ in range(n)]


def gen_length(problem: Problem, block_length: int) -> int:
    """Output positions offered: the answer bound plus EOS, rounded up to whole blocks."""
    return whole_blocks(problem.max_tokens + 1, block_length)


def check(problem: Problem, answer: str) -> bool:
    """Whether `answer` is a valid answer to `problem` (any valid one, where several are)."""
    if problem.task == "rep":
        listed = problem.prompt[len("rep:") : -1]
        return len(answer) == REP_LENGTH and len(set(answer)) == 1 and answer[0] in listed
    if problem.task == "draw":
        columns = list(zip(*problem.prompt[len("draw:") : -1].split(","), strict=True))
        if len(answer) != len(columns):
            return False
        return all(a in column for a, column in zip(answer, columns, strict=True))
    return answer == problem.answer
