"""`dilaserve predictor collect|train|calibrate`: the learned step predictor of a model."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tqdm import tqdm

from dilaserve.cli.args import floats
from dilaserve.cli.common import add_model_arguments, load_model_from_args, model_dir


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "predictor",
        help="collect traces, train the LightGBM step predictor, calibrate the mean-rate table",
        description=(
            "The remaining-step predictor of a served model (DESIGN §3): `collect` decodes a "
            "prompt set under every threshold (and with τ switched mid-request) and records "
            "each step's features and true remaining steps to Parquet; `train` fits the "
            "LightGBM boosters and saves them as predictor.txt and predictor_recompute.txt "
            "in the checkpoint directory; `calibrate` measures tokens per step per τ and "
            "saves predictor_rates.json, the fallback of a model without boosters."
        ),
    )
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)

    c = actions.add_parser("collect", help="decode prompts and record features + labels")
    c.add_argument("--out", required=True, help="Parquet file to write")
    _add_decode_arguments(c)
    c.add_argument(
        "--switched-runs",
        type=int,
        default=4,
        help="runs per prompt whose τ switches mid-request, besides one run per threshold",
    )
    c.add_argument("--max-switch-step", type=int, default=4, help="switch after 1..N steps")
    c.set_defaults(run=run_collect)

    t = actions.add_parser("train", help="fit the boosters, print held-out error, save them")
    t.add_argument("--data", required=True, help="Parquet file written by `collect`")
    t.add_argument(
        "--out",
        default=None,
        help="directory for predictor.txt and predictor_recompute.txt (default: --model's)",
    )
    t.add_argument("--model", default=None, help="checkpoint directory (default: dilaserve-tiny)")
    t.add_argument("--num-leaves", type=int, default=31)
    t.add_argument("--max-depth", type=int, default=6)
    t.add_argument("--learning-rate", type=float, default=0.3)
    t.add_argument("--max-rounds", type=int, default=20, help="most trees")
    t.add_argument("--heldout", type=float, default=0.2, help="share of prompts held out")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--json", action="store_true", help="print the result as one JSON object")
    t.set_defaults(run=run_train)

    k = actions.add_parser("calibrate", help="measure tokens per step per τ (mean-rate table)")
    k.add_argument(
        "--data", default=None, help="use the fixed-τ runs of a collected file instead of decoding"
    )
    k.add_argument(
        "--out", default=None, help="JSON file to write (default: predictor_rates.json in --model)"
    )
    _add_decode_arguments(k)
    k.set_defaults(run=run_calibrate)

    g = actions.add_parser(
        "progress", help="the simulator's progress model from traces and measured accuracy"
    )
    g.add_argument("--data", required=True, help="Parquet file written by `collect`")
    g.add_argument("--eval", required=True, help="`dilaserve eval --json` output (accuracy per τ)")
    g.add_argument(
        "--out", default=None, help="JSON file to write (default: progress.json in --model)"
    )
    g.add_argument("--model", default=None, help="checkpoint directory (default: dilaserve-tiny)")
    g.set_defaults(run=run_progress)


def _add_decode_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--prompts",
        default=None,
        help='JSON-lines file of {"prompt": ..., "max_tokens": ...} (default: the '
        "dilaserve-tiny task suite)",
    )
    p.add_argument("--n", type=int, default=600, help="task-suite prompts to draw")
    p.add_argument("--seed", type=int, default=20_260_612, help="seed of the drawn prompts")
    p.add_argument("--thresholds", type=floats, default=(0.5, 0.6, 0.7, 0.8, 0.9, 1.0))
    p.add_argument(
        "--cache",
        choices=["none", "prefix", "dual", "block"],
        help="default: dual, or block for a block diffusion model",
    )
    p.add_argument(
        "--block-length", type=int, help="default: 32, or a block diffusion model's block"
    )
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    add_model_arguments(p)


def _decode(args: argparse.Namespace, switched_runs: int, max_switch_step: int = 4):
    from dilaserve.models import load_tokenizer
    from dilaserve.predictor.collect import CollectConfig, collect, load_prompts, tiny_prompts
    from dilaserve.worker.runner import StepRunner

    if args.n <= 0:
        raise ValueError("--n must be positive")
    model = load_model_from_args(args)
    block = model.config.block_size
    config = CollectConfig(
        thresholds=tuple(args.thresholds),
        switched_runs=switched_runs,
        max_switch_step=max_switch_step,
        block_length=args.block_length or block or 32,
        batch_size=args.batch_size,
        cache=args.cache or ("block" if block else "dual"),
        seed=args.seed,
    )
    prompts = load_prompts(args.prompts) if args.prompts else tiny_prompts(args.n, args.seed)
    runner = StepRunner(model, cache=config.cache, max_requests=args.batch_size)
    runs = len(prompts) * (len(config.thresholds) + config.switched_runs)
    with tqdm(total=runs, disable=args.quiet, file=sys.stderr, unit="run") as bar:
        return collect(runner, load_tokenizer(model_dir(args)), prompts, config, bar.update)


def run_collect(args: argparse.Namespace) -> int:
    from dilaserve.predictor.collect import save

    table = _decode(args, args.switched_runs, args.max_switch_step)
    path = save(table, args.out)
    print(f"{table.num_rows} request states saved to {path}")
    return 0


def run_train(args: argparse.Namespace) -> int:
    from dilaserve.predictor.collect import load, recorded_config
    from dilaserve.predictor.evaluate import (
        best_interval,
        refresh_errors,
        row_predictor,
        sorted_by_run,
    )
    from dilaserve.predictor.features import BLOCK_FEATURES, FEATURE_NAMES
    from dilaserve.predictor.native import GbmPredictor
    from dilaserve.predictor.train import TrainConfig, train

    table = load(args.data)
    # Under the exact block cache, what is left is blocks times their steps.
    exact = recorded_config(table).get("cache") == "block"
    config = TrainConfig(
        features=FEATURE_NAMES + BLOCK_FEATURES if exact else FEATURE_NAMES,
        num_leaves=args.num_leaves,
        max_depth=args.max_depth,
        learning_rate=args.learning_rate,
        max_rounds=args.max_rounds,
        heldout=args.heldout,
        seed=args.seed,
    )
    result = train(table, config)
    out = Path(args.out or model_dir(args))
    total, recompute = result.save(out)
    by_interval = refresh_errors(
        sorted_by_run(table.filter(result.split.heldout)),
        row_predictor(table.filter(result.split.heldout), GbmPredictor.load(total)),
    )
    trees = {"total": result.total.best_iteration or result.total.num_trees()}
    if result.recompute is not None:
        trees["recompute"] = result.recompute.best_iteration or result.recompute.num_trees()
    saved = [str(p) for p in (total, recompute) if p is not None]
    summary = {
        "heldout": {k: e.to_dict() for k, e in result.heldout.items()},
        "refresh": {str(k): e.to_dict() for k, e in by_interval.items()},
        "predict_every": best_interval(by_interval),
        "trees": trees,
        "saved": saved,
    }
    if args.json:
        print(json.dumps(summary))
        return 0
    labels = {
        "total": "remaining steps",
        "recompute": "recompute steps (booster)",
        "recompute_structural": "recompute steps (one per block)",
    }
    for target, e in result.heldout.items():
        print(
            f"held-out {labels[target]}: MAE {e.mae:.4f}, MAPE {100 * e.mape:.2f} % "
            f"({e.n} request states)"
        )
    if result.recompute is None:
        print("recompute booster not kept: counting blocks is at least as accurate")
    steps = ", ".join(f"every {k}: {e.mae:.3f}" for k, e in by_interval.items())
    print(f"held-out MAE as the scheduler sees it, by refresh interval: {steps}")
    print(
        f"Policy.predict_every for this model: {summary['predict_every']} (the largest "
        "interval within 5 % of refreshing every step)"
    )
    print(f"saved {', '.join(saved)} ({trees['total']} trees)")
    return 0


def run_calibrate(args: argparse.Namespace) -> int:
    from dilaserve.predictor.calibrate import RATES_FILE, rates_from_table
    from dilaserve.predictor.collect import load

    table = load(args.data) if args.data else _decode(args, switched_runs=0)
    rates = rates_from_table(table, args.thresholds)
    path = rates.save(args.out or Path(model_dir(args)) / RATES_FILE)
    for tau, rate in rates.points:
        print(f"τ = {tau:.2f}: {rate:.2f} tokens per step")
    print(f"saved {path}")
    return 0


def run_progress(args: argparse.Namespace) -> int:
    from dilaserve.predictor import progress
    from dilaserve.predictor.collect import load, recorded_config

    table = load(args.data)
    cache = recorded_config(table).get("cache")
    rows = [json.loads(line) for line in Path(args.eval).read_text().splitlines() if line]
    # The accuracy of the cache mode the traces were decoded with.
    accuracy = {r["threshold"]: r["accuracy"] for r in rows if r["cache"] == cache}
    if not accuracy:
        raise ValueError(f"{args.eval} has no rows of the traces' cache mode {cache!r}")
    directory = Path(model_dir(args))
    model = progress.progress_model(table, accuracy, model=directory.name)
    path = progress.save(model, args.out or directory / "progress.json")
    print(f"saved {path}")
    return 0
