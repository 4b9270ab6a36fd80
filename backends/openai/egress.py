"""``EgressPolicy``: which hosts and addresses a fleet may connect to, checked twice.

An upstream is where the gateway sends a model's requests with the platform's
key for it, so whoever can define one could otherwise aim the gateway (and
that key) at anything it can reach: a cloud metadata service, a database on
the private network, the gateway's own port. The rules, in the order they
are applied to one address and port:

1. **the gateway's own listening port** on one of its own addresses (loopback,
   the address it listens on, its host name's): always refused, whatever the
   allow list says (a model served by itself is a loop);
2. **link-local, metadata and other non-unicast addresses** (169.254.0.0/16,
   fe80::/10, 169.254.169.254, fd00:ec2::254, 100.100.100.200, multicast,
   unspecified, reserved): refused unless ``allowed_hosts`` lists that very
   address (a range or a host name does not do);
3. **private addresses** (RFC 1918, loopback, unique-local fc00::/7, shared
   100.64.0.0/10, every range that is not globally routable): refused unless an
   ``allowed_hosts`` entry names the host (an exact name, ``*.suffix``) or covers
   the address (an IP or a CIDR range);
4. **public addresses**: allowed without ``allowed_hosts``; with it, only where an
   entry names the host or covers the address.

``check_endpoint`` applies them to a URL when a fleet is configured (an IP
literal completely; a host name by name: the metadata names, ``localhost``, and
the allow list). The transport's resolver (``transport.CheckedResolver``) applies them again at connect time to
every address a host name resolves to, so a name that passed as public and
later resolves (or rebinds) to a refused address is refused before any byte is
sent, and one refused address among several refuses the name. IPv4 written
inside IPv6 (``::ffff:a.b.c.d``, NAT64 ``64:ff9b::/96``, 6to4 ``2002::/16``) is
judged as the IPv4 address it carries.
"""

from __future__ import annotations

import functools
import ipaddress
import socket
from dataclasses import dataclass, field
from urllib.parse import urlsplit

__all__ = ["EgressPolicy", "EgressRefused", "address_kind", "canonical", "own_addresses", "parse_host_entry"]

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

# Cloud instance-metadata services: AWS (and most others) 169.254.169.254 and fd00:ec2::254, AWS ECS
# 169.254.170.2, Alibaba 100.100.100.200, Oracle Cloud Classic 192.0.0.192.
METADATA_ADDRESSES = frozenset(ipaddress.ip_address(a) for a in (
    "169.254.169.254", "169.254.170.2", "fd00:ec2::254", "100.100.100.200", "192.0.0.192",
))  # fmt: skip
METADATA_NAMES = frozenset({
    "metadata", "metadata.google.internal", "metadata.goog", "instance-data", "instance-data.ec2.internal",
    "metadata.azure.internal", "metadata.tencentyun.com",
})  # fmt: skip
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_DEFAULT_PORTS = {"http": 80, "https": 443}


class EgressRefused(OSError):
    """An upstream host or address the egress rules refuse. An OSError, so that aiohttp reports it as a
    failed connection (nothing was sent); its message names the host and the rule, never a URL."""


def parse_host_entry(entry: str) -> str | IPNetwork:
    """One ``allowed_hosts`` entry: an IP or CIDR range as a network, else a host name or ``*.suffix``
    (lower case, without a trailing dot); ValueError for anything else."""
    text = entry.strip().lower().rstrip(".") if isinstance(entry, str) else ""
    if not text:
        raise ValueError(f"{entry!r} is not a host name, *.domain, IP address or CIDR range")
    try:
        return ipaddress.ip_network(text, strict=False)
    except ValueError:
        pass
    name = text[2:] if text.startswith("*.") else text
    labels = name.split(".")
    if not all(label and len(label) <= 63 and label.replace("-", "").replace("_", "").isalnum() and label.isascii()
               for label in labels):  # fmt: skip
        raise ValueError(f"{entry!r} is not a host name, *.domain, IP address or CIDR range")
    return text


def canonical(address: IPAddress) -> IPAddress:
    """The IPv4 address an IPv6 one carries (mapped, NAT64, 6to4), else the address itself, without a scope."""
    if isinstance(address, ipaddress.IPv6Address):
        if address.scope_id:
            address = ipaddress.IPv6Address(str(address).split("%", 1)[0])
        if address.ipv4_mapped is not None:
            return address.ipv4_mapped
        if address in _NAT64:
            return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
        if address.sixtofour is not None:
            return address.sixtofour
    return address


def address_kind(address: IPAddress) -> str:
    """``forbidden`` (link-local, metadata, non-unicast), ``private`` (not globally routable) or ``public``."""
    address = canonical(address)
    if address in METADATA_ADDRESSES:
        return "forbidden"
    if address.is_loopback:
        return "private"
    if address.is_link_local or address.is_multicast or address.is_unspecified or address.is_reserved:
        return "forbidden"
    return "public" if address.is_global else "private"


