"""Which host a network address belongs to, so an error that names only an address names ranks.

gloo reports a peer that died without a word (SIGKILL, a host gone) as a socket error naming the peer's
address ("Connection closed by peer [198.18.0.2]:27373"). Every rank lists its host's addresses at init
(`local_addresses`); the book (`AddressBook`) maps each address that exactly one host listed to that
host's ranks. Loopback addresses, and any that several hosts list (a container bridge such as docker0's
172.17.0.1 on every host), name no host.
"""

from __future__ import annotations

import fcntl
import ipaddress
import re
import socket
import struct

from axonml_distributed.hosts.layout import HostLayout

_SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address
# gloo names a peer as [address]:port.
_BRACKETED = re.compile(r"\[([0-9A-Fa-f.:]+)(?:%[\w.-]+)?\]:\d+")


def local_addresses() -> list[str]:
    """This host's IPv4 and IPv6 addresses, loopback aside, in their canonical text."""
    found: set[str] = set()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address on it
                continue
            found.add(socket.inet_ntoa(raw[20:24]))
    try:
        with open("/proc/net/if_inet6") as f:
            found.update(str(ipaddress.IPv6Address(bytes.fromhex(line.split()[0]))) for line in f)
    except OSError:
        pass  # no IPv6
    return sorted(a for a in found if not ipaddress.ip_address(a).is_loopback)


def canonical(text: str) -> str | None:
    """An address as `local_addresses` writes it (an IPv4 address mapped into IPv6 as IPv4)."""
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return str(address)


class AddressBook:
    """Every rank's host addresses (`listed[r]`: rank r's), as hosts of `layout`."""

    def __init__(self, layout: HostLayout, listed: list[list[str]]) -> None:
        owners: dict[str, set[int]] = {}
        for host, ranks in enumerate(layout.hosts):
            for r in ranks:
                for address in listed[r]:
                    owners.setdefault(address, set()).add(host)
        self._hosts = layout.hosts
        self._host_of = {a: next(iter(h)) for a, h in owners.items() if len(h) == 1}

    def named_in(self, text: str, me: int) -> tuple[list[str], list[int]]:
        """The known addresses of other hosts than rank `me`'s that `text` names ([address]:port, as
        gloo writes them) and their hosts' ranks, ascending; nothing where it names none of them. (A
        host peer's socket closes when it leaves after failing itself: never the first failure.)"""
        mine = next(h for h, ranks in enumerate(self._hosts) if me in ranks)
        found = (canonical(a) for a in _BRACKETED.findall(text))
        addresses = [a for a in found if a is not None and self._host_of.get(a, mine) != mine]
        addresses = list(dict.fromkeys(addresses))
        ranks = sorted({r for a in addresses for r in self._hosts[self._host_of[a]]})
        return addresses, ranks
