"""The ADR-0060 §4 reduction tree and a mesh placement that makes its pairs neighbours.

Level k pairs consecutive survivors of level k-1; the higher rank of a pair survives (it is
the parent), so for N = 8: [(0,1),(2,3),(4,5),(6,7)] -> [(1,3),(5,7)] -> [(3,7)], root 7,
ceil(log2 N) rounds. An odd survivor out carries to the next level unpaired.
"""
from __future__ import annotations

from .errors import TopologyError
from .mesh import DIRECTIONS


def tree_levels(n: int) -> list[list[tuple[int, int]]]:
    """[(child, parent), ...] per level; the child sends (m, l, O) to the parent."""
    if n < 1:
        raise ValueError(f"a reduction group needs at least one PE, got {n}")
    survivors, levels = list(range(n)), []
    while len(survivors) > 1:
        pairs = [(survivors[i], survivors[i + 1]) for i in range(0, len(survivors) - 1, 2)]
        levels.append(pairs)
        survivors = [p for _, p in pairs] + (survivors[-1:] if len(survivors) % 2 else [])
    return levels


def tree_root(n: int) -> int:
    levels = tree_levels(n)
    return levels[-1][0][1] if levels else 0


def tree_parent(rank: int, n: int) -> int | None:
    for level in tree_levels(n):
        for child, parent in level:
            if child == rank:
                return parent
    return None


def tree_children(rank: int, n: int) -> list[int]:
    """The children of rank in the order they are folded (lowest level first)."""
    return [child for level in tree_levels(n) for child, parent in level if parent == rank]


def tree_placement(n: int, rows: int, cols: int) -> tuple[tuple[int, int], ...]:
    """A placement (rank -> (row, col)) of all rows*cols ranks in which every tree pair of
    ranks 0..n-1 is a physical N/S/E/W neighbour; ranks >= n fill the remaining cells in
    row-major order. Deterministic (first solution of a backtracking search from the root)."""
    if n > rows * cols:
        raise TopologyError(f"a {n}-PE tree does not fit a {rows}x{cols} mesh")
    root = tree_root(n)
    children = {r: tree_children(r, n) for r in range(n)}
    order, parent_of = [root], {}
    for r in order:  # breadth-first from the root
        for ch in children[r]:
            parent_of[ch] = r
            order.append(ch)
    cells = [(r, c) for r in range(rows) for c in range(cols)]
    where: dict[int, tuple[int, int]] = {}

    def place(i: int) -> bool:
        if i == len(order):
            return True
        rank = order[i]
        if i == 0:
            candidates = cells
        else:
            pr, pc = where[parent_of[rank]]
            candidates = [(pr + dr, pc + dc) for dr, dc in DIRECTIONS.values()]
        taken = set(where.values())
        for cell in candidates:
            if 0 <= cell[0] < rows and 0 <= cell[1] < cols and cell not in taken:
                where[rank] = cell
                if place(i + 1):
                    return True
                del where[rank]
        return False

    if not place(0):
        raise TopologyError(f"no placement of the {n}-PE reduction tree on a {rows}x{cols} mesh "
                            f"makes every pair a neighbour; use the default placement and "
                            f"routed sends (tl.send(rank, x)), which pay per hop")
    free = [c for c in cells if c not in set(where.values())]
    return tuple(where[r] for r in range(n)) + tuple(free)
