from __future__ import annotations

import json
from pathlib import Path

import pytest

from canvas_ls.engine import InfillSettings, SettingsError
from canvas_ls.engine.settings import MODEL_SETTINGS_FILE, model_settings


def test_overrides_apply_and_none_is_ignored() -> None:
    settings = InfillSettings().merged({"gap_tokens": 12, "seed": None, "t_min": 0})
    assert settings.gap_tokens == 12
    assert settings.seed == InfillSettings().seed


def test_ints_are_accepted_for_floats() -> None:
    assert InfillSettings().merged({"entropy_bound": 1}).entropy_bound == 1.0


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"gap_tokns": 3}, "unknown infill setting 'gap_tokns'"),
        ({"gap_tokens": "8"}, "gap_tokens must be int, got '8'"),
        ({"gap_tokens": True}, "gap_tokens must be int, got True"),
        ({"gap_tokens": 0}, "gap_tokens must be >= 1, got 0"),
        ({"layout": "sideways"}, "layout must be one of"),
        ({"t_min": 0.9}, "need 0 <= t_min < t_max"),
    ],
)
def test_bad_settings_name_the_problem(overrides: dict, message: str) -> None:
    with pytest.raises(SettingsError, match=message.replace("(", r"\(")):
        InfillSettings().merged(overrides)


def test_a_models_settings_file_with_an_unknown_section_is_refused_naming_it(tmp_path: Path) -> None:
    """A misspelt section ("settings" for "infill") would leave the model on settings it did not ask for."""
    (tmp_path / MODEL_SETTINGS_FILE).write_text(json.dumps({"infill": {"max_steps": 4}, "settings": {}}))
    with pytest.raises(SettingsError) as raised:
        model_settings(tmp_path, None)
    assert str(raised.value) == (
        f"{tmp_path / MODEL_SETTINGS_FILE}: unknown section settings (known: display, infill, trained, trained_before)"
    )
    (tmp_path / MODEL_SETTINGS_FILE).write_text(json.dumps({"infill": {"max_steps": 4}, "display": {}}))
    assert model_settings(tmp_path, None) == {"max_steps": 4}
