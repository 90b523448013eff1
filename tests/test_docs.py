"""The docs stay true: the README's configuration table is the one the settings model generates."""

from __future__ import annotations

from conftest import REPO_ROOT

from sessionlog.settings import settings_table_markdown


def test_the_readme_configuration_table_matches_the_settings() -> None:
    readme = (REPO_ROOT / "README.md").read_text()
    assert settings_table_markdown() in readme


def test_the_readme_names_the_two_commands_and_ci_runs_the_test_one() -> None:
    readme = (REPO_ROOT / "README.md").read_text()
    assert "make demo" in readme and "make test" in readme
    assert "make test" in (REPO_ROOT / ".ci" / "run").read_text()
