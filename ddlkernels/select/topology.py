"""The cluster model the planner and the simulator share: levels of links, inside out.

Worked example
--------------
The paper's cluster, ``powerai-ddl``: 4 racks x 16 nodes x 4 GPUs = 256 ranks::

    level 3 "cluster": 4 racks behind a director switch      links=16 per rack, 9.5 GB/s each
      level 2 "rack": 16 nodes behind a top-of-rack switch   links=1 per node (the NIC), 10 GB/s
        level 1 "node": 4 GPUs on NVLink                     links=1 per GPU, 20 GB/s

Level ``i`` says how the ``fanout`` members of a level-``i`` group (level-``i-1``
groups; the members of a level-1 group are ranks) talk to each other: every
member has ``links`` links of ``bandwidth`` bytes/s per direction towards the
group's switch, and a message between two members costs ``latency`` seconds
on top of its bytes.  Ranks are numbered inside out: rank ``r`` sits in node
``r // 4``, rack ``r // 64``.

A message from rank 5 (node 1, rack 0) to rank 70 (node 17, rack 1) first
differs at level 3, so it leaves GPU 5 through its level-1 link, node 1 through
its level-2 link (the NIC it shares with the other 3 GPUs of node 1), rack 0
through one of its 16 level-3 links, and enters rack 1, node 17 and GPU 70 the
same way.  It pays the level-3 latency, and one message alone never moves
faster than the slowest level it crosses (here 9.5 GB/s); messages in flight
at once share each group's links (``links * bandwidth`` in each direction).
``ddlkernels.tools.simulator`` implements exactly this; ``docs/planner.md`` derives
the lower bound from it.

An optional ``capacity`` (bytes/s) caps everything moving between members of
one level-``i`` group at once: the memory bus of a node whose ranks talk
through shared memory, measured by ``ddlkernels.tools.calibrate``.  ``cpu_copy``
says that a message at this level is copied by the receiving rank's CPU (host
shared memory: MPI's single-copy read runs inside the receiver's MPI calls),
so it makes no progress while that rank is busy reducing; links driven by
DMA engines (NVLink, InfiniBand) leave it false.

Placement
---------
Presets are uniform trees: the product of the fan-outs is the number of ranks
and rank ``r``'s level-``j`` group is ``r // (f1 * ... * fj)``.  A detected job
may be uneven (3 ranks on one node, 2 on another) or place its ranks round
robin; it then carries an explicit ``placement``: for each rank, its group id
at levels 1..k-1 (the top level is the whole job).

The file format is JSON (``Topology.from_json`` / ``to_json``); unknown keys,
non-positive bandwidths and fan-outs that do not multiply to ``ranks`` are
rejected with an error that names the field.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

__all__ = [
    "Level",
    "Topology",
    "TopologyError",
    "preset_names",
    "load_preset",
    "load",
    "detect",
    "read_rack_map",
]

_PRESET_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "presets")

#: Reduction rate assumed when a topology file does not state one (bytes of
#: reduced data per second per rank): a single host core adding float32
#: arrays with numpy, the slowest executor ddlkernels has.
DEFAULT_REDUCE_RATE = 2.0e9


class TopologyError(ValueError):
    """A topology description is invalid; the message names the offending field."""


_LEVEL_KEYS = {"name", "fanout", "bandwidth", "latency", "links", "capacity", "cpu_copy", "note"}
_TOP_KEYS = {"name", "description", "ranks", "reduce_rate", "chunk_overhead", "levels", "placement", "hostnames", "notes", "source"}


def _positive(value, where: str, *, integer: bool = False, allow_none: bool = False):
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TopologyError(f"{where}: must be a positive {'integer' if integer else 'number'}, got {value!r}")
    if integer and int(value) != value:
        raise TopologyError(f"{where}: must be a positive integer, got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise TopologyError(f"{where}: must be a positive {'integer' if integer else 'number'}, got {value!r}")
    return int(value) if integer else float(value)


@dataclass(frozen=True)
class Level:
    """One level of the cluster (see the module docstring).

    ``fanout``    -- members per group of this level (ranks for level 1).
    ``bandwidth`` -- bytes/s per direction of one link between members.
    ``latency``   -- seconds per message between two members of one group.
    ``links``     -- links leaving each member towards the group's switch.
    ``capacity``  -- optional bytes/s cap on all traffic inside one group.
    ``cpu_copy``  -- messages are copied by the receiver's CPU (pause while it reduces).
    """

    name: str
    fanout: int
    bandwidth: float
    latency: float
    links: int = 1
    capacity: float | None = None
    cpu_copy: bool = False
    note: str = ""

    def check(self, where: str) -> "Level":
        if not isinstance(self.name, str) or not self.name:
            raise TopologyError(f"{where}.name: must be a non-empty string, got {self.name!r}")
        _positive(self.fanout, f"{where}.fanout", integer=True)
        _positive(self.bandwidth, f"{where}.bandwidth")
        if isinstance(self.latency, bool) or not isinstance(self.latency, (int, float)) or not math.isfinite(self.latency) or self.latency < 0:
            raise TopologyError(f"{where}.latency: must be a number of seconds >= 0, got {self.latency!r}")
        _positive(self.links, f"{where}.links", integer=True)
        _positive(self.capacity, f"{where}.capacity", allow_none=True)
        if not isinstance(self.cpu_copy, bool):
            raise TopologyError(f"{where}.cpu_copy: must be true or false, got {self.cpu_copy!r}")
        return self

    def to_dict(self) -> dict:
        d = {"name": self.name, "fanout": self.fanout, "bandwidth": self.bandwidth, "latency": self.latency, "links": self.links}
        if self.capacity is not None:
            d["capacity"] = self.capacity
        if self.cpu_copy:
            d["cpu_copy"] = True
        if self.note:
            d["note"] = self.note
        return d


@dataclass(frozen=True)
class Topology:
    """A cluster of ``ranks`` ranks described by ``levels`` (innermost first).

    ``reduce_rate`` -- bytes/s one rank reduces (reads two, writes one) while
    the network runs; ``chunk_overhead`` -- seconds of a rank's CPU per chunk
    it receives beyond moving and reducing the bytes (the engine's own work:
    wait, kernel call, repost, forward; 0 = not modelled, as for the presets,
    whose software is not this one); ``placement`` -- optional per-rank tuple of group ids at
    levels 1..k-1 (``None``: the uniform tree given by the fan-outs).
    """

    levels: tuple[Level, ...]
    ranks: int
    name: str = "custom"
    reduce_rate: float = DEFAULT_REDUCE_RATE
    chunk_overhead: float = 0.0
    placement: tuple[tuple[int, ...], ...] | None = None
    hostnames: tuple[str, ...] | None = None
    description: str = ""
    notes: tuple[str, ...] = field(default=())

    def __post_init__(self):
        object.__setattr__(self, "levels", tuple(self.levels))
        self.validate()

    # ------------------------------------------------------------------ checks
    def validate(self) -> None:
        if not self.levels:
            raise TopologyError("levels: a topology needs at least one level")
        for i, lv in enumerate(self.levels):
            if not isinstance(lv, Level):
                raise TopologyError(f"levels[{i}]: expected a Level, got {type(lv).__name__}")
            lv.check(f"levels[{i}]")
        _positive(self.ranks, "ranks", integer=True)
        _positive(self.reduce_rate, "reduce_rate")
        c = self.chunk_overhead
        if isinstance(c, bool) or not isinstance(c, (int, float)) or not math.isfinite(c) or c < 0:
            raise TopologyError(f"chunk_overhead: must be a number of seconds >= 0, got {c!r}")
        k = len(self.levels)
        if self.placement is None:
            prod = math.prod(lv.fanout for lv in self.levels)
            if prod != self.ranks:
                fan = " x ".join(str(lv.fanout) for lv in self.levels)
                raise TopologyError(f"levels[*].fanout: the fan-outs {fan} = {prod} ranks, but ranks = {self.ranks}")
        else:
            pl = tuple(tuple(int(g) for g in row) for row in self.placement)
            if len(pl) != self.ranks:
                raise TopologyError(f"placement: has {len(pl)} rows, but ranks = {self.ranks}")
            for r, row in enumerate(pl):
                if len(row) != k - 1:
                    raise TopologyError(f"placement[{r}]: needs {k - 1} group ids (levels 1..{k - 1}), got {len(row)}")
            # A group of level j must sit inside one group of level j+1.
            for j in range(k - 2):
                parent: dict[int, int] = {}
                for r, row in enumerate(pl):
                    if parent.setdefault(row[j], row[j + 1]) != row[j + 1]:
                        raise TopologyError(f"placement[{r}]: {self.levels[j].name} group {row[j]} lies in two {self.levels[j + 1].name} groups")
            object.__setattr__(self, "placement", pl)
        if self.hostnames is not None and len(self.hostnames) != self.ranks:
            raise TopologyError(f"hostnames: has {len(self.hostnames)} entries, but ranks = {self.ranks}")

    # --------------------------------------------------------------- structure
    @property
    def depth(self) -> int:
        return len(self.levels)

    def group_ids(self) -> list[list[int]]:
        """``ids[j][r]``: the level-``j`` group of rank ``r`` for j = 0..k (level 0: the rank itself)."""
        k = self.depth
        ids = [list(range(self.ranks))]
        if self.placement is None:
            size = 1
            for lv in self.levels[:-1]:
                size *= lv.fanout
                ids.append([r // size for r in range(self.ranks)])
        else:
            for j in range(k - 1):
                ids.append([row[j] for row in self.placement])
        ids.append([0] * self.ranks)
        return ids

    def topology_order(self) -> tuple[int, ...]:
        """Ranks sorted inside out (by outermost group, then inner groups, then rank).

        Used as ``Plan.order``: neighbours in the box are neighbours in the cluster.
        """
        ids = self.group_ids()
        return tuple(sorted(range(self.ranks), key=lambda r: tuple(ids[j][r] for j in range(self.depth, -1, -1))))

    def subset(self, p: int) -> "Topology":
        """The first ``p`` ranks of a uniform tree, filled inside out (a job on part of the cluster).

        ``p`` must fill whole groups up to some level and then a whole number
        of them at the next: on 4 x 16 x 4, p = 8 is 2 nodes, p = 128 is 2
        racks, p = 6 is refused.  Levels left with fan-out 1 are dropped.
        """
        if p == self.ranks:
            return self
        if self.placement is not None:
            raise TopologyError("subset: only uniform topologies (no placement) can be cut to fewer ranks")
        _positive(p, "ranks", integer=True)
        if p > self.ranks:
            raise TopologyError(f"ranks: {p} ranks do not fit on {self.name} ({self.ranks} ranks)")
        levels, rest = [], p
        for lv in self.levels:
            if rest == 1:
                break
            if rest >= lv.fanout:
                if rest % lv.fanout:
                    raise TopologyError(f"ranks: {p} ranks cannot fill {self.name} evenly ({lv.name} holds {lv.fanout})")
                levels.append(lv)
                rest //= lv.fanout
            else:
                levels.append(_replace(lv, fanout=rest))
                rest = 1
        if not levels:  # p == 1: a single rank still needs a level to be a valid topology
            levels = [_replace(self.levels[0], fanout=1)]
        return Topology(levels=tuple(levels), ranks=p, name=f"{self.name}[{p}]", reduce_rate=self.reduce_rate,
                        chunk_overhead=self.chunk_overhead, description=self.description, notes=self.notes)

    # ------------------------------------------------------------------- files
    def to_dict(self) -> dict:
        d: dict[str, Any] = {"name": self.name}
        if self.description:
            d["description"] = self.description
        d["ranks"] = self.ranks
        d["reduce_rate"] = self.reduce_rate
        if self.chunk_overhead:
            d["chunk_overhead"] = self.chunk_overhead
        d["levels"] = [lv.to_dict() for lv in self.levels]
        if self.placement is not None:
            d["placement"] = [list(row) for row in self.placement]
        if self.hostnames is not None:
            d["hostnames"] = list(self.hostnames)
        if self.notes:
            d["notes"] = list(self.notes)
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Topology":
        if not isinstance(d, Mapping):
            raise TopologyError(f"topology: expected a JSON object, got {type(d).__name__}")
        unknown = sorted(set(d) - _TOP_KEYS)
        if unknown:
            raise TopologyError(f"{unknown[0]}: unknown key (allowed: {', '.join(sorted(_TOP_KEYS))})")
        if "levels" not in d:
            raise TopologyError("levels: missing")
        if not isinstance(d["levels"], list):
            raise TopologyError("levels: must be a list of objects")
        levels = []
        for i, ld in enumerate(d["levels"]):
            if not isinstance(ld, Mapping):
                raise TopologyError(f"levels[{i}]: must be an object")
            unknown = sorted(set(ld) - _LEVEL_KEYS)
            if unknown:
                raise TopologyError(f"levels[{i}].{unknown[0]}: unknown key (allowed: {', '.join(sorted(_LEVEL_KEYS))})")
            for key in ("name", "fanout", "bandwidth", "latency"):
                if key not in ld:
                    raise TopologyError(f"levels[{i}].{key}: missing")
            levels.append(
                Level(
                    name=ld["name"],
                    fanout=ld["fanout"],
                    bandwidth=ld["bandwidth"],
                    latency=ld["latency"],
                    links=ld.get("links", 1),
                    capacity=ld.get("capacity"),
                    cpu_copy=ld.get("cpu_copy", False),
                    note=ld.get("note", ""),
                ).check(f"levels[{i}]")
            )
        ranks = d.get("ranks", math.prod(lv.fanout for lv in levels) if "placement" not in d else None)
        if ranks is None:
            raise TopologyError("ranks: missing (required with placement)")
        _positive(ranks, "ranks", integer=True)
        notes = d.get("notes", ())
        if isinstance(notes, str):
            notes = (notes,)
        return cls(
            levels=tuple(levels),
            ranks=int(ranks),
            name=str(d.get("name", "custom")),
            reduce_rate=d.get("reduce_rate", DEFAULT_REDUCE_RATE),
            chunk_overhead=d.get("chunk_overhead", 0.0),
            placement=d.get("placement"),
            hostnames=tuple(d["hostnames"]) if d.get("hostnames") is not None else None,
            description=str(d.get("description", "")),
            notes=tuple(notes),
        )

    @classmethod
    def from_json(cls, text: str) -> "Topology":
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise TopologyError(f"topology: not valid JSON ({e})") from None
        return cls.from_dict(d)

    def save(self, path: str) -> None:
        with open(path, "w", encoding="utf-8") as f:
            f.write(self.to_json() + "\n")


def _replace(lv: Level, **kw) -> Level:
    d = dict(name=lv.name, fanout=lv.fanout, bandwidth=lv.bandwidth, latency=lv.latency, links=lv.links, capacity=lv.capacity, cpu_copy=lv.cpu_copy, note=lv.note)
    d.update(kw)
    return Level(**d)


# --------------------------------------------------------------------- presets
def preset_names() -> list[str]:
    """Names of the shipped presets (files ``ddlkernels/select/presets/NAME.json``)."""
    return sorted(f[:-5] for f in os.listdir(_PRESET_DIR) if f.endswith(".json"))


def load_preset(name: str) -> Topology:
    path = os.path.join(_PRESET_DIR, f"{name}.json")
    if not os.path.isfile(path):
        raise TopologyError(f"topology: no preset named {name!r} (presets: {', '.join(preset_names())})")
    with open(path, encoding="utf-8") as f:
        return Topology.from_json(f.read())


def load(spec: str | Topology) -> Topology:
    """A topology from a preset name or a JSON file path (or a Topology, returned as is)."""
    if isinstance(spec, Topology):
        return spec
    if os.path.isfile(spec):
        with open(spec, encoding="utf-8") as f:
            try:
                return Topology.from_json(f.read())
            except TopologyError as e:
                raise TopologyError(f"{spec}: {e}") from None
    return load_preset(spec)


# ------------------------------------------------------------------- detection
#: Link parameters used by ``detect`` when no calibrated file is given: host
#: shared memory inside a node (memcpy through the MPI library), a 100 Gb/s
#: class network between nodes, one more switch hop between racks.  They only
#: steer the planner until ``python -m ddlkernels calibrate`` measures the job.
_DETECT_DEFAULTS = {
    "node": dict(bandwidth=5e9, latency=1e-6),
    "rack": dict(bandwidth=10e9, latency=5e-6),
    "cluster": dict(bandwidth=10e9, latency=7e-6),
}


def read_rack_map(path: str) -> dict[str, str]:
    """Read a rack map: JSON ``{"host": "rack", ...}`` or lines ``host rack`` (``#`` comments)."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if text.lstrip().startswith("{"):
        try:
            m = json.loads(text)
        except json.JSONDecodeError as e:
            raise TopologyError(f"{path}: not valid JSON ({e})") from None
        if not all(isinstance(k, str) and isinstance(v, (str, int)) for k, v in m.items()):
            raise TopologyError(f"{path}: a rack map maps host names to rack names")
        return {k: str(v) for k, v in m.items()}
    out = {}
    for n, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2:
            raise TopologyError(f"{path}:{n}: expected 'host rack', got {line!r}")
        out[parts[0]] = parts[1]
    return out


def _group_structure(node_of: Sequence[int], rack_of: Sequence[int] | None, hostnames, params, reduce_rate, name) -> Topology:
    """Build a Topology from per-rank node ids (and rack ids) with dense renumbering."""
    p = len(node_of)

    def dense(xs):
        m: dict[Any, int] = {}
        return [m.setdefault(x, len(m)) for x in xs]

    node_of = dense(node_of)
    n_nodes = max(node_of) + 1
    per_node = max(node_of.count(n) for n in range(n_nodes))

    def lv(level_name, fanout, proto_index):
        src = params.levels[proto_index] if params is not None and proto_index < params.depth else None
        if src is not None:
            return _replace(src, name=level_name, fanout=fanout)
        return Level(name=level_name, fanout=fanout, links=1, **_DETECT_DEFAULTS[level_name])

    levels = [lv("node", per_node, 0)]
    placement = [[n] for n in node_of]
    if n_nodes > 1:
        if rack_of is not None and len(set(rack_of)) > 1:
            rack_of = dense(rack_of)
            n_racks = max(rack_of) + 1
            nodes_in = [len({node_of[r] for r in range(p) if rack_of[r] == k}) for k in range(n_racks)]
            levels.append(lv("rack", max(nodes_in), 1))
            levels.append(lv("cluster", n_racks, 2))
            placement = [[node_of[r], rack_of[r]] for r in range(p)]
        else:
            levels.append(lv("rack", n_nodes, 1))
    uniform = _is_uniform_identity(placement, levels)
    return Topology(
        levels=tuple(levels),
        ranks=p,
        name=name,
        reduce_rate=params.reduce_rate if params is not None else reduce_rate,
        chunk_overhead=params.chunk_overhead if params is not None else 0.0,
        placement=None if uniform else tuple(tuple(row[: len(levels) - 1]) for row in placement),
        hostnames=tuple(hostnames) if hostnames is not None else None,
    )


def _is_uniform_identity(placement, levels) -> bool:
    """Whether the placement is exactly what the fan-outs imply (then it need not be stored)."""
    if math.prod(lv.fanout for lv in levels) != len(placement):
        return False
    size = 1
    for j, lv in enumerate(levels[:-1]):
        size *= lv.fanout
        if any(row[j] != r // size for r, row in enumerate(placement)):
            return False
    return True


def detect(where: Sequence[tuple[int, str]], rack_map: str | Mapping[str, str] | None = None,
           params: Topology | str | None = None) -> Topology:
    """The topology of the running job from ``where``, every rank's ``(node id, host name)`` as
    ``ddlkernels.algorithms.hier.node_split`` gathers them (ranks that share memory, or node labels, which
    may split MPI's nodes); no communication.

    Racks come from ``rack_map`` (a path or a ``{host: rack}`` dict) when
    given -- hosts missing from it are an error.
    Link parameters are copied level by level from ``params`` (a calibrated
    topology, as written by ``python -m ddlkernels calibrate``) when given, or
    else are the documented defaults ``_DETECT_DEFAULTS``.  Ranks may be placed
    unevenly or round robin; the result then carries a ``placement`` and the
    planner's ring order (``Topology.topology_order``) follows it.
    """
    node_of = [r[0] for r in where]
    hostnames = [r[1] for r in where]
    rack_of = None
    if rack_map is not None:
        m = read_rack_map(rack_map) if isinstance(rack_map, str) else dict(rack_map)
        missing = sorted({h for h in hostnames if h not in m})
        if missing:
            raise TopologyError(f"rack_map: no rack for host(s) {', '.join(missing)}")
        rack_of = [m[h] for h in hostnames]
    if isinstance(params, str):
        params = load(params)
    return _group_structure(node_of, rack_of, hostnames, params, DEFAULT_REDUCE_RATE, name="detected")
