"""Decoding options of the runner: the fixed steps-per-block schedule, temperature with
Gumbel noise, and the checkpoint's stop tokens."""

from __future__ import annotations

import json

import pytest
import torch

from dilaserve.models import load_model, read_config
from dilaserve.protocol import RequestState, StepEntry
from dilaserve.worker import batch_decoding
from dilaserve.worker.runner import StepRunner
from dilaserve.worker.sampling import sample_tokens, token_probability, top_k_commit

BLOCK = 8


@pytest.fixture(scope="module")
def model(tiny_llada_dir):
    return load_model(tiny_llada_dir)


def _fixed_reference(model, prompt, gen_length, steps):
    """LLaDA's generate with low-confidence remasking: each block in `steps` steps, each
    committing its share of the block's most confident masked positions."""
    mask = model.config.mask_token_id
    x = torch.tensor(prompt + [mask] * gen_length)
    n = x.numel()
    share, extra = divmod(BLOCK, steps)
    for block in range(gen_length // BLOCK):
        lo = len(prompt) + block * BLOCK
        for step in range(steps):
            logits = model(x[None], torch.arange(n)[None], torch.ones(1, n, dtype=torch.bool))[0]
            logits[:, mask] = -torch.inf
            conf, x0 = torch.softmax(logits[lo : lo + BLOCK].float(), dim=-1).max(dim=-1)
            conf = torch.where(x[lo : lo + BLOCK] == mask, conf, -torch.inf)
            k = share + (step < extra)
            picked = torch.sort(conf, descending=True, stable=True).indices[:k]
            x[lo + picked] = x0[picked]
    return x[len(prompt) :].tolist()


def _decode(runner, prompt, gen_length, **options):
    mask = runner.config.mask_token_id
    state = RequestState.new(
        0, prompt, gen_length, block_length=BLOCK, mask_token_id=mask, **options
    )
    runner.add(state)
    steps = 0
    while not runner.state(0).done:
        runner.step([StepEntry(0, 0.9, runner.next_kind(0))])
        steps += 1
    return runner.release(0), steps


@pytest.mark.parametrize("steps", [1, 3, 8])
@pytest.mark.parametrize("cache", ["none", "dual"])
def test_fixed_schedule_matches_llada_generate(model, steps, cache):
    prompt = [3, 17, 42, 5, 9]
    runner = StepRunner(model, cache=cache, max_requests=1, max_seq_len=64)
    state, taken = _decode(runner, prompt, 2 * BLOCK, steps_per_block=steps)
    assert taken == 2 * steps  # τ is ignored: every block takes exactly `steps` steps
    if cache == "none":
        assert state.output_ids == _fixed_reference(model, prompt, 2 * BLOCK, steps)


def test_temperature_zero_is_the_argmax_and_sampling_repeats_per_seed(model):
    prompt = [3, 17, 42, 5, 9]
    greedy, _ = _decode(StepRunner(model, max_requests=1), prompt, 2 * BLOCK)
    cold, _ = _decode(StepRunner(model, max_requests=1), prompt, 2 * BLOCK, temperature=1e-9)
    hot = [
        _decode(StepRunner(model, max_requests=1), prompt, 2 * BLOCK, temperature=2.0)[0]
        for _ in range(2)
    ]
    assert cold.output_ids == greedy.output_ids
    assert hot[0].output_ids == hot[1].output_ids  # the runner's noise is seeded
    assert hot[0].output_ids != greedy.output_ids


def _decode_together(runner, prompts, gen_length, options):
    """Decodes requests with their own `options` in one batch; their final states."""
    mask = runner.config.mask_token_id
    for rid, (prompt, opts) in enumerate(zip(prompts, options, strict=True)):
        runner.add(
            RequestState.new(
                rid, prompt, gen_length, block_length=BLOCK, mask_token_id=mask, **opts
            )
        )
    active = list(range(len(prompts)))
    while active:
        report = runner.step([StepEntry(r, 0.9, runner.next_kind(r)) for r in active])
        active = [o.request_id for o in report.outputs if not o.done]
    return [runner.release(rid) for rid in range(len(prompts))]


@pytest.mark.parametrize(
    "options",
    [
        {"temperature": 1.5},
        {"temperature": 1.0, "alg": "origin"},
        {"alg": "entropy", "alg_temp": 0.5},
    ],
)
def test_a_seeded_request_decodes_the_same_in_any_batch_and_on_any_instance(model, options):
    """Its samples come from its own stream, not the runner's: other rows in the step (and
    how many positions they still have masked) and the runner's past steps change nothing,
    while another seed changes the tokens."""
    prompt = [3, 17, 42, 5, 9]
    seeded = {**options, "seed": 1234}

    def fresh():
        return StepRunner(model, max_requests=4, max_seq_len=64)

    alone, _ = _decode(fresh(), prompt, 2 * BLOCK, **seeded)
    busy = fresh()
    _decode(busy, [8, 8, 8], 2 * BLOCK, temperature=2.0)  # the runner's stream moves on
    batch = _decode_together(
        busy,
        [[7, 7], prompt, [1, 2, 3, 4, 5, 6], [11]],
        2 * BLOCK,
        [{"temperature": 2.0}, seeded, {**options, "seed": 99}, {}],
    )
    assert batch[1].output_ids == alone.output_ids
    reseeded, _ = _decode(fresh(), prompt, 2 * BLOCK, **{**options, "seed": 4321})
    assert reseeded.output_ids != alone.output_ids


def test_only_rows_with_options_go_through_the_full_vocabulary(model, monkeypatch):
    """One sampled row in a batch of argmax rows: the float64 noise and the sampler see
    that row alone (at a real vocabulary and batch, the whole batch's would be gigabytes),
    and the argmax rows commit exactly what they commit without it."""
    sampled_rows = []

    def spy(logits, *args):
        sampled_rows.append(logits.shape[0])
        return sample_tokens(logits, *args)

    monkeypatch.setattr(batch_decoding, "sample_tokens", spy)
    prompts = [[3, 17, 42, 5, 9], [7, 7], [1, 2, 3, 4, 5, 6]]
    runner = StepRunner(model, cache="dual", max_requests=3, max_seq_len=64)
    mixed = _decode_together(runner, prompts, 2 * BLOCK, [{}, {"temperature": 1.5}, {}])
    assert sampled_rows and set(sampled_rows) == {1}
    plain = _decode_together(runner, prompts, 2 * BLOCK, [{}, {}, {}])
    assert [mixed[i].output_ids for i in (0, 2)] == [plain[i].output_ids for i in (0, 2)]


def test_gumbel_samples_follow_the_softmax_with_noiseless_confidence():
    logits = torch.tensor([[[2.0, 1.0, 0.0, -torch.inf]]]).expand(1, 4000, 4)
    noise = torch.rand(
        logits.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(0)
    )
    x0 = sample_tokens(logits, torch.tensor([1.0]), None, noise)
    freq = torch.bincount(x0.flatten(), minlength=4).float() / x0.numel()
    torch.testing.assert_close(freq, torch.softmax(logits[0, 0], -1), atol=0.03, rtol=0)
    torch.testing.assert_close(
        token_probability(logits, x0), torch.softmax(logits, -1).gather(-1, x0[..., None])[..., 0]
    )
    x0 = sample_tokens(logits, torch.tensor([0.0]), None, noise)
    assert bool((x0 == 0).all())


def test_top_k_commit_takes_the_most_confident_lowest_position_first():
    confidence = torch.tensor([[0.5, 0.9, 0.5, 0.1], [0.2, 0.2, 0.2, 0.2]])
    candidate = torch.tensor([[True, False, True, True], [True, True, True, True]])
    got = top_k_commit(confidence, candidate, torch.tensor([2, 3]))
    assert got.tolist() == [[True, False, True, False], [True, True, True, False]]


def test_stop_tokens_come_from_the_generation_and_tokenizer_configs(tmp_path, tiny_llada_dir):
    import shutil

    directory = tmp_path / "instruct"
    shutil.copytree(tiny_llada_dir, directory)
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 11]}))
    tokenizer_config = json.loads((directory / "tokenizer_config.json").read_text())
    tokenizer_config.setdefault("added_tokens_decoder", {})["13"] = {"content": "<|eot_id|>"}
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    _, original = read_config(tiny_llada_dir)
    _, config = read_config(directory)
    # The tiny tokenizer already names <|eot_id|>, like LLaDA-8B-Instruct's.
    assert len(original.stop_token_ids) == 2 and original.eos_token_id in original.stop_token_ids
    assert set(config.stop_token_ids) == {7, 11, 13, *original.stop_token_ids}
    runner = StepRunner(load_model(directory), max_requests=1)
    state, _ = _decode(runner, [3, 4, 5], 4 * BLOCK, stop_token_ids=config.stop_token_ids)
    stop = state.stop_position
    assert stop is None or state.generated_ids() == state.output_ids[:stop]
