"""The pure module paths above a name (dmuon.functional.module_paths)."""
from dmuon.functional.module_paths import ancestors


def test_ancestors_nearest_first_without_the_root():
    assert ancestors("a.b.w") == ["a.b", "a"]
    assert ancestors("a.w") == ["a"]
    assert ancestors("w") == []

