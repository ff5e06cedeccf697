"""The topology model: presets, file validation (errors name the field), structure, detection helpers."""

import json
import os
import subprocess
import sys

import pytest

from ddlkernels.select import topology as T
from ddlkernels.select.topology import Level, Topology, TopologyError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _level(**kw):
    d = dict(name="node", fanout=4, bandwidth=1e10, latency=1e-6)
    d.update(kw)
    return d


def test_presets_load_and_are_complete():
    names = T.preset_names()
    assert {"powerai-ddl", "dgx1-goyal", "h100-ib"} <= set(names)
    for name in names:
        topo = T.load_preset(name)
        assert topo.ranks == 256
        # Every level states why its latency is what it is.
        assert all("atency" in lv.note for lv in topo.levels), name
    pw = T.load_preset("powerai-ddl")
    assert [lv.fanout for lv in pw.levels] == [4, 16, 4]
    assert [lv.bandwidth for lv in pw.levels] == [20e9, 10e9, 9.5e9]


def test_json_round_trip():
    for name in T.preset_names():
        topo = T.load_preset(name)
        again = Topology.from_json(topo.to_json())
        assert again == topo


@pytest.mark.parametrize(
    "doc, field",
    [
        ({"levels": [_level(bandwidth=-5.0)]}, "levels[0].bandwidth"),
        ({"levels": [_level(bandwidth=0)]}, "levels[0].bandwidth"),
        ({"levels": [_level(latency=-1e-6)]}, "levels[0].latency"),
        ({"levels": [_level(fanout=0)]}, "levels[0].fanout"),
        ({"levels": [_level(fanout=2.5)]}, "levels[0].fanout"),
        ({"levels": [_level(links=0)]}, "levels[0].links"),
        ({"levels": [_level(capacity=-1.0)]}, "levels[0].capacity"),
        ({"levels": [_level(), _level(name="rack", fanout=3)], "ranks": 16}, "fanout"),
        ({"levels": [_level()], "ranks": 5}, "fanout"),
        ({"levels": [_level()], "bandwith": 3}, "bandwith"),
        ({"levels": [_level(bandwith=3e9)]}, "levels[0].bandwith"),
        ({"levels": [{"name": "node", "fanout": 4, "latency": 1e-6}]}, "levels[0].bandwidth"),
        ({"levels": []}, "levels"),
        ({}, "levels"),
        ({"levels": [_level()], "reduce_rate": "fast"}, "reduce_rate"),
        ({"levels": [_level(fanout=2), _level(name="rack", fanout=2)], "ranks": 4, "placement": [[0], [1], [0]]}, "placement"),
    ],
)
def test_bad_files_name_the_field(doc, field):
    with pytest.raises(TopologyError) as e:
        Topology.from_json(json.dumps(doc))
    assert field in str(e.value)


def test_not_json():
    with pytest.raises(TopologyError, match="not valid JSON"):
        Topology.from_json("{levels: ")


