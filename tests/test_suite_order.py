"""The suite's own scheduling (tests/conftest.py): under pytest-xdist the heaviest files are handed out
first, so that no heavy file starts when the other worker has nothing left."""

from __future__ import annotations

import types
from pathlib import Path

import conftest


def test_every_heaviest_file_exists():
    """A renamed or removed file in HEAVIEST_FILES would silently go back to being handed out last."""
    here = Path(__file__).parent
    assert [name for name in conftest.HEAVIEST_FILES if not (here / name).is_file()] == []
    assert len(set(conftest.HEAVIEST_FILES)) == len(conftest.HEAVIEST_FILES)


def _items(*names):
    return [
        types.SimpleNamespace(path=Path("tests") / name, nodeid=f"tests/{name}::t{i}") for i, name in enumerate(names)
    ]


def test_a_worker_puts_the_heaviest_files_first_and_keeps_the_rest_in_order():
    light_a, light_b = "test_a.py", "test_zz.py"
    first, second = conftest.HEAVIEST_FILES[:2]
    items = _items(light_a, light_a, second, light_b, first, first)
    worker = types.SimpleNamespace(workerinput={"workerid": "gw0"})
    conftest.pytest_collection_modifyitems(worker, items)
    assert [item.nodeid for item in items] == [
        f"tests/{first}::t4",
        f"tests/{first}::t5",
        f"tests/{second}::t2",
        f"tests/{light_a}::t0",
        f"tests/{light_a}::t1",
        f"tests/{light_b}::t3",
    ]
    alone = _items(light_b, first)  # without xdist (no workerinput): the collection's order
    conftest.pytest_collection_modifyitems(types.SimpleNamespace(), alone)
    assert [item.path.name for item in alone] == [light_b, first]


def test_loadfile_hands_out_files_in_the_collections_order():
    """xdist's default (loadscope-reorder) sorts the files by their number of tests; the controller's
    configure turns that off under --dist loadfile, so the worker's order above is the order handed out."""
    option = types.SimpleNamespace(dist="loadfile", loadscopereorder=True)
    conftest._heaviest_files_first(types.SimpleNamespace(option=option))
    assert option.loadscopereorder is False
    option = types.SimpleNamespace(dist="load", loadscopereorder=True)
    conftest._heaviest_files_first(types.SimpleNamespace(option=option))
    assert option.loadscopereorder is True
