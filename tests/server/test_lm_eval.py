"""lm-evaluation-harness against the server, as the README's recipe runs it: the
`local-completions` model (no tokenizer: prompts go as text, `--batch_size` > 1 sends
lists of prompts) on the local additions task, scored by exact match."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

lm_eval = pytest.importorskip("lm_eval")
from lm_eval.tasks import TaskManager  # noqa: E402

TASK = Path(__file__).parent / "data" / "lm_eval" / "additions.yaml"


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path):
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "HF_EVALUATE_OFFLINE"):
        monkeypatch.setenv(name, "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))


def task_config() -> dict:
    """The task file with its data path made absolute (the file names it relative to the
    repository root, where the README runs lm_eval)."""
    config = yaml.safe_load(TASK.read_text())
    data = TASK.parent / Path(config["dataset_kwargs"]["data_files"]["test"]).name
    config["dataset_kwargs"]["data_files"]["test"] = str(data)
    return config


@pytest.mark.parametrize("batch_size", [1, 8])
def test_local_completions_scores_the_additions(start_module_server, batch_size):
    live = start_module_server(instances=(1, 1))
    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args={
            "model": "dilaserve-tiny",
            "base_url": f"{live.url}/v1/completions",
            "tokenizer_backend": "none",
            "max_retries": 1,
        },
        tasks=[task_config()],
        task_manager=TaskManager(include_defaults=False),
        batch_size=batch_size,
        log_samples=False,
    )
    score = results["results"]["dilaserve_additions"]["exact_match,none"]
    assert float(score) >= 0.95
