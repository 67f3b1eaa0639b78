"""The thresholds file as a typed, validated model: every file and override is checked when
loaded, and a bad value is named with its path rather than surfacing as a broken rule."""

from __future__ import annotations

import json

import pytest

from syncscope.thresholds import Thresholds, load_config, thresholds_text, validate


def test_the_shipped_file_is_valid_and_typed():
    typed = load_config()
    assert isinstance(typed, Thresholds)
    assert validate(json.loads(thresholds_text())) == typed
    assert typed.alerts["SyncscopeStraggler"].for_ == "5m"
    assert typed.alerts["SyncscopeStraggler"].keep_firing_for == "1m"
    assert typed.windows.rate == "1m"
    assert 0 < typed.diagnosis.verdict_score <= 1


@pytest.mark.parametrize(
    ("override", "path", "why"),
    [
        (
            {"alerts.SyncscopeStraggler.for": "5 minutes"},
            "alerts.SyncscopeStraggler.for",
            "duration",
        ),
        ({"windows.rate": 60}, "windows.rate", "string"),
        ({"diagnosis.verdict_score": 1.5}, "diagnosis.verdict_score", "less than or equal to 1"),
        ({"alerts.SyncscopeRankSilent.levels.0.severity": "page"}, "severity", "warning"),
        ({"diagnosis.min_aligned_steps": 0}, "diagnosis.min_aligned_steps", "greater than"),
    ],
)
def test_a_bad_override_is_named_with_its_path(override, path, why):
    with pytest.raises(ValueError) as err:
        load_config(override)
    assert path in str(err.value) and why in str(err.value), str(err.value)


def test_an_unknown_key_in_a_file_is_refused(tmp_path):
    cfg = json.loads(thresholds_text())
    cfg["windows"]["rates"] = "1m"  # a typo beside the real key
    path = tmp_path / "thresholds.json"
    path.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"windows\.rates: Extra inputs are not permitted"):
        load_config(path=path)
    assert str(path) in str(pytest.raises(ValueError, load_config, path=path).value)
