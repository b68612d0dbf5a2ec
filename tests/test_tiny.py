"""dilaserve-tiny: task suite, tokenizer, training objective, and the commands."""

from __future__ import annotations

import json
import random
from dataclasses import replace

import pytest
import torch

from dilaserve.cli import build_parser
from dilaserve.cli.train_tiny import run_config
from dilaserve.models import load_model, load_tokenizer
from dilaserve.tiny import MOE_MODEL_NAME, default_model_dir, model_path, tasks
from dilaserve.tiny.evaluate import EVAL_SEED, decode_problems
from dilaserve.tiny.tokenizer import (
    EOS_ID,
    MASK_ID,
    PAD_ID,
    UnknownCharacterError,
    decode,
    encode,
    save_tokenizer,
)
from dilaserve.tiny.train import (
    TINY_MOE,
    BatchStream,
    Example,
    TrainConfig,
    Trainer,
    build_model,
    collate,
    export,
    make_example,
    one_noisy_block,
)
from dilaserve.worker.runner import StepRunner

# -- task suite ---------------------------------------------------------------------------


def test_problems_are_reproducible_and_their_answers_check():
    first, second = tasks.make_problems(400, seed=3), tasks.make_problems(400, seed=3)
    assert first == second
    assert {p.task for p in first} == set(tasks.GENERATORS)
    for p in first:
        assert tasks.check(p, p.answer), p
        assert len(p.answer) <= p.max_tokens, p
        assert p.prompt[-1] in "=>"


def test_answers_reach_128_tokens():
    longest = max(len(p.answer) for p in tasks.make_problems(2000, seed=1, tasks=("tr",)))
    assert longest >= 128


def test_evaluation_problems_differ_from_training_stream():
    """Held-out problems are new, except `rep`'s: it has a few thousand prompts in all."""
    training = {p.prompt for p in tasks.make_problems(2000, seed=TrainConfig().seed)}
    held_out = [p for p in tasks.make_problems(500, seed=EVAL_SEED) if p.task != "rep"]
    assert held_out and not any(p.prompt in training for p in held_out)


def test_rep_accepts_one_listed_letter_written_throughout_only():
    problem = tasks.Problem("rep", "rep:ab>", "a" * tasks.REP_LENGTH, tasks.REP_LENGTH)
    assert tasks.check(problem, "b" * tasks.REP_LENGTH)
    assert not tasks.check(problem, "aaaabbbb")  # positions that settled on different letters
    assert not tasks.check(problem, "c" * tasks.REP_LENGTH)
    assert not tasks.check(problem, "a" * (tasks.REP_LENGTH - 1))


def test_rep_prompts_offer_two_and_three_way_choices():
    """Top shares 1/2 (the tie a threshold of 1/2 breaks badly), 1/3 and 2/3."""
    shares = set()
    for p in tasks.make_problems(200, seed=4, tasks=("rep",)):
        listed = p.prompt[len("rep:") : -1]
        shares.add(max(listed.count(c) for c in listed) / len(listed))
    assert shares == {1 / 2, 1 / 3, 2 / 3}


def test_draw_accepts_one_letter_of_each_column():
    problem = tasks.Problem("draw", "draw:ace,bce,ade>", "ace", 3)
    assert tasks.check(problem, "bde")
    assert not tasks.check(problem, "dbe")  # each letter from its own column
    assert not tasks.check(problem, "ab")


def test_draw_columns_offer_every_level_of_ambiguity():
    """Top shares 1, 3/4 and 1/2: the thresholds between 0.5 and 0.9 each matter."""
    shares = set()
    for p in tasks.make_problems(200, seed=6, tasks=("draw",)):
        rows = p.prompt[len("draw:") : -1].split(",")
        assert len(rows) == tasks.DRAW_ROWS and {len(r) for r in rows} == {tasks.DRAW_LENGTH}
        for column in zip(*rows, strict=True):
            shares.add(max(column.count(c) for c in column) / tasks.DRAW_ROWS)
    assert shares == {1.0, 0.75, 0.5}


def test_deterministic_tasks_need_the_exact_answer():
    problem = tasks.Problem("add", "12345+67890=", "80235", 6)
    assert tasks.check(problem, "80235")
    assert not tasks.check(problem, "080235")
    assert not tasks.check(problem, "80236")


# -- tokenizer ----------------------------------------------------------------------------


