"""``tokenrouter-ray plan`` as a user runs it: the plan it prints keeps its targets with the
fewest GPUs, R2R's ``--escalation`` shape is the routing it names, and bad arguments are
one-line errors."""

from __future__ import annotations

import json

import pytest

from tokenrouter_ray.cli import main

H200 = ["--rate", "40", "--output-tokens", "256", "--step-profile", "h200"]


def plan_json(capsys, *argv: str) -> tuple[int, dict]:
    rc = main(["plan", *H200, *argv, "--json"])
    return rc, json.loads(capsys.readouterr().out)


def test_the_plan_keeps_its_targets_with_the_fewest_gpus(capsys) -> None:
    rc, planned = plan_json(capsys, "--tpot-ms", "12")
    assert rc == 0 and planned["feasible"]
    assert planned["tpot_ms"] <= 12.0
    for name, share in planned["utilisation"].items():
        assert share <= planned["targets"]["utilisation"][name]
    assert planned["offered_tokens_per_s"] == 40 * 256 <= planned["max_tokens_per_s"]
    for name, count in planned["replicas"].items():  # with one fewer of any model: no fewer GPUs
        if count == 1:
            continue
        rc, fewer = plan_json(capsys, "--tpot-ms", "12", "--max-replicas", f"{name}={count - 1}")
        assert (rc, fewer["feasible"]) in ((0, True), (1, False))
        assert not fewer["feasible"] or fewer["gpus"] >= planned["gpus"], (name, fewer)
    rc, looser = plan_json(capsys, "--tpot-ms", "40")
    assert rc == 0 and looser["gpus"] <= planned["gpus"]


def test_escalation_is_r2rs_routing_written_out(capsys) -> None:
    names = list(plan_json(capsys)[1]["replicas"])
    small, large = names
    route = f"{small}:{small}=0.65,{small}:{large}=0.35,{large}:{small}=1"
    commit = f"{small}:{small}=1,{large}:{small}=1"
    _, shaped = plan_json(capsys, "--escalation", "0.35")
    _, written = plan_json(capsys, "--route-prob", route, "--commit", commit)
    assert shaped == written
    _, more = plan_json(capsys, "--escalation", "0.6")
    assert more["replicas"][large] >= shaped["replicas"][large]
    assert more["max_tokens_per_s"] != shaped["max_tokens_per_s"]


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--utilisation", "1.5"], "--utilisation: targets must lie in (0, 1]"),
        (["--max-rows", "nope=3"], "--max-rows: unknown model 'nope'"),
        (["--tpot-ms", "0"], "--tpot-ms must be positive"),
        (["--escalation", "2"], "--escalation must be a probability"),
    ],
)
def test_bad_arguments_are_one_line_errors(capsys, argv, says) -> None:
    assert main(["plan", *H200, *argv]) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1, err
