"""The pure module paths above a name (dmuon.functional.module_paths)."""
from dmuon.functional.module_paths import ancestors, modules_above


def test_ancestors_nearest_first_without_the_root():
    assert ancestors("a.b.w") == ["a.b", "a"]
    assert ancestors("a.w") == ["a"]
    assert ancestors("w") == []


def test_modules_above_parents_before_children_each_once():
    assert modules_above(["x.y.w", "a.b.c.w", "a.v"]) == ["x", "a", "x.y", "a.b", "a.b.c"]
    assert modules_above(["w", "v"]) == []
