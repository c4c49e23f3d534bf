"""One Detector contract: the protocol the rule engine depends on, implemented by the base
class of every registered detector."""

from __future__ import annotations

import inspect

from agent.detectors import DETECTORS, Detector, DetectorProtocol, build_detector
from agent.rules import detector_catalog

MEMBERS = [
    "baseline",
    "direction",
    "load_state_dict",
    "onset_step",
    "state_dict",
    "statistic",
    "triggered",
    "update",
]


def test_the_rules_package_defines_no_detector_type_of_its_own():
    own = [
        obj
        for obj in vars(detector_catalog).values()
        if inspect.isclass(obj) and obj.__module__ == detector_catalog.__name__
    ]
    assert own == [detector_catalog.DetectorCatalog]
    assert sorted(n for n in vars(DetectorProtocol) if not n.startswith("_")) == MEMBERS


def test_every_registered_detector_has_the_protocol_members():
    for name, cls in DETECTORS.items():
        assert issubclass(cls, Detector), name
        required = {"threshold": {"above": 1.0}, "drawdown": {"ratio": 1.5, "span": 100}}
        detector = build_detector(name, required.get(name, {}))
        for member in MEMBERS:
            assert hasattr(detector, member), (name, member)
        assert detector.update(0, 0.5) is detector
        assert (detector.triggered, detector.onset_step, detector.direction) == (False, None, None)
