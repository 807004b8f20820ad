"""The intrusive doubly linked free list (server/ledger/freelist.py)."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvkeeper.server.ledger.freelist import FreeList


class Node:
    __slots__ = ("name", "prev", "next")

    def __init__(self, name: str) -> None:
        self.name = name
        self.prev = None
        self.next = None

    def __repr__(self) -> str:
        return f"Node({self.name})"


def names(fl: FreeList) -> list[str]:
    return [n.name for n in fl]


def check_links(fl: FreeList) -> None:
    """Forward and backward walks agree and match len()."""
    fwd, node = [], fl._head.next
    while node is not fl._tail:
        fwd.append(node)
        node = node.next
    back, node = [], fl._tail.prev
    while node is not fl._head:
        back.append(node)
        node = node.prev
    assert fwd == back[::-1]
    assert len(fwd) == len(fl)


def linked(labels: str) -> tuple[FreeList, list[Node]]:
    """A list of one node per label, appended in order."""
    fl, nodes = FreeList(), [Node(n) for n in labels]
    for n in nodes:
        fl.append(n)
    return fl, nodes


def test_empty_list():
    fl = FreeList()
    assert len(fl) == 0 and list(fl) == []
    assert fl.popleft() is None and fl.peekleft() is None
    check_links(fl)


def test_append_keeps_insertion_order_and_popleft_takes_the_oldest():
    fl, (a, b, c) = linked("abc")
    assert names(fl) == ["a", "b", "c"] and len(fl) == 3
    assert fl.peekleft() is a and len(fl) == 3  # peek does not unlink
    assert fl.popleft() is a
    assert a.prev is None and a.next is None
    assert names(fl) == ["b", "c"] and len(fl) == 2
    check_links(fl)


@pytest.mark.parametrize("victim", ["a", "b", "c"])
def test_remove_from_any_position(victim):
    fl = FreeList()
    nodes = {n: Node(n) for n in "abc"}
    for n in nodes.values():
        fl.append(n)
    fl.remove(nodes[victim])
    assert names(fl) == [n for n in "abc" if n != victim]
    assert nodes[victim].prev is None and nodes[victim].next is None
    check_links(fl)
    # An unlinked node can be appended again; it goes to the back.
    fl.append(nodes[victim])
    assert names(fl)[-1] == victim and len(fl) == 3
    check_links(fl)


def test_remove_relinks_only_the_neighbours():
    # O(1): remove touches the node and its two neighbours, nothing else.
    fl, (a, b, c) = linked("abc")
    fl.remove(b)
    assert a.next is c and c.prev is a


@pytest.mark.parametrize("victim", ["a", "b", "c"])
@pytest.mark.parametrize("move", ["move_to_back", "move_to_front"])
def test_a_move_relinks_in_one_step(victim, move):
    fl = FreeList()
    nodes = {n: Node(n) for n in "abc"}
    for n in nodes.values():
        fl.append(n)
    getattr(fl, move)(nodes[victim])
    rest = [n for n in "abc" if n != victim]
    assert names(fl) == (rest + [victim] if move == "move_to_back" else [victim] + rest)
    assert len(fl) == 3
    check_links(fl)


def test_move_to_front_makes_it_the_next_popleft_and_an_unlinked_node_raises():
    fl, nodes = linked("abc")
    fl.move_to_front(nodes[2])
    assert fl.popleft() is nodes[2]
    with pytest.raises(ValueError):
        fl.move_to_front(nodes[2])      # not linked any more: changes nothing
    assert names(fl) == ["a", "b"] and len(fl) == 2
    check_links(fl)




@settings(max_examples=150, deadline=None)
@given(size=st.integers(1, 8), moves=st.lists(st.integers(0, 7), max_size=12))
def test_move_all_to_back_equals_one_move_to_back_per_node(size, moves):
    """The batch move (a lookup's run of hits) ends in the order the single moves
    would give, nodes named twice included, and its fast path (the run already at
    the back) as well: each batch is applied twice."""
    one, batch = FreeList(), FreeList()
    a = [Node(str(i)) for i in range(size)]
    b = [Node(str(i)) for i in range(size)]
    for x, y in zip(a, b):
        one.append(x)
        batch.append(y)
    run = [i for i in moves if i < size]
    for _ in range(2):
        for i in run:
            one.move_to_back(a[i])
        batch.move_all_to_back([b[i] for i in run])
        assert names(batch) == names(one)
        check_links(batch)


def test_move_all_to_back_with_an_unlinked_node_raises_and_changes_nothing():
    fl, (a, b, c) = linked("abc")
    with pytest.raises(ValueError, match="not linked"):
        fl.move_all_to_back([a, Node("x"), b])
    assert names(fl) == ["a", "b", "c"] and len(fl) == 3
    check_links(fl)
    fl.move_all_to_back([])
    assert names(fl) == ["a", "b", "c"]


def test_move_to_back_of_an_unlinked_node_raises_and_changes_nothing():
    fl = FreeList()
    a = Node("a")
    fl.append(a)
    with pytest.raises(ValueError, match="not linked"):
        fl.move_to_back(Node("x"))
    assert names(fl) == ["a"] and len(fl) == 1
    fl.move_to_back(a)                     # the only node: stays where it is
    assert names(fl) == ["a"] and len(fl) == 1
    check_links(fl)


def test_double_append_raises_and_changes_nothing():
    fl = FreeList()
    a, b = Node("a"), Node("b")
    fl.append(a)
    fl.append(b)
    with pytest.raises(ValueError, match="already linked"):
        fl.append(a)
    assert names(fl) == ["a", "b"] and len(fl) == 2
    check_links(fl)


def test_append_of_a_node_linked_in_another_list_raises():
    one, two = FreeList(), FreeList()
    a = Node("a")
    one.append(a)
    with pytest.raises(ValueError):
        two.append(a)
    assert len(two) == 0 and names(one) == ["a"]


def test_remove_of_an_unlinked_node_raises_and_changes_nothing():
    fl = FreeList()
    a, b = Node("a"), Node("b")
    fl.append(a)
    with pytest.raises(ValueError, match="not linked"):
        fl.remove(b)
    fl.remove(a)
    with pytest.raises(ValueError):
        fl.remove(a)  # twice
    assert len(fl) == 0 and list(fl) == []
    check_links(fl)


def test_iteration_survives_removing_the_current_node():
    fl = FreeList()
    nodes = [Node(str(i)) for i in range(5)]
    for n in nodes:
        fl.append(n)
    seen = []
    for n in fl:
        seen.append(n.name)
        if int(n.name) % 2 == 0:
            fl.remove(n)
    assert seen == ["0", "1", "2", "3", "4"]
    assert names(fl) == ["1", "3"]
    check_links(fl)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["append", "remove", "popleft", "move"]),
                          st.integers(0, 5)), max_size=60))
def test_matches_a_python_list_model(ops):
    fl, model = FreeList(), []
    nodes = [Node(str(i)) for i in range(6)]
    for op, i in ops:
        n = nodes[i]
        if op == "append":
            if n in model:
                with pytest.raises(ValueError):
                    fl.append(n)
            else:
                fl.append(n)
                model.append(n)
        elif op == "remove":
            if n in model:
                fl.remove(n)
                model.remove(n)
            else:
                with pytest.raises(ValueError):
                    fl.remove(n)
        elif op == "move":
            if n in model:
                fl.move_to_back(n)
                model.remove(n)
                model.append(n)
            else:
                with pytest.raises(ValueError):
                    fl.move_to_back(n)
        else:
            got = fl.popleft()
            assert got is (model.pop(0) if model else None)
        assert list(fl) == model
        assert fl.peekleft() is (model[0] if model else None)
        check_links(fl)


def test_discard_empty_leaves_nothing_for_the_cyclic_gc() -> None:
    import gc
    fl = FreeList()
    a = Node("a")
    fl.append(a)
    with pytest.raises(ValueError, match="still holds 1"):
        fl.discard_empty()
    assert names(fl) == ["a"]                 # refused: unchanged
    fl.popleft()
    was = gc.isenabled()
    gc.disable()
    try:
        gc.collect()
        fl.discard_empty()
        del fl
        assert gc.collect() == 0              # the two sentinels went by reference count
        other = FreeList()
        del other
        assert gc.collect() == 2              # without it, an empty list is a cycle
    finally:
        if was:
            gc.enable()
