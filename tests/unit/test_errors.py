"""The error tree across process boundaries."""

from __future__ import annotations

from sokuji.errors import Overloaded


def test_every_error_survives_pickling_with_its_status_and_headers() -> None:
    """An error raised in another process (a Ray Serve replica) must arrive as itself: 429
    with Retry-After stays 429 with Retry-After."""
    import pickle

    from sokuji import errors

    refused = pickle.loads(pickle.dumps(Overloaded("full", retry_after_s=3)))
    assert isinstance(refused, Overloaded) and refused.status == 429
    assert refused.retry_after_s == 3 and refused.headers == {"retry-after": "3"}
    assert str(refused) == "full"
    for cls in vars(errors).values():
        if isinstance(cls, type) and issubclass(cls, errors.SokujiError) \
                and cls is not Overloaded:
            try:
                err = cls("why", param="p")
            except TypeError:  # needs more arguments: built by its own factory only
                continue
            back = pickle.loads(pickle.dumps(err))
            assert type(back) is cls and back.status == err.status and back.param == "p"
