"""A link with a fixed one-way delay between two network namespaces, where the
kernel has no ``netem``: each namespace gets a TUN device, and this process
carries every IP packet from one device to the other after ``delay`` seconds
(a FIFO per direction: the delay is fixed, so packets keep their order).
Rate limits stay with ``tc`` (tbf on each device, as on the veth link).

Run as root by ``network_hosts.TwoHosts(delay_ms=...)``:

    python tests/support/delay_line.py NAMESPACE_A ADDRESS_A NAMESPACE_B ADDRESS_B DELAY_MS READY_FILE

It creates the devices, moves them into the namespaces (``tun-a``, ``tun-b``,
addresses /24, MTU 16000), writes READY_FILE and relays until killed. The
devices go with it: a TUN device lives as long as its file descriptor.
"""

from __future__ import annotations

import collections
import fcntl
import os
import selectors
import struct
import subprocess
import sys
import time

TUNSETIFF = 0x400454CA
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000
MTU = 16000  # large packets: fewer for this process to carry
PACKET_LIMIT = 65536


def open_tun(name: str) -> int:
    descriptor = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(descriptor, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    return descriptor


def ip(*arguments: str) -> None:
    subprocess.run(["ip", *arguments], check=True, capture_output=True, timeout=30)


def place(temporary_name: str, namespace: str, name: str, address: str) -> None:
    """Move the device into ``namespace``, rename it, give it ``address``/24 and bring it up."""
    ip("link", "set", temporary_name, "netns", namespace)
    ip("-n", namespace, "link", "set", temporary_name, "name", name)
    ip("-n", namespace, "address", "add", f"{address}/24", "dev", name)
    ip("-n", namespace, "link", "set", name, "mtu", str(MTU), "up")


def relay(first: int, second: int, delay: float) -> None:
    """Carry packets both ways, each ``delay`` seconds after it was read."""
    selector = selectors.DefaultSelector()
    selector.register(first, selectors.EVENT_READ, second)
    selector.register(second, selectors.EVENT_READ, first)
    waiting: dict[int, collections.deque[tuple[float, bytes]]] = {first: collections.deque(), second: collections.deque()}
    while True:
        now = time.monotonic()
        due = min((queue[0][0] for queue in waiting.values() if queue), default=None)
        timeout = None if due is None else max(0.0, due - now)
        for key, _ in selector.select(timeout):
            while True:
                try:
                    packet = os.read(key.fd, PACKET_LIMIT)
                except BlockingIOError:
                    break
                waiting[key.data].append((time.monotonic() + delay, packet))
        now = time.monotonic()
        for target, queue in waiting.items():
            while queue and queue[0][0] <= now:
                try:
                    os.write(target, queue.popleft()[1])
                except BlockingIOError:  # the device's queue is full: the packet is lost, as on a wire
                    pass


def main(arguments: list[str]) -> None:
    namespace_a, address_a, namespace_b, address_b, delay_ms, ready = arguments
    tag = str(os.getpid())[-6:]
    first, second = open_tun(f"dla{tag}"), open_tun(f"dlb{tag}")
    place(f"dla{tag}", namespace_a, "tun-a", address_a)
    place(f"dlb{tag}", namespace_b, "tun-b", address_b)
    with open(ready, "w") as marker:
        marker.write("ready\n")
    relay(first, second, float(delay_ms) / 1000)


if __name__ == "__main__":
    main(sys.argv[1:])
