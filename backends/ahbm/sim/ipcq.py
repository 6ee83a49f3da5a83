"""IPCQ: FIFO channels between PEs, carried over directed N/S/E/W mesh links.

A channel is keyed by (src rank, dst rank); `tl.send('E', x)` on PE a and `tl.recv('W')` on
its east neighbour b use channel (a, b), as does a routed `tl.send(b, x)`. Each directed link
carries one message at a time for its serialisation time (bytes / link bandwidth); the head
of a message moves on one hop after the hop latency (cut-through). Links are claimed in issue
order, so a later-issued message never overtakes an earlier one on a link.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from .latency import LatencyModel
from .mesh import Topology


@dataclass
class Message:
    seq: int
    src: int
    dst: int
    payload: np.ndarray
    sent_at: float
    delivered_at: float
    hops: int
    cube_crossings: int

    @property
    def nbytes(self) -> int:
        return self.payload.nbytes


class Channel:
    def __init__(self, src: int, dst: int):
        self.src, self.dst = src, dst
        self.messages: list[Message] = []
        self.claimed = 0  # recv / recv_async calls issued so far; each claims the next message
        self.waiters: dict[int, int] = {}  # message index -> rank blocked on it

    @property
    def unconsumed(self) -> int:
        return max(0, len(self.messages) - self.claimed)


class Ipcq:
    def __init__(self, topology: Topology, latency: LatencyModel):
        self.topology, self.latency = topology, latency
        self.channels: dict[tuple[int, int], Channel] = {}
        self.link_free: dict[tuple[int, int], float] = defaultdict(float)
        self.link_busy: dict[tuple[int, int], float] = defaultdict(float)
        self._seq = 0

    def channel(self, src: int, dst: int) -> Channel:
        key = (src, dst)
        if key not in self.channels:
            self.channels[key] = Channel(src, dst)
        return self.channels[key]

    def send(self, src: int, dst: int, payload: np.ndarray, now: float) -> Message:
        links = self.topology.route(src, dst)
        ser = self.latency.serialisation_time(payload.nbytes)
        head, crossings = now, 0
        for link in links:
            start = max(head, self.link_free[link])
            self.link_free[link] = start + ser
            self.link_busy[link] += ser
            cross = self.topology.crosses_cube(*link)
            crossings += cross
            head = start + self.latency.hop_latency(cross)
        msg = Message(self._seq, src, dst, payload, now, head + ser, len(links), crossings)
        self._seq += 1
        self.channel(src, dst).messages.append(msg)
        return msg

    def unconsumed(self) -> int:
        return sum(ch.unconsumed for ch in self.channels.values())
