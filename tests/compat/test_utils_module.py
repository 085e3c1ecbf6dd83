"""spmd_torch.utils.utils (xu): typed environment reads, data generators, the nested-data
walkers, shapes, timing lines, temporary folders, free ports and thread-pool work."""

from __future__ import annotations

import collections
import gc
import os
import re
import socket

import pytest
import torch

import spmd_torch.utils.utils as xu
from tests.helpers import assert_close


@pytest.mark.parametrize(
    "raw, kind, expected",
    [
        ("12", int, 12),
        ("2.5", float, 2.5),
        ("abc", str, "abc"),
        ("0", bool, False),
        ("1", bool, True),
        ("2", bool, True),
        ("true", bool, True),
        ("Off", bool, False),
    ],
)
def test_getenv_as_parses_types(monkeypatch, raw, kind, expected):
    monkeypatch.setenv("XU_TEST_VALUE", raw)
    assert xu.getenv_as("XU_TEST_VALUE", kind, None) == expected
    assert type(xu.getenv_as("XU_TEST_VALUE", kind)) is kind


def test_getenv_as_default_when_unset(monkeypatch):
    monkeypatch.delenv("XU_TEST_VALUE", raising=False)
    assert xu.getenv_as("XU_TEST_VALUE", int, 7) == 7
    assert xu.getenv_as("XU_TEST_VALUE", bool) is None


def test_getenv_as_names_the_variable_it_cannot_parse(monkeypatch):
    monkeypatch.setenv("XU_TEST_VALUE", "many")
    with pytest.raises(ValueError, match="XU_TEST_VALUE='many' is not a valid int"):
        xu.getenv_as("XU_TEST_VALUE", int)
    with pytest.raises(ValueError, match="is not a valid bool"):
        xu.getenv_as("XU_TEST_VALUE", bool)


def test_check_env_flag(monkeypatch):
    for raw, expected in (("1", True), ("Yes", True), ("y", True), ("0", False), ("no", False)):
        monkeypatch.setenv("XU_TEST_FLAG", raw)
        assert xu.check_env_flag("XU_TEST_FLAG") is expected
    monkeypatch.delenv("XU_TEST_FLAG")
    assert xu.check_env_flag("XU_TEST_FLAG") is False
    assert xu.check_env_flag("XU_TEST_FLAG", "ON") is True


def test_sample_generator_yields_the_sample_count_times_each_epoch():
    data = (torch.zeros(2), torch.ones(2))
    loader = xu.SampleGenerator(data, 3)
    assert len(loader) == 3
    assert [batch is data for batch in loader] == [True] * 3
    assert len(list(loader)) == 3  # a second epoch starts over


def test_fn_data_generator_pairs_data_and_target():
    loader = xu.FnDataGenerator(lambda x: x.sum(1), 4, torch.ones, dims=[3], count=2)
    pairs = list(loader)
    assert len(loader) == 2 and len(pairs) == 2
    for data, target in pairs:
        assert data.shape == (4, 3)
        assert_close(target, torch.full((4,), 3.0), tol="exact")  # sums of three ones


class Pair(xu.DataWrapper):
    def __init__(self, a, b):
        self.a, self.b = a, b

    def get_tensors(self):
        return [self.a, self.b]

    def from_tensors(self, tensors):
        return Pair(*tensors)


class Holder:
    def __init__(self, value):
        self.value = value
        self.name = "holder"


def test_for_each_instance_visits_every_selected_value_once():
    a, b, c = torch.tensor(1), torch.tensor(2), torch.tensor(3)
    data = {"x": [a, (b, a)], a: "key", "pair": Pair(c, b), "obj": Holder({c}), "n": 5}
    seen = []
    xu.for_each_instance(data, torch.is_tensor, lambda t: seen.append(t.item()))
    assert seen == [1, 2, 3]


def test_for_each_instance_rewrite_replaces_and_keeps_structure():
    Point = collections.namedtuple("Point", "x y")
    a, b = torch.tensor(1), torch.tensor(2)
    holder = Holder(a)
    untouched = ["text", 3]
    data = {"p": Point(a, b), "t": (a, 4), "pair": Pair(a, b), "h": holder, "u": untouched}
    out = xu.for_each_instance_rewrite(data, torch.is_tensor, lambda t: t.item() * 10)
    assert out["p"] == Point(10, 20) and type(out["p"]) is Point
    assert out["t"] == (10, 4) and type(out["t"]) is tuple
    assert (out["pair"].a, out["pair"].b) == (10, 20)
    assert out["h"] is not holder and out["h"].value == 10 and out["h"].name == "holder"
    assert holder.value is a  # the input is not mutated
    assert out["u"] is untouched  # nothing selected inside: the same object


