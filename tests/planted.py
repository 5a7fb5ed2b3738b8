"""What every lab test asserts of its planted mistakes (imported by tests/test_lab_*.py)."""


def assert_each_named(got: dict[str, dict], want: dict[str, str]) -> None:
    """Each planted mistake `name` in `want` is refused (`got[name]["ok"]` is False) with one
    line containing `want[name]`, and no two mistakes share a message: a checker that said
    the same thing for all of them would name none."""
    messages = set()
    for name, text in want.items():
        assert got[name]["ok"] is False and text in got[name]["message"], (name, got[name])
        assert "\n" not in got[name]["message"], (name, got[name]["message"])
        messages.add(got[name]["message"])
    assert len(messages) == len(want), "two planted mistakes got the same message"


def broken_in(reference: str):
    """The plant of a lab test: ``broken(old, new)`` is `reference` (the lab's solution) with
    its first `old` replaced by `new` (or the same in another `source`); `old` must be there,
    so that a solution edited later cannot leave a plant that changes nothing."""
    def broken(old: str, new: str, source: str = reference) -> str:
        assert old in source, old
        return source.replace(old, new, 1)
    return broken
