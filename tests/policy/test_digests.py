"""policy.digests gives the standard SHA-256 and HMAC-SHA256, whatever the key and however often reused."""

from __future__ import annotations

import hashlib
import hmac
import threading

import pytest

from inferflux.policy.digests import HmacSha256, sha256

DATA = [b"", b"a", b"hello world", bytes(range(256)) * 40]


@pytest.mark.parametrize("data", DATA)
def test_sha256_is_hashlibs(data: bytes) -> None:
    assert sha256(data).digest() == hashlib.sha256(data).digest()
    assert sha256(data).hexdigest() == hashlib.sha256(data).hexdigest()  # the shared empty state is untouched


@pytest.mark.parametrize("size", [0, 1, 16, 32, 63, 64, 65, 128, 200])
def test_hmac_is_the_standard_one_for_every_key_length(size: int) -> None:
    key = bytes(range(7, 7 + size))
    mac = HmacSha256(key)
    for data in DATA * 2:  # reused: the keyed states must not absorb a previous message
        assert mac.digest(data) == hmac.new(key, data, hashlib.sha256).digest()
        assert mac.hexdigest(data) == hmac.new(key, data, hashlib.sha256).hexdigest()


def test_hmac_never_shows_its_key() -> None:
    assert "secret" not in repr(HmacSha256(b"secret" * 4))


def test_threads_share_one_keyed_state_safely() -> None:
    mac, key = HmacSha256(b"k" * 32), b"k" * 32
    wrong: list[bytes] = []

    def work(n: int) -> None:
        for i in range(300):
            data = f"{n}:{i}".encode()
            if mac.digest(data) != hmac.new(key, data, hashlib.sha256).digest():
                wrong.append(data)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert wrong == []
