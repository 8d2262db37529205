"""`hosts.addresses` in one process: which ranks an address in gloo's error names (simulated hosts run
the real thing: the kill-a-host test of tests/test_hosts_torch.py)."""

from __future__ import annotations

import ipaddress

from axonml_distributed.hosts.addresses import AddressBook, local_addresses
from axonml_distributed.hosts.layout import HostLayout

# gloo's words for a peer killed without a word (torch 2.15), as the simulated hosts showed them.
CLOSED = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:561] Connection closed by peer "
    "[{}]:27373. This is typically caused by a remote worker crashing."
)


def book() -> AddressBook:
    """Hosts [0, 1] and [2, 3]; both list a bridge address (as docker0 is on every host)."""
    listed = [["198.18.0.1", "172.17.0.1"]] * 2 + [["198.18.0.2", "172.17.0.1", "fd00::2"]] * 2
    return AddressBook(HostLayout(((0, 1), (2, 3)), 0), listed)


def test_an_address_one_host_listed_names_that_hosts_ranks() -> None:
    assert book().named_in(CLOSED.format("198.18.0.2"), 0) == (["198.18.0.2"], [2, 3])
    assert book().named_in(CLOSED.format("::ffff:198.18.0.2"), 1) == (["198.18.0.2"], [2, 3])
    assert book().named_in(CLOSED.format("fd00:0::2"), 0) == (["fd00::2"], [2, 3])


def test_an_address_several_hosts_list_or_none_at_all_or_of_this_host_names_no_one() -> None:
    assert book().named_in(CLOSED.format("172.17.0.1"), 0) == ([], [])
    assert book().named_in(CLOSED.format("10.9.9.9"), 0) == ([], [])
    assert book().named_in("Timed out waiting 10000ms for recv operation to complete", 0) == ([], [])
    assert book().named_in(CLOSED.format("198.18.0.2"), 3) == ([], [])  # rank 3's own host


def test_this_hosts_addresses_are_addresses_and_never_loopback() -> None:
    for text in local_addresses():
        assert not ipaddress.ip_address(text).is_loopback
