"""Algorithms, keys and the signature: which published key may verify a token, and whether it does.

The algorithm is checked against the global and the provider's allow-list
*before* any key is looked up, so ``none``, ``HS*`` and whatever else a
library might accept never reach key material (the classic
RSA-public-key-as-HMAC-secret attack). The key chosen by ``kid`` must be of
the type and curve the algorithm needs, and joserfc is then given exactly
that one algorithm to verify with.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from joserfc import jws
from joserfc.errors import (
    BadSignatureError,
    ExceededSizeError,
    InvalidKeyCurveError,
    InvalidKeyTypeError,
    JoseError,
    MissingCritHeaderError,
    UnsupportedAlgorithmError,
    UnsupportedHeaderError,
)
from joserfc.jwk import ECKey, JWKRegistry, Key, OKPKey, RSAKey
from joserfc.jws import JWSRegistry

from inferflux.policy.authn.oidc.config import ALLOWED_ALGORITHMS, KEY_REQUIREMENTS, OidcProviderConfig
from inferflux.policy.authn.oidc.parsing import ParsedToken
from inferflux.policy.errors import InvalidToken

logger = logging.getLogger(__name__)

MIN_RSA_KEY_BITS = 2048
# Members that make a JWK private. A verifier needs none of them, and keeping
# them would only widen what a leaked cache could expose.
_PRIVATE_JWK_MEMBERS = frozenset({"d", "p", "q", "dp", "dq", "qi", "oth", "k"})


@dataclass(frozen=True)
class Jwk:
    """One published verification key, imported."""

    kid: str | None
    alg: str | None  # the JWK's own "alg" member, if it pins one
    kty: str
    crv: str | None
    key: Key


class _JWSRegistry(JWSRegistry):
    """A registry that accepts exactly the algorithms it is built with.

    joserfc warns on every use of ``EdDSA`` (renamed by RFC 9864) while it is
    still what most IdPs publish; the allow-list is ours, so the warning is
    only noise here. Headers may be a little larger than joserfc's default to
    fit IdPs that add certificate thumbprints.
    """

    max_header_length = 4096

    def get_alg(self, name: str) -> Any:
        if not self.allowed or name not in self.allowed or name not in self.algorithms:
            raise UnsupportedAlgorithmError(f"Algorithm of '{name}' is not allowed")
        return self.algorithms[name]


def import_jwk(entry: Any, provider_id: str) -> Jwk | None:
    """One published key, or None (logged) when it cannot be used to verify signatures.

    A single odd key (an encryption key, an unknown type) must not make
    the provider's other keys unusable, so keys are judged one by one.
    """
    if not isinstance(entry, dict):
        return None
    kty, kid, alg = entry.get("kty"), entry.get("kid"), entry.get("alg")
    if kty not in ("RSA", "EC", "OKP") or not isinstance(kid, str | None) or not isinstance(alg, str | None):
        return None
    if entry.get("use", "sig") != "sig":
        return None
    key_ops = entry.get("key_ops")
    if key_ops is not None and (not isinstance(key_ops, list) or "verify" not in key_ops):
        return None
    public = {name: value for name, value in entry.items() if name not in _PRIVATE_JWK_MEMBERS}
    try:
        key = JWKRegistry.import_key(public)
    except Exception as exc:  # noqa: BLE001 - untrusted input; any import failure means "skip this key"
        logger.warning("OIDC provider %s: ignoring unusable JWK %r: %s", provider_id, kid, exc)
        return None
    if isinstance(key, RSAKey) and key.public_key.key_size < MIN_RSA_KEY_BITS:
        logger.warning("OIDC provider %s: ignoring RSA key %r shorter than %d bits", provider_id, kid, MIN_RSA_KEY_BITS)
        return None
    crv = key.curve_name if isinstance(key, (ECKey, OKPKey)) else None
    return Jwk(kid=kid, alg=alg, kty=kty, crv=crv, key=key)


def check_algorithm_allowed(parsed: ParsedToken) -> None:
    # Before the issuer is even looked at: 'none' and HS* are refused for everyone.
    if parsed.alg not in ALLOWED_ALGORITHMS:
        raise InvalidToken(f"algorithm {parsed.alg!r} is not accepted", code="unsupported_algorithm")


def check_algorithm_for_provider(parsed: ParsedToken, provider: OidcProviderConfig) -> None:
    if parsed.alg not in provider.algorithms:
        raise InvalidToken(
            f"algorithm {parsed.alg!r} is not accepted for provider {provider.id!r}", code="unsupported_algorithm"
        )


def key_fits(jwk: Jwk, alg: str) -> bool:
    requirement = KEY_REQUIREMENTS.get(alg)
    if requirement is None:
        return False
    kty, curves = requirement
    if jwk.kty != kty or (curves is not None and jwk.crv not in curves):
        return False
    return jwk.alg is None or jwk.alg == alg


def find_key(keys: Iterable[Jwk], parsed: ParsedToken) -> Jwk | None:
    kid = parsed.kid
    if kid is not None:
        candidates = [jwk for jwk in keys if jwk.kid == kid]
        # One kid may name keys of several types; prefer the one that fits the algorithm.
        fitting = [jwk for jwk in candidates if key_fits(jwk, parsed.alg)]
        return (fitting or candidates or [None])[0]
    # Without a kid a key can be chosen only if exactly one fits.
    fitting = [jwk for jwk in keys if key_fits(jwk, parsed.alg)]
    return fitting[0] if len(fitting) == 1 else None


def check_key_matches_algorithm(parsed: ParsedToken, jwk: Jwk) -> None:
    if not key_fits(jwk, parsed.alg):
        raise InvalidToken(
            f"key {jwk.kid!r} ({jwk.kty}) cannot verify algorithm {parsed.alg!r}", code="key_type_mismatch"
        )


def verify_signature(parsed: ParsedToken, jwk: Jwk) -> None:
    # Exactly one algorithm, already checked against both allow-lists and the key's type.
    registry = _JWSRegistry(algorithms=(parsed.alg,), strict_check_header=False)
    try:
        jws.deserialize_compact(parsed.raw, jwk.key, registry=registry)
    except BadSignatureError:
        raise InvalidToken("the token's signature is not valid", code="invalid_signature") from None
    except UnsupportedAlgorithmError:
        raise InvalidToken(f"algorithm {parsed.alg!r} is not accepted", code="unsupported_algorithm") from None
    except (InvalidKeyTypeError, InvalidKeyCurveError):
        raise InvalidToken("the signing key cannot verify this algorithm", code="key_type_mismatch") from None
    except (ExceededSizeError, MissingCritHeaderError, UnsupportedHeaderError):
        raise InvalidToken("the JWT header is not acceptable", code="malformed_token") from None
    except (JoseError, ValueError, TypeError, KeyError):
        # Whatever else the JOSE layer dislikes (odd header values, a
        # signature of the wrong length) is still a token we cannot trust.
        raise InvalidToken("the token's signature is not valid", code="invalid_signature") from None