def test_for_each_instance_rewrite_converts_a_shared_value_once():
    a = torch.tensor(1)
    calls = []
    out = xu.for_each_instance_rewrite([a, [a]], torch.is_tensor, lambda t: calls.append(t) or 9)
    assert out == [9, [9]] and len(calls) == 1


def test_rewrite_visits_attribute_values_not_names_in_the_walks_order():
    class Obj:
        def __init__(self):
            self.a = {"k": [1, 2], 4.5: "y"}
            self.b = ("f", 17)

    shared = Obj()
    data = {2.5: 11, "w": [12, Obj(), shared], 123: shared}
    walked, rewritten = [], []
    atom = lambda x: isinstance(x, (int, str, float))  # noqa: E731
    xu.for_each_instance(data, atom, walked.append)
    xu.for_each_instance_rewrite(data, atom, lambda x: rewritten.append(x) or x)
    assert walked == rewritten == [2.5, 11, "w", 12, "k", 1, 2, 4.5, "y", "f", 17, 123]


def test_rewrite_follows_cycles_once_and_points_them_at_the_copies():
    class Node:
        pass

    node, ring = Node(), [1]
    node.value, node.me, node.ring = 1, node, ring
    ring.append(ring)
    calls = []
    out = xu.for_each_instance_rewrite(
        node, lambda x: type(x) is int, lambda x: calls.append(x) or x + 1
    )
    assert calls == [1]  # the shared int 1 converted once
    assert out is not node and out.value == 2 and out.me is out
    assert out.ring == [2, out.ring] and out.ring[1] is out.ring
    assert node.value == 1 and node.me is node and ring[0] == 1  # the input is not mutated


def test_shape_and_flatten():
    assert xu.shape([[1, 2, 3], [4, 5, 6]]) == [2, 3]
    assert xu.shape(7) == []
    with pytest.raises(ValueError, match="element 1 has shape \\[2\\], element 0 has \\[3\\]"):
        xu.shape([[1, 2, 3], [4, 5]])
    assert xu.flatten_nested_tuple((1, (2, [3, 4]), 5)) == (1, 2, 3, 4, 5)
    assert xu.as_list(3) == [3] and xu.as_list((1, 2)) == (1, 2)
    base = [1]
    assert xu.list_copy_append(base, 2) == [1, 2] and base == [1]


def test_lazy_property_computes_once():
    calls = []
    prop = xu.LazyProperty(lambda: calls.append(1) or 42)
    assert calls == []
    assert prop.value == 42 and prop.value == 42
    assert calls == [1]


def test_timed_and_timed_scope_print_the_elapsed_time():
    lines = []
    assert xu.timed(lambda: 5, msg="step: ", printfn=lines.append) == 5
    with xu.TimedScope("block: ", printfn=lines.append):
        pass
    with xu.TimedScope("failed: ", printfn=lines.append) as scope:
        scope.set_error(ValueError("x"))
    assert len(lines) == 2
    assert re.fullmatch(r"step: \d+\.\d{3}ms", lines[0])
    assert re.fullmatch(r"block: \d+\.\d{3}ms", lines[1])


def test_get_print_fn_follows_debug(monkeypatch, capsys):
    monkeypatch.setenv("DEBUG", "1")
    xu.get_print_fn()("shown")
    monkeypatch.setenv("DEBUG", "0")
    xu.get_print_fn()("hidden")
    assert capsys.readouterr().err == "shown\n"


def test_tmp_folder_is_removed_with_the_object():
    folder = xu.TmpFolder()
    name = folder.name
    with open(os.path.join(name, "f.txt"), "w") as f:
        f.write("x")
    del folder
    gc.collect()
    assert not os.path.exists(name)


def test_get_free_tcp_ports_are_distinct_and_bindable():
    ports = xu.get_free_tcp_ports(3)
    assert len(set(ports)) == 3
    for port in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("", port))


def test_parallel_work_keeps_order_and_raises_errors():
    assert xu.parallel_work(3, lambda a, b: a * b, [1, 2, 3, 4], [5, 6, 7, 8]) == [5, 12, 21, 32]

    def fail(x):
        raise KeyError(x)

    with pytest.raises(KeyError):
        xu.parallel_work(2, fail, [1, 2])
