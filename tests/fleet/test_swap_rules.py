"""The swap strategy by vLLM version (`pipeline.serving.swap`) and the instance version match
(`pipeline.fleet.preflight.same_version`): unit tests of the rule table per version range."""

from __future__ import annotations

import pytest

from pipeline.errors import UsageError
from pipeline.fleet.preflight import same_version
from pipeline.serving.swap import swap_facts, swap_plan


@pytest.mark.parametrize(
    "version, key, sticky",
    [
        ("0.19.1", "name", True),
        ("0.19.2rc1.dev123+gabc1234", "name", True),  # the seed fleet's nightly
        ("0.20.0", "name", True),
        ("0.25.0", "name", True),
        ("0.32.0", "name+path", True),  # the CPU build the tests serve
        ("0.33.0", "name+path", False),
    ],
)
def test_facts_per_version_range(version, key, sticky):
    f = swap_facts(version)
    assert (f.prefix_key, f.inplace_sticky) == (key, sticky)
    assert f.source and "VLLM_SERVER_DEV_MODE" in f.reset_endpoint


@pytest.mark.parametrize("version", ["0.17.1", "0.28.0", "0.34.0", "1.0.0", "not-a-version", ""])
def test_unread_versions_have_no_facts_and_get_versioned(version):
    assert swap_facts(version) is None
    plan = swap_plan(version)
    assert plan.strategy == "versioned" and "not read" in plan.reason


@pytest.mark.parametrize(
    "version, why",
    [
        ("0.19.2rc1.dev123+gabc1234", "keyed by adapter name only"),
        ("0.21.0", "keyed by adapter name only"),
        ("0.32.0", "load_inplace sticky"),
    ],
)
def test_auto_never_repoints_where_a_hazard_holds(version, why):
    plan = swap_plan(version, "auto")
    assert plan.strategy == "versioned" and why in plan.reason


def test_auto_repoints_on_033():
    assert swap_plan("0.33.0", "auto").strategy == "repoint"
    assert swap_plan("0.33.0", "versioned").strategy == "versioned"  # explicit choice wins


@pytest.mark.parametrize("version", ["0.19.1", "0.19.2rc1.dev7+g1", "0.25.0", "0.29.0"])
def test_explicit_repoint_refused_where_it_serves_stale_kv_or_is_unread(version):
    with pytest.raises(UsageError, match="repoint"):
        swap_plan(version, "repoint")


def test_explicit_repoint_on_sticky_version_warns():
    plan = swap_plan("0.32.0", "repoint")
    assert plan.strategy == "repoint" and any("every scheduler step" in w for w in plan.warnings)


@pytest.mark.parametrize(
    "configured, reported, same",
    [
        ("0.19.2rc1.dev123+gabc", "0.19.2rc1.dev123+gabc", True),
        ("0.19.2rc1.dev123", "0.19.2rc1.dev123+gabc", True),  # no local part: any build of it
        ("0.19.2rc1.dev123+gabc", "0.19.2rc1.dev123+gdef", False),  # another commit
        ("0.19.2rc1.dev123", "0.19.2rc1.dev124+gabc", False),  # another nightly
        ("0.19.2", "0.19.2rc1.dev123+gabc", False),  # a nightly before 0.19.2 is not 0.19.2
        ("0.19.1", "0.19.10", False),
        ("0.32.0", "0.32.0+cpu", True),
        ("0.32.0+cpu", "0.32.0", False),
        ("0.32.0", "0.32", True),  # PEP 440: 0.32 == 0.32.0
        ("0.32.0", None, False),  # no /version
        ("weird", "weird", True),  # unparsable: exact string match
        ("weird", "weird2", False),
    ],
)
def test_same_version(configured, reported, same):
    assert same_version(configured, reported) is same
