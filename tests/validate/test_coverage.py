"""Every registered check id has a failing fixture in the suite: a test that produces exactly that id."""

from pathlib import Path

from pipeline.validate import RULES
from tests.train.test_training_config import TRAIN_CASES
from tests.validate.cases import CASES

HERE = Path(__file__).parent
# ids whose fixture is a dedicated test (the fixture needs more than one edit of the good adapter): test -> ids
BESPOKE = {
    "tests/validate/test_validate.py::test_file_faults_are_findings_not_tracebacks": [
        "config.missing",
        "config.invalid",
        "weights.missing",
        "weights.pickle",
        "weights.ambiguous",
        "weights.empty",
        "weights.header",
    ],
    "tests/validate/test_validate.py::test_served_checks": [
        "served.unreadable",
        "served.geometry",
        "served.module_missing",
        "served.shape",
        "served.quant_unknown",
    ],
    "tests/validate/test_validate.py::test_missing_adapter_directory": ["adapter.missing"],
    "tests/validate/test_validate.py::test_unquantized_served_checkpoint_is_info": ["served.not_quantized"],
    "tests/validate/test_validate_fleet.py::test_other_vocabulary_is_refused": ["tokenizer.vocab"],
    "tests/validate/test_validate_fleet.py::test_fold_rslora_keeps_every_scale": ["config.rslora_folded"],
    "tests/validate/test_validate_fleet.py::test_behaviour_fixtures": [
        "behaviour.canary",
        "behaviour.eval_loss",
    ],
    "tests/validate/test_validate_fleet.py::test_behaviour_unavailable_and_skipped": [
        "behaviour.unavailable",
        "behaviour.skipped",
    ],
    "tests/validate/test_validate_fleet.py::test_behaviour_without_validation_data": ["behaviour.no_data"],
    "tests/validate/test_acceptance.py::test_validate_behaviour_reports_and_gates_the_estimate": [
        "behaviour.acceptance"
    ],
    "tests/train/test_training_config.py::test_unservable_settings_refused": ["train.unpinned_base"],
}


def covered() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for c in CASES:
        out.setdefault(c[0], []).append("tests/validate/cases.py")
    for c in TRAIN_CASES:
        out.setdefault(c[0], []).append("tests/train/test_training_config.py")
    for test, ids in BESPOKE.items():
        path, name = test.split("::")
        src = (HERE.parents[1] / path).read_text()
        assert f"def {name}(" in src, f"{test} does not exist"
        for i in ids:
            assert f'"{i}"' in src, f"{test} does not produce {i}"
            out.setdefault(i, []).append(test)
    return out


def test_every_check_id_has_a_failing_fixture():
    missing = sorted(set(RULES) - set(covered()))
    assert missing == [], f"registered checks without a failing fixture: {missing}"


def test_every_fixture_names_a_registered_check():
    assert sorted(set(covered()) - set(RULES)) == []


def test_train_scope_rules_have_a_training_config_fixture():
    train_ids = {k for k, s in RULES.items() if s.scopes == ("train",)}
    assert train_ids <= {c[0] for c in TRAIN_CASES} | {"train.unpinned_base"}