def test_saved_tokenizer_loads_through_transformers_and_agrees(tmp_path):
    save_tokenizer(tmp_path, max_length=512)
    tokenizer = load_tokenizer(tmp_path)
    assert (tokenizer.eos_token_id, tokenizer.pad_token_id) == (EOS_ID, PAD_ID)
    assert tokenizer.mask_token_id == MASK_ID
    for p in tasks.make_problems(50, seed=5):
        text = p.prompt + p.answer
        assert tokenizer(text, add_special_tokens=False)["input_ids"] == encode(text)
        assert tokenizer.decode(encode(text) + [EOS_ID, EOS_ID], skip_special_tokens=True) == text


def test_encode_rejects_characters_outside_the_alphabet():
    with pytest.raises(UnknownCharacterError, match="alphabet"):
        encode("12+Ab=")


# -- training objective -------------------------------------------------------------------


def test_collate_masks_answer_positions_only_and_weights_by_inverse_ratio():
    rng = random.Random(0)
    examples = [make_example(p, rng) for p in tasks.make_problems(256, seed=2)]
    clean, noisy, valid, masked, weight = collate(examples, torch.Generator().manual_seed(0))
    for i, e in enumerate(examples):
        assert not masked[i, : e.answer_start].any()  # the prompt is never noised
        assert not masked[i, len(e.ids) :].any()  # nor the padding
        assert valid[i].sum() == len(e.ids)
    assert torch.equal(noisy[masked], torch.full_like(noisy[masked], MASK_ID))
    assert torch.equal(noisy[~masked], clean[~masked])
    # 1/p weighting: the expected weighted count of masked answer positions per example is 1,
    # whatever its mask ratio, so the batch's total weight is about one.
    assert weight[~masked].abs().sum() == 0
    assert 0.8 < float(weight.sum()) < 1.25


