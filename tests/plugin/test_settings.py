"""Strict settings: every declared variable rejects every bad value, naming the variable."""

from __future__ import annotations

import pytest

from dspark_harden.core.manager import all_setting_specs, make_manager
from dspark_harden.core.settings import Setting, SettingsError, bad_examples, flag01, load_settings, positive_int

SPECS = all_setting_specs(make_manager())


def test_every_parser_declares_bad_values():
    missing = [s.name for s in SPECS if not bad_examples(s.parse)]
    assert not missing, f"settings whose parser declares no bad_examples (cannot be tested): {missing}"


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_every_bad_value_is_rejected_naming_the_variable(spec: Setting):
    for bad in bad_examples(spec.parse):
        with pytest.raises(SettingsError) as info:
            load_settings(SPECS, {spec.name: bad})
        assert spec.name in str(info.value), (spec.name, bad, str(info.value))
        assert len(info.value.problems) == 1


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_defaults_parse_and_are_documented(spec: Setting):
    settings = load_settings(SPECS, {})
    assert settings[spec.name] == spec.default
    assert not settings.is_explicit(spec.name)
    assert spec.doc.strip(), f"{spec.name} has no description"


def test_all_problems_reported_at_once():
    specs = [Setting("A_FLAG", flag01, False, "a"), Setting("B_INT", positive_int, 1, "b")]
    with pytest.raises(SettingsError) as info:
        load_settings(specs, {"A_FLAG": "true", "B_INT": "0"})
    assert len(info.value.problems) == 2
    assert "A_FLAG" in str(info.value) and "B_INT" in str(info.value)


def test_explicit_values_are_tracked():
    specs = [Setting("A_FLAG", flag01, False, "a")]
    settings = load_settings(specs, {"A_FLAG": "1"})
    assert settings["A_FLAG"] is True and settings.is_explicit("A_FLAG")


def test_duplicate_declaration_is_an_error():
    specs = [Setting("A_FLAG", flag01, False, "a", feature="x"), Setting("A_FLAG", flag01, False, "a", feature="y")]
    with pytest.raises(SettingsError, match="declared twice"):
        load_settings(specs, {})


def test_undeclared_setting_lookup_names_it():
    settings = load_settings([], {})
    with pytest.raises(KeyError, match="NOT_DECLARED"):
        settings["NOT_DECLARED"]
