"""An emulated network: one Linux network namespace per rank ("host"), joined through a bridge, shaped by tc.

Each host namespace gets a veth pair whose other end is enslaved to a bridge in a switch namespace; the host's
end is shaped with ``tc`` (rate and optional delay). Addresses are 10.88.0.K/24, inside namespaces this run
creates; nothing else is touched. The rate is shaped with ``tbf`` (a token bucket holding 10 ms of traffic);
a delay needs ``netem``, and a kernel without it is told in one line (no silent fallback). ``Link`` is a context manager: namespaces are removed on exit, also after a
failure or Ctrl-C (deleting a namespace removes its interfaces and qdiscs).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass

from graphddp.passes import rate_bits_per_second


class LinkUnavailable(RuntimeError):
    """No root, or no ``ip``/``tc``: the emulated link cannot be built here."""


@dataclass(frozen=True)
class LinkSpec:
    rate: str
    """tc rate, e.g. ``2gbit``."""
    delay: str | None = None
    """One-way delay added on each host's egress, e.g. ``2ms``."""

    @classmethod
    def parse(cls, text: str) -> LinkSpec:
        m = re.fullmatch(r"(\d+(?:\.\d+)?[kmg]?bit)(?::(\d+(?:\.\d+)?(?:us|ms|s)))?", text.strip().lower())
        if not m:
            raise ValueError(f"--link must be 'loopback' or RATE[:DELAY] such as 2gbit or 1gbit:2ms, got {text!r}")
        return cls(m.group(1), m.group(2))

    def __str__(self) -> str:
        return self.rate + (f":{self.delay}" if self.delay else "")


class Link:
    """``world_size`` host namespaces on a shaped bridge; ``host(k)`` is the namespace name of rank k's host."""

    def __init__(self, spec: LinkSpec, world_size: int, tag: str | None = None) -> None:
        self.spec = spec
        self.world_size = world_size
        self.tag = tag or f"gddp{os.getpid() % 100000}"
        self.switch = f"{self.tag}-sw"
        self._created: list[str] = []

    @staticmethod
    def check_available() -> None:
        missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
        if missing:
            raise LinkUnavailable(f"the emulated link needs {' and '.join(missing)} (iproute2); run with --link loopback")
        if os.geteuid() != 0:
            raise LinkUnavailable("the emulated link needs root (network namespaces); run with --link loopback")

    def host(self, rank: int) -> str:
        return f"{self.tag}-h{rank}"

    def address(self, rank: int) -> str:
        return f"10.88.0.{rank + 1}"

    def __enter__(self) -> Link:
        self.check_available()
        try:
            self._netns("add", self.switch)
            self._ip(self.switch, "link add br0 type bridge")
            self._ip(self.switch, "link set br0 up")
            for rank in range(self.world_size):
                host = self.host(rank)
                self._netns("add", host)
                self._ip(host, "link set lo up")
                self._ip(host, f"link add eth0 type veth peer name p{rank} netns {self.switch}")
                self._ip(self.switch, f"link set p{rank} master br0")
                self._ip(self.switch, f"link set p{rank} up")
                self._ip(host, f"addr add {self.address(rank)}/24 dev eth0")
                self._ip(host, "link set eth0 up")
                _run(["ip", "netns", "exec", host, "tc", "qdisc", "add", "dev", "eth0", *self._qdisc()])
        except BaseException:
            self.close()
            raise
        return self

    def _qdisc(self) -> list[str]:
        if self.spec.delay is not None:
            return ["root", "netem", "rate", self.spec.rate, "delay", self.spec.delay]
        burst = max(64 * 1024, int(rate_bits_per_second(self.spec.rate) / 8 / 100))  # 10 ms of traffic
        return ["root", "tbf", "rate", self.spec.rate, "burst", str(burst), "latency", "50ms"]

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for name in reversed(self._created):
            subprocess.run(["ip", "netns", "del", name], check=False, capture_output=True)
        self._created.clear()

    def _netns(self, verb: str, name: str) -> None:
        _run(["ip", "netns", verb, name])
        self._created.append(name)

    def _ip(self, namespace: str, command: str) -> None:
        _run(["ip", "-n", namespace, *command.split()])


def _run(cmd: list[str]) -> None:
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        if "netem" in cmd and "unknown" in result.stderr:
            raise LinkUnavailable("this kernel has no netem qdisc, so a link delay cannot be emulated; use --link RATE")
        raise LinkUnavailable(f"{' '.join(cmd)} failed: {result.stderr.strip()}")
