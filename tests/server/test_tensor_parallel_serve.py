"""`dilaserve serve --instances "1x2,2x1"`: a mixed-degree cluster (one TP-2 instance of two
gloo-joined CPU processes, two TP-1 instances) answering over real HTTP."""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor

import aiohttp
from prometheus_client.parser import text_string_to_metric_families
from tiny_problems import PINNED_TAU, solvable
from tp_profiles import write_tp_profile

from dilaserve.cli import build_parser
from dilaserve.cli.serve import engine_config, settings_from
from dilaserve.tiny.tasks import check, gen_length


def test_serve_a_mixed_degree_cluster(start_server, tmp_path):
    profile = write_tp_profile(tmp_path / "tp.json", (1, 2))
    argv = ["serve", "--instances", "1x2,2x1", "--device", "cpu", "--profile", profile]
    config = engine_config(settings_from(build_parser().parse_args(argv)))
    assert config.instances == (2, 1, 1) and config.slots == 4
    live = start_server(instances=config.instances, profile=config.profile)
    problems = solvable(8, 77)
    client = live.client()

    def ask(problem):
        return client.completions.create(
            model="dilaserve-tiny",
            prompt=problem.prompt,
            max_tokens=gen_length(problem, 32),
            extra_body={"confidence_threshold": PINNED_TAU},
        )

    with ThreadPoolExecutor(len(problems)) as pool:
        answers = list(pool.map(ask, problems))
    assert all(check(p, a.choices[0].text) for p, a in zip(problems, answers, strict=True))
    served_by = {i for a in answers for i in a.model_extra["dilaserve"]["instances"]}
    assert 0 in served_by  # the TP-2 instance took requests

    async def get(path):
        async with aiohttp.ClientSession() as s, s.get(live.url + path) as r:
            return await r.text()

    cluster = json.loads(asyncio.run(get("/v1/cluster")))
    assert [i["tp"] for i in cluster["instances"]] == [2, 1, 1]
    assert cluster["instances"][0]["gpus"] == [0, 1]
    assert all(i["state"] == "serving" for i in cluster["instances"])
    families = {f.name: f for f in text_string_to_metric_families(asyncio.run(get("/metrics")))}
    per_degree = {s.labels["tp"]: s.value for s in families["dilaserve:instances"].samples}
    assert per_degree == {"1": 2.0, "2": 1.0}
