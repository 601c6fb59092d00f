"""The threshold rules written once (tokenrouter_ray/thresholds.py): lookup, fill, the
no-deadlock rule, and that every user reads them from there."""

from __future__ import annotations

import itertools
import pickle

import msgspec
import pytest

from tokenrouter_ray.engine.block_pool import KVCacheManager
from tokenrouter_ray.engine.scheduler import Scheduler, SchedulerConfig
from tokenrouter_ray.simulation.loads import thresholds_table
from tokenrouter_ray.thresholds import (
    ThresholdTable,
    check_admissible,
    check_tables,
    first_deadlock,
    is_admissible,
    json_hook,
)
from tokenrouter_ray.tuning.examples import paper_r2r
from tokenrouter_ray.tuning.search import threshold_lists, tune
from tokenrouter_ray.tuning.solver import ThresholdSolver


def test_lookup_repeats_the_last_entry_and_clamps_below_zero() -> None:
    table = ThresholdTable((1, 1, 3, 5))
    assert [table.at(n) for n in range(-1, 8)] == [1, 1, 1, 3, 5, 5, 5, 5, 5]
    assert table.extended(5).to_list() == [1, 1, 3, 5, 5, 5]
    assert table.extended(1).to_list() == [1, 1]


@pytest.mark.parametrize("values", [(), (1, 0), (-2,)])
def test_a_table_needs_at_least_one_positive_entry(values: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match="B >= 1"):
        ThresholdTable(values)


def test_fill_takes_the_largest_tuned_n_below_and_1_under_the_smallest() -> None:
    table = ThresholdTable.from_tuned({2: 2, 4: 3, 8: 6}, top=10)
    #          N:  0  1  2  3  4  5  6  7  8  9  10
    assert table.to_list() == [1, 1, 2, 2, 3, 3, 3, 3, 6, 6, 6]
    assert ThresholdTable.from_tuned({3: 2}).to_list() == [1, 1, 1, 2]
    assert ThresholdTable.from_tuned({}).to_list() == [1]


def test_fill_of_admissible_points_is_admissible_everywhere() -> None:
    """B admissible at a tuned N stays admissible at every n between it and the next."""
    small = ThresholdTable.from_tuned({1: 1, 4: 2, 8: 3}, top=20)
    large = ThresholdTable.from_tuned({1: 1, 4: 2, 8: 5}, top=20)
    for n in (1, 4, 8):
        assert is_admissible(n, [small.at(n), large.at(n)])
    assert first_deadlock([small, large]) is None


@pytest.mark.parametrize("replicas", [(1, 1), (1, 2), (3, 1), (2, 2)])
def test_admissible_iff_replicas_cannot_all_hold_back(replicas: tuple[int, int]) -> None:
    """Brute force of the rule's meaning: the sets of waiting counts where no replica can
    launch (each replica of model i holds at most B_i - 1) cover N requests iff slack >= N."""
    for n, b0, b1 in itertools.product(range(1, 7), range(1, 5), range(1, 5)):
        caps = [b0 - 1] * replicas[0] + [b1 - 1] * replicas[1]
        stuck_possible = any(
            sum(split) == n for split in itertools.product(*(range(c + 1) for c in caps))
        )
        assert is_admissible(n, (b0, b1), replicas) is (not stuck_possible), (n, b0, b1)


def test_check_admissible_says_why() -> None:
    check_admissible(3, (1, 3))
    with pytest.raises(ValueError, match=r"deadlock at N=2.*sum\(B_i - 1\) = 2"):
        check_admissible(2, (2, 2))
    with pytest.raises(ValueError, match=r"R=\(1, 2\)"):
        check_admissible(2, (1, 2), (1, 2))
    with pytest.raises(ValueError, match="at least one active request"):
        check_admissible(0, (1, 1))


def test_check_tables_names_the_first_deadlocking_n() -> None:
    tables = {"small": ThresholdTable((1,)), "large": ThresholdTable((1, 1, 1, 2))}
    check_tables(tables)
    with pytest.raises(ValueError, match=r"deadlock at 3 active.*3\*\(2-1\) \[large\] = 3"):
        check_tables(tables, {"large": 3})
    # past the longest table only N grows: a table admissible at its end stays so
    assert first_deadlock([ThresholdTable((1, 1, 2))], [1]) is None
    assert first_deadlock([ThresholdTable((1, 2))], [1]) == 1


def test_the_scheduler_reads_its_own_table_and_the_tuner_replaces_it() -> None:
    config = SchedulerConfig(batch_thresholds=[1, 1, 3])
    sched = Scheduler(config, KVCacheManager(num_blocks=8, block_size=4))
    sched.active_requests = 5
    assert sched.threshold() == 3
    sched.set_thresholds(ThresholdTable((1, 2)))
    assert sched.threshold() == 2
    assert config.batch_thresholds == [1, 1, 3]  # the config is the start-up value only


def test_search_tuner_and_simulation_fill_the_same_way() -> None:
    profile = paper_r2r()
    results = tune(profile, [2, 4], fixed={"small": 1})
    lists = threshold_lists(results, max_n=6)
    for i, name in enumerate(profile.names):
        tuned = {n: r.best.thresholds[i] for n, r in results.items()}
        assert lists[name] == ThresholdTable.from_tuned(tuned, 6).to_list()
    tuner = ThresholdSolver(list(profile.names), concurrencies=[2, 4], fixed={"small": 1})
    decision = tuner.decide(profile, force=True)
    for name in profile.names:
        tuned = {n: decision.thresholds[name][n] for n in (2, 4)}
        assert decision.thresholds[name] == ThresholdTable.from_tuned(tuned, 4).to_list()
    assert thresholds_table(3, 2) == [1, 1, 1, 2]


def test_a_table_is_one_value_from_the_solver_to_a_json_body() -> None:
    """Equal to the list or tuple of its values (a config's, a JSON body's), hashable,
    indexed as written, pickled as its values (across Ray) and a list at a JSON edge."""
    table, as_list = ThresholdTable([1, 1, 3]), [1, 1, 3]
    assert table == as_list and as_list == table and table == (1, 1, 3)  # both ways round
    assert table != [1, 1, 3, 3] and table != ThresholdTable((1, 1, 3, 3)) and table != "113"
    assert {table: "x"}[ThresholdTable.of((1, 1, 3))] == "x"
    assert table[2] == 3 and list(table) == [1, 1, 3] and len(table) == 3
    assert pickle.loads(pickle.dumps(table)) == table
    assert msgspec.json.decode(msgspec.json.encode({"large": table}, enc_hook=json_hook)) == {
        "large": [1, 1, 3]
    }
    with pytest.raises(AttributeError, match="immutable"):
        table.values = (2,)
