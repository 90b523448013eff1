"""The closed table of wire codes: every code round-trips through its class, and no error class outside it
carries a code of its own."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

import services
import sessionlog
from sessionlog.errors import CODES, ERRORS_BY_CODE, SessionLogError, UpstreamError, error_from_code, http_status


@pytest.mark.parametrize("code", sorted(CODES))
def test_every_code_in_the_table_round_trips_code_to_class_to_code(code: str) -> None:
    err = error_from_code(code, "what went wrong", seq=3)
    assert type(err) is CODES[code].cls is ERRORS_BY_CODE[code]
    assert err.code == code and err.seq == 3 and err.message == "what went wrong"
    assert error_from_code(err.code, err.message, seq=err.seq).to_dict() == err.to_dict()
    assert http_status(err) == CODES[code].status
    assert 400 <= CODES[code].status < 600


def test_an_unknown_code_keeps_its_code_and_answers_500() -> None:
    err = error_from_code("FROM_A_NEWER_PEER", "later build", seq=None)
    assert type(err) is SessionLogError and err.code == "FROM_A_NEWER_PEER" and http_status(err) == 500


def test_a_provider_error_answers_the_status_the_gateway_chose() -> None:
    assert http_status(UpstreamError("rate limited", status=429)) == 429
    assert http_status(UpstreamError("bad gateway")) == CODES["UPSTREAM_ERROR"].status == 502


def _subclasses(cls: type[SessionLogError]) -> list[type[SessionLogError]]:
    found = []
    for sub in cls.__subclasses__():
        found += [sub, *_subclasses(sub)]
    return found


def test_every_error_class_of_the_library_and_the_services_is_in_the_table() -> None:
    """With every module imported, each error class's code is a row of the table whose class it is or extends
    (a subclass that only narrows, like a writer's `Conflict`, keeps its parent's code)."""
    for package in (sessionlog, services):
        for module in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            if not module.name.endswith(".__main__"):  # running one starts a process
                importlib.import_module(module.name)
    for cls in _subclasses(SessionLogError):
        assert cls.code in CODES, f"{cls.__module__}.{cls.__qualname__} has code {cls.code} outside the table"
        assert issubclass(cls, CODES[cls.code].cls), (cls, CODES[cls.code].cls)


def test_structure_invalid_is_409_a_refusal_not_unavailability() -> None:
    assert CODES["STRUCTURE_INVALID"].status == 409