def test_a_block_diffusion_example_trains_one_block_over_a_clean_prefix():
    """Block-causal training: each example is cut at the end of one whole block that
    decoding produces (none past the block of the first EOS), and only that block's answer
    positions are noised."""
    rng = random.Random(0)
    examples = [make_example(p, rng) for p in tasks.make_problems(64, seed=3)]
    generator = torch.Generator().manual_seed(0)
    cut = [one_noisy_block(e, 8, generator) for e in examples]
    for e, c in zip(examples, cut, strict=True):
        first_eos = e.ids.index(EOS_ID, e.answer_start)
        kept = min(len(c.ids), len(e.ids))
        assert e.ids[:kept] == c.ids[:kept] and set(c.ids[kept:]) <= {EOS_ID}
        assert len(c.ids) % 8 == 0  # a whole block, padded with EOS where the example ends
        assert c.answer_start >= e.answer_start and c.answer_start < len(c.ids)
        assert (len(c.ids) - 1) // 8 == c.answer_start // 8  # the loss lies in one block
        assert c.answer_start // 8 <= first_eos // 8  # never a block of EOS padding alone
    assert len({len(c.ids) for c in cut}) > 1
    _, _, _, masked, _ = collate(examples, torch.Generator().manual_seed(1), block=8)
    for i in range(len(examples)):
        positions = masked[i].nonzero().flatten().tolist()
        assert len({p // 8 for p in positions}) <= 1


def test_the_moe_run_trains_a_block_diffusion_model_and_balances_its_routers(tmp_path):
    cfg = small_moe_config(batch_tokens=512, steps=4, save_every=4, router_bias_rate=0.01)
    trainer = Trainer(cfg, tmp_path)
    trainer.run()
    model = load_model(tmp_path / "checkpoint")
    assert model.config.family == "llada2" and model.config.block_size == 8
    assert model.config.moe.num_experts == 8 and model.config.moe.first_dense == 1
    bias = model.layers[1].mlp.router.expert_bias
    # Moved by ±rate per step towards equal load: over- and under-used experts both.
    assert bias.abs().max() > 0 and (bias > 0).any() and (bias < 0).any()


def test_first_steps_train_the_solo_task_alone():
    stream = BatchStream(small_config(solo_steps=3, pool_size=256), random.Random(0))

    def task_names(batches: list[list[Example]]) -> set[str]:
        prompts = [decode(e.ids[: e.answer_start]) for batch in batches for e in batch]
        return {p.split(":")[0] if ":" in p else "add" for p in prompts}

    assert task_names([stream.next_batch(0), *stream.pending]) == {"add"}
    stream.pending.clear()
    assert task_names([stream.next_batch(3), *stream.pending]) == set(tasks.GENERATORS)


def small_config(**overrides) -> TrainConfig:
    """A model and batches small enough to train a few steps in a test, on one thread."""
    settings = {"d_model": 32, "n_layers": 1, "n_heads": 2, "mlp_hidden_size": 64}
    return TrainConfig(**{**settings, "batch_tokens": 512, "threads": 1, **overrides})


def small_moe_config(**overrides) -> TrainConfig:
    """`small_config`'s sizes for the MoE run: two layers, the first dense, experts of 16."""
    settings = {"d_model": 32, "n_layers": 2, "n_heads": 2, "mlp_hidden_size": 64}
    return replace(TINY_MOE, **{**settings, "expert_hidden_size": 16, **overrides})


def test_resumed_training_matches_an_uninterrupted_run(tmp_path):
    cfg = small_config(steps=6, save_every=3, log_every=3)
    straight = Trainer(cfg, tmp_path / "straight")
    straight.run()
    Trainer(cfg, tmp_path / "resumed").run(until=3)
    log = tmp_path / "resumed" / Trainer.LOG_FILE
    with log.open("a") as f:  # a record logged after the last save, then interrupted
        f.write(json.dumps({"step": 4, "loss": 9.0}) + "\n")
    resumed = Trainer(cfg, tmp_path / "resumed")
    assert resumed.resume() and resumed.step == 3
    resumed.run()
    for name, tensor in straight.model.state_dict().items():
        assert torch.equal(tensor, resumed.model.state_dict()[name]), name
    logged = [json.loads(line) for line in log.read_text().splitlines()]
    straight_log = (tmp_path / "straight" / Trainer.LOG_FILE).read_text().splitlines()
    assert [r["step"] for r in logged] == [json.loads(line)["step"] for line in straight_log]
    exported = load_model(tmp_path / "resumed" / "checkpoint")
    assert exported.config.family == "llada" and exported.config.num_layers == 1


def test_training_lowers_the_loss(tmp_path):
    cfg = small_config(
        d_model=64,
        n_layers=2,
        mlp_hidden_size=128,
        batch_tokens=1024,
        steps=150,
        warmup_steps=10,
        save_every=150,
        log_every=25,
    )
    Trainer(cfg, tmp_path).run()
    log = [json.loads(line) for line in (tmp_path / Trainer.LOG_FILE).read_text().splitlines()]
    assert log[-1]["loss"] < 0.8 * log[0]["loss"]


# -- the commands, on a freshly initialised checkpoint ------------------------------------


@pytest.fixture(scope="module")
def untrained_dir(tmp_path_factory):
    """A dilaserve-tiny-format checkpoint (config, weights, tokenizer) with random weights."""
    directory = tmp_path_factory.mktemp("untrained")
    cfg = small_config()
    export(build_model(cfg, torch.Generator().manual_seed(0)), directory)
    return directory


def test_exported_checkpoint_loads_like_a_released_llada(untrained_dir):
    config = json.loads((untrained_dir / "config.json").read_text())
    assert config["model_type"] == "llada" and config["architectures"] == ["LLaDAModelLM"]
    model, tokenizer = load_model(untrained_dir), load_tokenizer(untrained_dir)
    assert model.config.mask_token_id == tokenizer.mask_token_id == MASK_ID
    assert next(model.parameters()).dtype == torch.float32  # bf16 on disk, fp32 by default


def test_generate_command_honours_its_decoding_flags(capsys, untrained_dir):
    from dilaserve.cli import main

    args = ["generate", "12+34=", "--model", str(untrained_dir), "--max-tokens", "8"]
    assert main([*args, "--block-length", "4", "--threshold", "1.0", "--stats"]) == 0
    out, err = capsys.readouterr()
    assert len(out.strip()) <= 8
    steps = int(err.split("steps=")[1].split()[0])
    assert 1 <= steps <= 8  # τ = 1.0 commits one position per step, at most 8 of them


def test_generate_command_rejects_unknown_characters(capsys, untrained_dir):
    from dilaserve.cli import main

    assert main(["generate", "12+AB=", "--model", str(untrained_dir)]) == 2
    assert "cannot represent" in capsys.readouterr().err


def test_eval_command_prints_one_json_object_per_cell(capsys, tmp_path, untrained_dir):
    from dilaserve.cli import main

    plot = tmp_path / "eval.png"
    args = ["eval", "--json", "--n", "6", "--thresholds", "0.7,0.9", "--caches", "dual"]
    assert main([*args, "--model", str(untrained_dir), "--plot", str(plot)]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["threshold"], r["cache"]) for r in rows] == [(0.7, "dual"), (0.9, "dual")]
    fields = {
        "threshold",
        "cache",
        "accuracy",
        "mean_steps",
        "tokens_per_step",
        "tokens_per_s",
        "n",
    }
    assert all(set(r) == fields and r["n"] == 6 for r in rows)
    assert plot.stat().st_size > 0


def test_eval_of_a_block_diffusion_model_compares_its_exact_cache_with_none(capsys, tmp_path):
    from dilaserve.cli import main

    export(build_model(small_moe_config(), torch.Generator()), tmp_path)
    args = ["eval", "--json", "--n", "4", "--thresholds", "0.9", "--model", str(tmp_path)]
    assert main(args) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["cache"] for r in rows] == ["none", "block"]
    # The exact cache decodes the same tokens: the same accuracy and steps.
    assert rows[0]["accuracy"] == rows[1]["accuracy"]
    assert rows[0]["mean_steps"] == rows[1]["mean_steps"]
    assert main([*args, "--caches", "dual"]) == 2
    assert "choose from ['none', 'block']" in capsys.readouterr().err


