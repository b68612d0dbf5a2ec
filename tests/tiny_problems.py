"""Task problems for serving tests, and their reference answers decoded alone."""

from __future__ import annotations

from functools import cache

from dilaserve.models import encode_prompt, load_model, load_tokenizer
from dilaserve.tiny import default_model_dir
from dilaserve.tiny.tasks import Problem, check, gen_length, make_problems
from dilaserve.worker.generate import Generation, generate
from dilaserve.worker.runner import StepRunner

#: τ the fault and load tests pin, so that a right answer is the reference's answer.
PINNED_TAU = 0.9


@cache
def _runner_and_tokenizer():
    model = load_model(default_model_dir())
    return StepRunner(model, cache="dual", max_requests=1), load_tokenizer(default_model_dir())


def decode_alone(prompt: str, max_tokens: int, taus: tuple[float, ...], **options) -> Generation:
    """Decodes one prompt alone with the given τ at each step (and decoding `options`)."""
    runner, tokenizer = _runner_and_tokenizer()
    (g,) = generate(
        runner,
        [encode_prompt(tokenizer, prompt)],
        gen_length=max_tokens,
        threshold=lambda state: taus[state.steps_done],
        stop_at_eos=True,
        **options,
    )
    return g


def solvable(n: int, seed: int) -> list[Problem]:
    """`tr` (five blocks) and `add` problems the model answers right alone at τ 0.9, so
    that after any migration or restart a wrong answer is the serving system's fault."""
    _, tokenizer = _runner_and_tokenizer()
    problems = []
    for p in make_problems(4 * n, seed, tasks=("tr", "add")):
        length = gen_length(p, 32)
        ids = decode_alone(p.prompt, length, (PINNED_TAU,) * (length + 1)).output_ids
        if check(p, tokenizer.decode(ids, skip_special_tokens=True)):
            problems.append(p)
        if len(problems) == n:
            return problems
    raise AssertionError("too few solvable problems")
