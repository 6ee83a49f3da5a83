"""Mesh topology: CUBEs of PEs on a 2-D grid, logical ranks placed on physical coordinates.

Vocabulary (ADR-0060 §0): an AHBM chip is a set of CUBEs (memory cubes whose logic die holds
PEs). Here the chip's PEs form one `rows x cols` grid; CUBEs are the `cube_rows x cube_cols`
blocks of that grid. Each PE has four IPCQ queue pairs, N/S/E/W, to its physical neighbours
(N = row - 1, S = row + 1, W = col - 1, E = col + 1); a PE on the grid edge has no queue pair
in that direction. Links between two CUBEs exist but cost `cube_crossing_latency_ns` extra.

A kernel sees *ranks* (`tl.program_id()`), not coordinates. `placement[rank] = (row, col)` says
where each rank sits; the default is row-major. ADR-0060 §4/§9 requires every reduction-tree
pair to be a physical neighbour: `tree.tree_placement` computes such a placement.
"""
from __future__ import annotations

from dataclasses import dataclass

from .errors import TopologyError

DIRECTIONS: dict[str, tuple[int, int]] = {"N": (-1, 0), "S": (1, 0), "W": (0, -1), "E": (0, 1)}
OPPOSITE = {"N": "S", "S": "N", "E": "W", "W": "E"}


@dataclass(frozen=True)
class MeshConfig:
    """Shape of the mesh and per-PE capacities (the timing lives in `LatencyModel`)."""

    rows: int = 1
    cols: int = 1
    cube_rows: int | None = None
    """PE rows per CUBE; None: the whole mesh is one CUBE."""
    cube_cols: int | None = None
    """PE columns per CUBE; None: the whole mesh is one CUBE."""
    scratch_bytes: int = 1 << 20
    """Scratch (TCM) per PE: 1 MiB, bump-allocated (ADR-0060 §A.3)."""
    scratch_align: int = 64
    """Every scratch allocation starts on this many bytes."""
    hbm_bytes: int = 1 << 31
    """Address space of one PE's HBM (2 GiB); buffers are allocated in it 4 KiB-aligned."""
    placement: tuple[tuple[int, int], ...] | None = None
    """placement[rank] = (row, col); None: row-major (rank = row * cols + col)."""


class Topology:
    """Rank <-> coordinate, neighbours, directions and dimension-ordered (X then Y) routes."""

    def __init__(self, config: MeshConfig):
        if config.rows < 1 or config.cols < 1:
            raise TopologyError(f"mesh must have at least 1x1 PEs, got {config.rows}x{config.cols}")
        self.rows, self.cols = config.rows, config.cols
        self.cube_rows = config.cube_rows or config.rows
        self.cube_cols = config.cube_cols or config.cols
        if self.rows % self.cube_rows or self.cols % self.cube_cols:
            raise TopologyError(f"CUBE {self.cube_rows}x{self.cube_cols} does not tile the "
                                f"{self.rows}x{self.cols} mesh")
        cells = [(r, c) for r in range(self.rows) for c in range(self.cols)]
        placement = list(config.placement) if config.placement is not None else cells
        placement = [tuple(p) for p in placement]
        if sorted(placement) != cells:
            raise TopologyError(f"placement must list each of the {len(cells)} mesh coordinates "
                                f"exactly once, got {placement}")
        self._coord = placement
        self._rank = {coord: rank for rank, coord in enumerate(placement)}

    @property
    def size(self) -> int:
        return self.rows * self.cols

    def coord(self, rank: int) -> tuple[int, int]:
        self.check_rank(rank)
        return self._coord[rank]

    def rank_at(self, row: int, col: int) -> int | None:
        return self._rank.get((row, col))

    def cube_of(self, rank: int) -> tuple[int, int]:
        r, c = self.coord(rank)
        return r // self.cube_rows, c // self.cube_cols

    def describe(self, rank: int) -> str:
        r, c = self.coord(rank)
        return f"PE {rank} (row {r}, col {c})"

    def check_rank(self, rank) -> None:
        if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < self.size:
            raise TopologyError(f"no PE {rank!r} on the {self.rows}x{self.cols} mesh "
                                f"(ranks are 0..{self.size - 1})")

    def neighbour(self, rank: int, direction: str) -> int | None:
        if direction not in DIRECTIONS:
            raise TopologyError(f"{self.describe(rank)}: unknown direction {direction!r} "
                                f"(expected one of N, S, E, W)")
        dr, dc = DIRECTIONS[direction]
        r, c = self.coord(rank)
        return self.rank_at(r + dr, c + dc)

    def direction(self, src: int, dst: int) -> str | None:
        """The direction from src to dst when they are physical neighbours, else None."""
        for d in DIRECTIONS:
            if self.neighbour(src, d) == dst:
                return d
        return None

    def route(self, src: int, dst: int) -> list[tuple[int, int]]:
        """Directed links (from_rank, to_rank) from src to dst, X (E/W) first, then Y (N/S)."""
        self.check_rank(src)
        self.check_rank(dst)
        (r, c), (r1, c1) = self.coord(src), self.coord(dst)
        links = []
        here = src
        while c != c1:
            c += 1 if c1 > c else -1
            nxt = self._rank[(r, c)]
            links.append((here, nxt))
            here = nxt
        while r != r1:
            r += 1 if r1 > r else -1
            nxt = self._rank[(r, c)]
            links.append((here, nxt))
            here = nxt
        return links

    def crosses_cube(self, a: int, b: int) -> bool:
        return self.cube_of(a) != self.cube_of(b)
