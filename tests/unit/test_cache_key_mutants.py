"""The response cache's key and entry format (``core/cache.py``) against the mutants mutmut
left alive there (docs/mutation.md): each test names the mutant(s) it kills, by mutmut's
name."""

from __future__ import annotations

import numpy as np

from sokuji.core.cache import Entry, cache_key


def test_the_key_format_is_stable_across_releases() -> None:
    """Replicas share a Redis backend through a rolling upgrade, so the key is a stored
    format: these literals are SHA-256 over the mode ("keyed" / "open"), then each part
    length-prefixed (8 bytes, little-endian), then the number of texts. Kills
    ``x_cache_key__mutmut_7``, ``_8``, ``_9`` and ``_10`` (another mode prefix: every entry
    written before the upgrade missed, and keyed and open modes no longer told apart by a
    fixed tag)."""
    assert cache_key("acme", "minilm", "1", ["hello", "world"]) == \
        "7cd37a397c707be4bc438bc73bdb2bdb19a48bd9f3fcad9660591fb829d1c3da"
    assert cache_key("anonymous", "minilm", "1", ["hello"], keyed=False) == \
        "52498951defa2940e8099be1b28d6759c23c9daca389d4716cded138ac134447"


def test_by_default_a_key_is_keyed_and_of_no_particular_form() -> None:
    """A caller that does not say gets the safe mode (keyed: never an open server's entry)
    and the plain form. Kills ``x_cache_key__mutmut_1`` (default ``keyed=False``) and ``_2``
    (a default form other than "")."""
    assert cache_key("a", "m", "1", ["x"]) == cache_key("a", "m", "1", ["x"], keyed=True,
                                                        form="")


def test_a_text_with_a_lone_surrogate_has_a_key_of_its_own() -> None:
    """JSON may carry "\\ud800" (a lone surrogate); it is keyed, not a 500, and not the key of
    another surrogate. Kills ``x_cache_key__mutmut_15`` (strict UTF-8: UnicodeEncodeError),
    ``_18`` and ``_19`` (an error handler that does not exist: LookupError)."""
    assert cache_key("a", "m", "1", ["\ud800"]) != cache_key("a", "m", "1", ["\ud801"])


def test_a_big_endian_entry_round_trips() -> None:
    """The dtype's byte order is the first character of its string (">f4"). Kills
    ``xǁEntryǁfrom_bytes__mutmut_14`` (the header read from its second byte: ">f4" read as
    "f4", native order, every value garbled)."""
    output = np.arange(6, dtype=">f4").reshape(2, 3)
    back = Entry.from_bytes(Entry(output, 7).to_bytes())
    assert back.output.dtype == np.dtype(">f4") and back.num_tokens == 7
    np.testing.assert_array_equal(back.output, output)
