"""A verified token's claims: which must be there, the registered ones' rules, and what they grant here.

Read only after the signature holds, so an unsigned payload cannot steer
which error a caller sees.

The registered claims (``iss``, ``aud``, ``sub``, ``exp``, ``nbf``, ``iat``)
are judged by joserfc's ``JWTClaimsRegistry`` (exact issuer, our audience in
``aud``, a non-empty subject, the time claims with the provider's leeway).
What this module adds on top is stricter than the registry on its own:

* required claims (``ALWAYS_REQUIRED_CLAIMS`` plus the provider's own, which
  may be dotted paths into nested objects) are checked first, each by name;
* the claims are judged one at a time in a fixed order, so which error a
  token gets does not depend on the order its IdP wrote the claims in, and
  only those registered claims: an odd ``jti`` is not our concern;
* a time claim must be a JSON number that fits a float (a 400-digit integer
  is refused, not compared); a ``null`` ``nbf`` counts as absent.

Each failure is an ``InvalidToken`` (401) whose ``code`` names the rule.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from joserfc.errors import JoseError
from joserfc.jwt import JWTClaimsRegistry

from inferflux.policy.authn.oidc.config import OidcProviderConfig
from inferflux.policy.errors import InvalidToken

ALWAYS_REQUIRED_CLAIMS: tuple[str, ...] = ("iss", "sub", "aud", "exp", "iat")
_TIME_CLAIMS = frozenset({"exp", "nbf", "iat"})

# The registered claims in the order they are judged, each with what its failure is called.
_REGISTERED_CLAIMS: tuple[tuple[str, str, str], ...] = (
    ("iss", "invalid_issuer", "the token's issuer does not match {issuer!r}"),
    ("aud", "invalid_audience", "the token is not meant for this service"),
    ("sub", "invalid_claim", "the token's 'sub' claim is not a non-empty string"),
    ("exp", "token_expired", "the token has expired"),
    ("nbf", "token_not_yet_valid", "the token is not valid yet"),
    ("iat", "token_issued_in_future", "the token was issued in the future"),
)


def claim_at(claims: Mapping[str, Any], path: str) -> Any:
    """The value at ``path``: an exact claim name first, so namespaced claims
    such as ``https://example.com/tenant`` work, then a dotted path into
    nested objects. None when absent."""
    if path in claims:
        return claims[path]
    value: Any = claims
    for part in path.split("."):
        if not isinstance(value, Mapping) or part not in value:
            return None
        value = value[part]
    return value


def check_required_claims(claims: Mapping[str, Any], provider: OidcProviderConfig) -> None:
    for name in (*ALWAYS_REQUIRED_CLAIMS, *provider.required_claims):
        if claim_at(claims, name) is None:
            raise InvalidToken(f"the token has no {name!r} claim", code="missing_claim")


def check_registered_claims(claims: Mapping[str, Any], provider: OidcProviderConfig, now: float) -> None:
    """Issuer, audience, subject and the time claims at ``now``, with the provider's leeway."""
    registry = JWTClaimsRegistry(
        # A float, as the clock gives it (joserfc's hint says int; it only compares):
        # truncating to whole seconds would let a token live up to a second past its "exp".
        now=now,
        leeway=provider.leeway_seconds,
        iss={"value": provider.issuer},
        aud={"value": provider.audience},
        sub={"allow_blank": False},
    )
    for name, code, message in _REGISTERED_CLAIMS:
        value = claims.get(name)
        if value is None:
            continue  # the required ones are known present; an optional one (nbf) is absent
        if name in _TIME_CLAIMS and not _is_numeric_date(value):
            raise InvalidToken(f"the token's {name!r} claim is not a number", code="invalid_claim")
        try:
            registry.validate({name: value})
        except JoseError:
            raise InvalidToken(message.format(issuer=provider.issuer), code=code) from None


def _is_numeric_date(value: Any) -> bool:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an integer too large for a float
        return False


def map_tenant(claims: Mapping[str, Any], provider: OidcProviderConfig) -> str:
    tenant = claim_at(claims, provider.tenant_claim)
    if tenant is None or tenant == "":
        raise InvalidToken(f"the token has no {provider.tenant_claim!r} claim", code="missing_tenant_claim")
    if not isinstance(tenant, str):
        raise InvalidToken(f"the token's {provider.tenant_claim!r} claim is not a string", code="invalid_tenant_claim")
    return tenant


def map_roles(claims: Mapping[str, Any], provider: OidcProviderConfig) -> tuple[str, ...]:
    # Unmapped values are dropped: an IdP's role vocabulary grants nothing here unless configured.
    values = _string_list(claim_at(claims, provider.roles_claim))
    return _dedupe(provider.role_map[v] for v in values if v in provider.role_map)


def map_groups(claims: Mapping[str, Any], provider: OidcProviderConfig) -> tuple[str, ...]:
    if provider.groups_claim is None:
        return ()
    return _dedupe(_string_list(claim_at(claims, provider.groups_claim)))


def _string_list(value: Any) -> list[str]:
    """A list claim, given as a JSON array or a space-separated string; anything else counts as empty."""
    if isinstance(value, str):
        return value.split()
    if isinstance(value, list):
        return [item for item in value if isinstance(item, str) and item]
    return []


def _dedupe(values: Iterable[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(values))