def test_cli_bad_file_exits_nonzero_naming_field(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"levels": [_level(), _level(name="rack", fanout=4, bandwidth=-1.0)], "ranks": 16}))
    for cmd in ("plan", "simulate"):
        r = subprocess.run([sys.executable, "-m", "ddlkernels", cmd, "--topology", str(bad), "--bytes", "1M"],
                           capture_output=True, text=True, cwd=ROOT)
        assert r.returncode == 2, r.stderr
        assert "levels[1].bandwidth" in r.stderr
    bad.write_text(json.dumps({"levels": [_level(fanout=4)], "ranks": 6}))
    r = subprocess.run([sys.executable, "-m", "ddlkernels", "plan", "--topology", str(bad), "--bytes", "1M"],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2 and "fanout" in r.stderr and "ranks = 6" in r.stderr
    bad.write_text(json.dumps({"levels": [_level()], "color": "red"}))
    r = subprocess.run([sys.executable, "-m", "ddlkernels", "plan", "--topology", str(bad), "--bytes", "1M"],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2 and "color" in r.stderr and "unknown key" in r.stderr


def test_unknown_preset():
    with pytest.raises(TopologyError, match="no preset named"):
        T.load("no-such-cluster")


def test_uniform_group_ids():
    topo = T.load_preset("powerai-ddl")
    ids = topo.group_ids()
    assert len(ids) == 4
    assert ids[0][70] == 70 and ids[1][70] == 17 and ids[2][70] == 1 and ids[3][70] == 0
    assert topo.topology_order() == tuple(range(256))


@pytest.mark.parametrize("p, fanouts", [(1, [1]), (2, [2]), (4, [4]), (8, [4, 2]), (12, [4, 3]), (64, [4, 16]), (128, [4, 16, 2]), (256, [4, 16, 4])])
def test_subset(p, fanouts):
    sub = T.load_preset("powerai-ddl").subset(p)
    assert sub.ranks == p
    assert [lv.fanout for lv in sub.levels] == fanouts


@pytest.mark.parametrize("p", [6, 7, 100, 257, 0])
def test_subset_refuses_uneven(p):
    with pytest.raises(TopologyError, match="ranks"):
        T.load_preset("powerai-ddl").subset(p)


def test_placement_uneven_and_round_robin():
    # 5 ranks on 2 nodes, placed round robin by the launcher: 0,2,4 on node 0; 1,3 on node 1.
    topo = T._group_structure([0, 1, 0, 1, 0], None, ["a", "b", "a", "b", "a"], None, 1e9, "t")
    assert topo.ranks == 5 and topo.placement == ((0,), (1,), (0,), (1,), (0,))
    assert [lv.fanout for lv in topo.levels] == [3, 2]
    assert topo.topology_order() == (0, 2, 4, 1, 3)
    again = Topology.from_json(topo.to_json())
    assert again == topo


def test_detect_structure_with_racks(tmp_path):
    rack_file = tmp_path / "racks.txt"
    rack_file.write_text("# host rack\nh0 r0\nh1 r0\nh2 r1\nh3 r1\n")
    m = T.read_rack_map(str(rack_file))
    assert m == {"h0": "r0", "h1": "r0", "h2": "r1", "h3": "r1"}
    (tmp_path / "racks.json").write_text(json.dumps(m))
    assert T.read_rack_map(str(tmp_path / "racks.json")) == m
    hosts = [f"h{r // 2}" for r in range(8)]  # 2 ranks per host, 4 hosts, 2 racks
    topo = T._group_structure([r // 2 for r in range(8)], [m[h] for h in hosts], hosts, None, 1e9, "t")
    assert [lv.name for lv in topo.levels] == ["node", "rack", "cluster"]
    assert [lv.fanout for lv in topo.levels] == [2, 2, 2]
    assert topo.placement is None  # exactly the uniform tree, so no placement is stored
    (tmp_path / "bad.txt").write_text("h0 r0 extra\n")
    with pytest.raises(TopologyError, match="bad.txt:1"):
        T.read_rack_map(str(tmp_path / "bad.txt"))


def test_detect_params_copied_from_calibrated():
    params = Topology(levels=(Level("node", 2, 3e9, 2e-6, capacity=4e9),), ranks=2, reduce_rate=1e9)
    topo = T._group_structure([0, 0, 1, 1], None, None, params, 5e9, "t")
    assert topo.levels[0].bandwidth == 3e9 and topo.levels[0].capacity == 4e9
    assert topo.levels[1].bandwidth == T._DETECT_DEFAULTS["rack"]["bandwidth"]
    assert topo.reduce_rate == 1e9


def test_detect_on_this_process():
    from mpi4py import MPI

    from ddlkernels.algorithms.hier import node_split

    nodes, where = node_split(MPI.COMM_WORLD)
    nodes.Free()
    topo = T.detect(where)
    assert topo.ranks == MPI.COMM_WORLD.Get_size()
    assert topo.hostnames is not None and len(topo.hostnames) == topo.ranks


def test_node_labels_split_mpi_nodes_and_never_join_them():
    from ddlkernels.algorithms.hier import check_node, node_colors

    # (label, lowest rank of its shared-memory node) per rank: 4 ranks on shared nodes 0 and 2.
    assert node_colors([(None, 0), (None, 0), (None, 2), (None, 2)]) is None  # MPI's split stands
    assert node_colors([("a", 0), ("a", 0), ("b", 2), ("b", 2)]) == [0, 0, 2, 2]
    assert node_colors([(0, 0), (1, 0), (0 + 2, 2), (3, 2)]) == [0, 1, 2, 3]  # one rank per node
    assert node_colors([("x", 0), ("y", 0), ("x", 0), ("y", 0)]) == [0, 1, 0, 1]  # round robin on one machine
    assert node_colors([(1, 0), ("1", 0)]) == [0, 1]  # labels compare as given: the int 1 is not "1"
    with pytest.raises(ValueError, match=r"ranks 1 and 2 gave the node label 'a' but do not share memory"):
        node_colors([("b", 0), ("a", 0), ("a", 2), ("c", 2)])
    with pytest.raises(ValueError, match=r"rank\(s\) \[0, 3\] gave no node label"):
        node_colors([(None, 0), ("a", 0), ("a", 0), (None, 0)])
    import numpy as np

    assert check_node(np.int64(3)) == 3 and type(check_node(np.int64(3))) is int and check_node("n") == "n"
    for bad in (True, 1.5, ("a",), b"n"):
        with pytest.raises(TypeError, match="node must be None, a str or an int"):
            check_node(bad)