def test_eval_command_decodes_only_the_tasks_asked_for(capsys, untrained_dir, monkeypatch):
    from dilaserve.cli import eval as eval_cli
    from dilaserve.cli import main

    decoded: list[str] = []

    def spy(model, tokenizer, problems, **kwargs):
        decoded.extend(p.task for p in problems)
        return sweep(model, tokenizer, problems, **kwargs)

    sweep = eval_cli.sweep
    monkeypatch.setattr(eval_cli, "sweep", spy)
    args = ["eval", "--json", "--n", "5", "--thresholds", "0.9", "--caches", "none"]
    assert main([*args, "--tasks", "add", "--model", str(untrained_dir)]) == 0
    assert decoded == ["add"] * 5
    assert json.loads(capsys.readouterr().out)["n"] == 5
    assert main([*args, "--tasks", "sum", "--model", str(untrained_dir)]) == 2
    assert "unknown tasks ['sum']" in capsys.readouterr().err


def test_eval_command_writes_no_plot_unless_asked(capsys, tmp_path, untrained_dir, monkeypatch):
    from dilaserve.cli import main

    monkeypatch.chdir(tmp_path)
    args = ["eval", "--json", "--n", "2", "--thresholds", "0.9", "--caches", "none"]
    assert main([*args, "--model", str(untrained_dir)]) == 0
    assert list(tmp_path.iterdir()) == []


# -- the shipped model --------------------------------------------------------------------


def test_model_names_resolve_to_the_embedded_checkpoints_unless_a_directory_exists(
    tmp_path, monkeypatch
):
    assert model_path(None) == str(default_model_dir())
    assert model_path(MOE_MODEL_NAME) == str(default_model_dir(MOE_MODEL_NAME))
    assert model_path("some/dir") == "some/dir"
    monkeypatch.chdir(tmp_path)
    (tmp_path / MOE_MODEL_NAME).mkdir()
    assert model_path(MOE_MODEL_NAME) == MOE_MODEL_NAME
    with pytest.raises(ValueError, match="no embedded model"):
        default_model_dir("dilaserve-huge")


def test_shipped_model_is_a_small_llada_checkpoint():
    directory = default_model_dir()
    config = json.loads((directory / "config.json").read_text())
    assert config["model_type"] == "llada"
    assert sum(f.stat().st_size for f in directory.iterdir()) <= 25_000_000


def test_shipped_model_answers_held_out_problems_and_lower_tau_takes_fewer_steps():
    model, tokenizer = load_model(default_model_dir()), load_tokenizer(default_model_dir())
    problems = tasks.make_problems(24, seed=EVAL_SEED)
    runner = StepRunner(model, cache="dual", max_requests=len(problems))
    strict, _ = decode_problems(runner, tokenizer, problems, threshold=0.9)
    loose, _ = decode_problems(runner, tokenizer, problems, threshold=0.5)
    assert sum(o.correct for o in strict) >= 20
    assert sum(o.steps for o in loose) < sum(o.steps for o in strict)


def test_generate_command_answers_with_the_shipped_model_by_default(capsys):
    from dilaserve.cli import main

    assert main(["generate", "12345+67890="]) == 0
    assert capsys.readouterr().out.strip() == "80235"


def test_train_tiny_keeps_each_models_own_settings_unless_a_flag_names_one():
    """The MoE run trains in fp32; a default `--bf16` used to override it (bf16 autocast is
    ten times slower on CPUs without AVX512-bf16)."""
    parser = build_parser()

    def config(*flags: str) -> TrainConfig:
        return run_config(parser.parse_args(["train-tiny", "--out", "x", *flags]))

    assert config("--model", "dilaserve-tiny-moe") == TINY_MOE
    assert config() == TrainConfig()
    assert config("--model", "dilaserve-tiny-moe", "--bf16").bf16
    assert not config("--no-bf16").bf16
    assert config("--steps", "7").steps == 7
