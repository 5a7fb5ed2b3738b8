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
