"""errors.same_kind: passing an error on with the model's name, its status and attributes kept; cap_message."""

from __future__ import annotations

import pytest

from nereid.errors import MESSAGE_LIMIT, InvalidArgument, ModelFailure, NotFound, Unavailable, cap_message, same_kind


class OwnStr(InvalidArgument):
    """A plugin's refusal whose str is an attribute of its own, not its message."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return self.text


class Missing(NotFound):
    """One whose str formats a field."""

    def __init__(self, item: str) -> None:
        super().__init__(item)
        self.item = item

    def __str__(self) -> str:
        return f"no {self.item}"


class Slotted(Unavailable):
    """One that keeps its data in slots."""

    __slots__ = ("retry_s",)

    def __init__(self, retry_s: int) -> None:
        super().__init__(f"busy for {retry_s} s")
        self.retry_s = retry_s


@pytest.mark.parametrize("error, kind", [(OwnStr("x[0] must not be 1"), InvalidArgument),
                                         (Missing("row 3"), NotFound)], ids=["InvalidArgument", "NotFound"])
def test_an_error_whose_str_is_its_own_keeps_its_status_family(error, kind) -> None:
    """Defect: only DeadlineExceeded, Unavailable and ModelFailure were known as families: a plugin's
    InvalidArgument or NotFound subclass with a __str__ of its own became INTERNAL (and was logged as a fault)."""
    named = same_kind(error, f"model 'm': {error}")
    assert type(named) is kind and str(named) == f"model 'm': {error}"


def test_an_error_keeps_its_slots_and_its_type() -> None:
    named = same_kind(Slotted(3), "model 'm': busy for 3 s")
    assert type(named) is Slotted and named.retry_s == 3 and str(named) == "model 'm': busy for 3 s"


def test_a_plain_error_is_passed_on_as_its_own_type() -> None:
    assert type(same_kind(ModelFailure("x"), "model 'm': x")) is ModelFailure


def test_a_capped_message_keeps_its_end_where_a_chain_of_causes_names_the_first():
    # Found by a bug hunt: a deep chain of meta models failing kept the outer levels' "sub-call to ... failed"
    # and cut the cause itself, the one line that said what went wrong.
    chain = "".join(f"meta model 'relay{i:03}': sub-call to 'relay{i + 1:03}' failed: " for i in range(100))
    message = chain + "model 'scorer': input 'x': expected FP32, got INT64"
    capped = cap_message(message)
    assert len(capped) <= MESSAGE_LIMIT
    assert capped.startswith("meta model 'relay000': sub-call to 'relay001' failed: ")
    assert capped.endswith("model 'scorer': input 'x': expected FP32, got INT64")
    assert f" ... [{len(message) - (MESSAGE_LIMIT - 64)} characters cut] ... " in capped
    assert cap_message("short") == "short"
