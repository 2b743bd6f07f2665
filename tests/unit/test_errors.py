import errno

from cella import errors


def test_errno_mapping() -> None:
    assert isinstance(errors.from_errno(errno.ENOENT, "x"), errors.NotFound)
    assert isinstance(errors.from_errno(errno.EISDIR, "x"), errors.IsADirectory)
    assert isinstance(errors.from_errno(errno.EACCES, "x"), errors.PermissionDenied)
    assert isinstance(errors.from_errno(errno.EIO, "x"), errors.GuestError)


def test_codes_are_unique_and_snake_case() -> None:
    codes = [cls.code for cls in [errors.CellaError, *errors.CellaError.__subclasses__()]]
    assert len(codes) == len(set(codes))
    assert all(c == c.lower() and " " not in c for c in codes)
    assert errors.ALL_ERRORS["not_found"] is errors.NotFound


def test_the_tree_groups_by_status() -> None:
    every = list(errors.ALL_ERRORS.values())
    assert len(every) == len({cls.code for cls in every}) >= 25
    for cls in every:
        if issubclass(cls, errors.RequestError):
            assert 400 <= cls.status < 500, cls
        elif cls is not errors.CellaError:
            assert issubclass(cls, errors.SandboxError | errors.HostError), cls
            assert cls.status >= 500, cls
    assert all(
        issubclass(errors.ALL_ERRORS[c], errors.Conflict) for c in ("in_use", "invalid_state")
    )
    forbidden = {c for c, cls in errors.ALL_ERRORS.items() if cls.status == 403}
    assert forbidden == {"permission_denied", "destination_forbidden"}
    assert issubclass(errors.DestinationForbidden, errors.PermissionDenied)
    assert errors.Forbidden is errors.PermissionDenied
    assert set(errors.__all__) >= {cls.__name__ for cls in every}