@functools.cache
def _host_name_addresses() -> frozenset[IPAddress]:
    """This machine's host name's addresses (best effort: /etc/hosts or DNS, once per process)."""
    try:
        infos = socket.getaddrinfo(socket.gethostname(), None, type=socket.SOCK_STREAM)
    except OSError:
        return frozenset()
    return frozenset(canonical(ipaddress.ip_address(info[4][0])) for info in infos)


def own_addresses(host: str) -> frozenset[IPAddress]:
    """The addresses a gateway listening on ``host`` answers on, as far as it can tell without a lookup of
    ``host`` itself: loopback always counts separately; an unspecified or named ``host`` adds the machine's
    host name's addresses."""
    try:
        listening = canonical(ipaddress.ip_address(host))
    except ValueError:
        return _host_name_addresses()
    if listening.is_unspecified:
        return _host_name_addresses()
    return frozenset({listening})


@dataclass(frozen=True)
class EgressPolicy:
    """The rules above: ``allowed_hosts`` (None: no allow list), and the gateway's own ``own_port`` on
    ``own_addresses`` (besides loopback and the unspecified address)."""

    allowed_hosts: tuple[str, ...] | None = None
    own_port: int | None = None
    own_addresses: frozenset[IPAddress] = frozenset()
    _names: frozenset[str] = field(init=False, repr=False, compare=False)
    _suffixes: tuple[str, ...] = field(init=False, repr=False, compare=False)
    _networks: tuple[IPNetwork, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        entries = [parse_host_entry(e) for e in self.allowed_hosts or ()]
        names = {e for e in entries if isinstance(e, str)}
        object.__setattr__(self, "_names", frozenset(n for n in names if not n.startswith("*.")))
        object.__setattr__(self, "_suffixes", tuple(n[1:] for n in names if n.startswith("*.")))
        object.__setattr__(self, "_networks", tuple(e for e in entries if not isinstance(e, str)))

    # -- what the allow list says

    def _names_host(self, host: str) -> bool:
        return host in self._names or any(host.endswith(suffix) for suffix in self._suffixes)

    def _covers(self, address: IPAddress) -> bool:
        return any(address in network or canonical(address) in network for network in self._networks)

    def _lists_exactly(self, address: IPAddress) -> bool:
        return any(network.num_addresses == 1 and (address in network or canonical(address) in network)
                   for network in self._networks)  # fmt: skip

    def _is_own(self, address: IPAddress, port: int) -> bool:
        if self.own_port is None or port != self.own_port:
            return False
        address = canonical(address)
        return address.is_loopback or address.is_unspecified or address in self.own_addresses

    # -- the checks

    def check_address(self, host: str, port: int, address: IPAddress) -> None:
        """Raises EgressRefused if ``host`` (a name or the address itself) may not be reached at ``address``."""
        name = _normal(host)
        if self._is_own(address, port):
            raise EgressRefused(f"the upstream host {name!r} is this gateway's own address and port {port}")
        kind, shown = address_kind(address), canonical(address)
        if kind == "forbidden":
            if not self._lists_exactly(address):
                raise EgressRefused(f"the upstream host {name!r} is a link-local, metadata or non-unicast "
                                    f"address ({shown}); upstreams.allowed_hosts must list that address itself")  # fmt: skip
            return
        if self._names_host(name) or self._covers(address):
            return
        if self.allowed_hosts is not None:
            raise EgressRefused(f"the upstream host {name!r} ({shown}) is not in upstreams.allowed_hosts")
        if kind == "private":
            raise EgressRefused(f"the upstream host {name!r} is a private address ({shown}): private and "
                                "loopback addresses need an entry in upstreams.allowed_hosts")  # fmt: skip

    def check_host(self, host: str, port: int) -> None:
        """The rules as far as they apply before a lookup: all of them to an IP literal; the metadata names,
        ``localhost`` and the allow list to a name (its addresses are checked at connect time)."""
        name = _normal(host)
        try:
            literal = ipaddress.ip_address(name)
        except ValueError:
            literal = None
        if literal is not None:
            self.check_address(name, port, literal)
            return
        if name in METADATA_NAMES and name not in self._names:
            raise EgressRefused(f"the upstream host {name!r} is a cloud metadata service; upstreams.allowed_hosts "
                                "must list that name itself")  # fmt: skip
        if name == "localhost" or name.endswith(".localhost"):
            self.check_address(name, port, ipaddress.IPv4Address("127.0.0.1"))
            return
        if self.allowed_hosts is not None and not self._names_host(name):
            raise EgressRefused(f"the upstream host {name!r} is not in upstreams.allowed_hosts")

    def check_endpoint(self, url: str) -> None:
        """``check_host`` for a base URL already checked for its shape (``FleetConfig``)."""
        parts = urlsplit(url)
        self.check_host(parts.hostname or "", parts.port or _DEFAULT_PORTS.get(parts.scheme, 0))


def _normal(host: str) -> str:
    return host.strip().lower().rstrip(".").strip("[]")

