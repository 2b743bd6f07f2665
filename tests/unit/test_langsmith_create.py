"""A LangSmith create's fields: each is read or refused by name, none ignored."""

from __future__ import annotations

import pytest

from cella import errors
from cella.server.compat.langsmith.create import read_create


def test_labels_are_carried_and_persistence_is_kept() -> None:
    box = read_create({"name": "b", "labels": {"team": "x"}, "persistent": True})
    assert box.spec().labels == {"team": "x"}


@pytest.mark.parametrize(
    ("body", "named"),
    [
        ({"persistent": False}, "persistent: false"),
        ({"volumes": [{"volume": "v", "mount_path": "/data"}]}, "volumes"),
        ({"cpu_millicores": 500}, "cpu_millicores"),
        ({"env_vars": {"A": "1"}, "tag_value_ids": ["t"]}, "env_vars"),
    ],
)
def test_fields_cella_cannot_honour_are_refused_by_name(
    body: dict[str, object], named: str
) -> None:
    with pytest.raises(errors.CellaError, match=f"not supported by cella.*{named}"):
        read_create({"name": "b", **body})


def test_a_field_sent_as_null_is_not_a_request() -> None:
    assert read_create({"name": "b", "volumes": None, "persistent": None}).name == "b"
