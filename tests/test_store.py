from __future__ import annotations

import json
import threading
import warnings

import pytest

from agent.rules.matchers import LabelMatcher
from agent.samples import Sample
from agent.store import SeriesStore, flat_name, normalize_labels


def test_ring_buffer_keeps_last_capacity_points_per_series():
    store = SeriesStore(capacity=3)
    store.extend(Sample.make(s, "loss", float(s)) for s in range(5))
    store.extend(Sample.make(s, "grad_norm", 10.0 + s, rank=0) for s in range(2))
    assert store.series("loss") == [(2, 2.0), (3, 3.0), (4, 4.0)]
    assert store.series("grad_norm", {"rank": 0}) == [(0, 10.0), (1, 11.0)]
    assert store.series("grad_norm") == []  # the unlabelled series does not exist
    assert store.series("nope") == []
    assert store.metrics() == ["grad_norm", "loss"]
    assert len(store) == 2
    assert store.version("loss") == 5 and store.version("nope") == 0


def test_labels_are_normalized_like_samples():
    assert normalize_labels({"layer": "a", "head": 3}) == (("head", "3"), ("layer", "a"))
    assert normalize_labels([("b", 1), ("a", 2)]) == (("a", "2"), ("b", "1"))
    store = SeriesStore()
    store.append(Sample.make(7, "qk_delta2_entropy", 1.5, layer="l0", head=3))
    assert store.series("qk_delta2_entropy", {"head": 3, "layer": "l0"}) == [(7, 1.5)]
    assert store.series("qk_delta2_entropy", (("layer", "l0"), ("head", "3"))) == [(7, 1.5)]


def test_select_by_glob_and_regex_requires_the_label():
    store = SeriesStore()
    store.extend(
        [
            Sample.make(1, "m", 1.0, layer="model.layers.0.self_attn", head=0),
            Sample.make(1, "m", 2.0, layer="model.layers.1.self_attn", head=1),
            Sample.make(1, "m", 3.0, layer="model.layers.12.self_attn", head=1),
            Sample.make(1, "m", 4.0, router="model.layers.0.mlp.gate"),
        ]
    )
    by_glob = store.select("m", {"layer": "model.layers.?.self_attn"})
    assert sorted(v[0][1] for v in by_glob.values()) == [1.0, 2.0]
    by_regex = store.select("m", {"layer": r"~model\.layers\.1\d*\..*", "head": "1"})
    assert sorted(v[0][1] for v in by_regex.values()) == [2.0, 3.0]
    assert len(store.select("m", {"layer": "*"})) == 3  # the router series has no layer label
    assert len(store.select("m")) == 4
    compiled = LabelMatcher.from_mapping({"router": "*gate"})
    assert list(store.select("m", compiled)) == [(("router", "model.layers.0.mlp.gate"),)]


def test_latest_flattens_names_for_loggers():
    store = SeriesStore()
    store.extend([Sample.make(1, "loss", 2.5), Sample.make(2, "loss", 2.25)])
    store.append(Sample.make(2, "router_entropy", 0.7, router="gate"))
    store.append(Sample.make(2, "m", 1.0, b="2", a="1"))
    assert store.latest() == {"loss": 2.25, "router_entropy{router=gate}": 0.7, "m{a=1,b=2}": 1.0}
    assert flat_name("m", ()) == "m"


def test_series_count_is_bounded_and_new_series_are_dropped_with_one_warning():
    store = SeriesStore(capacity=4, max_series=2)
    store.extend([Sample.make(0, "a", 1.0), Sample.make(0, "b", 1.0)])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        store.extend([Sample.make(1, "c", 1.0), Sample.make(1, "a", 2.0)])
        store.append(Sample.make(2, "a", 3.0, extra="x"))
    assert len(caught) == 1 and "max_series" in str(caught[0].message)
    assert store.dropped_samples == 2
    assert len(store) == 2
    assert store.series("a") == [(0, 1.0), (1, 2.0)]  # existing series keep growing
    assert store.series("c") == []


def test_invalid_bounds_are_value_errors():
    with pytest.raises(ValueError, match="capacity must be >= 1, got 0"):
        SeriesStore(capacity=0)
    with pytest.raises(ValueError, match="max_series must be >= 1, got -1"):
        SeriesStore(max_series=-1)


def test_read_new_returns_only_unseen_points_and_skips_overwritten_ones():
    store = SeriesStore(capacity=4)
    store.extend(Sample.make(s, "m", float(s), head=h) for s in range(3) for h in (0, 1))
    accept_head0 = lambda labels: dict(labels)["head"] == "0"  # noqa: E731
    new, cursors = store.read_new("m", accept_head0, {})
    assert new == {(("head", "0"),): [(0, 0.0), (1, 1.0), (2, 2.0)]}
    assert cursors == {(("head", "0"),): 3}
    assert store.read_new("m", accept_head0, cursors) == ({}, {})
    store.extend(Sample.make(s, "m", float(s), head=0) for s in range(3, 9))  # 6 new, keeps 4
    new, cursors = store.read_new("m", accept_head0, cursors)
    assert new == {(("head", "0"),): [(5, 5.0), (6, 6.0), (7, 7.0), (8, 8.0)]}
    assert cursors == {(("head", "0"),): 9}


def test_extend_is_atomic_for_concurrent_readers():
    store = SeriesStore(capacity=10_000)
    n_series, n_steps = 16, 300
    torn: list[dict] = []
    done = threading.Event()

    def writer() -> None:
        for step in range(n_steps):
            store.extend(Sample.make(step, "m", float(step), head=h) for h in range(n_series))
        done.set()

    def reader() -> None:
        while not done.is_set():
            snapshot = store.select("m")
            lengths = {len(points) for points in snapshot.values()}
            if snapshot and (len(snapshot) != n_series or len(lengths) != 1):
                torn.append({k: len(v) for k, v in snapshot.items()})

    threads = [threading.Thread(target=reader), threading.Thread(target=writer)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not torn
    assert all(len(p) == n_steps for p in store.select("m").values())


def test_state_dict_round_trips_through_json():
    store = SeriesStore(capacity=3)
    store.extend(Sample.make(s, "loss", s / 2, rank=0) for s in range(5))
    store.append(Sample.make(9, "m", float("nan")))
    state = json.loads(json.dumps(store.state_dict()))
    restored = SeriesStore(capacity=3)
    restored.load_state_dict(state)
    assert restored.epoch == store.epoch
    assert restored.series("loss", {"rank": 0}) == [(2, 1.0), (3, 1.5), (4, 2.0)]
    assert restored.version("loss") == 5
    _, cursors = restored.read_new("loss", lambda labels: True, {})
    assert cursors == {(("rank", "0"),): 5}
    assert str(restored.latest()["m"]) == "nan"
