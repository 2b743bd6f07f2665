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
