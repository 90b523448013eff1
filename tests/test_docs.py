"""The docs stay true: the README's configuration table is the one the settings model generates."""

from __future__ import annotations

from pathlib import Path

from conftest import REPO_ROOT

from sessionlog.settings import settings_table_markdown


def test_the_readme_configuration_table_matches_the_settings() -> None:
    readme = (REPO_ROOT / "README.md").read_text()
    assert settings_table_markdown() in readme


def test_the_readme_names_the_two_commands_and_ci_runs_the_test_one() -> None:
    readme = (REPO_ROOT / "README.md").read_text()
    assert "make demo" in readme and "make test" in readme
    assert "make test" in (REPO_ROOT / ".ci" / "run").read_text()


def test_nothing_in_the_project_reads_the_folder_beside_the_checkout() -> None:
    """A user's clone has no `../shared`: code, tests, build and CI files name no path outside the repository."""
    checked = [REPO_ROOT / name for name in ("Makefile", "pyproject.toml", "Dockerfile", "compose.yaml", ".ci/run")]
    for folder in ("shared", "services", "tests", "bench", "examples", "deploy"):
        checked += [p for p in (REPO_ROOT / folder).rglob("*") if p.suffix in {".py", ".sh", ".yaml", ".yml", ".toml"}]
    this_file = Path(__file__).resolve()
    offenders = [
        str(p.relative_to(REPO_ROOT))
        for p in checked
        if p.resolve() != this_file
        and any(pattern in p.read_text() for pattern in ("../shared", 'parent / "shared"', "parents[2]"))
    ]
    assert offenders == []


def test_the_dsh_fixtures_are_vendored_with_their_notice() -> None:
    fixtures = REPO_ROOT / "tests" / "fixtures"
    assert len(list((fixtures / "dsh-sessions").glob("*.jsonl"))) == 81
    notice = (fixtures / "README.md").read_text()
    assert "Copyright (c) 2026 DeepSeek" in notice and "MIT License" in notice
